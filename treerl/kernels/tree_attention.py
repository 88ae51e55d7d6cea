"""Tree attention for any transformers causal LM, registered with ``AttentionInterface``.

A tree-packed row holds each unique token of a group's prefix tree once (see
:mod:`treerl.kernels.tree_layout`). This module makes a stock transformers model attend
along the tree instead of along the row::

    from treerl.kernels.tree_attention import enable_tree_attention
    from treerl.kernels.tree_layout import TreeBatch, TreeLayout

    choice = enable_tree_attention(model)          # impl="auto"; choice.reason says why
    batch = TreeBatch([TreeLayout.from_parents([5, 3, 4], [-1, 0, 0])])
    out = model(input_ids, position_ids=batch.position_ids(input_ids.device),
                tree_layout=batch, use_cache=False)

How it hooks in (transformers 5.x): the model's ``config._attn_implementation`` is set to
one of our registered names, so every attention layer calls our function with its
``**kwargs`` (where ``tree_layout`` rides along). Our names are deliberately *not*
registered with ``AttentionMaskInterface``: transformers then builds no mask at all (no
dense T x T mask, and no "packed sequence" guess from position ids, which would be wrong
for tree depths). The function refuses any mask that still reaches it. Note that for such
names transformers also drops a 2-D ``attention_mask`` the caller passes: padding is
described by the :class:`TreeBatch` (rows shorter than the batch), never by a mask.

Backends (one table, :data:`BACKENDS`):

- ``reference``: SDPA with the dense tree mask, O(T^2) memory. Small inputs and tests.
- ``segment``: each segment's queries against the gathered keys of its root-to-segment
  path, segments of similar sizes batched into one SDPA call. Memory grows with the sum
  over segments of (segment length x path length), not with T^2. CPU and GPU.
- ``flex``: FlexAttention with a block mask from a ``mask_mod``, compiled on CUDA.
  FlexAttention has no backward on CPU, so ``auto`` only picks it on CUDA.
- ``triton``: treerl's block-sparse Triton kernel (forward and backward,
  :mod:`treerl.kernels.triton_tree_attention`); ``auto`` picks it first on CUDA.

``impl="auto"`` walks :data:`AUTO_ORDER` and takes the first backend that can run on the
model's device; the returned :class:`TreeAttentionChoice` (also logged) keeps the reason.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from treerl.kernels.tree_layout import TreeBatch, TreeLayout
from treerl.kernels.triton_tree_attention import interpreted_on, triton_tree_attention, triton_unavailable
from treerl.kernels.types import TreeAttentionError  # below the Triton backend, which raises it too

__all__ = [
    "TREE_KWARG",
    "AUTO_ORDER",
    "BACKENDS",
    "TreeAttentionBackend",
    "TreeAttentionChoice",
    "TreeAttentionError",
    "attn_implementation_name",
    "check_model_supported",
    "choose_backend",
    "enable_tree_attention",
    "flex_tree_attention",
    "reference_tree_attention",
    "register_tree_attention",
    "segment_tree_attention",
    "tree_mask_mod",
]

logger = logging.getLogger(__name__)

TREE_KWARG = "tree_layout"
"""Name of the model-call keyword that carries the :class:`TreeBatch` to the attention layers."""

_ATTN_PREFIX = "treerl_tree_"

# Layer kinds whose attention is plain softmax attention over the past, which the tree mask
# can express. Anything else (linear attention, chunked attention, state-space layers) mixes
# tokens in a way that ignores the tree, so packed rows would leak across branches.
_SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

# Keywords that would change the attention math in a way the backends do not implement.
_UNSUPPORTED_KWARGS = {
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks",
}


# -- backends: pure functions on (B, H, T, D) tensors -------------------------------------------


def reference_tree_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    batch: TreeBatch,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> Tensor:
    """SDPA with the dense tree mask. Returns (B, T, H, Dv), the layout transformers expects.

    query: (B, H, T, D); key: (B, Hkv, T, D); value: (B, Hkv, T, Dv), H a multiple of Hkv.
    """
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    mask = batch.dense_mask(query.device)  # (B, T, T)
    if sliding_window is not None:
        mask &= _window_mask(batch.position_ids(query.device), sliding_window)
    # Plain head repetition keeps the reference obviously right; the fast paths avoid the copy.
    key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)  # (B, H, T, D)
    value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)  # (B, H, T, Dv)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask[:, None], dropout_p=dropout, scale=scaling
    )  # (B, H, T, Dv)
    return out.transpose(1, 2).contiguous()


def segment_tree_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    batch: TreeBatch,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> Tensor:
    """Per-segment attention over gathered root-to-segment paths. Returns (B, T, H, Dv).

    Segments whose (length, path length) round to the same bucket share one SDPA call, so a
    hundred siblings of a prompt cost a few calls, not a hundred. GQA folds the query heads
    of one key head into the query length, so keys and values are never repeated. Where
    nothing branches the causal kernel runs instead of a mask, which skips the masked half of
    the scores: a batch of single-chain rows runs as is, and buckets of root segments (packed
    episodes that share nothing) run gathered but causal.
    """
    batch_size, num_heads, length, head_dim = query.shape
    num_kv_heads, value_dim = key.shape[1], value.shape[-1]
    n_rep = num_heads // num_kv_heads
    if sliding_window is None and all(l.num_segments == 1 and l.num_tokens == length for l in batch.layouts):
        # Every row is one chain filling the row: plain causal attention over the rows is the
        # tree mask, and the causal kernel needs no gather and skips the masked half. (Padding
        # tokens attend only to themselves in every backend, so rows with padding take the plan.)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling,
                                             enable_gqa=n_rep > 1)  # (B, H, T, Dv)
        return out.transpose(1, 2).contiguous()
    plan = batch.segment_plan(query.device)
    q_flat = query.transpose(1, 2).reshape(batch_size * length, num_heads, head_dim)  # (B*T, H, D)
    k_flat = key.transpose(1, 2).reshape(batch_size * length, num_kv_heads, head_dim)  # (B*T, Hkv, D)
    v_flat = value.transpose(1, 2).reshape(batch_size * length, num_kv_heads, value_dim)  # (B*T, Hkv, Dv)

    def rows(flat: Tensor, index: Tensor, start: int | None) -> Tensor:
        # Consecutive slots are a view of the row: no gather forward, no scatter-add backward.
        return flat.narrow(0, start, index.numel()) if start is not None else flat.index_select(0, index)

    outs = []
    for b, bucket in enumerate(plan.buckets):
        n, q_len, k_len = bucket.num, bucket.q_len, bucket.k_len
        if bucket.roots_only and sliding_window is None:
            # A root attends causally to itself (a root's keys are its queries, q_len == k_len):
            # the causal kernel skips the upper triangle that a mask would only zero out.
            q = rows(q_flat, bucket.q_index, bucket.q_start).view(n, q_len, num_heads, head_dim).transpose(1, 2)
            k = rows(k_flat, bucket.k_index, bucket.q_start).view(n, k_len, num_kv_heads, head_dim).transpose(1, 2)
            v = rows(v_flat, bucket.k_index, bucket.q_start).view(n, k_len, num_kv_heads, value_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                               enable_gqa=n_rep > 1)  # (N, H, Lq, Dv)
            o = o.transpose(1, 2).reshape(n * q_len, num_heads, value_dim)
            outs.append(o if bucket.q_start is not None else o.index_select(0, bucket.q_valid_rows))
            continue
        q = rows(q_flat, bucket.q_index, bucket.q_start).view(n, q_len, num_kv_heads, n_rep, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, n_rep * q_len, head_dim)  # (N, Hkv, R*Lq, D)
        k = k_flat.index_select(0, bucket.k_index).view(n, k_len, num_kv_heads, head_dim).transpose(1, 2)
        v = v_flat.index_select(0, bucket.k_index).view(n, k_len, num_kv_heads, value_dim).transpose(1, 2)
        # Every layer of the forward (and its backward) uses the same mask: build it once per
        # batch, already additive in the query dtype, which SDPA would otherwise convert per call.
        mask = batch.cached(
            ("segment_mask", b, str(query.device), query.dtype, n_rep, sliding_window),
            lambda: _additive_mask(bucket.mask(sliding_window), n_rep, query.dtype),
        )  # (N, 1, R*Lq, Lk)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
        o = o.view(n, num_kv_heads, n_rep, q_len, value_dim).permute(0, 3, 1, 2, 4)  # (N, Lq, Hkv, R, Dv)
        o = o.reshape(n * q_len, num_heads, value_dim)
        outs.append(o if bucket.q_start is not None else o.index_select(0, bucket.q_valid_rows))  # (V, H, Dv)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (B*T, H, Dv)
    if not plan.in_order:
        out = out.index_select(0, plan.inverse_order)
    return out.view(batch_size, length, num_heads, value_dim)


def _additive_mask(mask: Tensor, n_rep: int, dtype: torch.dtype) -> Tensor:
    """(N, Lq, Lk) bool -> (N, 1, R*Lq, Lk) of 0 and -inf, the query heads of a key head folded into Lq."""
    n, q_len, k_len = mask.shape
    mask = mask[:, None, None].expand(n, 1, n_rep, q_len, k_len).reshape(n, 1, n_rep * q_len, k_len)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def tree_mask_mod(subtree_end: Tensor, depth: Tensor | None = None, sliding_window: int | None = None) -> Callable:
    """The FlexAttention ``mask_mod`` of a tree batch.

    subtree_end: (B, T) long, :meth:`TreeBatch.subtree_end_of_token`; depth: (B, T) long
    position ids, needed only with a sliding window. In depth-first layout, key ``k`` is
    visible from query ``q`` iff ``k <= q`` and ``q`` lies inside the subtree of ``k``'s
    segment, one gather per pair.
    """
    if sliding_window is not None and depth is None:
        raise TreeAttentionError("tree_mask_mod needs `depth` (the position ids) when a sliding window is set.")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        visible = (kv_idx <= q_idx) & (q_idx < subtree_end[b, kv_idx])
        if sliding_window is not None:
            visible = visible & (depth[b, q_idx] - depth[b, kv_idx] < sliding_window)
        return visible

    return mask_mod


def flex_tree_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    batch: TreeBatch,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> Tensor:
    """FlexAttention with the tree block mask. Returns (B, T, H, Dv).

    Compiled on CUDA (the fused kernel, forward and backward); eager elsewhere, which runs
    the forward only and materializes scores, useful to test the mask on CPU.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if dropout:
        raise TreeAttentionError(
            f"the flex tree-attention backend has no attention dropout (got dropout={dropout}); "
            "set config.attention_dropout=0.0 or use impl='segment'."
        )
    batch_size, num_heads, length, _ = query.shape
    device = query.device

    def build_block_mask():
        depth = batch.position_ids(device) if sliding_window is not None else None
        mask_mod = tree_mask_mod(batch.subtree_end_of_token(device), depth, sliding_window)
        # H=None: one mask for all heads, since the tree does not depend on the head. Compiled
        # mask building works block by block instead of materializing (B, T, T) on the GPU.
        return create_block_mask(
            mask_mod, batch_size, None, length, length, device=device, _compile=device.type == "cuda"
        )

    # Every layer of a forward shares the block mask (one per sliding window size).
    block_mask = batch.cached(("flex_block_mask", str(device), sliding_window), build_block_mask)
    if torch.compiler.is_compiling() or device.type != "cuda":
        attend = flex_attention  # inside a compiled model dynamo fuses it; eager on CPU (forward only)
    else:
        attend = _compiled_flex_attention()
    out = attend(
        query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=num_heads != key.shape[1]
    )  # (B, H, T, Dv)
    return out.transpose(1, 2).contiguous()


@functools.cache
def _compiled_flex_attention() -> Callable:
    # Uncompiled FlexAttention materializes the full score matrix; compiling once per process
    # gives the fused kernel. Cached so that every layer and step reuses the compiled graph.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _window_mask(depth: Tensor, sliding_window: int) -> Tensor:
    """(B, T, T) bool from (B, T) depths: transformers' ``kv > q - window``, in depths along the path."""
    return depth[:, :, None] - depth[:, None, :] < sliding_window


# -- the table ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeAttentionBackend:
    """One way to compute tree attention, and when it can run."""

    name: str
    attend: Callable[..., Tensor]
    """(query, key, value, batch, *, scaling, dropout, sliding_window) -> (B, T, H, Dv)."""
    unavailable: Callable[[torch.device], str | None]
    """Why it cannot serve a model on this device (forward and backward), or None if it can."""


def _always_available(device: torch.device) -> str | None:
    return None


def _flex_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"FlexAttention has no backward pass on {device.type}; it needs CUDA"
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs torch >= 2.5)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "compiling FlexAttention needs triton, which is not installed"
    return None


BACKENDS: dict[str, TreeAttentionBackend] = {
    "triton": TreeAttentionBackend("triton", triton_tree_attention, triton_unavailable),
    "flex": TreeAttentionBackend("flex", flex_tree_attention, _flex_unavailable),
    "segment": TreeAttentionBackend("segment", segment_tree_attention, _always_available),
    "reference": TreeAttentionBackend("reference", reference_tree_attention, _always_available),
}

AUTO_ORDER: tuple[str, ...] = ("triton", "flex", "segment")
"""Backends ``impl="auto"`` tries, fastest first; ``segment`` runs everywhere."""


@dataclass(frozen=True)
class TreeAttentionChoice:
    """Which backend serves a model, and why."""

    impl: str
    """Key of :data:`BACKENDS`."""
    attn_implementation: str
    """The name registered with transformers' ``AttentionInterface`` and set on the model."""
    reason: str
    """Why this backend: requested explicitly, or what ``auto`` ruled out before it."""
    previous: str | None = None
    """The model's attention implementation before, to restore it with ``model.set_attn_implementation``."""
    no_backward: str | None = None
    """Why the backward pass cannot run on the model's device (forward-only use still can), or None."""


def choose_backend(impl: str, device: torch.device | str) -> tuple[str, str]:
    """Resolve ``impl`` ("auto" or a key of :data:`BACKENDS`) on ``device``: ``(name, reason)``.

    >>> choose_backend("auto", "cpu")[0]
    'segment'
    """
    device = torch.device(device)
    if impl != "auto":
        if impl not in BACKENDS:
            raise ValueError(
                f"impl={impl!r} is not a tree-attention backend; use 'auto' or one of {sorted(BACKENDS)}."
            )
        why_not = BACKENDS[impl].unavailable(device)
        if why_not is None:
            return impl, f"requested impl={impl!r}"
        return impl, f"requested impl={impl!r} although {why_not}"
    ruled_out = []
    for name in AUTO_ORDER:
        why_not = BACKENDS[name].unavailable(device)
        if why_not is None:
            reason = f"auto on {device.type}: {name}"
            return name, reason + (f" ({'; '.join(ruled_out)})" if ruled_out else "")
        ruled_out.append(f"not {name}: {why_not}")
    raise TreeAttentionError(f"no tree-attention backend can run on {device}: {'; '.join(ruled_out)}.")


def attn_implementation_name(impl: str) -> str:
    """The ``AttentionInterface`` name of a backend, e.g. ``'treerl_tree_segment'``."""
    return _ATTN_PREFIX + impl


# -- the transformers side -----------------------------------------------------------------------


def _make_attention_forward(impl: str) -> Callable:
    backend = BACKENDS[impl]

    def tree_attention_forward(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: int | None = None,
        **kwargs,
    ) -> tuple[Tensor, None]:
        """transformers' attention signature: (B, H, T, D) in, ((B, T, H, Dv), no weights) out."""
        batch = _batch_from_kwargs(kwargs, length=query.shape[2])
        _check_call(module, query, key, attention_mask, batch, kwargs)
        out = backend.attend(
            query, key, value, batch, scaling=scaling, dropout=dropout, sliding_window=sliding_window
        )
        return out, None

    tree_attention_forward.__name__ = f"tree_attention_forward_{impl}"
    return tree_attention_forward


def _batch_from_kwargs(kwargs: dict, length: int) -> TreeBatch:
    batch = kwargs.get(TREE_KWARG)
    if batch is None:
        raise TreeAttentionError(
            f"tree attention is enabled on this model but the call has no `{TREE_KWARG}`; pass "
            f"model(input_ids, position_ids=batch.position_ids(), {TREE_KWARG}=batch) with a TreeBatch, "
            "or restore ordinary attention with model.set_attn_implementation(choice.previous)."
        )
    if isinstance(batch, TreeBatch):
        return batch
    if isinstance(batch, Sequence) and batch and all(isinstance(layout, TreeLayout) for layout in batch):
        # Works, but every layer rebuilds the index tensors: pass a TreeBatch to share them.
        return TreeBatch(batch, length=max(length, max(layout.num_tokens for layout in batch)))
    raise TreeAttentionError(
        f"`{TREE_KWARG}` must be a TreeBatch (or a list of TreeLayout, one per row), got {type(batch).__name__}."
    )


def _check_call(
    module: torch.nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None, batch: TreeBatch, kwargs: dict
) -> None:
    if attention_mask is not None:
        raise TreeAttentionError(
            "tree attention got an attention_mask; the tree layout is the mask. Call the model with "
            "attention_mask=None (padding is described by the TreeBatch, not by a mask)."
        )
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise TreeAttentionError(f"tree attention does not implement {what} (`{name}` was passed by the model).")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise TreeAttentionError(
            f"{type(module).__name__} is not causal; tree attention only serves causal self-attention."
        )
    batch_size, _, length, _ = query.shape
    if key.shape[2] != length:
        raise TreeAttentionError(
            f"queries cover {length} tokens but keys cover {key.shape[2]}: a KV cache is in use. "
            "Tree-packed forwards run without a cache: pass use_cache=False."
        )
    if (batch.batch_size, batch.length) != (batch_size, length):
        raise TreeAttentionError(
            f"the TreeBatch describes {batch.batch_size} rows of {batch.length} tokens but the input has "
            f"{batch_size} rows of {length}; build it with TreeBatch(layouts, length=input_ids.shape[1])."
        )
    if query.shape[1] % key.shape[1]:
        raise TreeAttentionError(
            f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads."
        )


def register_tree_attention() -> None:
    """Register every backend with transformers' ``AttentionInterface`` (idempotent).

    Only the attention functions are registered, never a mask function: that is what makes
    transformers skip building its own mask (see the module docstring).
    """
    from transformers import AttentionInterface

    for impl in BACKENDS:
        name = attn_implementation_name(impl)
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _make_attention_forward(impl))


def check_model_supported(model: torch.nn.Module) -> None:
    """Raise :class:`TreeAttentionError` if tree attention cannot serve ``model`` exactly."""
    from transformers import PreTrainedModel

    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise TreeAttentionError(f"{name} is not a transformers PreTrainedModel; tree attention hooks into those only.")
    config = model.config.get_text_config()
    if getattr(config, "is_causal", True) is False:
        raise TreeAttentionError(f"{name} is configured as non-causal (config.is_causal=False).")
    layer_types = getattr(config, "layer_types", None) or []
    unsupported = sorted(set(layer_types) - _SUPPORTED_LAYER_TYPES)
    if unsupported:
        raise TreeAttentionError(
            f"{name} has layers of type {unsupported}, which mix tokens without softmax attention over the "
            "past (e.g. the linear-attention layers of Qwen3-Next / Qwen3.5); their state would flow across "
            "branches of a packed tree. Train such models on unpacked sequences."
        )
    # gpt-oss's attention sinks (a learned logit per head that joins every softmax) reach the
    # attention function as `s_aux`; a parameter named `sinks` is how a model holds them.
    if any(param_name.rsplit(".", 1)[-1] == "sinks" for param_name, _ in model.named_parameters()):
        raise TreeAttentionError(
            f"{name} uses attention sinks (its layers' `sinks` parameters, as gpt-oss's), which the tree-attention "
            "backends do not implement; pack its sequences padded (PackingConfig(mode='padded'), "
            "--pack-mode padded)."
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise TreeAttentionError(
            f"{name} uses attention logit soft-capping (config.attn_logit_softcapping="
            f"{config.attn_logit_softcapping}), which the tree-attention backends do not implement."
        )
    # `is_backend_compatible` is transformers' own flag for "attention keywords reach the
    # attention function", which is how the TreeBatch gets to every layer.
    if not model._can_set_attn_implementation() or not model.is_backend_compatible():
        raise TreeAttentionError(
            f"{name} does not route its attention (and its call keywords) through transformers' "
            "AttentionInterface, so tree attention cannot reach it; use a model family that does "
            "(Llama, Qwen2/3, Mistral, Gemma 3, ...)."
        )


def enable_tree_attention(model: torch.nn.Module, impl: str = "auto") -> TreeAttentionChoice:
    """Make ``model`` attend along the tree given by the ``tree_layout`` keyword of each call.

    ``impl`` is ``"auto"`` (triton, then flex, on CUDA when they can run there, else segment) or a key of
    :data:`BACKENDS`. Refuses, with :class:`TreeAttentionError`, architectures it cannot
    serve exactly (see :func:`check_model_supported`). Returns the choice and its reason,
    which is also logged.
    """
    if impl != "auto" and impl not in BACKENDS:
        raise ValueError(f"impl={impl!r} is not a tree-attention backend; use 'auto' or one of {sorted(BACKENDS)}.")
    check_model_supported(model)
    register_tree_attention()
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    chosen, reason = choose_backend(impl, device)
    name = attn_implementation_name(chosen)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise TreeAttentionError(
            f"{type(model).__name__} kept attn_implementation={model.config._attn_implementation!r} after "
            f"set_attn_implementation({name!r}); it cannot be switched to tree attention."
        )
    no_backward = BACKENDS[chosen].unavailable(device)
    if chosen == "triton" and interpreted_on(device):
        no_backward = None
        logger.warning("tree attention: %s; TRITON_INTERPRET=1 runs its kernels in Triton's CPU interpreter, forward "
                       "and backward, but very slowly (impl='segment' is the fast backend on %s)", reason, device)
    elif no_backward is not None:
        logger.warning("tree attention: %s; the backward pass will fail on %s", reason, device)
    else:
        logger.info("tree attention: %s", reason)
    return TreeAttentionChoice(impl=chosen, attn_implementation=name, reason=reason, previous=previous,
                               no_backward=no_backward)
