"""Policy losses as pure functions on the flat (token, episode) layout.

Tree packing deduplicates the forward pass, never the loss (DESIGN.md, principle 3): a
token shared by ``k`` episodes of a prefix tree yields ``k`` **loss terms**, one per
(token, episode) pair, each with its episode's advantage. An unpacked batch yields the
same terms. Every loss here is written on that flat list of ``M`` terms, so packing and
micro-batching cannot change the result.

A policy loss is ``(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) ->
LossOutput`` and is picked by name from :data:`POLICY_LOSSES`:

========== ===================================================== ==================
name       surrogate per term                                    default aggregation
========== ===================================================== ==================
grpo       PPO clipped ratio (current / old)                     sequence_mean
dapo       PPO clipped ratio, clip-higher                        token_mean
dr_grpo    PPO clipped ratio                                     constant
gspo       sequence ratio, GSPO-token gradient                   sequence_mean
cispo      clipped detached ratio x log-prob                     token_mean
sapo       sigmoid soft gate instead of clipping                 sequence_mean
vespo      gamma-shaped weight of the sequence ratio x log-prob  token_mean
dppo       probability-difference trust-region mask              token_mean
========== ===================================================== ==================

The three aggregations (:data:`AGGREGATIONS`) are linear in the terms and divide by
counts that the caller supplies in :class:`LossNormalizer` for the **whole accumulation
window on all ranks**. So the loss of a window is the sum of the losses of its
micro-batches, exactly, and ``loss.backward()`` per micro-batch accumulates the gradient
of the whole window:

- ``token_mean``: ``sum(terms) / normalizer.num_tokens`` (DAPO).
- ``sequence_mean``: ``sum_e (1 / n_e) sum_{t in e} term / normalizer.num_sequences``
  (GRPO). ``n_e`` is episode ``e``'s term count over the whole window: pass it as
  ``normalizer.episode_num_tokens`` when an episode's terms may be split across
  micro-batches; without it ``n_e`` is counted from ``inputs.episode``, which is exact
  only when each micro-batch holds its episodes whole.
- ``constant``: ``sum(terms) / (normalizer.num_sequences * cfg.max_completion_length)``
  (Dr. GRPO).

Three policies stay distinct. ``old_logp`` defines the trust region (the PPO ratio is
``exp(logp - old_logp)``); ``sampler_logp`` is the policy that produced the token (vLLM,
a stale policy version). The sampler-vs-trainer correction is computed by
:func:`treerl.learners.importance.importance_weights` and handed to the losses as
``LossInputs.is_weight`` and ``LossInputs.is_mask``; they multiply the policy term of every
loss (except that ``vespo`` reshapes the full ratio ``logp - sampler_logp`` itself and so
uses only ``is_mask``). Masked terms still count in the normalizers, as in TRL: a mask
drops a term's gradient, it does not re-weight the others.

The KL to a reference (k3 estimator, ``cfg.beta``) and the entropy bonus
(``cfg.entropy_coef``) use the same aggregation as the policy term, so they too add up
exactly over micro-batches.

Example:
    >>> import torch
    >>> logp = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    >>> inputs = LossInputs(
    ...     logp=logp, old_logp=logp.detach(), sampler_logp=logp.detach(),
    ...     adv=torch.tensor([1.0, 1.0, -1.0]), episode=torch.tensor([0, 0, 1]),
    ...     num_episodes=2)
    >>> out = POLICY_LOSSES["dapo"](inputs, LossConfig(), LossNormalizer.from_inputs(inputs))
    >>> round(out.loss.item(), 4)  # on-policy: -(1 + 1 - 1) / 3
    -0.3333
    >>> sorted(out.metrics)
    ['clip/high_frac', 'clip/low_frac', 'clip/region_frac', 'loss/policy']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "LossConfig",
    "LossInputs",
    "LossNormalizer",
    "LossOutput",
    "cispo_loss",
    "compute_loss",
    "dapo_loss",
    "dppo_loss",
    "dr_grpo_loss",
    "episode_sum",
    "grpo_loss",
    "gspo_loss",
    "k3_kl",
    "sapo_loss",
    "vespo_loss",
]

# exp() of a log-ratio beyond this overflows float32 into inf and then NaN gradients; the
# same bound as TRL and the VESPO reference code. Ratios this far off are clipped,
# masked or weighted to ~0 by every loss anyway.
_MAX_LOG_RATIO = 20.0


# --------------------------------------------------------------------------------------
# Inputs, normalizer, config, output
# --------------------------------------------------------------------------------------


@dataclass
class LossInputs:
    """The loss terms of one micro-batch, one entry per (token, episode) pair.

    Shapes use ``M`` for the number of terms. Tensors may be in any float dtype; the
    losses compute in at least float32.
    """

    logp: Tensor
    """(M,) log-prob of each term's target token under the current policy (requires grad)."""
    old_logp: Tensor
    """(M,) log-prob under the policy that defines the trust region (detached)."""
    sampler_logp: Tensor
    """(M,) log-prob under the sampler that produced the token (detached)."""
    adv: Tensor
    """(M,) advantage of the term's episode."""
    episode: Tensor
    """(M,) long, episode index of each term, in ``[0, num_episodes)``."""
    num_episodes: int
    """Size of the episode index space (rows of ``LossNormalizer.episode_num_tokens``)."""
    ref_logp: Tensor | None = None
    """(M,) log-prob under the reference model; required when ``LossConfig.beta > 0``."""
    entropy: Tensor | None = None
    """(M,) entropy of the current policy at each term's position; required when
    ``LossConfig.entropy_coef > 0``, reported as ``loss/entropy`` whenever given."""
    is_weight: Tensor | None = None
    """(M,) detached sampler-vs-trainer importance weight from
    :func:`treerl.learners.importance.importance_weights`; ``None`` means 1."""
    is_mask: Tensor | None = None
    """(M,) 0/1 mask from the same function; ``None`` keeps every term."""

    def __post_init__(self) -> None:
        if self.logp.dim() != 1:
            raise ValueError(
                f"LossInputs.logp has shape {tuple(self.logp.shape)}; the losses take a flat "
                "list of (token, episode) terms of shape (M,). Gather the log-probs at the loss "
                "positions and flatten them first."
            )
        m = self.logp.shape[0]
        for name in ("old_logp", "sampler_logp", "adv", "episode", "ref_logp", "entropy", "is_weight", "is_mask"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (m,):
                raise ValueError(
                    f"LossInputs.{name} has shape {tuple(value.shape)} but logp has ({m},); every "
                    "per-term tensor must have one entry per (token, episode) term."
                )
        for name in ("old_logp", "sampler_logp", "ref_logp", "is_weight", "is_mask"):
            value = getattr(self, name)
            if value is not None and value.requires_grad:
                raise ValueError(
                    f"LossInputs.{name} requires grad, so the loss would differentiate through "
                    "a policy that is not being trained. Compute it under torch.no_grad() or "
                    "pass .detach()."
                )
        if self.episode.dtype != torch.long:
            raise ValueError(
                f"LossInputs.episode has dtype {self.episode.dtype}; it indexes episodes and "
                "must be torch.long. Pass episode.long()."
            )
        if self.num_episodes < 1:
            raise ValueError(f"LossInputs.num_episodes is {self.num_episodes}; it must be at least 1.")
        # One host sync per micro-batch; an out-of-range index would otherwise surface as
        # an opaque device-side assert in index_add.
        if m > 0 and (int(self.episode.min()) < 0 or int(self.episode.max()) >= self.num_episodes):
            raise ValueError(
                f"LossInputs.episode has values in [{int(self.episode.min())}, "
                f"{int(self.episode.max())}] but num_episodes is {self.num_episodes}; episode "
                "indices must lie in [0, num_episodes)."
            )

    @property
    def num_terms(self) -> int:
        """``M``, the number of loss terms."""
        return self.logp.shape[0]


@dataclass
class LossNormalizer:
    """Counts over the whole accumulation window on all ranks, supplied by the caller.

    The losses divide by these instead of by local counts so that summing the losses of
    the micro-batches (and averaging gradients over ranks) gives the loss of the window.
    With several data-parallel ranks, ``all_reduce`` ``num_tokens`` and ``num_sequences``
    (sum), and multiply the loss by the world size when the wrapper averages gradients
    across ranks (DDP does). ``episode_num_tokens`` stays rank-local when episodes are.
    """

    num_tokens: float
    """Number of loss terms (token, episode pairs) in the window: the DAPO denominator."""
    num_sequences: float
    """Number of episodes in the window: the GRPO and Dr. GRPO denominator."""
    episode_num_tokens: Tensor | None = None
    """(num_episodes,) each episode's number of terms over the whole window, indexed like
    ``LossInputs.episode``. Needed by ``sequence_mean`` when an episode's terms are split
    across micro-batches; also lets sequence-level losses check that they are not."""

    def __post_init__(self) -> None:
        if not self.num_tokens > 0:
            raise ValueError(
                f"LossNormalizer.num_tokens is {self.num_tokens}; it counts the loss terms of the "
                "whole window and must be positive. Skip the step when there is nothing to train on."
            )
        if not self.num_sequences > 0:
            raise ValueError(
                f"LossNormalizer.num_sequences is {self.num_sequences}; it counts the episodes of "
                "the whole window and must be positive."
            )
        if self.episode_num_tokens is not None and self.episode_num_tokens.dim() != 1:
            raise ValueError(
                f"LossNormalizer.episode_num_tokens has shape {tuple(self.episode_num_tokens.shape)}; "
                "it must be (num_episodes,)."
            )

    @classmethod
    def from_inputs(cls, inputs: LossInputs) -> LossNormalizer:
        """The normalizer of a window that is this one micro-batch on one rank."""
        return cls.from_micro_batches([inputs.episode], inputs.num_episodes)

    @classmethod
    def from_micro_batches(cls, episodes: Sequence[Tensor], num_episodes: int) -> LossNormalizer:
        """The normalizer of a window made of micro-batches that share one episode index space.

        ``episodes`` holds each micro-batch's ``LossInputs.episode``. An episode's terms may
        be spread over several micro-batches. ``num_sequences`` counts episodes with at
        least one term.

        Example:
            >>> import torch
            >>> n = LossNormalizer.from_micro_batches([torch.tensor([0, 0, 1]), torch.tensor([1, 2])], 3)
            >>> n.num_tokens, n.num_sequences, n.episode_num_tokens.tolist()
            (5, 3, [2, 2, 1])
        """
        counts = torch.zeros(num_episodes, dtype=torch.long, device=episodes[0].device if episodes else None)
        for episode in episodes:
            counts = counts + torch.bincount(episode, minlength=num_episodes)
        return cls(
            num_tokens=int(counts.sum()),
            num_sequences=int((counts > 0).sum()),
            episode_num_tokens=counts,
        )


@dataclass
class LossConfig:
    """Which policy loss to use and its coefficients."""

    policy_loss: str = "dapo"
    """Name in :data:`POLICY_LOSSES`: grpo, dapo, dr_grpo, gspo, cispo, sapo, vespo, dppo."""
    aggregation: str | None = None
    """Override the loss's default aggregation: token_mean, sequence_mean or constant."""
    epsilon_low: float = 0.2
    """PPO clip: ratios below ``1 - epsilon_low`` stop pushing down (grpo, dapo, dr_grpo)."""
    epsilon_high: float = 0.28
    """PPO clip: ratios above ``1 + epsilon_high`` stop pushing up; 0.28 is DAPO's clip-higher."""
    max_completion_length: int | None = None
    """Dr. GRPO's constant: the most loss tokens an episode may have. Needed by ``constant``."""
    beta: float = 0.0
    """Weight of the k3 KL to the reference model; 0 needs no reference model."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    gspo_epsilon_low: float = 3e-4
    """GSPO sequence-ratio clip below 1 (GSPO paper v2, section 5.1)."""
    gspo_epsilon_high: float = 4e-4
    """GSPO sequence-ratio clip above 1 (GSPO paper v2, section 5.1)."""
    cispo_ratio_min: float = 0.0
    """CISPO lower bound of the detached weight; 0 means none, as in MiniMax-M1."""
    cispo_ratio_max: float = 5.0
    """CISPO upper bound of the detached weight (the ScaleRL recommendation, as in TRL)."""
    sapo_tau_pos: float = 1.0
    """SAPO gate temperature for positive advantages (SAPO paper default)."""
    sapo_tau_neg: float = 1.05
    """SAPO gate temperature for negative advantages; larger decays faster (paper default)."""
    vespo_k_pos: float = 2.0
    """VESPO gamma shape for non-negative advantages (reference code and TRL default)."""
    vespo_lambda_pos: float = 3.0
    """VESPO gamma rate for non-negative advantages."""
    vespo_k_neg: float = 3.0
    """VESPO gamma shape for negative advantages."""
    vespo_lambda_neg: float = 2.0
    """VESPO gamma rate for negative advantages."""
    dppo_delta_low: float = 0.15
    """DPPO-Binary-TV: a negative-advantage term is masked once ``p - p_old < -delta_low``."""
    dppo_delta_high: float = 0.15
    """DPPO-Binary-TV: a positive-advantage term is masked once ``p - p_old > delta_high``."""
    dppo_ratio_max: float | None = None
    """DPPO: truncate the detached ratio at this value; ``None`` (the paper's recipe) does not."""

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"LossConfig.policy_loss is {self.policy_loss!r}, which is not a known loss; "
                f"choose one of {sorted(POLICY_LOSSES)}."
            )
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"LossConfig.aggregation is {self.aggregation!r}; choose one of "
                f"{sorted(AGGREGATIONS)}, or None for the loss's default."
            )
        if not 0.0 <= self.epsilon_low < 1.0:
            raise ValueError(
                f"LossConfig.epsilon_low is {self.epsilon_low}; the lower clip 1 - epsilon_low must "
                "stay in (0, 1], so use a value in [0, 1) such as 0.2."
            )
        if not self.epsilon_high >= 0.0:
            raise ValueError(f"LossConfig.epsilon_high is {self.epsilon_high}; use a value >= 0 such as 0.28.")
        if not 0.0 <= self.gspo_epsilon_low < 1.0 or not self.gspo_epsilon_high >= 0.0:
            raise ValueError(
                f"LossConfig.gspo_epsilon_low/high are {self.gspo_epsilon_low}/{self.gspo_epsilon_high}; "
                "use small non-negative values (the GSPO paper uses 3e-4 and 4e-4), low below 1."
            )
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(
                f"LossConfig.max_completion_length is {self.max_completion_length}; it must be a "
                "positive token count, or None when the constant aggregation is not used."
            )
        uses_constant = (self.aggregation or _DEFAULT_AGGREGATION[self.policy_loss]) == "constant"
        if uses_constant and self.max_completion_length is None:
            raise ValueError(
                f"LossConfig.max_completion_length is None but policy_loss={self.policy_loss!r} "
                "with the 'constant' aggregation divides by num_sequences * max_completion_length "
                "(Dr. GRPO). Set max_completion_length to the generation budget in tokens."
            )
        if not (self.beta >= 0.0 and math.isfinite(self.beta)):
            raise ValueError(f"LossConfig.beta is {self.beta}; use a finite value >= 0 (0 disables the KL term).")
        if not (self.entropy_coef >= 0.0 and math.isfinite(self.entropy_coef)):
            raise ValueError(
                f"LossConfig.entropy_coef is {self.entropy_coef}; use a finite value >= 0 "
                "(0 disables the entropy bonus)."
            )
        if not 0.0 <= self.cispo_ratio_min < self.cispo_ratio_max:
            raise ValueError(
                f"LossConfig.cispo_ratio_min/max are {self.cispo_ratio_min}/{self.cispo_ratio_max}; "
                "they must satisfy 0 <= min < max (MiniMax-M1 uses no lower bound: min = 0)."
            )
        if not (self.sapo_tau_pos > 0.0 and self.sapo_tau_neg > 0.0):
            raise ValueError(
                f"LossConfig.sapo_tau_pos/neg are {self.sapo_tau_pos}/{self.sapo_tau_neg}; the gate "
                "temperatures must be positive (the paper uses 1.0 and 1.05)."
            )
        if min(self.vespo_k_pos, self.vespo_k_neg) < 0.0 or min(self.vespo_lambda_pos, self.vespo_lambda_neg) <= 0.0:
            raise ValueError(
                "LossConfig.vespo_k_* must be >= 0 and vespo_lambda_* > 0 for the gamma kernel "
                "w^k exp(lambda (1 - w)) to peak at a finite ratio; the defaults are 2, 3, 3, 2."
            )
        if not (0.0 < self.dppo_delta_low <= 1.0 and 0.0 < self.dppo_delta_high <= 1.0):
            raise ValueError(
                f"LossConfig.dppo_delta_low/high are {self.dppo_delta_low}/{self.dppo_delta_high}; "
                "they bound a difference of probabilities, so use values in (0, 1] such as 0.15."
            )
        if self.dppo_ratio_max is not None and not self.dppo_ratio_max > 0.0:
            raise ValueError(
                f"LossConfig.dppo_ratio_max is {self.dppo_ratio_max}; use a positive cap or None."
            )


@dataclass
class LossOutput:
    """A scalar loss to call ``backward()`` on, and detached metrics."""

    loss: Tensor
    """() the micro-batch's share of the window loss."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Detached scalars. ``loss/*`` are this micro-batch's additive shares of the window
    value (they sum over micro-batches); ``clip/*`` and the others are means over this
    micro-batch's terms."""


# --------------------------------------------------------------------------------------
# Small pure helpers
# --------------------------------------------------------------------------------------


def episode_sum(x: Tensor, episode: Tensor, num_episodes: int) -> Tensor:
    """Sum per-term values per episode: (M,) -> (num_episodes,). Differentiable.

    Example:
        >>> import torch
        >>> episode_sum(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 0, 1]), 3).tolist()
        [2.0, 4.0, 0.0]
    """
    return torch.zeros(num_episodes, dtype=x.dtype, device=x.device).index_add(0, episode, x)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-term k3 estimate of KL(current || reference): ``exp(d) - d - 1`` with ``d = ref - logp``.

    Non-negative, and unbiased for tokens sampled from the current policy (the "k3"
    estimator of the note "Approximating KL Divergence", as in GRPO and TRL).
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def _at_least_f32(x: Tensor) -> Tensor:
    # bf16 log-probs lose the small differences that ratios are made of.
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _frac(mask: Tensor) -> Tensor:
    return mask.float().mean() if mask.numel() else mask.new_zeros((), dtype=torch.float32)


def _clip_metrics(low: Tensor, high: Tensor) -> dict[str, Tensor]:
    return {
        "clip/low_frac": _frac(low),
        "clip/high_frac": _frac(high),
        "clip/region_frac": _frac(low | high),
    }


def _local_episode_counts(inputs: LossInputs) -> Tensor:
    return torch.bincount(inputs.episode, minlength=inputs.num_episodes)


def _require_whole_episodes(inputs: LossInputs, normalizer: LossNormalizer, loss_name: str) -> None:
    """Sequence-level losses need all of an episode's terms in one micro-batch."""
    if normalizer.episode_num_tokens is None:
        return
    local = _local_episode_counts(inputs)
    total = normalizer.episode_num_tokens.to(local.device)
    split = (local > 0) & (local != total)
    if bool(split.any()):
        first = int(split.nonzero()[0, 0])
        raise ValueError(
            f"{loss_name} computes a per-sequence ratio, but episode {first} has "
            f"{int(local[first])} of its {int(total[first])} terms in this micro-batch. Put each "
            "episode's terms in a single micro-batch (a packed tree holds its episodes whole)."
        )


# --------------------------------------------------------------------------------------
# Aggregations: (M,) terms -> () share of the window loss
# --------------------------------------------------------------------------------------


def _token_mean(terms: Tensor, inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> Tensor:
    return terms.sum() / normalizer.num_tokens


def _sequence_mean(terms: Tensor, inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> Tensor:
    counts = normalizer.episode_num_tokens
    if counts is None:
        counts = _local_episode_counts(inputs)
    elif counts.shape[0] != inputs.num_episodes:
        raise ValueError(
            f"LossNormalizer.episode_num_tokens has {counts.shape[0]} entries but "
            f"LossInputs.num_episodes is {inputs.num_episodes}; they index the same episodes."
        )
    n = counts.to(device=terms.device, dtype=terms.dtype).clamp(min=1.0)  # (E,)
    return (terms / n[inputs.episode]).sum() / normalizer.num_sequences


def _constant(terms: Tensor, inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> Tensor:
    if cfg.max_completion_length is None:
        raise ValueError(
            "The 'constant' aggregation divides by num_sequences * LossConfig.max_completion_length, "
            "which is None. Set max_completion_length."
        )
    return terms.sum() / (normalizer.num_sequences * cfg.max_completion_length)


Aggregation = Callable[[Tensor, LossInputs, LossConfig, LossNormalizer], Tensor]

AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": _token_mean,
    "sequence_mean": _sequence_mean,
    "constant": _constant,
}
"""How per-term values become the micro-batch's share of the window loss (see module doc)."""


def _finish(
    policy_terms: Tensor,
    inputs: LossInputs,
    cfg: LossConfig,
    normalizer: LossNormalizer,
    *,
    loss_name: str,
    metrics: dict[str, Tensor],
    apply_is_weight: bool = True,
) -> LossOutput:
    """IS weight and mask, aggregation, KL and entropy: shared by every policy loss."""
    if apply_is_weight and inputs.is_weight is not None:
        policy_terms = policy_terms * inputs.is_weight.to(policy_terms.dtype)
    if inputs.is_mask is not None:
        policy_terms = policy_terms * inputs.is_mask.to(policy_terms.dtype)
    aggregate = AGGREGATIONS[cfg.aggregation or _DEFAULT_AGGREGATION[loss_name]]

    policy = aggregate(policy_terms, inputs, cfg, normalizer)
    loss = policy
    metrics["loss/policy"] = policy.detach()

    if cfg.beta > 0.0:
        if inputs.ref_logp is None:
            raise ValueError(
                f"LossConfig.beta is {cfg.beta} but LossInputs.ref_logp is None; compute the "
                "reference model's log-probs at the loss positions, or set beta=0.0."
            )
        kl = aggregate(k3_kl(_at_least_f32(inputs.logp), _at_least_f32(inputs.ref_logp)), inputs, cfg, normalizer)
        loss = loss + cfg.beta * kl
        metrics["loss/kl"] = kl.detach()

    if cfg.entropy_coef > 0.0 and inputs.entropy is None:
        raise ValueError(
            f"LossConfig.entropy_coef is {cfg.entropy_coef} but LossInputs.entropy is None; "
            "compute the per-position entropy in the forward pass, or set entropy_coef=0.0."
        )
    if inputs.entropy is not None:
        entropy = aggregate(_at_least_f32(inputs.entropy), inputs, cfg, normalizer)
        if cfg.entropy_coef > 0.0:
            loss = loss - cfg.entropy_coef * entropy
        metrics["loss/entropy"] = entropy.detach()

    return LossOutput(loss=loss, metrics=metrics)


# --------------------------------------------------------------------------------------
# PPO-clip family: grpo, dapo, dr_grpo
# --------------------------------------------------------------------------------------


def _ppo_clip_terms(inputs: LossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    logp, old_logp, adv = (_at_least_f32(t) for t in (inputs.logp, inputs.old_logp, inputs.adv))
    ratio = torch.exp((logp - old_logp).clamp(max=_MAX_LOG_RATIO))  # (M,)
    clipped = ratio.clamp(1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    terms = -torch.minimum(ratio * adv, clipped * adv)  # (M,)
    # A clip only matters where it binds: going down with A < 0, up with A > 0.
    low = (ratio < 1.0 - cfg.epsilon_low) & (adv < 0)
    high = (ratio > 1.0 + cfg.epsilon_high) & (adv > 0)
    return terms, _clip_metrics(low.detach(), high.detach())


def grpo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """GRPO: PPO clipped surrogate, token mean per sequence, then mean over sequences.

    ``L = -1/G sum_i 1/|o_i| sum_t min(r_t A_i, clip(r_t, 1-eps_low, 1+eps_high) A_i)``
    with ``r_t = pi(o_t) / pi_old(o_t)`` (DeepSeekMath, https://arxiv.org/abs/2402.03300).
    Long sequences weigh less per token.
    """
    terms, metrics = _ppo_clip_terms(inputs, cfg)
    return _finish(terms, inputs, cfg, normalizer, loss_name="grpo", metrics=metrics)


def dapo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """DAPO: the PPO clipped surrogate averaged over all tokens of the window.

    Token-level mean over the whole accumulation window and all ranks (``sum / num_tokens``)
    with decoupled clip bounds, ``epsilon_high`` > ``epsilon_low`` ("clip-higher")
    (DAPO, https://arxiv.org/abs/2503.14476). Every token weighs the same.
    """
    terms, metrics = _ppo_clip_terms(inputs, cfg)
    return _finish(terms, inputs, cfg, normalizer, loss_name="dapo", metrics=metrics)


def dr_grpo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """Dr. GRPO: the PPO clipped surrogate summed and divided by a constant.

    ``sum / (num_sequences * max_completion_length)`` removes GRPO's length bias
    ("Understanding R1-Zero-Like Training", https://arxiv.org/abs/2503.20783).
    """
    terms, metrics = _ppo_clip_terms(inputs, cfg)
    return _finish(terms, inputs, cfg, normalizer, loss_name="dr_grpo", metrics=metrics)


# --------------------------------------------------------------------------------------
# Sequence-level ratio: gspo
# --------------------------------------------------------------------------------------


def gspo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """GSPO: a clipped sequence-level ratio, in the GSPO-token form.

    ``s_i = exp(1/|o_i| sum_t log(pi(o_t) / pi_old(o_t)))`` (the geometric mean of the
    token ratios) is clipped to ``[1 - gspo_epsilon_low, 1 + gspo_epsilon_high]`` at
    sequence level. Each term uses ``s_it = sg[s_i] * pi(o_t) / sg[pi(o_t)]``: its value is
    ``s_i`` and its gradient ``s_i * grad log pi(o_t)``, so a token-level advantage is
    possible; with one advantage per sequence this equals GSPO exactly ("Group Sequence
    Policy Optimization", https://arxiv.org/abs/2507.18071, the GSPO-token variant).
    Aggregated as GRPO.

    Needs all of an episode's terms in one micro-batch (checked when
    ``normalizer.episode_num_tokens`` is given). Clip fractions count terms of clipped
    sequences.
    """
    _require_whole_episodes(inputs, normalizer, "gspo")
    logp, old_logp, adv = (_at_least_f32(t) for t in (inputs.logp, inputs.old_logp, inputs.adv))
    counts = _local_episode_counts(inputs).to(logp.dtype).clamp(min=1.0)  # (E,)
    seq_log_ratio = episode_sum((logp - old_logp).detach(), inputs.episode, inputs.num_episodes) / counts  # (E,)
    seq_ratio = torch.exp(seq_log_ratio.clamp(max=_MAX_LOG_RATIO))[inputs.episode]  # (M,) detached
    ratio = seq_ratio * torch.exp(logp - logp.detach())  # (M,) value s_i, gradient s_i * dlogp
    clipped = ratio.clamp(1.0 - cfg.gspo_epsilon_low, 1.0 + cfg.gspo_epsilon_high)
    terms = -torch.minimum(ratio * adv, clipped * adv)
    low = (seq_ratio < 1.0 - cfg.gspo_epsilon_low) & (adv < 0)
    high = (seq_ratio > 1.0 + cfg.gspo_epsilon_high) & (adv > 0)
    return _finish(terms, inputs, cfg, normalizer, loss_name="gspo", metrics=_clip_metrics(low, high))


# --------------------------------------------------------------------------------------
# Weighted log-prob losses: cispo, vespo, dppo; soft gate: sapo
# --------------------------------------------------------------------------------------


def cispo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """CISPO: clipped, detached importance weight times log-prob times advantage.

    ``L = -1/N sum sg[clip(r_t, ratio_min, ratio_max)] A_t log pi(o_t)``: clipping the weight
    instead of the update keeps every token's gradient, including the rare "fork" tokens
    that PPO clipping drops (MiniMax-M1, https://arxiv.org/abs/2506.13585, section 3.1).
    Token mean over the window, as in the paper.
    """
    logp, old_logp, adv = (_at_least_f32(t) for t in (inputs.logp, inputs.old_logp, inputs.adv))
    ratio = torch.exp((logp - old_logp).detach().clamp(max=_MAX_LOG_RATIO))  # (M,)
    weight = ratio.clamp(min=cfg.cispo_ratio_min, max=cfg.cispo_ratio_max)
    terms = -weight * adv * logp
    metrics = _clip_metrics(ratio < cfg.cispo_ratio_min, ratio > cfg.cispo_ratio_max)
    return _finish(terms, inputs, cfg, normalizer, loss_name="cispo", metrics=metrics)


def sapo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """SAPO: a temperature-controlled sigmoid gate instead of hard clipping.

    ``L = -1/G sum_i 1/|o_i| sum_t f(r_t) A_i`` with ``f(r) = 4/tau * sigmoid(tau (r - 1))``
    and ``tau = sapo_tau_pos`` if ``A > 0`` else ``sapo_tau_neg``. The gradient weight
    ``f'(r) = 4 s (1 - s)`` is 1 on-policy and decays smoothly off-policy; negative
    advantages decay faster (Qwen, "Soft Adaptive Policy Optimization",
    https://arxiv.org/abs/2511.20347). Aggregated as GRPO, as in the paper.

    ``clip/soft_weight_mean`` is the mean gradient weight ``f'(r)``: 1 means nothing gated.
    """
    logp, old_logp, adv = (_at_least_f32(t) for t in (inputs.logp, inputs.old_logp, inputs.adv))
    ratio = torch.exp((logp - old_logp).clamp(max=_MAX_LOG_RATIO))  # (M,)
    tau = torch.where(adv > 0, ratio.new_tensor(cfg.sapo_tau_pos), ratio.new_tensor(cfg.sapo_tau_neg))  # (M,)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    terms = -(4.0 / tau) * gate * adv
    soft_weight = (4.0 * gate * (1.0 - gate)).detach()
    metrics = {"clip/soft_weight_mean": soft_weight.mean() if soft_weight.numel() else soft_weight.sum()}
    return _finish(terms, inputs, cfg, normalizer, loss_name="sapo", metrics=metrics)


def vespo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """VESPO: a gamma-shaped, detached weight of the sequence importance ratio.

    ``w_i = prod_t pi(o_t) / mu(o_t)`` is the full sequence ratio (a product, no length
    normalization) of the current policy over the sampler ``mu``, and
    ``phi(w) = w^k exp(lambda (1 - w))`` (normalized so ``phi(1) = 1``) with ``(k, lambda)``
    chosen by the sign of the advantage. ``L = -1/N sum sg[phi(w_i)] A_t log pi(o_t)``
    ("VESPO: Variational Sequence-Level Soft Policy Optimization",
    https://arxiv.org/abs/2602.10693; the reference code and TRL use the same kernel and
    the same token-mean aggregation).

    VESPO is itself the off-policy correction, so it reads ``sampler_logp`` and ignores
    ``is_weight`` (applying it too would correct twice); ``is_mask`` still applies. Needs all
    of an episode's terms in one micro-batch. Log-ratios are clamped like the reference.
    """
    _require_whole_episodes(inputs, normalizer, "vespo")
    logp, sampler_logp, adv = (_at_least_f32(t) for t in (inputs.logp, inputs.sampler_logp, inputs.adv))
    token_log_w = (logp.detach() - sampler_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (M,)
    seq_log_w = episode_sum(token_log_w, inputs.episode, inputs.num_episodes)  # (E,)
    log_w = seq_log_w.clamp(math.log(1e-8), _MAX_LOG_RATIO)[inputs.episode]  # (M,)
    nonneg = adv >= 0
    k = torch.where(nonneg, log_w.new_tensor(cfg.vespo_k_pos), log_w.new_tensor(cfg.vespo_k_neg))
    lam = torch.where(nonneg, log_w.new_tensor(cfg.vespo_lambda_pos), log_w.new_tensor(cfg.vespo_lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # (M,) detached
    terms = -phi * adv * logp
    metrics = {
        "vespo/phi_mean": phi.mean() if phi.numel() else phi.sum(),
        "vespo/log_ratio_mean": log_w.mean() if log_w.numel() else log_w.sum(),
    }
    return _finish(terms, inputs, cfg, normalizer, loss_name="vespo", metrics=metrics, apply_is_weight=False)


def dppo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """DPPO (Binary-TV): a trust region on the probability difference, not the ratio.

    A term leaves the trust region when its probability moved too far in the direction
    its advantage pushes: ``p - p_old > dppo_delta_high`` with ``A > 0``, or
    ``p - p_old < -dppo_delta_low`` with ``A <= 0``. Such terms are masked; the others give
    the policy gradient ``L = -1/N sum mask_t sg[r_t] A_t log pi(o_t)`` whose gradient is
    ``-A grad r_t``. Ratios blow up for rare tokens whose true divergence is tiny, while
    probability differences do not ("Rethinking the Trust Region in LLM Reinforcement
    Learning", https://arxiv.org/abs/2602.04879; as in verl's ``dppo_tv``).

    The paper anchors the trust region at the rollout policy: pass ``old_logp =
    sampler_logp`` for that. ``dppo_ratio_max`` truncates the detached ratio; the paper's
    recipe leaves it off. Clip fractions count masked terms.
    """
    logp, old_logp, adv = (_at_least_f32(t) for t in (inputs.logp, inputs.old_logp, inputs.adv))
    ratio = torch.exp((logp - old_logp).detach().clamp(max=_MAX_LOG_RATIO))  # (M,)
    if cfg.dppo_ratio_max is not None:
        ratio = ratio.clamp(max=cfg.dppo_ratio_max)
    diff = torch.exp(logp.detach()) - torch.exp(old_logp)  # (M,) p - p_old
    positive = adv > 0
    high = positive & (diff > cfg.dppo_delta_high)
    low = ~positive & (diff < -cfg.dppo_delta_low)
    inside = ~(high | low)
    terms = -adv * ratio * logp * inside.to(logp.dtype)
    return _finish(terms, inputs, cfg, normalizer, loss_name="dppo", metrics=_clip_metrics(low, high))


# --------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------

PolicyLoss = Callable[[LossInputs, LossConfig, LossNormalizer], LossOutput]

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "grpo": grpo_loss,
    "dapo": dapo_loss,
    "dr_grpo": dr_grpo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "vespo": vespo_loss,
    "dppo": dppo_loss,
}
"""Policy losses by name; ``LossConfig.policy_loss`` picks one."""

_DEFAULT_AGGREGATION: dict[str, str] = {
    "grpo": "sequence_mean",
    "dapo": "token_mean",
    "dr_grpo": "constant",
    "gspo": "sequence_mean",
    "cispo": "token_mean",
    "sapo": "sequence_mean",
    "vespo": "token_mean",
    "dppo": "token_mean",
}


def compute_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """Run the policy loss named by ``cfg.policy_loss``."""
    return POLICY_LOSSES[cfg.policy_loss](inputs, cfg, normalizer)
