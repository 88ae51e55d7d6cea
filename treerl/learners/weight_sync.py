"""Weight sync: the trainer's weights to the policy that samples, with a version number.

The policy holds its own copy of the weights (generation runs the model with ordinary
attention and a KV cache, training with tree attention), so after every update the learner
publishes the new weights and a new version; every sampled span records the version that
produced it. With LoRA the policy receives the adapter merged into the base weights.
``perf/sync_s`` is the time one publish takes.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from treerl.agents.policy import Policy

__all__ = ["WeightSync", "policy_state_dict"]


def policy_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a sampler needs: the model's own, or its LoRA adapter merged into the base weights."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.merge_adapter()
    try:
        out = {}
        for key, value in model.get_base_model().state_dict().items():
            if "lora_" in key:
                continue
            out[plain_name(key)] = value.detach().clone()
        return out
    finally:
        model.unmerge_adapter()


def plain_name(key: str) -> str:
    """A LoRA model's state-dict key as the plain model names it: without peft's ``base_layer`` wrappers, which
    nest when peft adapts several parameters of one module (a Mixture-of-Experts layer's fused experts:
    ``mlp.experts.base_layer.base_layer.gate_up_proj`` is ``mlp.experts.gate_up_proj``).

    >>> plain_name("model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj")
    'model.layers.0.mlp.experts.gate_up_proj'
    >>> plain_name("model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    """
    return ".".join(part for part in key.split(".") if part != "base_layer")


class WeightSync:
    """Publishes ``model``'s weights to ``policy``; ``version`` is the last one published.

    ``targets`` receive the same weights and version after the policy: anything with
    ``set_weights(state_dict, version)``, e.g. AsyncGRPO's generator processes.
    """

    def __init__(self, model: torch.nn.Module, policy: Policy, version: int = 0):
        self.model = model
        self.policy = policy
        self.version = version
        self.targets: list[Any] = []

    def publish(self, version: int | None = None) -> float:
        """Send the current weights as ``version`` (default: the next one); returns the seconds it took."""
        start = time.perf_counter()
        self.version = self.version + 1 if version is None else int(version)
        weights = policy_state_dict(self.model)
        self.policy.set_weights(weights, version=self.version)
        for target in self.targets:
            target.set_weights(weights, version=self.version)
        return time.perf_counter() - start
