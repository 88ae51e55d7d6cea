"""``benchmarks/bench_learning_vs_trl.py`` end to end at a tiny scale (slow: TRL and treerl both train)."""

from __future__ import annotations

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
