"""Advantages against loop-based references: group baselines, RLOO, scaling, several rewards."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from treerl.learners.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    compute_advantages,
    group_ids,
    grpo_advantages,
    rloo_advantages,
)

# Three groups with unsorted, non-contiguous labels; group 5 has zero variance and
# group 9 a single episode.
GROUP = [3, 5, 3, 3, 5, 9, 3, 5]
REWARD = [1.0, 0.5, 0.0, 1.0, 0.5, 0.7, 0.25, 0.5]
EPS = 1e-4


def members(g):
    return [i for i, x in enumerate(GROUP) if x == g]


def sample_std(values):
    return statistics.stdev(values) if len(values) > 1 else 0.0


def reference(rewards, estimator, scale):
    out = []
    for i, g in enumerate(GROUP):
        mine = [rewards[j] for j in members(g)]
        if estimator == "grpo":
            centered = rewards[i] - sum(mine) / len(mine)
        else:
            others = [rewards[j] for j in members(g) if j != i]
            centered = rewards[i] - sum(others) / len(others) if others else 0.0
        if scale == "group":
            centered /= sample_std(mine) + EPS
        elif scale == "batch":
            centered /= sample_std(rewards) + EPS
        out.append(centered)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_matches_reference(estimator, scale):
    cfg = AdvantageConfig(estimator=estimator, scale=scale, eps=EPS)
    out = compute_advantages(torch.tensor(REWARD, dtype=torch.float64), torch.tensor(GROUP), cfg)
    assert out.adv.tolist() == pytest.approx(reference(REWARD, estimator, scale), rel=1e-12, abs=1e-12)


def test_rloo_is_the_leave_one_out_mean():
    adv = rloo_advantages(torch.tensor([4.0, 1.0, 1.0, 2.0]), torch.tensor([0, 0, 0, 0]))
    # 4 - mean(1, 1, 2), 1 - mean(4, 1, 2), ...
    assert adv.tolist() == pytest.approx([4 - 4 / 3, 1 - 7 / 3, 1 - 7 / 3, 2 - 2.0])
    # Sums to zero over a group, like the group-mean baseline, but larger by G / (G - 1).
    grpo = grpo_advantages(torch.tensor([4.0, 1.0, 1.0, 2.0]), torch.tensor([0, 0, 0, 0]), scale="none")
    torch.testing.assert_close(adv, grpo * 4 / 3)


def test_singleton_group_gets_zero():
    for estimator in sorted(ADVANTAGE_ESTIMATORS):
        out = compute_advantages(torch.tensor([3.0]), torch.tensor([0]), AdvantageConfig(estimator=estimator))
        assert out.adv.tolist() == [0.0]


def test_zero_variance_groups_are_counted_and_get_zero_advantage():
    out = compute_advantages(torch.tensor(REWARD), torch.tensor(GROUP), AdvantageConfig())
    # Group 5 is constant; group 9 has one episode, so no variance either.
    assert out.metrics["reward/num_zero_std_groups"].item() == 2.0
    assert out.metrics["reward/zero_std_frac"].item() == pytest.approx(2 / 3)
    for g in (5, 9):
        assert all(out.adv[i].item() == 0.0 for i in members(g))
    assert all(math.isfinite(a) for a in out.adv.tolist())
    varied = compute_advantages(torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), AdvantageConfig())
    assert varied.metrics["reward/num_zero_std_groups"].item() == 0.0


def test_several_rewards_sum_then_normalize():
    second = [0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    weights = [1.0, 0.5]
    rewards = torch.tensor(list(zip(REWARD, second)), dtype=torch.float64)  # (E, 2)
    out = compute_advantages(rewards, torch.tensor(GROUP), AdvantageConfig(eps=EPS), weights=weights)
    combined = [weights[0] * a + weights[1] * b for a, b in zip(REWARD, second)]
    assert out.adv.tolist() == pytest.approx(reference(combined, "grpo", "group"), rel=1e-12, abs=1e-12)
    assert out.metrics["reward/mean"].item() == pytest.approx(sum(combined) / len(combined))
    # Over all episodes, as the rollout summary's reward/std (the population std, which learn logs
    # without reward functions): the same key means the same thing with them.
    assert out.metrics["reward/std"].item() == pytest.approx(statistics.pstdev(combined))
    assert out.metrics["reward/1/mean"].item() == pytest.approx(sum(second) / len(second))
    # Group 5's combined reward is no longer constant; only the singleton group is.
    assert out.metrics["reward/num_zero_std_groups"].item() == 1.0


def gdpo_reference(rows, groups, weights):
    """TRL's normalize_then_sum written out with loops: each weighted reward normalized in its group
    (over the values that are not None), the weighted sum, then that sum normalized over the batch;
    a row that no weighted reward scored has advantage 0 and stays out of the batch's statistics."""
    used = [k for k, w in enumerate(weights) if w != 0]
    sums = []
    for i, row in enumerate(rows):
        total = 0.0
        for k in used:
            values = [rows[j][k] for j, g in enumerate(groups) if g == groups[i] and not math.isnan(rows[j][k])]
            if not math.isnan(row[k]) and len(values) > 1:
                total += weights[k] * (row[k] - statistics.mean(values)) / (statistics.stdev(values) + EPS)
        sums.append(total if any(not math.isnan(row[k]) for k in used) else None)
    scored = [x for x in sums if x is not None]
    mean, std = statistics.mean(scored), statistics.stdev(scored)
    return [0.0 if x is None else (x - mean) / (std + EPS) for x in sums]


NAN = float("nan")


def test_several_rewards_normalize_then_sum():
    second = [0.0, 10.0, 100.0, 0.0, 30.0, 1.0, 100.0, 20.0]  # a much larger scale
    third = [NAN, 1.0, 0.0, NAN, 1.0, 2.0, 1.0, 0.0]  # None where it does not apply
    ignored = [5.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0]  # weight 0: left out
    rows = [list(r) for r in zip(REWARD, second, third, ignored)]
    weights = [1.0, 0.5, 2.0, 0.0]
    cfg = AdvantageConfig(multi_reward="normalize_then_sum", eps=EPS)
    out = compute_advantages(torch.tensor(rows, dtype=torch.float64), torch.tensor(GROUP), cfg, weights=weights)
    assert out.adv.tolist() == pytest.approx(gdpo_reference(rows, GROUP, weights), rel=1e-12, abs=1e-12)
    # Group 9 (one episode) has no spread in any reward; group 5's second reward varies.
    assert out.metrics["reward/num_zero_std_groups"].item() == 1.0
    assert out.metrics["reward/2/mean"].item() == pytest.approx(5.0 / 6.0)


def test_normalize_then_sum_unscorable_and_constant_groups():
    # Rows 2 and 3: every reward function returned None (the environment's column 0 is weighted 0).
    rows = [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, NAN, NAN], [0.0, NAN, NAN], [0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
    group = [0, 0, 1, 1, 2, 2]
    weights = [0.0, 1.0, 1.0]
    cfg = AdvantageConfig(multi_reward="normalize_then_sum", eps=EPS)
    out = compute_advantages(torch.tensor(rows, dtype=torch.float64), torch.tensor(group), cfg, weights=weights)
    assert out.adv.tolist() == pytest.approx(gdpo_reference(rows, group, weights), rel=1e-12, abs=1e-12)
    assert out.adv[2:4].tolist() == [0.0, 0.0]
    # Group 2 is constant in each reward: no signal of its own (TRL's batch step still shifts it).
    assert out.metrics["reward/num_zero_std_groups"].item() == 2.0


def nanstd(tensor, dim=None, keepdim=False):  # trl.trainer.utils.nanstd
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count / 1.0, float("nan")))
    std = torch.sqrt(variance * correction)
    return std if keepdim else std.squeeze(dim) if dim is not None else std.squeeze()


def trl_advantages(rewards_per_func, reward_weights, num_generations, multi_objective_aggregation="sum_then_normalize",
                   scale_rewards="group"):
    """TRL's own lines (GRPOTrainer._generate_and_score_completions, 1.16), transcribed: a completion that every
    reward function returned None for is unscorable, left out of the baseline and the batch's figures, with
    advantage 0."""
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    if multi_objective_aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        if scale_rewards == "batch":
            std_rewards = nanstd(rewards).expand_as(rewards)
        else:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        advantages = rewards - mean_grouped
        if scale_rewards != "none":
            advantages = advantages / (std_rewards + 1e-4)
    else:
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
        rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        std_rewards = nanstd(rewards).expand_as(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), rewards


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_sum_then_normalize_leaves_unscorable_completions_out_as_trls_code(scale_rewards):
    """TRL's default, sum_then_normalize: a completion that every reward function returned None for is left out
    of its group's mean and std and of the batch's std, and gets advantage 0; a None among others is left out of
    the sum. treerl's environment column, weighted 0 (as treerl.GRPOTrainer weights it), does not make a
    completion scorable."""
    rewards_per_func = torch.tensor([[1.0, NAN], [NAN, NAN], [0.0, 2.0], [1.0, 3.0],
                                     [0.5, 1.0], [NAN, NAN], [NAN, NAN], [0.5, 4.0]])
    reward_weights = torch.tensor([1.0, 0.3])
    advantages, rewards = trl_advantages(rewards_per_func, reward_weights, 4, scale_rewards=scale_rewards)

    with_env = torch.cat([torch.zeros(8, 1), rewards_per_func], dim=1)  # the environment's reward, weighted 0
    out = compute_advantages(with_env, torch.tensor([0] * 4 + [1] * 4), AdvantageConfig(scale=scale_rewards),
                             weights=torch.tensor([0.0, *reward_weights.tolist()]))
    torch.testing.assert_close(out.adv, advantages)
    assert out.metrics["reward/mean"].item() == pytest.approx(torch.nanmean(rewards).item())  # TRL's logged reward


@pytest.mark.parametrize("multi_reward", ["sum_then_normalize", "normalize_then_sum"])
def test_a_function_weighted_0_that_scored_keeps_a_completion_scorable_as_in_trl(multi_reward):
    """TRL's unscorable completion is one that every reward function returned None for, those weighted 0
    (logged only) too: a number from one of them keeps it in the baseline and the batch's figures. The
    learners' advantages pass that rule, the environment's column counting only where it is weighted."""
    from treerl.learners.grpo import GRPOConfig, advantages

    functions = torch.tensor([[1.0, NAN], [0.0, 1.0], [NAN, 1.0], [1.0, 0.0],
                              [NAN, 2.0], [0.0, NAN], [1.0, 1.0], [0.5, 0.0]])  # the second is weighted 0
    weights = torch.tensor([1.0, 0.0])
    expected, _ = trl_advantages(functions, weights, 4, multi_reward)
    rewards = torch.cat([torch.zeros(8, 1), functions], dim=1)  # the environment's column, weighted 0 (GRPOTrainer)
    cfg = GRPOConfig(output_dir="unused", group_size=4, multi_objective_aggregation=multi_reward)
    groups = [type("Group", (), {"episodes": [None] * 4})()] * 2
    torch.testing.assert_close(advantages(groups, rewards, [0.0, 1.0, 0.0], cfg, {}), expected)
    # The weighted columns alone would leave the third and fifth completions out: another baseline.
    alone = compute_advantages(rewards, torch.tensor([0] * 4 + [1] * 4), AdvantageConfig(multi_reward=multi_reward),
                               weights=[0.0, 1.0, 0.0])
    assert not torch.allclose(alone.adv, expected)


def test_normalize_then_sum_is_trls_code():
    """TRL's own lines (multi_objective_aggregation="normalize_then_sum") on groups of equal size, with None
    rewards and an unscorable completion."""
    rewards_per_func = torch.tensor([[1.0, NAN], [0.0, 2.0], [1.0, 3.0], [NAN, NAN],
                                     [0.5, 1.0], [0.0, NAN], [1.0, 0.0], [0.5, 4.0]])
    reward_weights = torch.tensor([1.0, 0.3])
    advantages, _ = trl_advantages(rewards_per_func, reward_weights, 4, "normalize_then_sum")
    out = compute_advantages(rewards_per_func, torch.tensor([0] * 4 + [1] * 4),
                             AdvantageConfig(multi_reward="normalize_then_sum"), weights=reward_weights)
    torch.testing.assert_close(out.adv, advantages)


def test_default_weights_are_ones():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    group = torch.tensor([0, 0, 0, 0])
    default = compute_advantages(rewards, group, AdvantageConfig())
    explicit = compute_advantages(rewards, group, AdvantageConfig(), weights=torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(default.adv, explicit.adv)


def test_group_ids_are_dense():
    ids, num_groups = group_ids(torch.tensor(GROUP))
    assert num_groups == 3
    assert ids.tolist() == [0, 1, 0, 0, 1, 2, 0, 1]


def test_errors():
    group = torch.tensor([0, 0])
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages(torch.tensor([1.0, float("nan")]), group, AdvantageConfig())
    with pytest.raises(ValueError, match="weights"):
        compute_advantages(torch.ones(2, 3), group, AdvantageConfig(), weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="group"):
        compute_advantages(torch.ones(3), group, AdvantageConfig())
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages(torch.ones(2, 1, 1), group, AdvantageConfig())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(estimator="ppo"), "estimator"),
        (dict(scale="global"), "scale"),
        (dict(multi_reward="max"), "multi_reward"),
        (dict(multi_reward="normalize_then_sum", estimator="rloo"), "normalize_then_sum"),
        (dict(multi_reward="normalize_then_sum", scale="none"), "normalize_then_sum"),
        (dict(eps=0.0), "eps"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdvantageConfig(**kwargs)
