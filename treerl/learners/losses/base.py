"""The pieces every policy loss is made of: inputs, normalizer, coefficients, aggregations, the table.

See :mod:`treerl.learners.losses` for the layout of terms and the aggregations. A new loss
is a function ``(inputs, cfg, normalizer) -> LossOutput`` that computes its per-term values
and hands them to :func:`finish_policy_loss` (importance weights, aggregation, KL, entropy),
added to the table with :func:`register_loss`:

>>> import torch
>>> def margin_loss(inputs, cfg, normalizer):
...     terms = -inputs.adv * inputs.logp + cfg.loss_kwargs.get("margin", 0.0)
...     return finish_policy_loss(terms, inputs, cfg, normalizer, loss_name="margin", metrics={})
>>> _ = register_loss("margin", margin_loss, default_aggregation="token_mean", override=True)
>>> logp = torch.tensor([-1.0, -2.0], requires_grad=True)
>>> inputs = LossInputs(logp=logp, old_logp=logp.detach(), sampler_logp=logp.detach(),
...                     adv=torch.tensor([1.0, -1.0]), episode=torch.tensor([0, 1]), num_episodes=2)
>>> cfg = LossConfig(policy_loss="margin", loss_kwargs={"margin": 0.5})
>>> round(compute_loss(inputs, cfg, LossNormalizer.from_inputs(inputs)).loss.item(), 4)  # (1 - 2 + 2 * 0.5) / 2
0.0
>>> del POLICY_LOSSES["margin"], DEFAULT_AGGREGATIONS["margin"]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from treerl.config import field_help

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_AGGREGATIONS",
    "MAX_LOG_RATIO",
    "POLICY_LOSSES",
    "LossCoefficients",
    "LossConfig",
    "LossInputs",
    "LossNormalizer",
    "LossOutput",
    "PolicyLoss",
    "at_least_f32",
    "clip_metrics",
    "compute_loss",
    "episode_sum",
    "finish_policy_loss",
    "high_entropy_threshold",
    "k3_kl",
    "local_episode_counts",
    "register_loss",
    "require_whole_episodes",
    "same_definition",
]

# exp() of a log-ratio beyond this overflows float32 into inf and then NaN gradients; the
# same bound as TRL and the VESPO reference code. Ratios this far off are clipped,
# masked or weighted to ~0 by every loss anyway.
MAX_LOG_RATIO = 20.0


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
    centering: Tensor | None = None
    """(M,) score-centering surrogate of each term (:mod:`treerl.learners.centering`); the
    loss adds ``adv * centering`` after the IS weight and mask, which it already carries."""
    entropy_mask: Tensor | None = None
    """(M,) 0/1, detached: the terms whose entropy reaches the step's :func:`high_entropy_threshold`
    (TRL's ``top_entropy_quantile``). It multiplies the policy term and the entropy bonus, not the
    KL; masked terms still count in the normalizers. ``None`` keeps every term."""

    def __post_init__(self) -> None:
        if self.logp.dim() != 1:
            raise ValueError(
                f"LossInputs.logp has shape {tuple(self.logp.shape)}; the losses take a flat "
                "list of (token, episode) terms of shape (M,). Gather the log-probs at the loss "
                "positions and flatten them first."
            )
        m = self.logp.shape[0]
        for name in ("old_logp", "sampler_logp", "adv", "episode", "ref_logp", "entropy", "is_weight", "is_mask",
                     "centering", "entropy_mask"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (m,):
                raise ValueError(
                    f"LossInputs.{name} has shape {tuple(value.shape)} but logp has ({m},); every "
                    "per-term tensor must have one entry per (token, episode) term."
                )
        for name in ("old_logp", "sampler_logp", "ref_logp", "is_weight", "is_mask", "entropy_mask"):
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
        # One host sync per micro-batch (min and max in one read); an out-of-range index would
        # otherwise surface as an opaque device-side assert in index_add.
        if m > 0:
            low, high = torch.stack(torch.aminmax(self.episode)).tolist()
            if low < 0 or high >= self.num_episodes:
                raise ValueError(
                    f"LossInputs.episode has values in [{low}, {high}] but num_episodes is {self.num_episodes}; "
                    "episode indices must lie in [0, num_episodes)."
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
    entropy_kept_frac: float | None = None
    """With ``LossInputs.entropy_mask``: the share of the window's terms it keeps, on all ranks. The
    entropy bonus is divided by it, so that it stays a mean over the kept terms (TRL's)."""
    window_num_tokens: float | None = None
    """The window's own terms on all ranks, where ``num_tokens`` counts others (``num_minibatches``: the
    step's / K, TRL's policy normalizer); the entropy bonus is a mean over these. None: ``num_tokens``."""

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
        if self.entropy_kept_frac is not None and not 0.0 < self.entropy_kept_frac <= 1.0:
            raise ValueError(
                f"LossNormalizer.entropy_kept_frac is {self.entropy_kept_frac}; it is the share of the window's "
                "terms the entropy mask keeps, in (0, 1] (the highest-entropy term is always kept)."
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
class LossCoefficients:
    """The coefficients of every policy loss, each with a default from its paper.

    A base of :class:`LossConfig` and of the learners' configs, so that every coefficient is
    a flag of ``treerl learn`` (``--gspo-epsilon-low 3e-4``) and a key of its YAML config,
    spelled once. ``loss_kwargs`` carries the coefficients of a loss added with
    :func:`register_loss`.
    """

    aggregation: str | None = field_help(None, "Override the loss's default aggregation: token_mean, sequence_mean "
                                               "or constant.")
    epsilon_low: float = field_help(0.2, "PPO clip: ratios below 1 - epsilon_low stop pushing down (grpo, dapo, "
                                         "dr_grpo).")
    epsilon_high: float | None = field_help(0.28, "PPO clip: ratios above 1 + epsilon_high stop pushing up; 0.28 is "
                                                  "DAPO's clip-higher (TRL's --epsilon sets epsilon_low only: pass "
                                                  "both); None: epsilon_low's value (TRL's default).")
    beta: float = field_help(0.0, "Weight of the k3 KL to a reference model (the starting weights, or "
                                  "--sync-ref-model's); 0 keeps none.")
    kl_bias_correction: bool = field_help(True, "Multiply the k3 KL by the differentiable ratio to the old policy "
                                                "(value 1 on-policy) so that its gradient is the unbiased reverse-KL "
                                                "gradient (DeepSeek-V3.2; TRL's default use_bias_correction_kl).")
    entropy_coef: float = field_help(0.0, "Weight of the entropy bonus (subtracted from the loss): the mean entropy "
                                          "over the step's trained tokens whatever --loss, as TRL's.")
    gspo_epsilon_low: float = field_help(3e-4, "GSPO sequence-ratio clip below 1 (GSPO paper v2, section 5.1).")
    gspo_epsilon_high: float = field_help(4e-4, "GSPO sequence-ratio clip above 1 (GSPO paper v2, section 5.1).")
    cispo_ratio_min: float = field_help(0.0, "CISPO lower bound of the detached weight; 0 means none, as in "
                                             "MiniMax-M1.")
    cispo_ratio_max: float = field_help(5.0, "CISPO upper bound of the detached weight (the ScaleRL recommendation, "
                                             "as in TRL).")
    sapo_tau_pos: float = field_help(1.0, "SAPO gate temperature for positive advantages (paper default).")
    sapo_tau_neg: float = field_help(1.05, "SAPO gate temperature for negative advantages; larger decays faster.")
    vespo_k_pos: float = field_help(2.0, "VESPO gamma shape for non-negative advantages (reference code and TRL).")
    vespo_lambda_pos: float = field_help(3.0, "VESPO gamma rate for non-negative advantages.")
    vespo_k_neg: float = field_help(3.0, "VESPO gamma shape for negative advantages.")
    vespo_lambda_neg: float = field_help(2.0, "VESPO gamma rate for negative advantages.")
    dppo_delta_low: float = field_help(0.15, "DPPO-Binary-TV: a negative-advantage term is masked once "
                                             "p - p_old < -delta_low.")
    dppo_delta_high: float = field_help(0.15, "DPPO-Binary-TV: a positive-advantage term is masked once "
                                              "p - p_old > delta_high.")
    dppo_ratio_max: float | None = field_help(None, "DPPO: truncate the detached ratio at this value; unset (the "
                                                    "paper's recipe) does not.")
    dppo_anchor: str = field_help("sampler", "DPPO's trust region is around the policy that sampled the tokens "
                                             "(sampler, the paper's; its ratio then is the importance weight) or "
                                             "the old policy of --num-iterations (old).")
    loss_kwargs: dict[str, Any] = field_help(help="Coefficients of a loss added with register_loss, e.g. "
                                                  "'{\"margin\": 0.1}' (read as cfg.loss_kwargs).",
                                             default_factory=dict)

    def coefficients(self) -> dict[str, Any]:
        """These fields by name (to build a :class:`LossConfig` from a learner's config)."""
        return {f.name: getattr(self, f.name) for f in fields(LossCoefficients)}

    def check_coefficients(self) -> None:
        """Raise ``ValueError`` naming the coefficient, why it cannot work, and a usual value; an
        ``epsilon_high`` of None becomes ``epsilon_low``'s value, as TRL reads it."""
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon_low
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"LossConfig.aggregation is {self.aggregation!r}; choose one of "
                f"{sorted(AGGREGATIONS)}, or None for the loss's default."
            )
        if not isinstance(self.loss_kwargs, dict):
            raise ValueError(f"LossConfig.loss_kwargs is {self.loss_kwargs!r}; pass a mapping of name: value.")
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
        if self.dppo_anchor not in ("sampler", "old"):
            raise ValueError(f"LossConfig.dppo_anchor is {self.dppo_anchor!r}; use sampler (the paper's) or old.")
        if self.dppo_ratio_max is not None and not self.dppo_ratio_max > 0.0:
            raise ValueError(
                f"LossConfig.dppo_ratio_max is {self.dppo_ratio_max}; use a positive cap or None."
            )


@dataclass
class LossConfig(LossCoefficients):
    """Which policy loss to use, and its coefficients."""

    policy_loss: str = "dapo"
    """Name in :data:`POLICY_LOSSES`: grpo, dapo, dr_grpo, gspo, cispo, sapo, vespo, dppo, or a registered one."""
    max_completion_length: int | None = None
    """Dr. GRPO's constant: the most loss tokens an episode may have. Needed by ``constant``."""

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"LossConfig.policy_loss is {self.policy_loss!r}, which is not a known loss; "
                f"choose one of {sorted(POLICY_LOSSES)}, or add yours with register_loss."
            )
        self.check_coefficients()
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(
                f"LossConfig.max_completion_length is {self.max_completion_length}; it must be a "
                "positive token count, or None when the constant aggregation is not used."
            )
        uses_constant = (self.aggregation or DEFAULT_AGGREGATIONS[self.policy_loss]) == "constant"
        if uses_constant and self.max_completion_length is None:
            raise ValueError(
                f"LossConfig.max_completion_length is None but policy_loss={self.policy_loss!r} "
                "with the 'constant' aggregation divides by num_sequences * max_completion_length "
                "(Dr. GRPO). Set max_completion_length to the generation budget in tokens."
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


def high_entropy_threshold(entropy: Tensor, top_quantile: float) -> Tensor:
    """() the entropy at the ``1 - top_quantile`` quantile of ``entropy`` (N,), N > 0: TRL's threshold.

    The terms with ``entropy >= threshold`` are the top ``top_quantile`` of them ("Beyond the 80/20
    Rule", https://arxiv.org/abs/2506.01939; TRL's ``get_high_entropy_mask``): 1.0 keeps every term, 0.0
    those at the largest entropy. Linear interpolation, computed as ``torch.quantile`` does (in the
    input's dtype), which refuses inputs of more than 2**24 values; a step may have more.

    Example:
        >>> import torch
        >>> entropy = torch.tensor([0.1, 0.5, 0.3, 0.9, 0.7])
        >>> threshold = high_entropy_threshold(entropy, 0.4)  # the 0.6 quantile: 0.5 + 0.4 * (0.7 - 0.5)
        >>> round(threshold.item(), 4), (entropy >= threshold).tolist()
        (0.58, [False, False, False, True, True])
    """
    ordered = entropy.detach().flatten().sort().values  # (N,)
    rank = torch.tensor(1.0 - top_quantile, dtype=ordered.dtype, device=ordered.device) * (ordered.numel() - 1)
    below, above = rank.long(), rank.ceil().long()
    return torch.lerp(ordered[below], ordered[above], rank - below)


def at_least_f32(x: Tensor) -> Tensor:
    # bf16 log-probs lose the small differences that ratios are made of.
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _frac(mask: Tensor) -> Tensor:
    return mask.float().mean() if mask.numel() else mask.new_zeros((), dtype=torch.float32)


def clip_metrics(low: Tensor, high: Tensor) -> dict[str, Tensor]:
    return {
        "clip/low_frac": _frac(low),
        "clip/high_frac": _frac(high),
        "clip/region_frac": _frac(low | high),
    }


def local_episode_counts(inputs: LossInputs) -> Tensor:
    return torch.bincount(inputs.episode, minlength=inputs.num_episodes)


def require_whole_episodes(inputs: LossInputs, normalizer: LossNormalizer, loss_name: str) -> None:
    """Sequence-level losses need all of an episode's terms in one micro-batch."""
    if normalizer.episode_num_tokens is None:
        return
    local = local_episode_counts(inputs)
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
        counts = local_episode_counts(inputs)
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


def finish_policy_loss(
    policy_terms: Tensor,
    inputs: LossInputs,
    cfg: LossConfig,
    normalizer: LossNormalizer,
    *,
    loss_name: str,
    metrics: dict[str, Tensor],
    apply_is_weight: bool = True,
) -> LossOutput:
    """IS weight and mask, aggregation, KL and entropy of per-term values: how every policy loss ends.

    ``policy_terms`` (M,) are the loss's per-term values before weighting; ``loss_name``
    picks the default aggregation; ``apply_is_weight=False`` for a loss that corrects for
    the sampler itself (``is_mask`` still applies).
    """
    if apply_is_weight and inputs.is_weight is not None:
        policy_terms = policy_terms * inputs.is_weight.to(policy_terms.dtype)
    if inputs.is_mask is not None:
        policy_terms = policy_terms * inputs.is_mask.to(policy_terms.dtype)
    if inputs.centering is not None:
        # The sampler-expected score, weighted as the sampled token is: subtracted from its score.
        policy_terms = policy_terms + at_least_f32(inputs.adv) * inputs.centering.to(policy_terms.dtype)
    if inputs.entropy_mask is not None:
        policy_terms = policy_terms * inputs.entropy_mask.to(policy_terms.dtype)
    aggregate = AGGREGATIONS[cfg.aggregation or DEFAULT_AGGREGATIONS[loss_name]]

    policy = aggregate(policy_terms, inputs, cfg, normalizer)
    loss = policy
    metrics["loss/policy"] = policy.detach()

    if cfg.beta > 0.0:
        if inputs.ref_logp is None:
            raise ValueError(
                f"LossConfig.beta is {cfg.beta} but LossInputs.ref_logp is None; compute the "
                "reference model's log-probs at the loss positions, or set beta=0.0."
            )
        logp = at_least_f32(inputs.logp)
        kl_terms = k3_kl(logp, at_least_f32(inputs.ref_logp))
        if cfg.kl_bias_correction:
            # k3's own gradient, (1 - pi_ref/pi) grad log pi, is biased for the reverse KL; times the ratio
            # it is (log pi - log pi_ref) grad log pi, the unbiased one, at the same value on-policy.
            kl_terms = kl_terms * torch.exp((logp - at_least_f32(inputs.old_logp)).clamp(max=MAX_LOG_RATIO))
        kl = aggregate(kl_terms, inputs, cfg, normalizer)
        loss = loss + cfg.beta * kl
        metrics["loss/kl"] = kl.detach()

    if cfg.entropy_coef > 0.0 and inputs.entropy is None:
        raise ValueError(
            f"LossConfig.entropy_coef is {cfg.entropy_coef} but LossInputs.entropy is None; "
            "compute the per-position entropy in the forward pass, or set entropy_coef=0.0."
        )
    if inputs.entropy is not None:
        entropy_terms = at_least_f32(inputs.entropy)
        if inputs.entropy_mask is not None:
            # TRL's bonus acts on the tokens the policy term keeps, as a mean over them.
            entropy_terms = entropy_terms * inputs.entropy_mask.to(entropy_terms.dtype)
            entropy_terms = entropy_terms / (normalizer.entropy_kept_frac or 1.0)
        # TRL's bonus is the mean entropy over the loss's tokens whatever the loss type, not rescaled to the
        # policy term's aggregation (a sequence mean, Dr. GRPO's constant), so entropy_coef means one thing.
        entropy = entropy_terms.sum() / (normalizer.window_num_tokens or normalizer.num_tokens)
        if cfg.entropy_coef > 0.0:
            loss = loss - cfg.entropy_coef * entropy
        metrics["loss/entropy"] = entropy.detach()

    return LossOutput(loss=loss, metrics=metrics)


# --------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------

PolicyLoss = Callable[[LossInputs, LossConfig, LossNormalizer], LossOutput]

POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""Policy losses by name; ``LossConfig.policy_loss`` picks one. Filled by :func:`register_loss`."""

DEFAULT_AGGREGATIONS: dict[str, str] = {}
"""Each loss's aggregation when ``LossConfig.aggregation`` does not override it."""


def same_definition(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one definition: the same object, or the same name in the same module
    (a user's module imported again by a second ``treerl`` command in one process re-registers itself)."""
    key = lambda f: (getattr(f, "__module__", None), getattr(f, "__qualname__", None))  # noqa: E731
    return a is b or (key(a) == key(b) and key(a) != (None, None))


def register_loss(name: str, fn: PolicyLoss, default_aggregation: str, *, override: bool = False) -> PolicyLoss:
    """Add a policy loss to :data:`POLICY_LOSSES` under ``name``; returns ``fn``.

    ``fn(inputs, cfg, normalizer) -> LossOutput``; ``default_aggregation`` is one of
    :data:`AGGREGATIONS`. A user's module registers its loss at import, and
    ``treerl learn --import my_losses.py --loss NAME`` trains with it.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_loss: name={name!r} must be a non-empty string (it is the --loss value).")
    if not callable(fn):
        raise TypeError(f"register_loss({name!r}): fn={fn!r} is not callable; pass fn(inputs, cfg, normalizer).")
    if default_aggregation not in AGGREGATIONS:
        raise ValueError(f"register_loss({name!r}): default_aggregation={default_aggregation!r}; choose one of "
                         f"{sorted(AGGREGATIONS)}.")
    if name in POLICY_LOSSES and not override and not same_definition(POLICY_LOSSES[name], fn):
        raise ValueError(f"register_loss: a loss named {name!r} exists already; pick another name or pass "
                         "override=True.")
    POLICY_LOSSES[name] = fn
    DEFAULT_AGGREGATIONS[name] = default_aggregation
    return fn


def compute_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """Run the policy loss named by ``cfg.policy_loss``."""
    return POLICY_LOSSES[cfg.policy_loss](inputs, cfg, normalizer)
