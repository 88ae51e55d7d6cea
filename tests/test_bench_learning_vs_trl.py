"""``benchmarks/bench_learning_vs_trl.py``: end to end at a tiny scale (slow: TRL and treerl both train), and how
a rerun reuses its results directory (fast)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_benchmark_trains_both_sides_and_scores_them_with_one_evaluator(tmp_path):
    pytest.importorskip("trl")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_learning_vs_trl.py"), "--steps", "2", "--tasks", "2",
         "--group-size", "4", "--eval-episodes", "8", "--seeds", "0", "--no-write", "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| 0 | training wall time |" in out.stdout and "**reduced scale**" in out.stdout
    for side in ("treerl", "trl"):
        trained = json.loads((tmp_path / f"{side}-seed0-train.json").read_text())
        assert len(trained["reward"]) == 2 and trained["train_s"] > 0  # one reward per step
        scored = json.loads((tmp_path / f"{side}-seed0-eval.json").read_text())
        assert scored["episodes"] == 8 and 0 <= scored["success"] <= 1
        assert (Path(trained["model_dir"]) / "config.json").exists()
    assert json.loads((tmp_path / "untrained.json").read_text())["episodes"] == 8


def _bench_with_fake_runs(monkeypatch, calls: list[str]):
    """The benchmark module with its training and evaluation replaced by records of the calls."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = pytest.importorskip("bench_learning_vs_trl")

    def fake(name):
        def run(*_):
            calls.append(name)
            return {"train_s": 1.0, "model_dir": name}
        return run

    monkeypatch.setattr(bench, "held_out", fake("eval"))
    monkeypatch.setattr(bench, "run_treerl", fake("treerl"))
    monkeypatch.setattr(bench, "run_trl", fake("trl"))
    return bench


def _args(**changes) -> argparse.Namespace:
    """The benchmark's options at their defaults, but for ``changes``."""
    defaults = dict(steps=60, tasks=8, group_size=8, learning_rate=2e-4, max_turns=4, max_new_tokens=64,
                    max_completion_length=256, eval_episodes=256, threads=1, treerl_env_kwargs="{}", seeds=[0],
                    sides=["treerl", "trl"])
    return argparse.Namespace(**{**defaults, **changes})


def test_a_rerun_with_other_treerl_options_reuses_trl_and_names_what_it_reused(tmp_path, monkeypatch):
    """treerl's result files are named by its options, TRL's and the untrained evaluation's are not: a rerun with
    a new treerl option trains treerl again and takes the rest from the results directory, and says so."""
    calls: list[str] = []
    bench = _bench_with_fake_runs(monkeypatch, calls)
    args = _args()
    assert (bench.side_name("treerl", args), bench.side_name("trl", args)) == ("treerl", "trl")
    args.treerl_env_kwargs = '{"malformed_penalty": 0.1, "max_turns": 4}'
    assert bench.side_name("treerl", args) == "treerl+malformed_penalty=0.1+max_turns=4"
    assert bench.side_name("trl", args) == "trl"

    bench.run_all(_args(), tmp_path, tmp_path / "runs")  # the first run
    calls.clear()
    out = bench.run_all(args, tmp_path, tmp_path / "runs")
    assert calls == ["treerl", "eval"]  # only treerl's side ran, then its evaluation
    assert out["reused"] == ["untrained", "trl-seed0-train", "trl-seed0-eval"]
    trained = json.loads((tmp_path / "treerl+malformed_penalty=0.1+max_turns=4-seed0-train.json").read_text())
    assert {"load_before", "load_after"} <= set(trained)  # the machine's load around the run is kept


def test_a_rerun_with_other_settings_refuses_the_stored_runs(tmp_path, monkeypatch):
    """A stored run's figures are reported as measured "with the same settings": a rerun with other steps or
    evaluation episodes in the same results directory must not pass them off as its own."""
    calls: list[str] = []
    bench = _bench_with_fake_runs(monkeypatch, calls)
    bench.run_all(_args(steps=30, eval_episodes=64), tmp_path, tmp_path / "runs")
    with pytest.raises(SystemExit, match="eval_episodes 64 there, 256 here"):
        bench.run_all(_args(steps=60), tmp_path, tmp_path / "runs")  # the untrained evaluation comes first
    (tmp_path / "untrained.json").unlink()
    with pytest.raises(SystemExit, match="steps 30 there, 60 here"):
        bench.run_all(_args(steps=60, eval_episodes=64), tmp_path, tmp_path / "runs")
    calls.clear()
    out = bench.run_all(_args(steps=30, eval_episodes=64), tmp_path, tmp_path / "runs")  # the same settings
    assert calls == [] and len(out["reused"]) == 5
