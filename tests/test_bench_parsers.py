"""``benchmarks/bench_parsers.py``'s linearity column: the ratio of the worst-scaling piece, not the largest fluke."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    """A thread clock the fake parsers advance: their cost is exact, so only the benchmark's reading is tested."""

    def __init__(self):
        self.now = 0.0

    def thread_time(self) -> float:
        return self.now


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = pytest.importorskip("bench_parsers")
    clock = FakeClock()
    monkeypatch.setattr(module, "time", clock)
    return module, clock


def test_a_linear_parser_reads_4_whatever_one_slow_moment_did(bench):
    module, clock = bench
    slow = {"left": 2}  # the first two 400 KB reads of piece "b" land on a busy machine: 3x their time

    def linear(text: str) -> None:
        clock.now += len(text) * 1e-8
        if text.startswith("b") and len(text) == 400_000 and slow["left"]:
            slow["left"] -= 1
            clock.now += 2 * len(text) * 1e-8

    ratio, piece = module.linearity(linear, ["a", "b", "c", "d", "e"])
    assert ratio == pytest.approx(4.0)


def test_a_quadratic_parser_still_reads_16(bench):
    module, clock = bench

    def quadratic_on_c(text: str) -> None:
        clock.now += (len(text) ** 2 * 1e-13) if text.startswith("c") else len(text) * 1e-8

    assert module.linearity(quadratic_on_c, ["a", "b", "c", "d", "e"]) == (pytest.approx(16.0), "c")
