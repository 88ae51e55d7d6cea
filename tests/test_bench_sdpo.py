"""``benchmarks/bench_sdpo.py`` reuses a finished run's record only when it was run as this run asks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_sdpo


def test_a_record_run_with_another_model_or_flags_is_refused_not_reused(tmp_path, monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(bench_sdpo.subprocess, "run", no_run)
    out = tmp_path / "Calculator-v0-grpo-0"
    out.mkdir()
    record = {"env": "treerl/Calculator-v0", "learner": "grpo", "seed": 0, "model": "tiny-reader",
              "extra": ["--steps", "15"], "start": 0.2, "end": 0.5}
    (out / "bench.json").write_text(json.dumps(record))
    kept = bench_sdpo.run_one("treerl/Calculator-v0", "grpo", 0, tmp_path, ["--steps", "15"], model="tiny-reader")
    assert kept == record  # the same settings: reused, nothing reruns
    with pytest.raises(SystemExit, match="--model tiny-reader"):
        bench_sdpo.run_one("treerl/Calculator-v0", "grpo", 0, tmp_path, [], model="tiny-reader")
    with pytest.raises(SystemExit, match="another --workdir"):
        bench_sdpo.run_one("treerl/Calculator-v0", "grpo", 0, tmp_path, ["--steps", "15"], model="tiny")
