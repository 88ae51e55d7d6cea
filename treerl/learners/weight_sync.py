"""Weight sync: the trainer's weights to the policy that samples, with a version number.

The policy holds its own copy of the weights (generation runs the model with ordinary
attention and a KV cache, training with tree attention), so after every update the learner
publishes the new weights and a new version; every sampled span records the version that
produced it. With LoRA the policy receives the adapter merged into the base weights (into new tensors: the
base weights the adapter trains on are never written).
``perf/sync_s`` is the time one publish takes.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from treerl.agents.policy import Policy

__all__ = ["WeightSync", "policy_state_dict", "merged_lora_weights"]


def policy_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a sampler needs: the model's own, or its LoRA adapter merged into the base weights.

    The merge goes into new tensors and leaves the frozen base weights as they are: merging in place and
    unmerging after (peft's ``merge_adapter``/``unmerge_adapter``) would leave each base weight off by a
    rounding error per sync, in bfloat16 by up to its resolution, and the errors would add up over a run.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    merged = merged_lora_weights(model)
    out = {}
    for key, value in model.get_base_model().state_dict(keep_vars=True).items():
        if "lora_" in key:
            continue
        # By the parameter, not its name: a tied weight (an adapted embedding shared with the LM head) is merged
        # under both of its names, as peft's merge shows it.
        out[plain_name(key)] = merged[id(value)] if id(value) in merged else value.detach().clone()
    return out


def merged_lora_weights(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Each weight a LoRA layer of ``model`` adapts, with the active adapters merged, by ``id`` of the base
    parameter: new tensors, computed as ``PeftModel.merge_and_unload`` computes them (base + the adapter's
    ``get_delta_weight``, in the same order and dtypes), so they equal a fresh merge bit for bit.

    Covers the layers peft wraps for treerl's LoRA: linear (and GPT-2's Conv1D), embedding, and parameters such as
    a Mixture-of-Experts layer's fused experts (peft's ``ParamWrapper``).
    """
    from peft.tuners.lora import Embedding, LoraLayer, ParamWrapper

    merged: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for name, layer in model.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            base = layer.get_base_layer()
            param = getattr(base, layer.parameter_name if isinstance(layer, ParamWrapper) else "weight")
            adapters = layer.lora_embedding_A if isinstance(layer, Embedding) else layer.lora_A
            for adapter in layer.active_adapters:
                if adapter not in adapters:
                    continue
                if adapter in layer.lora_variant or layer.lora_bias.get(adapter, False):
                    raise ValueError(f"{name}: adapter {adapter!r} is a LoRA variant (DoRA, ...) or trains a bias; "
                                     "treerl syncs plain LoRA adapters only: use a LoraConfig without them.")
                delta = layer.get_delta_weight(adapter)
                if isinstance(layer, Embedding):
                    delta = delta.to(param.dtype)  # peft's Embedding.merge rounds the delta first; Linear does not
                weight = merged.get(id(param))
                if weight is None:
                    weight = merged[id(param)] = param.detach().clone()
                weight += delta
    return merged


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
