"""TRL's ``num_generations_eval``: each evaluation prompt played that many times, as one group sharing the
prompt, in ``GRPOTrainer.evaluate()``, in its evaluation during training and in ``treerl learn``'s held-out
evaluation; TRL's figures checked against hand computations with deterministic rewards."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

import treerl.rollout.evaluate as evaluate_module
from treerl import AsyncGRPOConfig, GRPOConfig, GRPOTrainer, SDPOConfig
from treerl.cli import build_parser, main
from treerl.config import config_from_args

ROWS = [{"prompt": "What is 1 + 1?", "level": 1.0}, {"prompt": "What is 2 + 2?", "level": 3.0}]


def small(tmp_path, **kwargs) -> GRPOConfig:
    options = dict(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2, tasks_per_step=2,
                   max_new_tokens=4, progress=False, sample_groups=0)
    return GRPOConfig(**{**options, **kwargs})


@pytest.fixture
def played(monkeypatch):
    """The ``rollouts_per_task`` and groups of every evaluation played."""
    calls = []
    real = evaluate_module.evaluate_with

    def recording(*args, **kwargs):
        report = real(*args, **kwargs)
        calls.append((kwargs["rollouts_per_task"], report.groups))
        return report

    monkeypatch.setattr(evaluate_module, "evaluate_with", recording)
    return calls


def position(completions, **kwargs):  # 0, 1, 2, ... within each group of 3: the same whatever was generated
    return [float(i % 3) for i in range(len(completions))]


def test_evaluate_plays_each_row_num_generations_eval_times_with_trls_figures(tmp_path, played):
    seen = Counter()

    def by_row(prompts, level, **kwargs):  # the row's own column: the same for each play of a row
        seen.update(prompts)
        return list(level)

    trainer = GRPOTrainer(model="tiny", reward_funcs=[position, by_row],
                          args=small(tmp_path, num_generations_eval=3, reward_weights=[1.0, 0.5]),
                          train_dataset=ROWS, eval_dataset=ROWS)
    figures = trainer.evaluate()

    assert sorted(seen.values()) == [3, 3]  # each row played 3 times
    [(per_row, groups)] = played
    assert per_row == 3 and [len(g.episodes) for g in groups] == [3, 3]
    for g in groups:  # a row's plays are one group: its prompt prefilled once, shared by the three
        assert [s.kind for s in g.segments].count("prompt") == 1
        assert len({id(e.path()[0]) for e in g.episodes}) == 1
    # By hand: position [0, 1, 2] in each group, by_row [1, 1, 1] and [3, 3, 3]; the sum position + 0.5 by_row
    # is [0.5, 1.5, 2.5] and [1.5, 2.5, 3.5]: mean 2, each group's std (Bessel's) 1, as TRL's eval batch of one
    # group; the std over all six would be sqrt(5.5 / 5).
    assert figures == pytest.approx({
        "eval_reward": 2.0, "eval_reward_std": 1.0,
        "eval_rewards/position/mean": 1.0, "eval_rewards/position/std": 1.0,
        "eval_rewards/by_row/mean": 2.0, "eval_rewards/by_row/std": 0.0,
        "eval_frac_reward_zero_std": 0.0,
    })


def test_the_default_follows_num_generations_during_training_too(tmp_path, played):
    """Unset, num_generations_eval is num_generations (TRL's); eval_strategy="steps" plays and scores the same."""
    def parity(completions, **kwargs):
        return [float(i % 2) for i in range(len(completions))]

    trainer = GRPOTrainer(model="tiny", reward_funcs=parity, train_dataset=ROWS, eval_dataset=ROWS,
                          args=small(tmp_path, eval_strategy="steps", eval_steps=1, eval_on_start=True))
    trainer.train()

    assert [per_row for per_row, _ in played] == [2, 2]  # before the first step and after it
    assert all(len(g.episodes) == 2 for _, groups in played for g in groups)
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    for m in lines:  # each group [0, 1]: mean 0.5, std sqrt(0.5), none without spread
        assert m["eval_reward"] == pytest.approx(0.5) and m["eval_reward_std"] == pytest.approx(math.sqrt(0.5))
        assert m["eval_frac_reward_zero_std"] == 0.0 and m["eval_rewards/parity/std"] == pytest.approx(math.sqrt(0.5))


def test_trl_figures_of_rows_played_once_and_of_unscorable_completions():
    """Played once, a group has no spread: the std is over all the completions (TRL's batch of several
    prompts) and every completion counts as zero-std (TRL's); a completion no function scored is left out."""
    from treerl.trainer import _trl_eval_figures

    nan = float("nan")
    rewards = torch.tensor([[0.0, 1.0], [0.0, 2.0], [0.0, 6.0], [0.0, nan]])  # (E, 1 + F): env, then f
    figures = _trl_eval_figures(rewards, [0.0, 1.0], ["f"], num_generations=1)
    assert figures == pytest.approx({"eval_reward": 3.0, "eval_reward_std": math.sqrt(7.0),
                                     "eval_rewards/f/mean": 3.0, "eval_rewards/f/std": math.sqrt(7.0),
                                     "eval_frac_reward_zero_std": 1.0})
    figures = _trl_eval_figures(rewards, [0.0, 1.0], ["f"], num_generations=2)  # groups [1, 2] and [6, None]
    assert figures["eval_reward"] == pytest.approx((1.5 + 6.0) / 2)  # TRL's mean of its batches' means
    assert figures["eval_reward_std"] == pytest.approx(math.sqrt(0.5))  # a group of one number has none
    assert figures["eval_frac_reward_zero_std"] == 0.0


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


def test_resuming_with_another_num_generations_eval_warns_of_nothing(capsys):
    """Like eval_episodes, the held-out evaluation's repeats change none of the steps a resumed run took."""
    from treerl.learners.core import _warn_if_settings_changed

    cfg = GRPOConfig(output_dir="x", num_generations_eval=4)
    before = {**json.loads(json.dumps(cfg.recorded(), default=str)), "num_generations_eval": 1}
    _warn_if_settings_changed(before, cfg)
    assert "settings that differ" not in capsys.readouterr().err
