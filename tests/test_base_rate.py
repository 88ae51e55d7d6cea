"""The shipped model's base success rate on Calculator, measured through the environment."""

from __future__ import annotations

import torch

from treerl.agents import SamplingParams, TransformersPolicy
from treerl.models import load_default_model
from treerl.rollout.evaluate import evaluate


def test_shipped_model_base_success_rate_leaves_room_for_rl():
    torch.set_num_threads(1)
    model, tok = load_default_model()
    report = evaluate("treerl/Calculator-v0", TransformersPolicy(model, tok), tok, num_episodes=64, seed=10_000,
                      params=SamplingParams(temperature=1.0, max_new_tokens=96))
    print(report.table())
    # The band: good enough to make well-formed calls and sometimes be right, bad enough to learn.
    assert 0.10 <= report.success_rate <= 0.60
    assert report.tool_calls.get("ok", 0) > 32  # it really uses the calculator
