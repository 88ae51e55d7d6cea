"""``benchmarks/bench_prefix.py`` at a tiny size: its text describes the run it made, not the default one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_section_names_the_sizes_it_ran(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = pytest.importorskip("bench_prefix")
    monkeypatch.setattr(sys, "argv", ["bench_prefix.py", "--runs", "1", "--system", "64", "--questions", "3",
                                      "--hidden", "32", "--layers", "1", "--vocab", "256", "--no-write"])
    bench.main()
    out = capsys.readouterr().out
    assert "| one call of 3 requests |" in out and "| 3 calls of one request |" in out
    assert "over the 64 cached positions" in out
