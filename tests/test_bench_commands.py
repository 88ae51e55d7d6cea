"""The command a benchmark writes into BENCHMARKS.md is the one that measured it: rerun as printed, it measures
the same thing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_simulation_prints_the_options_it_ran_with():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_async_scale.py"), "--steps", "2",
                          "--generators", "2", "--tasks-per-step", "2", "--no-write"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Command: `python benchmarks/sim_async_scale.py --steps 2 --generators 2 --tasks-per-step 2`" in out.stdout


def test_bench_async_names_the_latencies_it_measured(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = pytest.importorskip("bench_async")
    monkeypatch.setattr(bench, "measure", lambda args: ([], [], ["0.0 0.0 0.0"]))
    monkeypatch.setattr(sys, "argv", ["bench_async.py", "--latencies", "0.1", "--repeats", "1", "--seed", "3",
                                      "--learning-steps", "0", "--no-write"])
    bench.main()
    assert ("`python benchmarks/bench_async.py --latencies 0.1 --repeats 1 --throughput-steps 10 --learning-steps 0 "
            "--seed 3`") in capsys.readouterr().out
