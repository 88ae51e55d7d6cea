"""``benchmarks/bench_scaling.py`` end to end at a tiny scale: one small step along each axis, both learners.

The full curves are a benchmark (BENCHMARKS.md); this checks that every axis runs through both
sides, that the numbers mean what the tables say (the tree holds fewer tokens than the flat
batch when a prompt is shared, TRL's padded batch holds at least the flat tokens, each point is
the rendering it claims), and that ``--device cuda`` without a GPU writes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="TRL is in the bench extra: pip install -e '.[bench]'")
pytest.importorskip("matplotlib", reason="matplotlib is in the bench extra: pip install -e '.[bench]'")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _scaling
import bench_scaling

from treerl.models import load_default_model


def test_episodes_are_the_rendered_conversation():
    _, tokenizer = load_default_model()
    point = _scaling.Point(prompt=300, group=3, turns=3, model="1.7M")
    group = _scaling.build_group(tokenizer, point)
    counts = _scaling.token_counts(group)
    assert 300 <= counts["prompt_tokens"] < 320  # the target, or just over it
    assert counts["unique_tokens"] == counts["prompt_tokens"] + sum(
        len(e.token_ids) - counts["prompt_tokens"] for e in group.episodes)  # only the prompt is shared
    assert counts["flat_tokens"] - counts["unique_tokens"] == 2 * counts["prompt_tokens"]
    text = tokenizer.decode(group.episodes[0].token_ids)
    assert text.count("<tool_call>") == 2 and text.count("<tool_response>") == 2 and "<tools>" in text
    batch = _scaling.trl_batch(group, torch.zeros(3), tokenizer.pad_token_id, "cpu")
    # TRL's loss mask is exactly treerl's loss positions: the sampled tokens.
    assert int(batch["num_items_in_batch"]) == counts["sampled_tokens"]


@pytest.mark.slow  # a benchmark run end to end: about 8 s
def test_one_small_point_of_each_axis_end_to_end(tmp_path, monkeypatch):
    base = _scaling.Point(prompt=256, group=2, turns=1, model="1.7M")
    monkeypatch.setattr(bench_scaling, "BASE", base)
    monkeypatch.setattr(bench_scaling, "AXES", {"prompt": (256, 300), "group": (2, 3), "turns": (1, 2),
                                                 "model": ("1.7M", "6M")})
    args = argparse.Namespace(device="cpu", axes=list(bench_scaling.AXES), points=2, repeats=1, warmup=0,
                              threads=1, argv=["--points", "2"])
    results = bench_scaling.run_all(args, measure_fn=bench_scaling.measure)  # in this process: no child startup
    assert list(results) == ["prompt", "group", "turns", "model"]
    for axis, rows in results.items():
        assert [r["value"] for r in rows] == list(bench_scaling.AXES[axis])
        for row in rows:
            ours, trl = row["sides"]["treerl"], row["sides"]["trl"]
            assert ours["counts"] == trl["counts"]  # the same episodes on both sides
            counts = ours["counts"]
            assert counts["unique_tokens"] < counts["flat_tokens"] <= counts["padded_tokens"]  # G >= 2 share
            for side in (ours, trl):
                # In this process the RSS high-water mark is not a step's own (glibc keeps freed
                # blocks; the benchmark pins its mmap threshold in each child): only check the time.
                assert side["time_s"] > 0 and isinstance(side["peak_bytes"], int)
    grown = {axis: bench_scaling.growth(axis, rows, "treerl") for axis, rows in results.items()}
    assert grown["group"]["unique"] < grown["group"]["flat"]  # a new generation adds its own tokens only
    assert grown["model"]["params"] > 2 and grown["model"]["unique"] == 1
    body = bench_scaling.report(results, args, "docs/scaling-cpu.png", 1.0)
    assert body.count("**TRL / treerl") == 0 and body.count("x** |") == 8  # one ratio per point
    figure = tmp_path / "scaling.png"
    bench_scaling.plot(results, bench_scaling.sides("cpu"), figure, "test")
    assert figure.stat().st_size > 10_000


@pytest.mark.slow  # a child process training a step: about 8 s
def test_child_process_measures_a_step_peak():
    args = argparse.Namespace(device="cpu", warmup=0, repeats=1, threads=1)
    point = _scaling.Point(prompt=256, group=4, turns=2, model="6M")
    result = bench_scaling.measure_in_child("treerl", point, args)
    # Activations, gradients and AdamW's two states of 6M float32 parameters: tens of MiB.
    assert 2**20 < result["peak_bytes"] < 2**30
    assert result["counts"]["unique_tokens"] < result["counts"]["flat_tokens"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the no-GPU path does not apply")
def test_cuda_without_a_gpu_says_so_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "BENCHMARKS.md"
    assert bench_scaling.main(["--device", "cuda", "--out", str(out)]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not out.exists() and not (tmp_path / "docs").exists()
