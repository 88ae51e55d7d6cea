"""Policy losses against direct formula implementations written with explicit loops.

The batch below is hand-made so that every clip and mask branch is taken: terms of four
episodes interleaved in the flat (token, episode) layout, ratios above and below the
clip bounds with both advantage signs, and one token whose ratio is small but whose
probability barely moved (DPPO keeps it, PPO would clip it).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from _helpers import HostReads

from treerl.learners.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossConfig,
    LossInputs,
    LossNormalizer,
    compute_loss,
    episode_sum,
    k3_kl,
)

ALL_LOSSES = sorted(POLICY_LOSSES)
SEQUENCE_LEVEL = {"gspo", "vespo"}

EPISODE = [0, 1, 0, 2, 1, 2, 0, 3, 2, 3, 2]
EPISODE_ADV = [1.0, -0.8, 0.5, -0.3]
LOGP = [-0.5, -1.2, -2.0, -0.3, -0.9, -1.5, -0.7, -2.5, -0.1, -1.0, -0.4]
# old_logp - logp; the PPO ratio is exp(-delta).
DELTA = [-0.5, 0.5, 0.1, -2.0, -0.4, 0.05, 0.3, 0.6, -0.1, -0.05, 0.2]
SAMPLER_DELTA = [0.05, -0.1, 0.02, 0.3, 0.0, -0.05, 0.1, -0.2, 0.0, 0.15, -0.02]
REF_DELTA = [0.1, -0.2, 0.3, 0.0, 0.05, -0.1, 0.2, 0.4, -0.3, 0.1, 0.0]
ENTROPY = [0.5, 1.0, 1.5, 0.2, 0.8, 1.1, 0.9, 2.0, 0.3, 0.7, 1.2]
IS_WEIGHT = [1.0, 0.9, 1.2, 2.0, 1.0, 0.5, 1.1, 1.0, 0.8, 1.3, 1.0]
IS_MASK = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
NUM_EPISODES = 4
MAX_LEN = 8


def make_config(name: str, **overrides) -> LossConfig:
    base = dict(
        policy_loss=name,
        max_completion_length=MAX_LEN,
        # Wider than GSPO's defaults so that some sequences are inside the clip range.
        gspo_epsilon_low=0.1,
        gspo_epsilon_high=0.1,
        # The reference below anchors DPPO at old_logp; its default, the sampler, has a test of its own.
        **({"dppo_anchor": "old"} if name == "dppo" else {}),
    )
    base.update(overrides)
    return LossConfig(**base)


def make_leaves():
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    entropy = torch.tensor(ENTROPY, dtype=torch.float64, requires_grad=True)
    return logp, entropy


def make_inputs(logp, entropy, idx=None, *, with_is=False) -> LossInputs:
    idx = list(range(len(LOGP))) if idx is None else idx

    def t(xs):
        return torch.tensor([xs[i] for i in idx], dtype=torch.float64)

    lp = logp[idx]
    return LossInputs(
        logp=lp,
        old_logp=lp.detach() + t(DELTA),
        sampler_logp=lp.detach() + t(DELTA) + t(SAMPLER_DELTA),
        adv=torch.tensor([EPISODE_ADV[EPISODE[i]] for i in idx], dtype=torch.float64),
        episode=torch.tensor([EPISODE[i] for i in idx], dtype=torch.long),
        num_episodes=NUM_EPISODES,
        ref_logp=lp.detach() + t(REF_DELTA),
        entropy=entropy[idx],
        is_weight=t(IS_WEIGHT) if with_is else None,
        is_mask=t(IS_MASK) if with_is else None,
    )


# ---------------------------------------------------------------------------------------
# The reference: the papers' formulas, one term at a time.
# ---------------------------------------------------------------------------------------


def episodes_of_batch():
    out: dict[int, list[int]] = {}
    for m, e in enumerate(EPISODE):
        out.setdefault(e, []).append(m)
    return out


def reference_aggregate(values, aggregation):
    """values: list of per-term scalar tensors over the full batch."""
    episodes = episodes_of_batch()
    num_seq = len(episodes)
    if aggregation == "sequence_mean":
        total = 0.0
        for terms in episodes.values():
            seq = 0.0
            for m in terms:
                seq = seq + values[m]
            total = total + seq / len(terms)
        return total / num_seq
    total = 0.0
    for v in values:
        total = total + v
    if aggregation == "token_mean":
        return total / len(values)
    assert aggregation == "constant"
    return total / (num_seq * MAX_LEN)


DEFAULT_AGG = {
    "grpo": "sequence_mean",
    "dapo": "token_mean",
    "dr_grpo": "constant",
    "gspo": "sequence_mean",
    "cispo": "token_mean",
    "sapo": "sequence_mean",
    "vespo": "token_mean",
    "dppo": "token_mean",
}


def reference_loss(name, cfg, logp, entropy, *, with_is):
    """Returns (loss, metrics) computed term by term."""
    M = len(LOGP)
    lp = [logp[m] for m in range(M)]
    old = [LOGP[m] + DELTA[m] for m in range(M)]
    sampler = [old[m] + SAMPLER_DELTA[m] for m in range(M)]
    adv = [EPISODE_ADV[EPISODE[m]] for m in range(M)]
    terms = [None] * M
    low = high = 0
    metrics = {}

    if name in ("grpo", "dapo", "dr_grpo"):
        for m in range(M):
            r = torch.exp(lp[m] - old[m])
            clipped = torch.clamp(r, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
            terms[m] = -torch.minimum(r * adv[m], clipped * adv[m])
            low += int(r.item() < 1 - cfg.epsilon_low and adv[m] < 0)
            high += int(r.item() > 1 + cfg.epsilon_high and adv[m] > 0)
    elif name == "gspo" and with_is:
        # Token-varying IS weights: GSPO-token, s_it = sg[s_i] * pi(o_t) / sg[pi(o_t)].
        for e, members in episodes_of_batch().items():
            s_i = math.exp(sum(lp[m].item() - old[m] for m in members) / len(members))
            a = EPISODE_ADV[e]
            for m in members:
                s_it = s_i * torch.exp(lp[m] - lp[m].detach())
                clipped = torch.clamp(s_it, 1 - cfg.gspo_epsilon_low, 1 + cfg.gspo_epsilon_high)
                terms[m] = -torch.minimum(s_it * a, clipped * a)
            low += len(members) * int(s_i < 1 - cfg.gspo_epsilon_low and a < 0)
            high += len(members) * int(s_i > 1 + cfg.gspo_epsilon_high and a > 0)
    elif name == "gspo":
        # The sequence-level GSPO objective, the gradient flowing through s_i itself: with
        # one advantage per episode the GSPO-token form must give the same gradient.
        for e, members in episodes_of_batch().items():
            mean_log_ratio = 0.0
            for m in members:
                mean_log_ratio = mean_log_ratio + (lp[m] - old[m]) / len(members)
            s = torch.exp(mean_log_ratio)
            a = EPISODE_ADV[e]
            objective = -torch.minimum(s * a, torch.clamp(s, 1 - cfg.gspo_epsilon_low, 1 + cfg.gspo_epsilon_high) * a)
            for m in members:
                # Spread over the episode's tokens so that the sequence mean gives it back.
                terms[m] = objective
            low += len(members) * int(s.item() < 1 - cfg.gspo_epsilon_low and a < 0)
            high += len(members) * int(s.item() > 1 + cfg.gspo_epsilon_high and a > 0)
    elif name == "cispo":
        for m in range(M):
            r = math.exp(lp[m].item() - old[m])
            w = min(max(r, cfg.cispo_ratio_min), cfg.cispo_ratio_max)
            terms[m] = -w * adv[m] * lp[m]
            low += int(r < cfg.cispo_ratio_min)
            high += int(r > cfg.cispo_ratio_max)
    elif name == "sapo":
        soft = 0.0
        for m in range(M):
            r = torch.exp(lp[m] - old[m])
            tau = cfg.sapo_tau_pos if adv[m] > 0 else cfg.sapo_tau_neg
            terms[m] = -(4.0 / tau) * torch.sigmoid(tau * (r - 1)) * adv[m]
            s = 1 / (1 + math.exp(-tau * (r.item() - 1)))
            soft += 4 * s * (1 - s) / M
        metrics["clip/soft_weight_mean"] = soft
    elif name == "vespo":
        phis = []
        for e, members in episodes_of_batch().items():
            w = math.prod(math.exp(lp[m].item() - sampler[m]) for m in members)
            a = EPISODE_ADV[e]
            k, lam = (cfg.vespo_k_pos, cfg.vespo_lambda_pos) if a >= 0 else (cfg.vespo_k_neg, cfg.vespo_lambda_neg)
            phi = w**k * math.exp(lam * (1 - w))
            for m in members:
                terms[m] = -phi * adv[m] * lp[m]
                phis.append(phi)
        metrics["vespo/phi_mean"] = sum(phis) / M
    elif name == "dppo":
        for m in range(M):
            r = math.exp(lp[m].item() - old[m])
            diff = math.exp(lp[m].item()) - math.exp(old[m])
            if adv[m] > 0:
                masked = diff > cfg.dppo_delta_high
                high += int(masked)
            else:
                masked = diff < -cfg.dppo_delta_low
                low += int(masked)
            terms[m] = 0.0 * lp[m] if masked else -adv[m] * r * lp[m]
    else:
        raise AssertionError(name)

    if name not in ("sapo", "vespo"):
        metrics.update({"clip/low_frac": low / M, "clip/high_frac": high / M, "clip/region_frac": (low + high) / M})

    if with_is:
        for m in range(M):
            weight = 1.0 if name == "vespo" else IS_WEIGHT[m]
            terms[m] = terms[m] * weight * IS_MASK[m]

    aggregation = cfg.aggregation or DEFAULT_AGG[name]
    loss = reference_aggregate(terms, aggregation)
    if cfg.beta > 0:
        kl_terms = []
        for m in range(M):
            d = (LOGP[m] + REF_DELTA[m]) - lp[m]
            ratio = torch.exp(lp[m] - (LOGP[m] + DELTA[m])) if cfg.kl_bias_correction else 1.0  # to old_logp
            kl_terms.append((torch.exp(d) - d - 1) * ratio)
        loss = loss + cfg.beta * reference_aggregate(kl_terms, aggregation)
    if cfg.entropy_coef > 0:
        # TRL's bonus: the mean entropy over the tokens, whatever the loss's aggregation.
        loss = loss - cfg.entropy_coef * reference_aggregate([entropy[m] for m in range(M)], "token_mean")
    return loss, metrics


# ---------------------------------------------------------------------------------------
# Each loss against its reference: value, gradients, clip and mask fractions.
# ---------------------------------------------------------------------------------------

VARIANTS = {
    "plain": dict(with_is=False, overrides={}),
    "kl_entropy": dict(with_is=False, overrides=dict(beta=0.05, entropy_coef=0.01)),
    "is_weights": dict(with_is=True, overrides=dict(beta=0.05)),
    "plain_k3": dict(with_is=False, overrides=dict(beta=0.05, kl_bias_correction=False)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_loss_matches_reference(name, variant):
    spec = VARIANTS[variant]
    cfg = make_config(name, **spec["overrides"])

    logp, entropy = make_leaves()
    inputs = make_inputs(logp, entropy, with_is=spec["with_is"])
    out = POLICY_LOSSES[name](inputs, cfg, LossNormalizer.from_inputs(inputs))
    out.loss.backward()

    ref_logp, ref_entropy = make_leaves()
    ref, ref_metrics = reference_loss(name, cfg, ref_logp, ref_entropy, with_is=spec["with_is"])
    ref.backward()

    torch.testing.assert_close(out.loss, ref.to(out.loss.dtype), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-10, atol=1e-12)
    if cfg.entropy_coef > 0:
        torch.testing.assert_close(entropy.grad, ref_entropy.grad, rtol=1e-10, atol=1e-12)
    for key, value in ref_metrics.items():
        assert out.metrics[key].item() == pytest.approx(value, rel=1e-6), key  # fractions are float32
    assert ("loss/kl" in out.metrics) == (cfg.beta > 0)
    assert "loss/entropy" in out.metrics  # reported whenever entropy is given
    for value in out.metrics.values():
        assert not value.requires_grad


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_the_entropy_bonus_is_the_token_mean_whatever_the_aggregation(aggregation):
    """TRL's entropy_coef "has the same meaning for every loss type": the bonus is the mean entropy over the
    tokens, not the policy term's sequence mean or Dr. GRPO's constant."""
    cfg = make_config("grpo", aggregation=aggregation, entropy_coef=0.1)
    logp, entropy = make_leaves()
    inputs = make_inputs(logp, entropy)
    out = POLICY_LOSSES["grpo"](inputs, cfg, LossNormalizer.from_inputs(inputs))
    assert out.metrics["loss/entropy"].item() == pytest.approx(sum(ENTROPY) / len(ENTROPY))
    out.loss.backward()
    torch.testing.assert_close(entropy.grad, torch.full_like(entropy, -0.1 / len(ENTROPY)))


def test_fixture_takes_every_branch():
    """The reference comparison is only as strong as the branches the batch exercises."""
    logp, entropy = make_leaves()
    inputs = make_inputs(logp, entropy)
    norm = LossNormalizer.from_inputs(inputs)
    for name in ("grpo", "gspo", "cispo", "dppo"):
        metrics = POLICY_LOSSES[name](inputs, make_config(name), norm).metrics
        region = metrics["clip/region_frac"].item()
        assert 0 < region < 1, name
        if name != "cispo":  # CISPO's weight has no lower bound by default
            assert metrics["clip/low_frac"].item() > 0, name
        assert metrics["clip/high_frac"].item() > 0, name
    assert POLICY_LOSSES["sapo"](inputs, make_config("sapo"), norm).metrics["clip/soft_weight_mean"].item() < 0.99


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_aggregation_override(aggregation):
    cfg = make_config("cispo", aggregation=aggregation)
    logp, entropy = make_leaves()
    inputs = make_inputs(logp, entropy)
    out = POLICY_LOSSES["cispo"](inputs, cfg, LossNormalizer.from_inputs(inputs))
    ref, _ = reference_loss("cispo", cfg, *make_leaves(), with_is=False)
    torch.testing.assert_close(out.loss, ref.to(out.loss.dtype), rtol=1e-10, atol=1e-12)


def test_dppo_anchors_its_trust_region_at_the_sampler_by_default():
    """The paper's DPPO: the mask and the ratio are against the policy that sampled the tokens, and
    the ratio is the importance weight, so the configured weight is not applied again (its mask is)."""
    logp, entropy = make_leaves()
    inputs = make_inputs(logp, entropy, with_is=True)
    cfg = LossConfig(policy_loss="dppo", max_completion_length=MAX_LEN)
    assert cfg.dppo_anchor == "sampler"
    out = compute_loss(inputs, cfg, LossNormalizer.from_inputs(inputs))
    terms, high, low = [], 0, 0
    for m in range(len(LOGP)):
        sampler = LOGP[m] + DELTA[m] + SAMPLER_DELTA[m]
        diff = math.exp(LOGP[m]) - math.exp(sampler)
        adv = EPISODE_ADV[EPISODE[m]]
        masked = diff > cfg.dppo_delta_high if adv > 0 else diff < -cfg.dppo_delta_low
        high, low = high + int(masked and adv > 0), low + int(masked and adv <= 0)
        term = 0.0 * logp[m] if masked else -adv * math.exp(LOGP[m] - sampler) * logp[m]
        terms.append(term * IS_MASK[m])
    want = reference_aggregate(terms, "token_mean")
    torch.testing.assert_close(out.loss, want.to(out.loss.dtype), rtol=1e-10, atol=1e-12)
    assert 0 < high + low < len(LOGP)  # the fixture masks some terms and keeps others
    assert out.metrics["clip/region_frac"].item() == pytest.approx((high + low) / len(LOGP))
    # Anchored at old_logp, the same batch masks other terms: the anchor is not a no-op here.
    old = compute_loss(inputs, LossConfig(policy_loss="dppo", max_completion_length=MAX_LEN, dppo_anchor="old"),
                       LossNormalizer.from_inputs(inputs))
    assert not torch.allclose(old.loss, out.loss)


def test_the_bias_corrected_kl_has_the_reverse_kl_gradient_on_policy():
    """TRL's default (use_bias_correction_kl): k3 times the ratio to the old policy has, where that ratio
    is 1, the value of k3 and the gradient (log pi - log pi_ref) grad log pi; plain k3's is
    (1 - pi_ref / pi) grad log pi."""
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(LOGP, dtype=torch.float64) + torch.tensor(REF_DELTA, dtype=torch.float64)
    inputs = LossInputs(logp=logp, old_logp=logp.detach(), sampler_logp=logp.detach(), adv=torch.zeros(len(LOGP),
                        dtype=torch.float64), episode=torch.tensor(EPISODE), num_episodes=NUM_EPISODES, ref_logp=ref)
    grads, values = {}, {}
    for corrected in (True, False):
        logp.grad = None
        cfg = make_config("dapo", beta=1.0, kl_bias_correction=corrected)
        out = compute_loss(inputs, cfg, LossNormalizer.from_inputs(inputs))
        out.loss.backward()
        grads[corrected], values[corrected] = logp.grad.clone(), out.metrics["loss/kl"]
    n = len(LOGP)
    torch.testing.assert_close(values[True], values[False])
    torch.testing.assert_close(grads[True], (logp.detach() - ref) / n)
    torch.testing.assert_close(grads[False], (1 - torch.exp(ref - logp.detach())) / n)


def test_on_policy_gradient_is_reinforce():
    """With old = current every clipped surrogate is plain REINFORCE: grad = -A / N."""
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([EPISODE_ADV[e] for e in EPISODE], dtype=torch.float64)
    inputs = LossInputs(
        logp=logp, old_logp=logp.detach(), sampler_logp=logp.detach(), adv=adv,
        episode=torch.tensor(EPISODE), num_episodes=NUM_EPISODES,
    )
    for name in ("dapo", "cispo", "dppo", "sapo"):
        logp.grad = None
        cfg = make_config(name, aggregation="token_mean")
        compute_loss(inputs, cfg, LossNormalizer.from_inputs(inputs)).loss.backward()
        torch.testing.assert_close(logp.grad, -adv / len(LOGP), msg=name)


# ---------------------------------------------------------------------------------------
# Micro-batches: the window loss and gradient are the sums over micro-batches.
# ---------------------------------------------------------------------------------------


def split_indices(name):
    if name in SEQUENCE_LEVEL:
        # Sequence ratios need whole episodes: episodes {0, 2} and {1, 3}.
        first = [m for m, e in enumerate(EPISODE) if e in (0, 2)]
    else:
        # Cuts episodes 0 and 2 across the two micro-batches.
        first = [0, 1, 2, 3, 4]
    second = [m for m in range(len(EPISODE)) if m not in first]
    return first, second


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_micro_batches_sum_to_the_batch(name):
    cfg = make_config(name, beta=0.05, entropy_coef=0.01)

    logp, entropy = make_leaves()
    full = make_inputs(logp, entropy, with_is=True)
    full_out = POLICY_LOSSES[name](full, cfg, LossNormalizer.from_inputs(full))
    full_out.loss.backward()

    split_logp, split_entropy = make_leaves()
    parts = [make_inputs(split_logp, split_entropy, idx, with_is=True) for idx in split_indices(name)]
    normalizer = LossNormalizer.from_micro_batches([p.episode for p in parts], NUM_EPISODES)
    outs = [POLICY_LOSSES[name](p, cfg, normalizer) for p in parts]
    total = sum(o.loss for o in outs)
    total.backward()

    torch.testing.assert_close(total, full_out.loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(split_logp.grad, logp.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(split_entropy.grad, entropy.grad, rtol=1e-10, atol=1e-12)
    for key in ("loss/policy", "loss/kl", "loss/entropy"):  # additive metrics add up too
        torch.testing.assert_close(sum(o.metrics[key] for o in outs), full_out.metrics[key])


def test_split_episode_needs_the_window_episode_counts():
    """Without episode_num_tokens, GRPO divides by local counts: wrong when an episode is split."""
    cfg = make_config("grpo")
    logp, entropy = make_leaves()
    full = make_inputs(logp, entropy)
    expected = POLICY_LOSSES["grpo"](full, cfg, LossNormalizer.from_inputs(full)).loss
    parts = [make_inputs(logp, entropy, idx) for idx in split_indices("grpo")]
    window = LossNormalizer.from_micro_batches([p.episode for p in parts], NUM_EPISODES)
    local_only = LossNormalizer(num_tokens=window.num_tokens, num_sequences=window.num_sequences)
    wrong = sum(POLICY_LOSSES["grpo"](p, cfg, local_only).loss for p in parts)
    right = sum(POLICY_LOSSES["grpo"](p, cfg, window).loss for p in parts)
    torch.testing.assert_close(right, expected)
    assert abs(wrong.item() - expected.item()) > 1e-3


@pytest.mark.parametrize("name", sorted(SEQUENCE_LEVEL))
def test_sequence_losses_reject_a_split_episode(name):
    logp, entropy = make_leaves()
    parts = [make_inputs(logp, entropy, idx) for idx in split_indices("grpo")]
    normalizer = LossNormalizer.from_micro_batches([p.episode for p in parts], NUM_EPISODES)
    with pytest.raises(ValueError, match="single micro-batch"):
        POLICY_LOSSES[name](parts[0], make_config(name), normalizer)


# ---------------------------------------------------------------------------------------
# Helpers, dtypes, configs and typed errors.
# ---------------------------------------------------------------------------------------


def test_episode_sum_and_k3():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert episode_sum(x, torch.tensor([2, 0, 2, 0]), 3).tolist() == [6.0, 0.0, 4.0]
    logp = torch.tensor([-1.0, -2.0])
    assert k3_kl(logp, logp).tolist() == [0.0, 0.0]
    assert (k3_kl(logp, torch.tensor([-0.5, -3.0])) > 0).all()


def test_bfloat16_inputs_compute_in_float32():
    logp = torch.tensor(LOGP, dtype=torch.bfloat16, requires_grad=True)
    inputs = LossInputs(
        logp=logp, old_logp=logp.detach() + 0.1, sampler_logp=logp.detach(),
        adv=torch.ones(len(LOGP), dtype=torch.bfloat16), episode=torch.tensor(EPISODE), num_episodes=NUM_EPISODES,
    )
    out = compute_loss(inputs, LossConfig(), LossNormalizer.from_inputs(inputs))
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    assert logp.grad is not None and logp.grad.dtype == torch.bfloat16


def test_compute_loss_dispatches_on_the_config():
    logp, entropy = make_leaves()
    inputs = make_inputs(logp, entropy)
    norm = LossNormalizer.from_inputs(inputs)
    assert set(POLICY_LOSSES) == {"grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "vespo", "dppo"}
    assert LossConfig().policy_loss == "dapo"
    for name in ALL_LOSSES:
        cfg = make_config(name)
        torch.testing.assert_close(compute_loss(inputs, cfg, norm).loss, POLICY_LOSSES[name](inputs, cfg, norm).loss)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(policy_loss="ppo"), "policy_loss"),
        (dict(policy_loss="dr_grpo"), "max_completion_length"),
        (dict(aggregation="constant"), "max_completion_length"),
        (dict(aggregation="median"), "aggregation"),
        (dict(epsilon_low=1.5), "epsilon_low"),
        (dict(epsilon_high=-0.1), "epsilon_high"),
        (dict(beta=-1.0), "beta"),
        (dict(entropy_coef=float("nan")), "entropy_coef"),
        (dict(cispo_ratio_max=0.0), "cispo_ratio"),
        (dict(sapo_tau_neg=0.0), "sapo_tau"),
        (dict(vespo_lambda_pos=0.0), "vespo_"),
        (dict(dppo_delta_low=2.0), "dppo_delta"),
        (dict(max_completion_length=0), "max_completion_length"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LossConfig(**kwargs)


def _inputs_kwargs(**overrides):
    m = 3
    base = dict(
        logp=torch.zeros(m, requires_grad=True), old_logp=torch.zeros(m), sampler_logp=torch.zeros(m),
        adv=torch.ones(m), episode=torch.tensor([0, 0, 1]), num_episodes=2,
    )
    base.update(overrides)
    return base


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(adv=torch.ones(4)), "adv"),
        (dict(old_logp=torch.zeros(3, requires_grad=True)), "old_logp requires grad"),
        (dict(episode=torch.tensor([0.0, 0.0, 1.0])), "torch.long"),
        (dict(episode=torch.tensor([0, 0, 2])), "num_episodes"),
        (dict(logp=torch.zeros(1, 3, requires_grad=True)), "flat"),
    ],
)
def test_input_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        LossInputs(**_inputs_kwargs(**overrides))


def test_episode_range_check_reads_back_once():
    # One host sync per micro-batch on an accelerator (it took two: the min, then the max).
    with HostReads() as reads:
        LossInputs(**_inputs_kwargs())
    assert reads.count == 1
    with pytest.raises(ValueError, match=r"values in \[-1, 1\] but num_episodes is 2"):
        LossInputs(**_inputs_kwargs(episode=torch.tensor([0, -1, 1])))


def test_missing_reference_or_entropy_says_what_to_do():
    inputs = LossInputs(**_inputs_kwargs())
    norm = LossNormalizer.from_inputs(inputs)
    with pytest.raises(ValueError, match="ref_logp"):
        compute_loss(inputs, LossConfig(beta=0.1), norm)
    with pytest.raises(ValueError, match="entropy"):
        compute_loss(inputs, LossConfig(entropy_coef=0.1), norm)


def test_normalizer_errors():
    with pytest.raises(ValueError, match="num_tokens"):
        LossNormalizer(num_tokens=0, num_sequences=1)
    with pytest.raises(ValueError, match="num_sequences"):
        LossNormalizer(num_tokens=3, num_sequences=0)
    inputs = LossInputs(**_inputs_kwargs())
    bad = LossNormalizer(num_tokens=3, num_sequences=2, episode_num_tokens=torch.tensor([2, 1, 0]))
    with pytest.raises(ValueError, match="episode_num_tokens"):
        compute_loss(inputs, LossConfig(policy_loss="grpo"), bad)


# ---------------------------------------------------------------------------------------
# Random batches and random splits (hypothesis): exactness is not an accident of the fixture.
# ---------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    num_episodes = draw(st.integers(1, 4))
    m = draw(st.integers(1, 12))
    episode = draw(st.lists(st.integers(0, num_episodes - 1), min_size=m, max_size=m))
    floats = st.floats(-2.0, 2.0, allow_nan=False)
    logp = [-abs(x) - 0.01 for x in draw(st.lists(floats, min_size=m, max_size=m))]
    delta = draw(st.lists(st.floats(-0.7, 0.7), min_size=m, max_size=m))
    episode_adv = draw(st.lists(floats, min_size=num_episodes, max_size=num_episodes))
    in_first = draw(st.lists(st.booleans(), min_size=m, max_size=m))
    return num_episodes, episode, logp, delta, episode_adv, in_first


@settings(max_examples=40, deadline=None)
@given(batch=batches(), name=st.sampled_from(sorted(set(ALL_LOSSES) - SEQUENCE_LEVEL)))
def test_any_split_of_token_level_losses_is_exact(batch, name):
    num_episodes, episode, logp_values, delta, episode_adv, in_first = batch
    cfg = make_config(name, beta=0.1)

    def inputs_for(logp, idx):
        lp = logp[idx]
        return LossInputs(
            logp=lp,
            old_logp=lp.detach() + torch.tensor([delta[i] for i in idx], dtype=torch.float64),
            sampler_logp=lp.detach(),
            adv=torch.tensor([episode_adv[episode[i]] for i in idx], dtype=torch.float64),
            episode=torch.tensor([episode[i] for i in idx], dtype=torch.long),
            num_episodes=num_episodes,
            ref_logp=lp.detach() - 0.1,
        )

    everything = list(range(len(episode)))
    logp = torch.tensor(logp_values, dtype=torch.float64, requires_grad=True)
    full = inputs_for(logp, everything)
    expected = POLICY_LOSSES[name](full, cfg, LossNormalizer.from_inputs(full)).loss
    expected.backward()

    split_logp = torch.tensor(logp_values, dtype=torch.float64, requires_grad=True)
    first = [i for i in everything if in_first[i]]
    second = [i for i in everything if not in_first[i]]
    parts = [inputs_for(split_logp, idx) for idx in (first, second)]  # one part may be empty
    normalizer = LossNormalizer.from_micro_batches([p.episode for p in parts], num_episodes)
    total = sum(POLICY_LOSSES[name](p, cfg, normalizer).loss for p in parts)
    total.backward()

    torch.testing.assert_close(total, expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(split_logp.grad, logp.grad, rtol=1e-9, atol=1e-12)
