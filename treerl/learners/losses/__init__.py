"""Policy losses as pure functions on the flat (token, episode) layout.

Tree packing deduplicates the forward pass, never the loss (DESIGN.md, principle 3): a
token shared by ``k`` episodes of a prefix tree yields ``k`` **loss terms**, one per
(token, episode) pair, each with its episode's advantage. An unpacked batch yields the
same terms. Every loss here is written on that flat list of ``M`` terms, so packing and
micro-batching cannot change the result.

A policy loss is ``(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) ->
LossOutput`` and is picked by name from :data:`POLICY_LOSSES`; :func:`register_loss` adds
one (``--loss NAME`` then trains with it, its coefficients in ``--loss-kwargs``):

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
uses only ``is_mask``). ``LossInputs.entropy_mask`` (TRL's ``top_entropy_quantile``) keeps only
the policy terms of high-entropy tokens. Masked terms still count in the normalizers, as in TRL: a
mask drops a term's gradient, it does not re-weight the others.

The KL to a reference (k3 estimator, ``cfg.beta``) uses the same aggregation as the policy
term; the entropy bonus (``cfg.entropy_coef``) is the token mean whatever the loss (TRL's: "not
rescaled to a loss type's policy normalization"). Both add up exactly over micro-batches.

The package holds the inputs, normalizer, config, aggregations and registry
(:mod:`treerl.learners.losses.base`), the policy losses themselves
(:mod:`treerl.learners.losses.policy`), and a Mixture-of-Experts router's load-balancing loss
(:mod:`treerl.learners.losses.router`, TRL's ``router_aux_loss_coef``), a mean over the forward's
tokens rather than a sum over terms.

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

from treerl.learners.losses.base import (
    AGGREGATIONS,
    DEFAULT_AGGREGATIONS,
    POLICY_LOSSES,
    LossCoefficients,
    LossConfig,
    LossInputs,
    LossNormalizer,
    LossOutput,
    PolicyLoss,
    compute_loss,
    episode_sum,
    finish_policy_loss,
    high_entropy_threshold,
    k3_kl,
    register_loss,
)
from treerl.learners.losses.policy import (
    cispo_loss,
    dapo_loss,
    dppo_loss,
    dr_grpo_loss,
    grpo_loss,
    gspo_loss,
    sapo_loss,
    vespo_loss,
)
from treerl.learners.losses.router import load_balancing_loss

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_AGGREGATIONS",
    "POLICY_LOSSES",
    "LossCoefficients",
    "LossConfig",
    "LossInputs",
    "LossNormalizer",
    "LossOutput",
    "PolicyLoss",
    "cispo_loss",
    "compute_loss",
    "dapo_loss",
    "dppo_loss",
    "dr_grpo_loss",
    "episode_sum",
    "finish_policy_loss",
    "grpo_loss",
    "gspo_loss",
    "high_entropy_threshold",
    "k3_kl",
    "load_balancing_loss",
    "register_loss",
    "sapo_loss",
    "vespo_loss",
]
