"""Self-distillation divergences between a student and a teacher at the same tokens, as pure functions.

SDPO (Hübotter et al., 2026, arXiv 2601.20802) trains the policy, the **student**, towards
the same policy conditioned on privileged context, the **teacher**, at every token the
student sampled. Both score the same token ``y_t`` after the same completion prefix; only
their contexts differ. Per token, one of three forms (picked by name, :data:`DIVERGENCES`):

- ``sampled_token``: the reverse KL estimated at the sampled token in REINFORCE form,
  ``(logp_s - logp_t).detach() * logp_s``. Its gradient ``(logp_s - logp_t) grad logp_s``
  is an unbiased estimate of ``grad KL(student || teacher)`` for tokens the student sampled.
  Reverse KL only (``alpha = 1``).
- ``full``: ``D_alpha`` over the whole vocabulary.
- ``topk``: ``D_alpha`` over the student's ``k`` most likely tokens, the teacher's
  log-probs taken at the same ids; the rest of each side's mass is one extra **tail
  bucket** (``add_tail``) or is dropped and the ``k`` renormalized.

``D_alpha`` of two distributions ``s`` (student) and ``t`` (teacher) over one support:

- ``alpha = 0``: ``KL(t || s)``, forward KL;
- ``alpha = 1``: ``KL(s || t)``, reverse KL;
- in between, the generalized Jensen-Shannon divergence
  ``(1 - alpha) KL(s || m) + alpha KL(t || m)`` with ``m = (1 - alpha) s + alpha t``.

These are the forms of the authors' code and of TRL's experimental SDPO trainer
(``tests/test_sdpo_trl_parity.py`` checks per-token values and gradients against TRL's).

Memory: the ``full`` and ``topk`` forms need logits over the vocabulary. The learner hands
in hidden states ``(M, H)`` and the LM heads, and :func:`chunked_divergence` builds the
logits ``chunk_tokens`` rows at a time, each chunk under activation checkpointing: the
backward recomputes a chunk's logits instead of keeping them, so the peak is a few
``(chunk_tokens, V)`` tiles, never ``(M, V)`` for the batch (as in
:mod:`treerl.kernels.logprobs`). Everything is computed in at least float32.

>>> s = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0]]), -1)
>>> t = torch.log_softmax(torch.tensor([[0.0, 1.0, 1.0]]), -1)
>>> [round(float(generalized_jsd(s, t, a)), 4) for a in (0.0, 0.5, 1.0)]
[1.2641, 0.2679, 1.1815]
>>> round(float(generalized_jsd(s, s, 0.5)), 6)
0.0
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = [
    "DIVERGENCES",
    "DISTILLATION_MODES",
    "LMHead",
    "add_tail_bucket",
    "chunked_divergence",
    "full_divergence",
    "generalized_jsd",
    "importance_clip",
    "sampled_token_reverse_kl",
    "topk_divergence",
]

DISTILLATION_MODES = ("sampled_token", "topk", "full")
"""``sampled_token`` works on log-probs of the sampled tokens; the others on logits (:data:`DIVERGENCES`)."""

# exp() of a log-ratio beyond this overflows float32; the authors' code and TRL clamp the
# IS log-ratio to the same bound.
_MAX_LOG_RATIO = 20.0


def _f32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """(..., K) -> (...): ``KL(p || q) = sum p (log p - log q)`` (``F.kl_div(log_q, log_p, log_target=True)``)."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def generalized_jsd(student_logp: Tensor, teacher_logp: Tensor, alpha: float) -> Tensor:
    """``D_alpha`` (see the module docstring) of log-probs over one support: (..., K), (..., K) -> (...).

    Gradients flow to both arguments; the learner passes a detached teacher.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha}: use a value in [0, 1] (0 forward KL, 1 reverse KL, between: JSD).")
    s, t = _f32(student_logp), _f32(teacher_logp)
    if alpha == 0.0:
        return _kl(t, s)
    if alpha == 1.0:
        return _kl(s, t)
    mixture = torch.logsumexp(torch.stack([s + math.log(1.0 - alpha), t + math.log(alpha)]), dim=0)  # (..., K)
    return (1.0 - alpha) * _kl(s, mixture) + alpha * _kl(t, mixture)


def add_tail_bucket(logp: Tensor) -> Tensor:
    """(..., K) log-probs of part of a distribution -> (..., K + 1): one more entry, the missing mass.

    The captured mass is clamped just below 1, so a support holding (nearly) everything
    gets a tiny finite tail instead of ``log 0``.

    >>> out = add_tail_bucket(torch.log(torch.tensor([0.5, 0.25])))
    >>> [round(v, 4) for v in out.exp().tolist()]
    [0.5, 0.25, 0.25]
    """
    captured = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)  # (..., 1)
    return torch.cat([logp, torch.log(-torch.expm1(captured))], dim=-1)


def full_divergence(student_logits: Tensor, teacher_logits: Tensor, *, alpha: float) -> Tensor:
    """(M, V), (M, V) tempered logits -> (M,): ``D_alpha`` over the whole vocabulary."""
    return generalized_jsd(_f32(student_logits).log_softmax(-1), _f32(teacher_logits).log_softmax(-1), alpha)


def topk_divergence(student_logits: Tensor, teacher_logits: Tensor, *, alpha: float, topk: int,
                    add_tail: bool = True) -> Tensor:
    """(M, V), (M, V) tempered logits -> (M,): ``D_alpha`` over the student's top ``topk`` tokens.

    The teacher's log-probs are read at the student's ids. With ``add_tail`` each side's
    remaining mass is one more category; without, both ``k``-sets are renormalized.
    """
    s, t = _f32(student_logits), _f32(teacher_logits)
    k = min(topk, s.shape[-1])
    top_s, ids = torch.topk(s, k, dim=-1)  # (M, k): the support carries no gradient, its values do
    s_k = top_s - torch.logsumexp(s, dim=-1, keepdim=True)  # (M, k) true log-probs
    t_k = t.gather(-1, ids) - torch.logsumexp(t, dim=-1, keepdim=True)  # (M, k)
    if add_tail:
        s_k, t_k = add_tail_bucket(s_k), add_tail_bucket(t_k)  # (M, k + 1)
    else:
        s_k = s_k - torch.logsumexp(s_k, dim=-1, keepdim=True)
        t_k = t_k - torch.logsumexp(t_k, dim=-1, keepdim=True)
    return generalized_jsd(s_k, t_k, alpha)


def sampled_token_reverse_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """(M,), (M,) log-probs of the sampled tokens -> (M,): ``(logp_s - logp_t).detach() * logp_s``.

    The value is not the KL; its gradient is the REINFORCE estimate of the reverse KL's.

    >>> s = torch.tensor([-1.0, -2.0], requires_grad=True)
    >>> sampled_token_reverse_kl(s, torch.tensor([-1.5, -1.0])).sum().backward()
    >>> s.grad.tolist()
    [0.5, -1.0]
    """
    s = _f32(student_logp)
    return (s - _f32(teacher_logp)).detach() * s


def importance_clip(logp: Tensor, sampler_logp: Tensor, clip: float | None) -> Tensor:
    """(M,) detached weight ``min(exp(logp - sampler_logp), clip)`` (1 when ``clip`` is None).

    The distillation loss is taken on tokens the sampler drew; this corrects, up to
    ``clip``, for the trainer's distribution having moved away from the sampler's.

    >>> importance_clip(torch.tensor([0.0, -1.0]), torch.tensor([-1.0, -1.0]), 2.0).tolist()
    [2.0, 1.0]
    """
    if clip is None:
        return torch.ones_like(_f32(logp)).detach()
    log_ratio = (_f32(logp) - _f32(sampler_logp)).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return log_ratio.exp().clamp(max=clip)


LogitDivergence = Callable[..., Tensor]

DIVERGENCES: dict[str, LogitDivergence] = {
    "full": full_divergence,
    "topk": topk_divergence,
}
"""Divergences over logits by mode name; ``sampled_token`` works on log-probs instead."""


class LMHead(NamedTuple):
    """An LM head's parameters: ``logits = hidden @ weight.T + bias``."""

    weight: Tensor
    """(V, H)."""
    bias: Tensor | None = None
    """(V,) or None."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> LMHead:
        head = model.get_output_embeddings()
        return cls(head.weight, head.bias)


def _chunk(student_hidden: Tensor, student_weight: Tensor, student_bias: Tensor | None, teacher_hidden: Tensor,
           teacher_weight: Tensor, teacher_bias: Tensor | None, temperature: float, mode: str, alpha: float,
           topk: int, add_tail: bool) -> Tensor:
    """One chunk: (n, H) hidden states of both sides -> (n,) divergence. Logits live only here."""
    z_s = _f32(student_hidden @ student_weight.T if student_bias is None
               else torch.addmm(student_bias, student_hidden, student_weight.T)) / temperature  # (n, V)
    with torch.no_grad():
        z_t = _f32(teacher_hidden @ teacher_weight.T if teacher_bias is None
                   else torch.addmm(teacher_bias, teacher_hidden, teacher_weight.T)) / temperature  # (n, V)
    if mode == "topk":
        return topk_divergence(z_s, z_t, alpha=alpha, topk=topk, add_tail=add_tail)
    return DIVERGENCES[mode](z_s, z_t, alpha=alpha)


def chunked_divergence(student_hidden: Tensor, student_head: LMHead, teacher_hidden: Tensor, teacher_head: LMHead,
                       *, mode: str, alpha: float, topk: int = 100, add_tail: bool = True, temperature: float = 1.0,
                       chunk_tokens: int = 256, fp32_head: bool = False) -> Tensor:
    """Per-term ``D_alpha`` from hidden states and LM heads, ``chunk_tokens`` rows of logits at a time.

    Args:
        student_hidden: (M, H) the student's final hidden states predicting each term's token.
        student_head: the student's LM head; gradients flow to it and to ``student_hidden``.
        teacher_hidden: (M, H) the teacher's, at the same terms (detached here).
        teacher_head: the teacher's LM head (detached here; the live student's own is fine).
        mode: ``full`` or ``topk`` (:data:`DIVERGENCES`).
        alpha, topk, add_tail: see :func:`generalized_jsd` and :func:`topk_divergence`.
        temperature: the sampler's; both sides' logits are divided by it.
        chunk_tokens: rows of logits built at once.
        fp32_head: both sides' logits in float32 from half-precision heads (TRL's
            ``cast_lm_head_to_fp32``; a float32 copy of each head while this runs).

    Returns:
        (M,) float32 divergence per term.

    >>> _ = torch.manual_seed(0); w = torch.randn(50, 8)
    >>> hs, ht = torch.randn(5, 8, requires_grad=True), torch.randn(5, 8)
    >>> d = chunked_divergence(hs, LMHead(w), ht, LMHead(w), mode="full", alpha=0.5, chunk_tokens=2)
    >>> bool(torch.allclose(d, full_divergence(hs @ w.T, ht @ w.T, alpha=0.5), atol=1e-6))
    True
    """
    if mode not in DIVERGENCES:
        raise ValueError(f"mode={mode!r}: chunked_divergence computes {sorted(DIVERGENCES)}; sampled_token "
                         "works on log-probs (sampled_token_reverse_kl).")
    if student_hidden.shape != teacher_hidden.shape or student_hidden.dim() != 2:
        raise ValueError(f"student_hidden {tuple(student_hidden.shape)} and teacher_hidden "
                         f"{tuple(teacher_hidden.shape)} must both be (M, H) at the same terms.")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1.")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (the sampler's).")
    if fp32_head:
        student_head, teacher_head = (LMHead(h.weight.float(), None if h.bias is None else h.bias.float())
                                      for h in (student_head, teacher_head))
    teacher_hidden = teacher_hidden.detach().to(teacher_head.weight.dtype)
    t_weight = teacher_head.weight.detach()
    t_bias = None if teacher_head.bias is None else teacher_head.bias.detach()
    student_hidden = student_hidden.to(student_head.weight.dtype)
    out = []
    for start in range(0, student_hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        args = (student_hidden[rows], student_head.weight, student_head.bias, teacher_hidden[rows], t_weight, t_bias,
                float(temperature), mode, float(alpha), int(topk), bool(add_tail))
        if torch.is_grad_enabled() and (student_hidden.requires_grad or student_head.weight.requires_grad):
            # Keep only the chunk's inputs for backward; its (n, V) logits are rebuilt there.
            out.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            out.append(_chunk(*args))
    if not out:
        return student_hidden.new_zeros(0, dtype=torch.promote_types(student_hidden.dtype, torch.float32))
    return torch.cat(out)
