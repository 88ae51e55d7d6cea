"""Importance sampling between the sampler and the trainer, as a pure function.

The sampler (vLLM, or a policy some versions behind) and the trainer compute slightly
different distributions, so the tokens are off-policy for the trainer. The correction is
explicit, detached and configurable (DESIGN.md, principle 4):

- the **ratio** is ``exp(trainer_logp - sampler_logp)``, per token or per sequence
  (the product of the token ratios of an episode);
- **truncate** (TIS) clamps it into ``[ratio_low, ratio_high]``; **mask** (MIS, IcePop)
  keeps it but masks the terms whose ratio leaves that interval;
- **geometric-mean sequence masking** masks a whole episode whose geometric-mean token
  ratio ``exp(mean_t log r_t)`` leaves ``[geo_mask_low, geo_mask_high]``;
- **off-policy sequence masking** (the DeepSeek-V3.2 technical report, as in TRL)
  masks an episode with a negative advantage whose mean sampler-vs-trainer KL,
  ``mean_t (sampler_logp - trainer_logp)``, exceeds ``opsm_threshold``: learning to avoid
  a sample the trainer would hardly produce mostly adds noise.

Which trainer log-prob to pass is the caller's choice, and it keeps the three policies
distinct: the PPO ratio of the losses is current / old, while the IS weight here is
**old / sampler** when the learner recomputes ``old_logp`` before the update, or
**current / sampler** (``logp.detach()``) when it does not. Old log-probs are fixed for
the whole window, so the weights can be computed once over the full batch and sliced per
micro-batch; that also keeps sequence-level modes exact when an episode's terms are
split. With current log-probs, put each episode in one micro-batch.

The learner passes ``weight`` and ``mask`` to the loss as ``LossInputs.is_weight`` and
``LossInputs.is_mask`` (:mod:`treerl.learners.losses`), which multiply the policy term.

Example:
    >>> import torch
    >>> out = importance_weights(
    ...     trainer_logp=torch.tensor([-1.0, -1.0, -0.2]),
    ...     sampler_logp=torch.tensor([-1.0, -2.0, -0.2]),
    ...     episode=torch.tensor([0, 0, 1]), num_episodes=2,
    ...     cfg=ImportanceConfig(ratio_high=2.0))
    >>> [round(w, 3) for w in out.weight.tolist()]  # exp(1) = 2.718 truncated to 2
    [1.0, 2.0, 1.0]
    >>> out.metrics["is/truncated_frac"].item()
    0.3333333432674408
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from treerl.learners.losses import episode_sum

__all__ = ["IMPORTANCE_LEVELS", "IMPORTANCE_MODES", "ImportanceConfig", "ImportanceOutput", "importance_weights",
           "ratio_weight"]

IMPORTANCE_LEVELS = ("token", "sequence")
IMPORTANCE_MODES = ("truncate", "mask", "off")

# A sequence ratio is a product over many tokens; beyond e^20 it is truncated or masked
# anyway, and exp() must not overflow on the way.
_MAX_LOG_RATIO = 20.0


@dataclass
class ImportanceConfig:
    """How to correct for the gap between the sampler and the trainer."""

    level: str = "token"
    """``token``: one ratio per token; ``sequence``: the product over the episode's tokens."""
    mode: str = "truncate"
    """``truncate`` (TIS): clamp the ratio into [ratio_low, ratio_high]; ``mask`` (MIS):
    mask terms whose ratio leaves it; ``off``: weight 1 (the masks below still apply)."""
    ratio_low: float = 0.0
    """Lower bound of the ratio; 0 truncates nothing from below."""
    ratio_high: float = 2.0
    """Upper bound of the ratio."""
    geo_mask_low: float | None = None
    """Mask an episode whose geometric-mean token ratio is below this; None disables."""
    geo_mask_high: float | None = None
    """Mask an episode whose geometric-mean token ratio is above this; None disables."""
    opsm_threshold: float | None = None
    """Off-policy sequence masking: mask an episode with advantage < 0 whose mean
    ``sampler_logp - trainer_logp`` exceeds this; None disables."""
    centering: bool = False
    """Score centering: also subtract each token's sampler-expected score, weighted the same
    way (:mod:`treerl.learners.centering`); token level only."""

    def __post_init__(self) -> None:
        if self.level not in IMPORTANCE_LEVELS:
            raise ValueError(f"ImportanceConfig.level is {self.level!r}; choose one of {IMPORTANCE_LEVELS}.")
        if self.mode not in IMPORTANCE_MODES:
            raise ValueError(f"ImportanceConfig.mode is {self.mode!r}; choose one of {IMPORTANCE_MODES}.")
        if not 0.0 <= self.ratio_low < self.ratio_high:
            raise ValueError(
                f"ImportanceConfig.ratio_low/ratio_high are {self.ratio_low}/{self.ratio_high}; they "
                "must satisfy 0 <= ratio_low < ratio_high (e.g. 0 and 2 for TIS, 0.5 and 5 for masking)."
            )
        low, high = self.geo_mask_low, self.geo_mask_high
        if (low is not None and not low > 0.0) or (high is not None and not high > 0.0):
            raise ValueError(
                f"ImportanceConfig.geo_mask_low/high are {low}/{high}; ratios are positive, so use "
                "positive bounds (e.g. 0.999 and 1.001) or None."
            )
        if low is not None and high is not None and not low < high:
            raise ValueError(
                f"ImportanceConfig.geo_mask_low ({low}) must be below geo_mask_high ({high})."
            )
        if self.opsm_threshold is not None and not (self.opsm_threshold >= 0.0 and math.isfinite(self.opsm_threshold)):
            raise ValueError(f"ImportanceConfig.opsm_threshold is {self.opsm_threshold}; it bounds a mean KL, so use a "
                             "finite value >= 0 (e.g. 0.5), or None.")
        if self.centering and self.level != "token":
            raise ValueError(
                "ImportanceConfig.centering needs level='token': each token's score is centered with its own "
                "importance weight. Use level='token', or centering=False."
            )
        if self.opsm_threshold is not None and not math.isfinite(self.opsm_threshold):
            raise ValueError(
                f"ImportanceConfig.opsm_threshold is {self.opsm_threshold}; use a finite KL "
                "threshold or None."
            )


@dataclass
class ImportanceOutput:
    """Detached per-term weights and masks, and metrics."""

    weight: Tensor
    """(M,) the (truncated) ratio; 1 where the mode is ``off``."""
    mask: Tensor
    """(M,) 1.0 to keep a term, 0.0 to drop it."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """``is/ratio_mean``, ``is/ratio_max`` (of the raw ratio at the configured level),
    ``is/masked_frac``, ``is/truncated_frac``; and ``is/geo_masked_frac``,
    ``is/opsm_masked_frac`` when those masks are on. Means over terms."""


def importance_weights(
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    episode: Tensor,
    num_episodes: int,
    cfg: ImportanceConfig,
    *,
    adv: Tensor | None = None,
) -> ImportanceOutput:
    """Importance weights and masks of the trainer over the sampler, per loss term.

    Args:
        trainer_logp: (M,) old log-probs, or current ones when old are not recomputed.
        sampler_logp: (M,) log-probs the sampler recorded for the same tokens.
        episode: (M,) long, episode index of each term.
        num_episodes: size of the episode index space.
        cfg: the correction to apply.
        adv: (M,) advantages; needed for off-policy sequence masking.

    Everything is computed without gradient. Sequence-level quantities use all the
    terms of an episode that are passed in, so pass whole episodes.
    """
    if trainer_logp.shape != sampler_logp.shape or trainer_logp.shape != episode.shape or trainer_logp.dim() != 1:
        raise ValueError(
            f"trainer_logp {tuple(trainer_logp.shape)}, sampler_logp {tuple(sampler_logp.shape)} and "
            f"episode {tuple(episode.shape)} must all be (M,), one entry per loss term."
        )
    if cfg.opsm_threshold is not None and (adv is None or adv.shape != trainer_logp.shape):
        raise ValueError(
            "ImportanceConfig.opsm_threshold is set, so importance_weights needs adv (M,): "
            "off-policy sequence masking only drops episodes with a negative advantage."
        )
    with torch.no_grad():
        dtype = torch.promote_types(trainer_logp.dtype, torch.float32)
        log_ratio = (trainer_logp.to(dtype) - sampler_logp.to(dtype)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (M,)
        counts = torch.bincount(episode, minlength=num_episodes).to(dtype).clamp(min=1.0)  # (E,)
        seq_log_ratio = episode_sum(log_ratio, episode, num_episodes)  # (E,)

        if cfg.level == "token":
            ratio = torch.exp(log_ratio)  # (M,)
        else:
            ratio = torch.exp(seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))[episode]  # (M,)

        outside = (ratio < cfg.ratio_low) | (ratio > cfg.ratio_high)  # (M,)
        weight, keep = ratio_weight(ratio, cfg)
        truncated = outside if cfg.mode == "truncate" else torch.zeros_like(keep)

        metrics: dict[str, Tensor] = {}
        if cfg.geo_mask_low is not None or cfg.geo_mask_high is not None:
            geo_ratio = torch.exp(seq_log_ratio / counts)[episode]  # (M,)
            geo_out = torch.zeros_like(keep)
            if cfg.geo_mask_low is not None:
                geo_out = geo_out | (geo_ratio < cfg.geo_mask_low)
            if cfg.geo_mask_high is not None:
                geo_out = geo_out | (geo_ratio > cfg.geo_mask_high)
            keep = keep & ~geo_out
            metrics["is/geo_masked_frac"] = _frac(geo_out)

        if cfg.opsm_threshold is not None:
            assert adv is not None  # checked above
            # Mean over the episode's tokens of log(sampler / trainer): a k1 estimate of
            # KL(sampler || trainer) on tokens the sampler drew.
            seq_kl = (episode_sum(-log_ratio, episode, num_episodes) / counts)[episode]  # (M,)
            opsm_out = (adv < 0) & (seq_kl > cfg.opsm_threshold)
            keep = keep & ~opsm_out
            metrics["is/opsm_masked_frac"] = _frac(opsm_out)

        metrics["is/ratio_mean"] = ratio.mean() if ratio.numel() else ratio.sum()
        metrics["is/ratio_max"] = ratio.max() if ratio.numel() else ratio.sum()
        metrics["is/masked_frac"] = _frac(~keep)
        metrics["is/truncated_frac"] = _frac(truncated)
        return ImportanceOutput(weight=weight, mask=keep.to(dtype), metrics=dict(sorted(metrics.items())))


def ratio_weight(ratio: Tensor, cfg: ImportanceConfig) -> tuple[Tensor, Tensor]:
    """The mode's weight and keep-mask of raw ratios (any shape): clamp, mask or 1.

    >>> import torch
    >>> w, keep = ratio_weight(torch.tensor([0.5, 3.0]), ImportanceConfig(mode="mask", ratio_high=2.0))
    >>> w.tolist(), keep.tolist()
    ([0.5, 3.0], [True, False])
    """
    keep = torch.ones_like(ratio, dtype=torch.bool)
    if cfg.mode == "truncate":
        return ratio.clamp(min=cfg.ratio_low, max=cfg.ratio_high), keep
    if cfg.mode == "mask":
        return ratio, keep & ~((ratio < cfg.ratio_low) | (ratio > cfg.ratio_high))
    return torch.ones_like(ratio), keep


def _frac(mask: Tensor) -> Tensor:
    return mask.float().mean() if mask.numel() else mask.new_zeros((), dtype=torch.float32)
