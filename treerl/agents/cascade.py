"""Shared-prefix (cascade) decode attention: a group's prompt is read once per step, not once per row.

When every row of a decode batch starts with the same prefix
(the G samples of a GRPO group share their prompt), the plain layout copies the prefix's keys
and values into every row and each decode step reads them G times. Here the prefix is stored
once, ``(1, Hkv, P, D)`` per layer, and each row's cache holds only what follows it,
``(B, Hkv, t, D)``. A decode query (one new token per row) is scored against both parts, the
prefix in one product for all rows of a kv head; one softmax runs over the concatenated scores
and each part's probabilities weight its own values::

    s_p = q @ prefix_k^T                # (Hkv, B*g, P): the prefix read once for the batch
    s_b = q_b @ own_k_b^T               # (B, Hkv, g, t): each row's own columns, padding masked
    p = softmax([s_p, s_b] * scale)     # exact softmax over the row's whole context
    o = p[:, :P] @ prefix_v + p[:, P:] @ own_v

This equals combining the two partial attentions with their log-sum-exps (what a fused
kernel returning an LSE per part would do); with the scores at hand one softmax is fewer
operations. At a 512-token prefix and 8 rows it is about as fast as SDPA over per-row copies
on CPU; at 2,048 tokens, 16 rows and 8 kv heads about 4x faster, the per-row copies' reads
growing with G x P and these with P + G x t.

Scores are computed in float32 whatever the model's dtype, as SDPA accumulates.

How it hooks in (transformers 5.x): for a decode step only, the model's
``config._attn_implementation`` is switched to :data:`ATTN_NAME` (:func:`cascade_attention`
restores it), and the :class:`CascadeState` rides along in the call's keywords to every
attention layer. The name is not registered as a mask function, so transformers builds no
mask: padding is described by the state. Prefills run the model's own attention.

>>> import torch
>>> q = torch.randn(3, 4, 1, 8)  # 3 rows, 4 query heads over 2 kv heads
>>> prefix_k, prefix_v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
>>> own_k, own_v = torch.randn(3, 2, 2, 8), torch.randn(3, 2, 2, 8)
>>> state = CascadeState([(prefix_k, prefix_v)], valid=None)
>>> out = cascade_attend(q, own_k, own_v, state, layer_idx=0, scaling=8 ** -0.5)  # (B, 1, Hq, D)
>>> k = torch.cat([prefix_k.expand(3, -1, -1, -1), own_k], dim=2)  # the plain layout: prefix copied per row
>>> v = torch.cat([prefix_v.expand(3, -1, -1, -1), own_v], dim=2)
>>> plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=8 ** -0.5, enable_gqa=True)
>>> torch.allclose(out.transpose(1, 2), plain, atol=1e-6)
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ATTN_NAME",
    "CASCADE_KWARG",
    "CascadeState",
    "cascade_attend",
    "cascade_attention",
    "cascade_unsupported",
]

ATTN_NAME = "treerl_cascade"
"""The name registered with transformers' ``AttentionInterface``."""
CASCADE_KWARG = "treerl_cascade"
"""The model-call keyword that carries the :class:`CascadeState` to every attention layer."""

# The model's own attention implementations this one stands in for; others (flash, flex,
# paged) keep their own decode path.
_REPLACES = ("sdpa", "eager")


@dataclass
class CascadeState:
    """What a decode step's attention needs beyond the rows' own keys and values."""

    prefix: list[tuple[Tensor, Tensor]]
    """Per layer, the shared prefix's (keys, values), each (1, Hkv, P, D)."""
    valid: Tensor | None
    """(B, t) bool: which columns of the rows' own caches are real (None: all of them)."""


def cascade_attend(query: Tensor, key: Tensor, value: Tensor, state: CascadeState, *, layer_idx: int,
                   scaling: float) -> Tensor:
    """Attention of one new token per row over the shared prefix and the row's own keys.

    query (B, Hq, 1, D); key, value (B, Hkv, t, D) the rows' own part; returns (B, 1, Hq, D),
    transformers' attention output layout.
    """
    batch, num_heads, length, head_dim = query.shape
    prefix_k, prefix_v = state.prefix[layer_idx]  # (1, Hkv, P, D) each
    num_kv, num_prefix = key.shape[1], prefix_k.shape[2]
    group = num_heads // num_kv
    q = query.float().view(batch, num_kv, group, head_dim)  # (B, Hkv, g, D): head h reads kv head h // g
    # Prefix: every row's queries of a kv head in one product with its one copy of the prefix.
    q_p = q.transpose(0, 1).reshape(num_kv, batch * group, head_dim)  # (Hkv, B*g, D)
    s_p = torch.matmul(q_p, prefix_k[0].float().transpose(1, 2))  # (Hkv, B*g, P)
    s_own = torch.matmul(q, key.float().transpose(2, 3))  # (B, Hkv, g, t)
    if state.valid is not None:  # left padding; the new token's column is always valid
        s_own = s_own.masked_fill(~state.valid[:, None, None, :], float("-inf"))
    scores = torch.cat([s_p.view(num_kv, batch, group, num_prefix).transpose(0, 1), s_own], dim=-1)  # (B, Hkv, g, P+t)
    probs = torch.softmax(scores.mul_(scaling), dim=-1)
    o_p = torch.matmul(probs[..., :num_prefix].transpose(0, 1).reshape(num_kv, batch * group, num_prefix),
                       prefix_v[0].float())  # (Hkv, B*g, D)
    out = torch.matmul(probs[..., num_prefix:], value.float())  # (B, Hkv, g, D)
    out += o_p.view(num_kv, batch, group, head_dim).transpose(0, 1)
    return out.reshape(batch, num_heads, length, head_dim).transpose(1, 2).to(query.dtype)


def _attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       sliding_window: int | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention signature: (B, H, T, D) in, ((B, T, H, D), no weights) out."""
    state = kwargs.get(CASCADE_KWARG)
    # Each of these is a bug of the caller (the policy checks the model before using this path).
    if state is None:
        raise RuntimeError(f"cascade attention was called without `{CASCADE_KWARG}`; this is a bug.")
    if query.shape[2] != 1 or attention_mask is not None or sliding_window is not None or kwargs.get("softcap"):
        raise RuntimeError("cascade attention serves decode steps of full causal attention only; this is a bug.")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return cascade_attend(query, key, value, state, layer_idx=module.layer_idx, scaling=scaling), None


def cascade_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot decode with cascade attention (None: it can).

    >>> cascade_unsupported(torch.nn.Linear(2, 2))
    'Linear is not a transformers PreTrainedModel'
    """
    from transformers import PreTrainedModel

    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        return f"{name} is not a transformers PreTrainedModel"
    config = model.config.get_text_config()
    if config._attn_implementation not in _REPLACES:
        return f"{name} runs attn_implementation={config._attn_implementation!r}, which keeps its own decode path"
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return f"{name} has layers other than full attention ({sorted(set(config.layer_types))})"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"{name} soft-caps its attention logits"
    if getattr(config, "is_causal", True) is False:
        return f"{name} is not causal"
    # transformers' own flag for "attention keywords reach the attention function".
    if not model._can_set_attn_implementation() or not model.is_backend_compatible():
        return f"{name} does not route its attention through transformers' AttentionInterface"
    return None


@contextlib.contextmanager
def cascade_attention(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s attention layers run :func:`cascade_attend` (the call must pass
    a :class:`CascadeState` as ``treerl_cascade=``); the model's own implementation is restored after.

    The switch is on the model's config, so nothing else may run the same model meanwhile (the
    policy holds its lock).
    """
    from transformers import AttentionInterface

    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, _attention_forward)
    config = model.config.get_text_config()  # the attention layers' config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
