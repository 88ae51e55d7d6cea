"""TRL's ``num_generations_eval``: each evaluation prompt played that many times, as one group sharing the
prompt, in ``treerl learn``'s held-out evaluation."""

from __future__ import annotations

import json

import pytest

from treerl import AsyncGRPOConfig, GRPOConfig, SDPOConfig
from treerl.cli import build_parser, main
from treerl.config import config_from_args


def test_num_generations_eval_is_an_option_of_every_learner_and_refuses_below_one(tmp_path):
    assert GRPOConfig(output_dir="x", num_generations_eval=3).num_generations_eval == 3
    assert GRPOConfig(output_dir="x").num_generations_eval is None  # TRL's default: num_generations decides
    assert SDPOConfig(output_dir="x", num_generations_eval=2).num_generations_eval == 2
    assert AsyncGRPOConfig(output_dir="x", num_generations_eval=2).num_generations_eval == 2
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match=f"num_generations_eval={bad!r} must be >= 1"):
            GRPOConfig(output_dir="x", num_generations_eval=bad)
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--num-generations-eval", "4"])
    assert config_from_args(GRPOConfig, args).num_generations_eval == 4
    (tmp_path / "c.yaml").write_text("num_generations: 8\nnum_generations_eval: 2\n")  # a TRL YAML file
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml")])
    assert config_from_args(GRPOConfig, args).num_generations_eval == 2


def test_learns_held_out_evaluation_plays_each_task_num_generations_eval_times(tmp_path):
    """treerl learn --num-generations-eval R: each held-out task R times as a group; success over all episodes,
    pass@k over tasks, as treerl eval --rollouts-per-task R reports them."""
    out = tmp_path / "run"
    assert main(["learn", "--output-dir", str(out), "--steps", "1", "--tasks-per-step", "1", "--group-size", "2",
                 "--max-new-tokens", "4", "--eval-episodes", "2", "--num-generations-eval", "2", "--progress",
                 "false", "--num-threads", "1", "--sample-groups", "0"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for figures in (summary["eval_start"], summary["eval_end"]):
        assert (figures["groups"], figures["episodes"]) == (2, 4)
        assert {"pass@1", "pass@2"} <= set(figures) and figures["pass@1"] == pytest.approx(figures["success_rate"])
