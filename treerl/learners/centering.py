"""Score centering: the sampler-expected score subtracted from each token's, with the same IS weight.

Off-policy, a token ``a`` is drawn from the sampler's distribution ``q`` and trained with
the importance weight ``w(a) = clamp(p(a) / q(a), lo, hi)`` of the trainer's ``p``, so its
score term is ``w(a) grad log p(a)``. Untruncated, that term has mean ``sum_v p(v) grad log
p(v) = 0``; truncated (or masked) it does not, and the bias drifts the policy a little with
every step, whatever the advantages say. Score centering (arXiv 2609.20807, "Score Centering
Stabilizes Off-policy Reinforcement Learning"; TRL's default for asynchronous training)
subtracts the term's expectation under the sampler, ``E_{v ~ q}[w(v) grad log p(v)]``, so
per token the policy gradient becomes::

    A * ( w(a) grad log p(a) - sum_v q(v) w(v) grad log p(v) )

whose score part has mean exactly 0 under the sampler. As a surrogate the subtracted part
is ``C = sum_v sg(c_v) log p(v)`` added to the loss times the advantage, with ``c_v = m_v -
alpha p_v`` and ``m_v = q(v) w(v)`` (the weighted sampler mass; truncation makes it
``clamp(p_v, lo q_v, hi q_v)``). ``alpha p_v`` is free to subtract because ``sum_v p_v grad
log p_v = 0`` over the full support; it is what the tail below needs, and it makes ``c``
exactly 0 wherever the weight is not truncated, so on-policy the term vanishes.

Which ``v`` the sum runs over:

- **exact** (the sampler used top-k/top-p/min-p and recorded its candidate set with the
  log-probs of all of it): the whole support, with ``p`` renormalized over it as the
  training core does, and ``alpha = 1``;
- **head** (the whole vocabulary was the support): the sampler's ``K`` most likely tokens
  ``H`` that it recorded; outside them the sampler's tail is modelled as the trainer's,
  rescaled: ``q(v) = rho p(v)`` with ``rho = (1 - sum_H q) / (1 - sum_H p)``. Their weight
  is then ``w(1/rho)`` and their expected score folds into the head as ``-alpha p_v`` with
  ``alpha = rho w(1/rho)`` (the estimator of the paper's top-k variant).

All weights are detached; the gradient flows through ``log p`` only.

Example (on-policy the centering is zero):
    >>> import torch
    >>> logp = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    >>> out = score_centering(logp, logp, torch.tensor([True]), ImportanceConfig(ratio_high=2.0))
    >>> out.terms.tolist(), out.metrics["centering/coef_abs_sum"].item()
    ([0.0], 0.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from treerl.learners.importance import ImportanceConfig, ratio_weight
from treerl.learners.packed_batch import PackedBatch

__all__ = ["CenteringOutput", "score_centering", "batch_centering"]

# Tail masses below this are float noise (1 - a sum of K float32 probabilities): rho's denominator
# stops here, and a head whose two tails are both below it is treated as the whole support.
_MIN_TAIL = 1e-5


@dataclass
class CenteringOutput:
    terms: Tensor
    """(M,) ``C_t = sum_v sg(c_v) log p(v)``: add ``adv * C_t`` to each term of the loss."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """``centering/coef_abs_sum`` (mean over terms of ``sum_v |c_v|``: 0 on-policy) and
    ``centering/sampler_tail_mass`` (mean sampler mass outside a recorded head)."""


def score_centering(trainer_logp: Tensor, sampler_logp: Tensor, exact: Tensor,
                    cfg: ImportanceConfig) -> CenteringOutput:
    """The score-centering surrogate of each term (see the module docstring).

    Args:
        trainer_logp: (M, K) the trainer's log-probs of the recorded head ids, over the whole
            vocabulary (renormalized here where ``exact``); -inf or anything on padding. Grad flows.
        sampler_logp: (M, K) the sampler's log-probs of the same ids; -inf marks padding.
        exact: (M,) bool, True where the head is the sampler's whole support.
        cfg: the importance sampling the sampled token is weighted with (mode, ratio bounds).
    """
    if trainer_logp.shape != sampler_logp.shape or trainer_logp.dim() != 2 or exact.shape != trainer_logp.shape[:1]:
        raise ValueError(f"score_centering: trainer_logp {tuple(trainer_logp.shape)} and sampler_logp "
                         f"{tuple(sampler_logp.shape)} must be (M, K) and exact {tuple(exact.shape)} (M,).")
    dtype = torch.promote_types(trainer_logp.dtype, torch.float32)
    valid = torch.isfinite(sampler_logp)  # (M, K)
    logp_vocab = trainer_logp.to(dtype).masked_fill(~valid, -torch.inf)  # (M, K)
    # Exact heads: the trainer's distribution renormalized over the support, as the core trains it.
    norm = torch.logsumexp(logp_vocab, dim=-1, keepdim=True)  # (M, 1)
    logp = torch.where(exact.unsqueeze(-1), logp_vocab - norm, logp_vocab)  # (M, K)
    with torch.no_grad():
        p = logp.exp().masked_fill(~valid, 0.0)  # (M, K)
        q = sampler_logp.to(dtype).exp().masked_fill(~valid, 0.0)  # (M, K)
        ratio = torch.where(valid, p / q.clamp(min=torch.finfo(dtype).tiny), torch.ones_like(p))  # (M, K)
        weight, keep = ratio_weight(ratio, cfg)
        # c_v = q_v w(r_v) - alpha p_v, written as q_v (w(r_v) - r_v) + (1 - alpha) p_v: both parts are
        # exactly 0 where no weight is truncated or masked, so a sampler equal to the trainer adds nothing.
        excess = q * (weight * keep - ratio)  # (M, K)
        tail_q = (1.0 - q.sum(-1)).clamp(min=0.0)  # (M,)
        tail_p = (1.0 - p.sum(-1)).clamp(min=_MIN_TAIL)  # (M,)
        rho = tail_q / tail_p  # (M,) the sampler's tail as a multiple of the trainer's
        inv = 1.0 / rho.clamp(min=torch.finfo(dtype).tiny)  # (M,) the tail's ratio p / q
        tail_weight, tail_keep = ratio_weight(inv, cfg)
        # 1 - alpha = 1 - rho w(1/rho) = rho (1/rho - w(1/rho)); no sampler tail: alpha = 0.
        one_minus_alpha = torch.where(rho > 0, rho * (inv - tail_weight * tail_keep), torch.ones_like(rho))
        # Exact heads have no tail (alpha = 1); nor, in effect, do heads whose tails on both sides are float
        # noise: the tail's expected score is O(tail mass), and rho of two noises would be noise.
        no_tail = exact | ((tail_q < _MIN_TAIL) & (tail_p <= _MIN_TAIL))
        one_minus_alpha = torch.where(no_tail, torch.zeros_like(rho), one_minus_alpha)  # (M,)
        coef = (excess + one_minus_alpha.unsqueeze(-1) * p).masked_fill(~valid, 0.0)  # (M, K) c_v
    terms = (coef * logp.masked_fill(~valid, 0.0)).sum(-1)  # (M,)
    head_terms = ~exact & valid.any(-1)  # terms with a recorded head over the vocabulary
    metrics = {
        "centering/coef_abs_sum": coef.abs().sum(-1).mean() if coef.numel() else coef.sum(),
        "centering/sampler_tail_mass": tail_q[head_terms].mean() if bool(head_terms.any()) else tail_q.sum() * 0,
    }
    return CenteringOutput(terms=terms, metrics=metrics)


def batch_centering(batch: PackedBatch, head_logp: Tensor, cfg: ImportanceConfig) -> CenteringOutput:
    """:func:`score_centering` of every term of a packed micro-batch.

    ``head_logp`` (M, K) is :func:`~treerl.learners.forward.packed_logprobs`'s ``head_logp``:
    the trainer's vocabulary log-probs of each term's ``loss_head_ids``.
    """
    if batch.loss_head_ids is None:
        raise ValueError("score centering needs the sampler's recorded head at every sampled token, and this batch "
                         "has none: sample with SamplingParams(top_logprobs=K) (AsyncGRPO does with "
                         "--objective score_centering), or train with --objective clipped.")
    sampler = batch.loss_head_logp[batch.term_loss].to(head_logp.device)  # (M, K)
    exact = batch.loss_head_exact[batch.term_loss].to(head_logp.device)  # (M,)
    return score_centering(head_logp, sampler, exact, cfg)
