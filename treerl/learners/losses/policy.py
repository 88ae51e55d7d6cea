"""The policy losses: grpo, dapo, dr_grpo, gspo, cispo, sapo, vespo, dppo (registered at import).

Each computes its per-term values from :class:`~treerl.learners.losses.base.LossInputs` and
ends in :func:`~treerl.learners.losses.base.finish_policy_loss`; the table in
:mod:`treerl.learners.losses` says which surrogate and aggregation each one uses.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from treerl.learners.losses.base import (
    MAX_LOG_RATIO,
    LossConfig,
    LossInputs,
    LossNormalizer,
    LossOutput,
    at_least_f32,
    clip_metrics,
    episode_sum,
    finish_policy_loss,
    local_episode_counts,
    register_loss,
    require_whole_episodes,
)

__all__ = ["grpo_loss", "dapo_loss", "dr_grpo_loss", "gspo_loss", "cispo_loss", "sapo_loss", "vespo_loss", "dppo_loss"]


# --------------------------------------------------------------------------------------
# PPO-clip family: grpo, dapo, dr_grpo
# --------------------------------------------------------------------------------------


def _ppo_clip_terms(inputs: LossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    logp, old_logp, adv = (at_least_f32(t) for t in (inputs.logp, inputs.old_logp, inputs.adv))
    ratio = torch.exp((logp - old_logp).clamp(max=MAX_LOG_RATIO))  # (M,)
    clipped = ratio.clamp(1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    terms = -torch.minimum(ratio * adv, clipped * adv)  # (M,)
    # A clip only matters where it binds: going down with A < 0, up with A > 0.
    low = (ratio < 1.0 - cfg.epsilon_low) & (adv < 0)
    high = (ratio > 1.0 + cfg.epsilon_high) & (adv > 0)
    return terms, clip_metrics(low.detach(), high.detach())


def grpo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """GRPO: PPO clipped surrogate, token mean per sequence, then mean over sequences.

    ``L = -1/G sum_i 1/|o_i| sum_t min(r_t A_i, clip(r_t, 1-eps_low, 1+eps_high) A_i)``
    with ``r_t = pi(o_t) / pi_old(o_t)`` (DeepSeekMath, https://arxiv.org/abs/2402.03300).
    Long sequences weigh less per token.
    """
    terms, metrics = _ppo_clip_terms(inputs, cfg)
    return finish_policy_loss(terms, inputs, cfg, normalizer, loss_name="grpo", metrics=metrics)


def dapo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """DAPO: the PPO clipped surrogate averaged over all tokens of the window.

    Token-level mean over the whole accumulation window and all ranks (``sum / num_tokens``)
    with decoupled clip bounds, ``epsilon_high`` > ``epsilon_low`` ("clip-higher")
    (DAPO, https://arxiv.org/abs/2503.14476). Every token weighs the same.
    """
    terms, metrics = _ppo_clip_terms(inputs, cfg)
    return finish_policy_loss(terms, inputs, cfg, normalizer, loss_name="dapo", metrics=metrics)


def dr_grpo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """Dr. GRPO: the PPO clipped surrogate summed and divided by a constant.

    ``sum / (num_sequences * max_completion_length)`` removes GRPO's length bias
    ("Understanding R1-Zero-Like Training", https://arxiv.org/abs/2503.20783).
    """
    terms, metrics = _ppo_clip_terms(inputs, cfg)
    return finish_policy_loss(terms, inputs, cfg, normalizer, loss_name="dr_grpo", metrics=metrics)


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
    Aggregated as GRPO. With token-level importance weights (the learners' default) each
    term carries its own token's weight; TRL applies them to one sequence-level objective
    (the episode's mean weight times its mean score), so the gradients differ there; with
    sequence-level weights (``--is-level sequence``) or none they are the same.

    Needs all of an episode's terms in one micro-batch (checked when
    ``normalizer.episode_num_tokens`` is given). Clip fractions count terms of clipped
    sequences.
    """
    require_whole_episodes(inputs, normalizer, "gspo")
    logp, old_logp, adv = (at_least_f32(t) for t in (inputs.logp, inputs.old_logp, inputs.adv))
    counts = local_episode_counts(inputs).to(logp.dtype).clamp(min=1.0)  # (E,)
    seq_log_ratio = episode_sum((logp - old_logp).detach(), inputs.episode, inputs.num_episodes) / counts  # (E,)
    seq_ratio = torch.exp(seq_log_ratio.clamp(max=MAX_LOG_RATIO))[inputs.episode]  # (M,) detached
    ratio = seq_ratio * torch.exp(logp - logp.detach())  # (M,) value s_i, gradient s_i * dlogp
    clipped = ratio.clamp(1.0 - cfg.gspo_epsilon_low, 1.0 + cfg.gspo_epsilon_high)
    terms = -torch.minimum(ratio * adv, clipped * adv)
    low = (seq_ratio < 1.0 - cfg.gspo_epsilon_low) & (adv < 0)
    high = (seq_ratio > 1.0 + cfg.gspo_epsilon_high) & (adv > 0)
    return finish_policy_loss(terms, inputs, cfg, normalizer, loss_name="gspo", metrics=clip_metrics(low, high))


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
    logp, old_logp, adv = (at_least_f32(t) for t in (inputs.logp, inputs.old_logp, inputs.adv))
    ratio = torch.exp((logp - old_logp).detach().clamp(max=MAX_LOG_RATIO))  # (M,)
    weight = ratio.clamp(min=cfg.cispo_ratio_min, max=cfg.cispo_ratio_max)
    terms = -weight * adv * logp
    metrics = clip_metrics(ratio < cfg.cispo_ratio_min, ratio > cfg.cispo_ratio_max)
    return finish_policy_loss(terms, inputs, cfg, normalizer, loss_name="cispo", metrics=metrics)


def sapo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """SAPO: a temperature-controlled sigmoid gate instead of hard clipping.

    ``L = -1/G sum_i 1/|o_i| sum_t f(r_t) A_i`` with ``f(r) = 4/tau * sigmoid(tau (r - 1))``
    and ``tau = sapo_tau_pos`` if ``A > 0`` else ``sapo_tau_neg``. The gradient weight
    ``f'(r) = 4 s (1 - s)`` is 1 on-policy and decays smoothly off-policy; negative
    advantages decay faster (Qwen, "Soft Adaptive Policy Optimization",
    https://arxiv.org/abs/2511.20347). Aggregated as GRPO, as in the paper.

    ``clip/soft_weight_mean`` is the mean gradient weight ``f'(r)``: 1 means nothing gated.
    """
    logp, old_logp, adv = (at_least_f32(t) for t in (inputs.logp, inputs.old_logp, inputs.adv))
    ratio = torch.exp((logp - old_logp).clamp(max=MAX_LOG_RATIO))  # (M,)
    tau = torch.where(adv > 0, ratio.new_tensor(cfg.sapo_tau_pos), ratio.new_tensor(cfg.sapo_tau_neg))  # (M,)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    terms = -(4.0 / tau) * gate * adv
    soft_weight = (4.0 * gate * (1.0 - gate)).detach()
    metrics = {"clip/soft_weight_mean": soft_weight.mean() if soft_weight.numel() else soft_weight.sum()}
    return finish_policy_loss(terms, inputs, cfg, normalizer, loss_name="sapo", metrics=metrics)


def vespo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """VESPO: a gamma-shaped, detached weight of the sequence importance ratio.

    ``w_i = prod_t pi(o_t) / mu(o_t)`` is the full sequence ratio (a product, no length
    normalization) of the current policy over the sampler ``mu``, and
    ``phi(w) = w^k exp(lambda (1 - w))`` (normalized so ``phi(1) = 1``) with ``(k, lambda)``
    chosen by the sign of the advantage. ``L = -1/N sum sg[phi(w_i)] A_t log pi(o_t)``
    ("VESPO: Variational Sequence-Level Soft Policy Optimization",
    https://arxiv.org/abs/2602.10693; the reference code and TRL use the same kernel and
    the same token-mean aggregation; TRL builds ``w_i`` from its truncated importance ratios,
    treerl from the raw ones, so they agree while no token's ratio reaches TRL's cap).

    VESPO is itself the off-policy correction, so it reads ``sampler_logp`` and ignores
    ``is_weight`` (applying it too would correct twice); ``is_mask`` still applies. Needs all
    of an episode's terms in one micro-batch. Log-ratios are clamped like the reference.
    """
    require_whole_episodes(inputs, normalizer, "vespo")
    logp, sampler_logp, adv = (at_least_f32(t) for t in (inputs.logp, inputs.sampler_logp, inputs.adv))
    token_log_w = (logp.detach() - sampler_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (M,)
    seq_log_w = episode_sum(token_log_w, inputs.episode, inputs.num_episodes)  # (E,)
    log_w = seq_log_w.clamp(math.log(1e-8), MAX_LOG_RATIO)[inputs.episode]  # (M,)
    nonneg = adv >= 0
    k = torch.where(nonneg, log_w.new_tensor(cfg.vespo_k_pos), log_w.new_tensor(cfg.vespo_k_neg))
    lam = torch.where(nonneg, log_w.new_tensor(cfg.vespo_lambda_pos), log_w.new_tensor(cfg.vespo_lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # (M,) detached
    terms = -phi * adv * logp
    metrics = {
        "vespo/phi_mean": phi.mean() if phi.numel() else phi.sum(),
        "vespo/log_ratio_mean": log_w.mean() if log_w.numel() else log_w.sum(),
    }
    return finish_policy_loss(terms, inputs, cfg, normalizer, loss_name="vespo", metrics=metrics, apply_is_weight=False)


def dppo_loss(inputs: LossInputs, cfg: LossConfig, normalizer: LossNormalizer) -> LossOutput:
    """DPPO (Binary-TV): a trust region on the probability difference, not the ratio.

    A term leaves the trust region when its probability moved too far in the direction
    its advantage pushes: ``p - p_old > dppo_delta_high`` with ``A > 0``, or
    ``p - p_old < -dppo_delta_low`` with ``A <= 0``. Such terms are masked; the others give
    the policy gradient ``L = -1/N sum mask_t sg[r_t] A_t log pi(o_t)`` whose gradient is
    ``-A grad r_t``. Ratios blow up for rare tokens whose true divergence is tiny, while
    probability differences do not ("Rethinking the Trust Region in LLM Reinforcement
    Learning", https://arxiv.org/abs/2602.04879; as in verl's ``dppo_tv``).

    The paper anchors the trust region at the rollout policy, ``dppo_anchor="sampler"`` (the
    default): ``p_old`` is the sampler's probability, the ratio is then the importance weight
    itself, so the configured importance weight is not applied on top (its mask still is).
    ``dppo_anchor="old"`` anchors it at ``old_logp`` instead (the weights before the first of
    ``num_iterations`` updates; with one update that is the current policy, and nothing is ever
    masked). ``dppo_ratio_max`` truncates the detached ratio; the paper's recipe leaves it off.
    Clip fractions count masked terms.
    """
    anchor = inputs.sampler_logp if cfg.dppo_anchor == "sampler" else inputs.old_logp
    logp, anchor, adv = (at_least_f32(t) for t in (inputs.logp, anchor, inputs.adv))
    ratio = torch.exp((logp - anchor).detach().clamp(max=MAX_LOG_RATIO))  # (M,)
    if cfg.dppo_ratio_max is not None:
        ratio = ratio.clamp(max=cfg.dppo_ratio_max)
    diff = torch.exp(logp.detach()) - torch.exp(anchor)  # (M,) p - p_anchor
    positive = adv > 0
    high = positive & (diff > cfg.dppo_delta_high)
    low = ~positive & (diff < -cfg.dppo_delta_low)
    inside = ~(high | low)
    terms = -adv * ratio * logp * inside.to(logp.dtype)
    return finish_policy_loss(terms, inputs, cfg, normalizer, loss_name="dppo", metrics=clip_metrics(low, high),
                              apply_is_weight=cfg.dppo_anchor != "sampler")


# --------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------

for _name, _fn, _aggregation in (
    ("grpo", grpo_loss, "sequence_mean"),
    ("dapo", dapo_loss, "token_mean"),
    ("dr_grpo", dr_grpo_loss, "constant"),
    ("gspo", gspo_loss, "sequence_mean"),
    ("cispo", cispo_loss, "token_mean"),
    ("sapo", sapo_loss, "sequence_mean"),
    ("vespo", vespo_loss, "token_mean"),
    ("dppo", dppo_loss, "token_mean"),
):
    register_loss(_name, _fn, _aggregation)
