"""Weights by collective broadcast: two processes on loopback (gloo on CPU, NCCL on two GPUs), and AsyncGRPO with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from treerl.learners.weight_broadcast import GroupAddress, WeightGroup, layout_of, serve_store

RECEIVER = Path(__file__).parent / "programs" / "weight_receiver.py"
ROOT = Path(__file__).resolve().parents[1]


def _states(device: str) -> list[dict[str, torch.Tensor]]:
    """Three versions of the tiny model's weights, plus tensors of other dtypes and shapes."""
    from treerl.models import load_default_model

    model, _ = load_default_model()
    gen = torch.Generator().manual_seed(0)
    out = []
    for v in range(3):
        state = {k: (t + v * torch.randn(t.shape, generator=gen).to(t.dtype)).to(device)
                 for k, t in model.state_dict().items()}
        state["extra.bf16"] = torch.randn(5, 7, generator=gen).to(torch.bfloat16).to(device)
        state["extra.int64"] = torch.arange(11, dtype=torch.int64, device=device) * (v + 1)
        state["extra.scalar"] = torch.tensor(float(v), device=device)
        out.append(state)
    return out


def _broadcast_to_a_receiver(tmp_path: Path, device: str, receiver_device: str, bucket_bytes: int):
    store = serve_store(60.0)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    receiver = subprocess.Popen([sys.executable, str(RECEIVER), str(store.port), "generator-0", receiver_device,
                                 str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    try:
        group = WeightGroup(GroupAddress(store.port, "generator-0", backend, 60.0), rank=0, device=device,
                            store=store)
        states, versions = _states(device), [3, 4, 7]
        for state, version in zip(states, versions):
            receiver.stdin.write(json.dumps([version, layout_of(state), bucket_bytes]) + "\n")
            receiver.stdin.flush()
            group.send(state, version, bucket_bytes)
            assert receiver.stdout.readline().strip() == str(version)
        receiver.stdin.write("\n")
        receiver.stdin.close()
        assert receiver.wait(timeout=60) == 0, receiver.stderr.read()[-2000:]
    finally:
        if receiver.poll() is None:
            receiver.kill()
    for state, version in zip(states, versions):
        got = load_file(str(tmp_path / f"v{version}.safetensors"))
        assert sorted(got) == sorted(state)
        for name, tensor in state.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor.cpu()), name


def test_weights_and_versions_arrive_exactly_over_gloo_on_loopback(tmp_path):
    """Bucketed (1 MB: the tiny model's weights take several buckets, and dtypes change between them),
    each version's header checked against its announcement, every tensor bit for bit."""
    _broadcast_to_a_receiver(tmp_path, "cpu", "cpu", bucket_bytes=1 << 20)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL needs a GPU per rank: the trainer and the generator each on its own (2 GPUs)")
def test_weights_and_versions_arrive_exactly_over_nccl(tmp_path):
    _broadcast_to_a_receiver(tmp_path, "cuda:0", "cuda:1", bucket_bytes=1 << 20)


@pytest.mark.slow  # a run with generator processes: about 12 s
def test_asyncgrpo_generators_take_weights_by_broadcast_and_publish_time_is_a_metric(tmp_path):
    """With max_staleness=0 a generator plays step k only with version k-1 loaded, so each step's spans
    carry the version the trainer broadcast; the publish time is logged every step."""
    from treerl.learners.async_grpo import AsyncGRPOConfig, train_async

    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), steps=3, tasks_per_step=2, group_size=4, max_new_tokens=32,
                          eval_episodes=0, progress=False, num_threads=1, max_staleness=0,
                          weight_transport="broadcast")
    result = train_async(cfg)
    assert result.policy_version == 3
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert [m["async/span_version_min"] for m in lines] == [0, 1, 2]
    assert all(m["async/staleness_0_frac"] == 1.0 for m in lines)
    assert all(m["async/weight_publish_s"] > 0 for m in lines)
