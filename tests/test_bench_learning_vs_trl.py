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


def test_a_rerun_with_other_treerl_options_reuses_trl_and_names_what_it_reused(tmp_path, monkeypatch):
    """treerl's result files are named by its options, TRL's and the untrained evaluation's are not: a rerun with
    a new treerl option trains treerl again and takes the rest from the results directory, and says so."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = pytest.importorskip("bench_learning_vs_trl")
    args = argparse.Namespace(treerl_env_kwargs="{}", seeds=[0], sides=["treerl", "trl"])
    assert (bench.side_name("treerl", args), bench.side_name("trl", args)) == ("treerl", "trl")
    args.treerl_env_kwargs = '{"malformed_penalty": 0.1, "max_turns": 4}'
    assert bench.side_name("treerl", args) == "treerl+malformed_penalty=0.1+max_turns=4"
    assert bench.side_name("trl", args) == "trl"

    calls = []

    def fake(name):
        def run(*_):
            calls.append(name)
            return {"train_s": 1.0, "model_dir": name}
        return run

    for name in ("untrained", "trl-seed0-train", "trl-seed0-eval"):  # what the first run left
        (tmp_path / f"{name}.json").write_text(json.dumps({"train_s": 2.0, "model_dir": "first run"}))
    monkeypatch.setattr(bench, "held_out", fake("eval"))
    monkeypatch.setattr(bench, "run_treerl", fake("treerl"))
    monkeypatch.setattr(bench, "run_trl", fake("trl"))
    out = bench.run_all(args, tmp_path, tmp_path / "runs")
    assert calls == ["treerl", "eval"]  # only treerl's side ran, then its evaluation
    assert out["reused"] == ["untrained", "trl-seed0-train", "trl-seed0-eval"]
    trained = json.loads((tmp_path / "treerl+malformed_penalty=0.1+max_turns=4-seed0-train.json").read_text())
    assert {"load_before", "load_after"} <= set(trained)  # the machine's load around the run is kept
