"""Slow: `treerl learn --learner async_grpo` raises Calculator held-out success by 20 points within 10 minutes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest


@pytest.mark.slow
@pytest.mark.timeout(25 * 60)  # the run's own limit is asserted below; this only stops a hung one
@pytest.mark.parametrize("seed", [0, 1])
def test_async_learn_on_calculator_gains_20_points_in_10_minutes(tmp_path, seed):
    out = tmp_path / "async"
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "treerl.cli", "learn", "--learner", "async_grpo", "--env", "treerl/Calculator-v0",
         "--output-dir", str(out), "--seed", str(seed), "--progress", "false"],
        capture_output=True, text=True, timeout=20 * 60,
    )
    wall = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_start"]["success_rate"], summary["eval_end"]["success_rate"]
    print(f"seed {seed}: held-out success {before:.1%} -> {after:.1%} in {wall:.0f} s; async {summary['async']}")
    assert after - before >= 0.20
    assert wall < 10 * 60
