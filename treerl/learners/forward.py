"""The packed forward pass: hidden states of packed rows, log-probs at loss positions, the loss.

Three steps, each a small function a learner calls in order::

    batches = pack_groups(groups, adv, PackingConfig(max_tokens_per_row=4096))
    normalizer = window_normalizer(batches)            # counts over the whole window
    for batch in batches:
        batch = batch.to(device)
        out = packed_logprobs(model, batch, temperature=0.8)         # (M,) per term
        inputs = loss_inputs(batch, out, old_logp=old[batch_index])  # LossInputs
        compute_loss(inputs, loss_cfg, normalizer).loss.backward()

:func:`packed_logprobs` runs the decoder (``model.get_decoder()``, the causal LM without
its head) on the packed rows with tree attention, gathers the hidden states at the loss
positions, and calls :func:`treerl.kernels.logprobs.token_logprobs` with the LM-head
weight, so the ``(tokens x vocab)`` logits are never built. The head runs once per loss
position; the per-term values are a gather, whose gradient sums the terms that share a
position. That is why the loss and every parameter gradient equal those of the same
episodes trained unpacked (one padded row per episode), which
``tests/test_packed_equals_unpacked.py`` checks for every policy loss.

The trained log-prob of a term is renormalized over the sampler's candidate set where the
sampler recorded one (DESIGN.md, principle 4), and over the full vocabulary elsewhere.

A Mixture-of-Experts model's router adds its load-balancing loss (TRL's ``router_aux_loss_coef``):
``packed_logprobs(..., router_top_k=router_top_k(model))`` asks the decoder for its router logits
and returns the loss of the batch, each token weighted by the episode paths through it, which is
the value of the unpacked batch (:func:`~treerl.learners.losses.load_balancing_loss`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from treerl.errors import ConfigError, TreerlError
from treerl.kernels.logprobs import ImplChoice, token_logprobs
from treerl.kernels.tree_attention import BACKENDS, TREE_KWARG, attn_implementation_name
from treerl.learners.losses import (LossConfig, LossInputs, LossNormalizer, LossOutput, compute_loss,
                                    load_balancing_loss)
from treerl.learners.packing import PackedBatch
from treerl.learners.precision import Precision

__all__ = [
    "PackedForwardError",
    "PackedLogprobs",
    "loss_inputs",
    "packed_hidden_states",
    "packed_logprobs",
    "packed_loss",
    "head_weights",
    "router_aux_loss_coef",
    "router_top_k",
    "uses_tree_attention",
    "window_normalizer",
]


class PackedForwardError(TreerlError, ValueError):
    """The model cannot run a packed batch exactly as asked."""


@dataclass
class PackedLogprobs:
    """Per-term outputs of :func:`packed_logprobs`, all ``(M,)`` float32."""

    logp: Tensor
    """Log-prob of each term's target, over the sampler's candidate set where it recorded
    one and over the full vocabulary elsewhere: the log-prob the losses train."""
    entropy: Tensor
    """Entropy of the full tempered distribution at the term's position."""
    logp_vocab: Tensor
    """Log-prob over the full vocabulary (equals ``logp`` where no candidate set was recorded)."""
    choice: ImplChoice | None = None
    """Which log-prob implementation ran, and why."""
    head_logp: Tensor | None = None
    """(M, K) with ``head=True``: the vocabulary log-probs of each term's ``loss_head_ids``
    (the sampler's recorded head; -inf on padding), for score centering."""
    hidden: Tensor | None = None
    """(N, H) the final hidden states at the loss positions (with their graph), for losses that
    need the distribution and not only the target's log-prob (SDPO's distillation)."""
    aux_loss: Tensor | None = None
    """() float32 with ``router_top_k``: the router's load-balancing loss of the batch's tokens,
    each counted once per episode path through it (the unpacked batch's value), with its graph."""


def uses_tree_attention(model: torch.nn.Module) -> bool:
    """Whether :func:`treerl.kernels.tree_attention.enable_tree_attention` switched ``model`` over."""
    names = {attn_implementation_name(impl) for impl in BACKENDS}
    return getattr(model.config, "_attn_implementation", None) in names


def _check_head(model: torch.nn.Module) -> torch.nn.Module:
    """The LM head, if it is a plain linear layer that :func:`token_logprobs` reproduces exactly."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = type(model).__name__
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise PackedForwardError(
            f"{name} soft-caps its logits (config.final_logit_softcapping={config.final_logit_softcapping}), "
            "which the fused log-prob head does not implement; train it with full logits instead."
        )
    for attr in ("logit_scale", "logits_scaling"):
        value = getattr(config, attr, None)
        if value is not None and float(value) != 1.0:
            raise PackedForwardError(
                f"{name} scales its logits (config.{attr}={value}), which the fused log-prob head does not "
                "implement; train it with full logits instead."
            )
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise PackedForwardError(
            f"{name}.get_output_embeddings() is {type(head).__name__}, not a torch.nn.Linear; the fused "
            "log-prob head needs the LM head's weight (and bias)."
        )
    return head


def _text_config(model: torch.nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def router_aux_loss_coef(model: torch.nn.Module, coef: float | None) -> float:
    """TRL's ``router_aux_loss_coef`` for ``model``: the weight of its router's load-balancing loss.

    A Mixture-of-Experts model is one whose config has ``output_router_logits`` (TRL's test; its
    value does not matter, the learner asks for the logits). ``None`` takes the config's own
    ``router_aux_loss_coef`` (0.001 in Qwen3-MoE and Mixtral checkpoints; 0.0 where it declares
    none, and for a dense model); a non-zero ``coef`` for a dense model is refused, as TRL does.
    """
    config = _text_config(model)
    if not hasattr(config, "output_router_logits"):
        if coef:
            raise ConfigError(f"router_aux_loss_coef={coef}: {type(model).__name__} is not a Mixture-of-Experts "
                              "model that returns its router logits (its config has no output_router_logits), so "
                              "there is no load-balancing loss to weight; drop --router-aux-loss-coef (or set 0).")
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if coef is None else float(coef)


def router_top_k(model: torch.nn.Module) -> int:
    """The experts each token is routed to, as the model's own forward passes it to its load-balancing
    loss (its ``num_experts_per_tok``: the config's, DBRX's ``ffn_config.moe_top_k``); refused where
    neither the model nor its config says."""
    top_k = getattr(model, "num_experts_per_tok", None)
    if top_k is None:
        top_k = getattr(_text_config(model), "num_experts_per_tok", None)
    if not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"router_aux_loss_coef: {type(model).__name__}'s config has no num_experts_per_tok (the "
                          "experts each token is routed to), which its load-balancing loss counts; pass "
                          "--router-aux-loss-coef 0 to train without it.")
    return top_k


def packed_hidden_states(model: torch.nn.Module, batch: PackedBatch) -> Tensor:
    """(B, T, H) final hidden states of the packed rows (the decoder only, no LM head).

    With tree attention enabled the rows attend along their trees. Without it, only rows
    that are single root-to-leaf chains (``PackingConfig(mode="padded")``) are exact, since
    plain causal attention over a right-padded chain is the tree mask; anything else is
    refused rather than silently attended across branches.
    """
    return _decoder_outputs(model, batch).last_hidden_state


def _decoder_outputs(model: torch.nn.Module, batch: PackedBatch, **extra: Any) -> Any:
    """The decoder's outputs on the packed rows (see :func:`packed_hidden_states`); ``extra`` keyword
    arguments go to the decoder (``output_router_logits=True``)."""
    kwargs = {}
    if uses_tree_attention(model):
        kwargs[TREE_KWARG] = batch.layouts
    elif any(layout.num_segments != 1 for layout in batch.layouts.layouts):
        raise PackedForwardError(
            f"this batch was packed with mode={batch.mode!r}: its rows hold trees or several episodes, but "
            f"{type(model).__name__} uses attn_implementation={model.config._attn_implementation!r}, which would "
            "attend across branches. Call treerl.kernels.tree_attention.enable_tree_attention(model) first, or "
            "pack with PackingConfig(mode='padded') for a model tree attention cannot serve."
        )
    decoder = model.get_decoder()
    out = decoder(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        attention_mask=None,
        use_cache=False,
        **kwargs,
        **extra,
    )
    return out


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    impl: str = "auto",
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
    head: bool = False,
    precision: Precision | None = None,
    router_top_k: int | None = None,
) -> PackedLogprobs:
    """Log-probs, entropies and candidate-renormalized log-probs of every term of ``batch``.

    Args:
        model: a transformers causal LM, with tree attention enabled for ``tree``/``flat``
            batches (any causal LM for ``padded`` ones).
        batch: one micro-batch from :func:`treerl.learners.packing.pack_groups`, on the
            model's device (``batch.to(device)``).
        temperature: the sampler's temperature; logits are divided by it.
        impl, chunk_tokens, chunk_vocab: passed to :func:`token_logprobs`.
        head: also the log-probs of the sampler's recorded head ids (``head_logp``).
        precision: the run's :class:`~treerl.learners.precision.Precision`; its autocast covers
            the decoder only, so the head, the log-probs and everything after are float32; its
            ``fp32_head`` multiplies a half-precision head in float32 too (TRL's ``cast_lm_head_to_fp32``).
        router_top_k: a Mixture-of-Experts model's :func:`router_top_k`: also its router's load-balancing
            loss (``aux_loss``), from the same forward.

    The LM head runs once per loss position (``N``), not per term (``M``): episodes that
    share a sampled token share its head computation, and the gather's gradient adds their
    terms up.
    """
    head = _check_head(model)
    fp32_head = precision is not None and precision.fp32_head
    aux_loss = None
    with precision.forward() if precision is not None else contextlib.nullcontext():
        if router_top_k is None:
            hidden = packed_hidden_states(model, batch)  # (B, T, H)
        else:
            decoded = _decoder_outputs(model, batch, output_router_logits=True)
            hidden = decoded.last_hidden_state  # (B, T, H)
            router_logits = getattr(decoded, "router_logits", None)  # per MoE layer (B * T, E)
            if not router_logits:
                raise PackedForwardError(f"{type(model).__name__}'s decoder returned no router logits for "
                                         "output_router_logits=True, so its load-balancing loss cannot be computed; "
                                         "pass --router-aux-loss-coef 0 to train without it.")
            aux_loss = load_balancing_loss(router_logits, router_top_k, batch.token_num_paths)
    batch_size, length, width = hidden.shape
    flat_index = batch.loss_row * length + batch.loss_pos  # (N,)
    hidden_at_loss = hidden.reshape(batch_size * length, width).index_select(0, flat_index)  # (N, H)
    if precision is not None and precision.autocast is not None:
        hidden_at_loss = hidden_at_loss.float()  # out of the autocast region: the head and log-probs in float32
    out = token_logprobs(
        hidden_at_loss.to(head.weight.dtype),
        head.weight,
        batch.loss_target,
        bias=head.bias,
        temperature=temperature,
        candidates=batch.loss_candidates,
        chunk_tokens=chunk_tokens,
        chunk_vocab=chunk_vocab,
        impl=impl,
        fp32_head=fp32_head,
    )
    logp = out.logp  # (N,)
    if out.logp_candidates is not None:
        logp = torch.where(batch.loss_has_candidates, out.logp_candidates, out.logp)
    head_logp = None
    if head and batch.loss_head_ids is not None:
        head_logp = _head_logprobs(hidden_at_loss, head_weights(model), batch, out.logp, temperature,
                                   chunk_tokens, fp32_head)[batch.term_loss]  # (M, K)
    return PackedLogprobs(
        logp=logp[batch.term_loss],  # (M,)
        entropy=out.entropy[batch.term_loss],
        logp_vocab=out.logp[batch.term_loss],
        choice=out.choice,
        head_logp=head_logp,
        hidden=hidden_at_loss,
        aux_loss=aux_loss,
    )


def head_weights(model: torch.nn.Module) -> tuple[Tensor, Tensor | None]:
    """The LM head's weight ``(V, H)`` and bias ``(V,)`` or None."""
    lm_head = model.get_output_embeddings()
    return lm_head.weight, lm_head.bias


def _head_logprobs(hidden: Tensor, weights: tuple[Tensor, Tensor | None], batch: PackedBatch, logp_target: Tensor,
                   temperature: float, chunk: int, fp32_head: bool = False) -> Tensor:
    """(N, K) vocabulary log-probs of ``batch.loss_head_ids`` at each loss position.

    Only K logits per position are formed: the log-normalizer comes from the target's
    vocabulary log-prob, ``log Z = z_target - logp_target``, which keeps the gradient of Z.
    """
    weight, bias = weights
    dtype = torch.float32 if fp32_head else weight.dtype  # float32: the gathered rows upcast, not the whole head
    bias = None if bias is None else bias.to(dtype)
    ids = batch.loss_head_ids.clamp(min=0)  # (N, K); padding reads id 0 and is masked below
    out = []
    for start in range(0, ids.shape[0], chunk):
        h = hidden[start:start + chunk].to(dtype)  # (n, H)
        z = torch.einsum("nh,nkh->nk", h, weight[ids[start:start + chunk]].to(dtype))  # (n, K)
        z_target = (h * weight[batch.loss_target[start:start + chunk]].to(dtype)).sum(-1)  # (n,)
        if bias is not None:
            z = z + bias[ids[start:start + chunk]]
            z_target = z_target + bias[batch.loss_target[start:start + chunk]]
        log_z = z_target.float() / temperature - logp_target[start:start + chunk]  # (n,)
        out.append(z.float() / temperature - log_z.unsqueeze(-1))
    logp = torch.cat(out) if out else hidden.new_zeros((0, ids.shape[1]), dtype=torch.float32)
    return logp.masked_fill(batch.loss_head_ids < 0, -torch.inf)


def window_normalizer(batches: Sequence[PackedBatch]) -> LossNormalizer:
    """The normalizer of a window made of these micro-batches (one :func:`pack_groups` call).

    Counts terms per episode exactly as an unpacked batch would: ``num_tokens`` is the
    number of (token, episode) terms, ``num_sequences`` the episodes with at least one.
    """
    if not batches:
        raise ValueError("window_normalizer needs at least one PackedBatch; there is nothing to train on.")
    return LossNormalizer.from_micro_batches([b.term_episode for b in batches], batches[0].num_episodes)


def loss_inputs(
    batch: PackedBatch,
    logprobs: PackedLogprobs,
    *,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    is_weight: Tensor | None = None,
    is_mask: Tensor | None = None,
    centering: Tensor | None = None,
    entropy_mask: Tensor | None = None,
) -> LossInputs:
    """The :class:`LossInputs` of one packed micro-batch.

    ``old_logp`` (M,) defaults to ``batch.term_old_logp`` (see
    :meth:`~treerl.learners.packing.PackedBatch.with_old_logp`), else to
    ``logprobs.logp.detach()``: on-policy with one update per batch, the PPO ratio is then
    exactly 1. When a batch is trained several times, compute the old log-probs once with
    :func:`packed_logprobs` under ``torch.no_grad()`` before the first update.
    """
    logp = logprobs.logp
    if old_logp is None:
        old_logp = batch.term_old_logp.to(logp.device) if batch.term_old_logp is not None else logp.detach()
    return LossInputs(
        logp=logp,
        old_logp=old_logp,
        sampler_logp=batch.term_sampler_logp.to(logp.device),
        adv=batch.term_adv.to(logp.device),
        episode=batch.term_episode.to(logp.device),
        num_episodes=batch.num_episodes,
        ref_logp=ref_logp,
        entropy=logprobs.entropy,
        is_weight=is_weight,
        is_mask=is_mask,
        centering=centering,
        entropy_mask=entropy_mask,
    )


def packed_loss(
    model: torch.nn.Module,
    batch: PackedBatch,
    cfg: LossConfig,
    normalizer: LossNormalizer,
    *,
    temperature: float = 1.0,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    is_weight: Tensor | None = None,
    is_mask: Tensor | None = None,
    impl: str = "auto",
) -> tuple[LossOutput, PackedLogprobs]:
    """Forward, log-probs and the policy loss of one micro-batch; call ``.loss.backward()`` on it."""
    logprobs = packed_logprobs(model, batch, temperature=temperature, impl=impl)
    inputs = loss_inputs(batch, logprobs, old_logp=old_logp, ref_logp=ref_logp, is_weight=is_weight, is_mask=is_mask)
    return compute_loss(inputs, cfg, normalizer), logprobs
