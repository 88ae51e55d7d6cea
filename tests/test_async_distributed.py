"""Slow: the AsyncGRPO trainer under accelerate (2 processes, gloo) takes the single-process steps.

Rank 0 runs the generator and takes each step's groups; both ranks train on their halves and
sum their gradients. With ``max_staleness=0`` the groups are those of the single-process run,
so the weights must agree with it (to the float noise of summing in another order, as in
``tests/test_distributed.py``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from treerl.learners.async_grpo import AsyncGRPOConfig, train_async

CONFIG = dict(steps=2, tasks_per_step=4, group_size=4, max_new_tokens=32, eval_episodes=0, progress=False,
              num_threads=1, skip_zero_advantage=False, max_staleness=0)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(15 * 60)
def test_the_async_trainer_under_accelerate_takes_the_single_process_steps(tmp_path):
    from treerl.models import load_default_model

    model, tok = load_default_model()
    before = _state(model)
    train_async(AsyncGRPOConfig(output_dir=str(tmp_path / "single"), **CONFIG), model=model, tokenizer=tok)
    single = _state(model)

    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port()), __file__, str(tmp_path)]
    r = subprocess.run(launch, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=12 * 60)
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [load_file(str(tmp_path / f"rank{i}.safetensors")) for i in range(2)]
    update = torch.cat([(single[k] - before[k]).flatten() for k in single])
    error = torch.cat([(ranks[0][k] - single[k]).flatten() for k in single])
    for k in single:
        assert torch.equal(ranks[0][k], ranks[1][k]), f"the ranks disagree on {k}"
    assert update.norm() > 0.1
    assert error.norm() <= 1e-4 * update.norm(), (error.norm(), update.norm())
    many = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    one = [json.loads(line) for line in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(one, many, strict=True):
        for key in ("reward/mean", "loss/policy", "grad/norm", "async/staleness_0_frac"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


if __name__ == "__main__":  # a rank of the accelerate run above
    from treerl.models import load_default_model

    out = Path(sys.argv[1])
    model, tok = load_default_model()
    train_async(AsyncGRPOConfig(output_dir=str(out / "run"), **CONFIG), model=model, tokenizer=tok)
    save_file(_state(model), str(out / f"rank{int(os.environ['RANK'])}.safetensors"))
