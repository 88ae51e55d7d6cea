"""Importance sampling between sampler and trainer, checked term by term with loops."""

from __future__ import annotations

import math

import pytest
import torch

from treerl.learners.importance import ImportanceConfig, importance_weights
from treerl.learners.losses import POLICY_LOSSES, LossConfig, LossInputs, LossNormalizer

EPISODE = [0, 0, 1, 1, 1, 2, 0, 2]
NUM_EPISODES = 3
TRAINER = [-1.0, -0.5, -2.0, -0.1, -0.3, -1.5, -0.8, -0.2]
# trainer - sampler per term: token ratios e^x.
LOG_RATIO = [0.0, 1.2, -0.9, 0.1, 0.05, -0.02, 0.3, 0.01]
SAMPLER = [t - d for t, d in zip(TRAINER, LOG_RATIO)]
ADV = [0.5, 0.5, -1.0, -1.0, -1.0, -0.2, 0.5, -0.2]


def run(cfg, *, trainer=TRAINER, adv=None):
    return importance_weights(
        torch.tensor(trainer, dtype=torch.float64),
        torch.tensor(SAMPLER, dtype=torch.float64),
        torch.tensor(EPISODE),
        NUM_EPISODES,
        cfg,
        adv=None if adv is None else torch.tensor(adv, dtype=torch.float64),
    )


def members(e):
    return [m for m, x in enumerate(EPISODE) if x == e]


def seq_ratio(e):
    return math.prod(math.exp(LOG_RATIO[m]) for m in members(e))


def geo_ratio(e):
    return math.exp(sum(LOG_RATIO[m] for m in members(e)) / len(members(e)))


def test_token_truncate():
    out = run(ImportanceConfig(level="token", mode="truncate", ratio_low=0.5, ratio_high=2.0))
    ratios = [math.exp(x) for x in LOG_RATIO]
    expected = [min(max(r, 0.5), 2.0) for r in ratios]
    assert out.weight.tolist() == pytest.approx(expected)
    assert out.mask.tolist() == [1.0] * len(EPISODE)
    truncated = sum(r < 0.5 or r > 2.0 for r in ratios)
    assert truncated == 2  # e^1.2 above, e^-0.9 below
    assert out.metrics["is/truncated_frac"].item() == pytest.approx(truncated / len(EPISODE))
    assert out.metrics["is/masked_frac"].item() == 0.0
    assert out.metrics["is/ratio_mean"].item() == pytest.approx(sum(ratios) / len(ratios))
    assert out.metrics["is/ratio_max"].item() == pytest.approx(max(ratios))


def test_token_mask():
    out = run(ImportanceConfig(level="token", mode="mask", ratio_low=0.5, ratio_high=2.0))
    ratios = [math.exp(x) for x in LOG_RATIO]
    assert out.weight.tolist() == pytest.approx(ratios)  # kept terms keep their ratio
    assert out.mask.tolist() == [0.0 if r < 0.5 or r > 2.0 else 1.0 for r in ratios]
    assert out.metrics["is/masked_frac"].item() == pytest.approx(2 / len(EPISODE))
    assert out.metrics["is/truncated_frac"].item() == 0.0


def test_sequence_truncate_uses_the_product_of_token_ratios():
    out = run(ImportanceConfig(level="sequence", mode="truncate", ratio_high=2.0))
    expected = [min(seq_ratio(e), 2.0) for e in EPISODE]
    assert out.weight.tolist() == pytest.approx(expected)
    # Episode 0: e^1.5 > 2, truncated; episode 1: e^-0.75; episode 2: e^-0.01.
    assert out.metrics["is/truncated_frac"].item() == pytest.approx(len(members(0)) / len(EPISODE))
    assert out.metrics["is/ratio_max"].item() == pytest.approx(seq_ratio(0))


def test_sequence_mask_drops_whole_episodes():
    out = run(ImportanceConfig(level="sequence", mode="mask", ratio_low=0.4, ratio_high=2.0))
    expected = [0.0 if not 0.4 <= seq_ratio(e) <= 2.0 else 1.0 for e in EPISODE]
    assert out.mask.tolist() == expected
    assert expected == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]


def test_off_gives_unit_weights_but_keeps_metrics():
    out = run(ImportanceConfig(mode="off"))
    assert out.weight.tolist() == [1.0] * len(EPISODE)
    assert out.mask.tolist() == [1.0] * len(EPISODE)
    assert out.metrics["is/ratio_max"].item() == pytest.approx(math.exp(1.2))


def test_geometric_mean_sequence_mask():
    cfg = ImportanceConfig(mode="off", geo_mask_low=0.9, geo_mask_high=1.2)
    out = run(cfg)
    expected = [1.0 if 0.9 <= geo_ratio(e) <= 1.2 else 0.0 for e in EPISODE]
    assert out.mask.tolist() == expected
    # Episode 0 (geo e^0.5) and 1 (geo e^-0.25) masked, episode 2 (e^-0.005) kept.
    assert expected == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert out.metrics["is/geo_masked_frac"].item() == pytest.approx(6 / 8)
    assert out.metrics["is/masked_frac"].item() == pytest.approx(6 / 8)


def test_off_policy_sequence_mask_only_drops_negative_advantages():
    # Mean sampler-vs-trainer KL (k1) per episode: episode 0 -0.5, episode 1 +0.25, episode 2 +0.005.
    cfg = ImportanceConfig(mode="off", opsm_threshold=0.1)
    out = run(cfg, adv=ADV)
    expected = []
    for m, e in enumerate(EPISODE):
        kl = -sum(LOG_RATIO[j] for j in members(e)) / len(members(e))
        expected.append(0.0 if ADV[m] < 0 and kl > 0.1 else 1.0)
    assert out.mask.tolist() == expected
    assert expected == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    # The same sequences with a positive advantage are kept.
    flipped = run(cfg, adv=[abs(a) for a in ADV])
    assert flipped.mask.tolist() == [1.0] * len(EPISODE)
    assert out.metrics["is/opsm_masked_frac"].item() == pytest.approx(3 / 8)


def test_masks_combine():
    cfg = ImportanceConfig(mode="mask", ratio_low=0.5, ratio_high=3.0, opsm_threshold=0.1)
    out = run(cfg, adv=ADV)
    token_keep = [0.5 <= math.exp(x) <= 3.0 for x in LOG_RATIO]
    opsm_keep = [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert out.mask.tolist() == [float(a and b) for a, b in zip(token_keep, opsm_keep)]


def test_weights_are_detached():
    trainer = torch.tensor(TRAINER, requires_grad=True)
    out = importance_weights(trainer, torch.tensor(SAMPLER), torch.tensor(EPISODE), NUM_EPISODES, ImportanceConfig())
    assert not out.weight.requires_grad and not out.mask.requires_grad


def test_weights_compose_with_the_loss():
    """The learner passes weight and mask as LossInputs.is_weight / is_mask."""
    logp = torch.tensor(TRAINER, dtype=torch.float64, requires_grad=True)
    cfg = ImportanceConfig(mode="mask", ratio_low=0.5, ratio_high=2.0)
    imp = importance_weights(logp.detach(), torch.tensor(SAMPLER, dtype=torch.float64), torch.tensor(EPISODE), 3, cfg)
    adv = torch.tensor(ADV, dtype=torch.float64)
    inputs = LossInputs(
        logp=logp, old_logp=logp.detach(), sampler_logp=torch.tensor(SAMPLER, dtype=torch.float64), adv=adv,
        episode=torch.tensor(EPISODE), num_episodes=NUM_EPISODES, is_weight=imp.weight, is_mask=imp.mask,
    )
    out = POLICY_LOSSES["dapo"](inputs, LossConfig(), LossNormalizer.from_inputs(inputs))
    out.loss.backward()
    # On-policy PPO: the gradient is -A * w * mask / N; masked terms get none.
    expected = -adv * imp.weight * imp.mask / len(EPISODE)
    torch.testing.assert_close(logp.grad, expected)
    assert (logp.grad[imp.mask == 0] == 0).all() and (imp.mask == 0).any()


def test_errors():
    with pytest.raises(ValueError, match="adv"):
        run(ImportanceConfig(opsm_threshold=0.1))
    with pytest.raises(ValueError, match=r"\(M,\)"):
        importance_weights(torch.zeros(3), torch.zeros(2), torch.zeros(3, dtype=torch.long), 1, ImportanceConfig())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(level="episode"), "level"),
        (dict(mode="clip"), "mode"),
        (dict(ratio_low=2.0, ratio_high=1.0), "ratio_low"),
        (dict(geo_mask_low=0.0), "geo_mask"),
        (dict(geo_mask_low=1.1, geo_mask_high=1.0), "geo_mask_low"),
        (dict(opsm_threshold=float("inf")), "opsm_threshold"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ImportanceConfig(**kwargs)
