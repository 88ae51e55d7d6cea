"""TRL's multi_objective_aggregation="normalize_then_sum" (GDPO) in the learners' advantages stage:
each reward column normalized in its group, their weighted sum normalized over the batch."""

from __future__ import annotations

import math
import statistics
import warnings
from types import SimpleNamespace

import pytest
import torch

from treerl.learners.async_grpo import AsyncGRPOConfig
from treerl.learners.grpo import GRPOConfig, advantages
from treerl.learners.sdpo import SDPOConfig

NAN = float("nan")
EPS = 1e-4


def trl_reference(rows, group_size, weights):
    """TRL's formula for groups of ``group_size`` consecutive rows, written out with loops."""
    sums = []
    for i, row in enumerate(rows):
        start = i - i % group_size
        total = 0.0
        for k, w in enumerate(weights):
            values = [r[k] for r in rows[start:start + group_size] if not math.isnan(r[k])]
            if not math.isnan(row[k]) and len(values) > 1:
                total += w * (row[k] - statistics.mean(values)) / (statistics.stdev(values) + EPS)
        sums.append(None if all(math.isnan(x) for x in row) else total)
    scored = [x for x in sums if x is not None]
    mean, std = statistics.mean(scored), statistics.stdev(scored)
    return [0.0 if x is None else (x - mean) / (std + EPS) for x in sums]


@pytest.mark.parametrize("config", [GRPOConfig, SDPOConfig, AsyncGRPOConfig])
def test_learners_take_trls_normalize_then_sum(config):
    # Column 0 is the environment's reward (0 here, weighted 0 as treerl.GRPOTrainer does); then two
    # reward functions on very different scales, one returning None for some completions.
    functions = [[1.0, 0.0], [0.0, 40.0], [1.0, NAN], [0.0, 10.0],
                 [NAN, NAN], [1.0, 20.0], [1.0, 30.0], [0.0, 20.0]]
    rewards = torch.tensor([[0.0, *row] for row in functions])
    groups = [SimpleNamespace(episodes=[None] * 4) for _ in range(2)]
    cfg = config(output_dir="x", multi_objective_aggregation="normalize_then_sum", group_size=4)
    metrics: dict[str, float] = {}
    adv = advantages(groups, rewards, [0.0, 1.0, 0.5], cfg, metrics)
    assert adv.tolist() == pytest.approx(trl_reference(functions, 4, [1.0, 0.5]), abs=1e-5)
    assert adv[4] == 0.0  # every function returned None: unscorable
    # TRL's default is unchanged: the weighted sum's group advantages
    summed = advantages(groups, rewards.nan_to_num(0.0), [0.0, 1.0, 0.5], config(output_dir="x", group_size=4), {})
    assert summed.tolist() != pytest.approx(adv.tolist(), abs=1e-3)


def test_flags_yaml_and_refusals(tmp_path):
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    args = build_parser().parse_args(["learn", "--output-dir", "x", "--multi-objective-aggregation",
                                      "normalize_then_sum"])
    assert config_from_args(GRPOConfig, args).advantage_config().multi_reward == "normalize_then_sum"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(output_dir="x", multi_objective_aggregation="sum_then_normalize", scale_rewards="none")
        GRPOConfig(output_dir="x", multi_objective_aggregation="normalize_then_sum")
    # TRL ignores scale_rewards with normalize_then_sum: taken, with a note
    with pytest.warns(UserWarning, match="changes nothing with multi_objective_aggregation='normalize_then_sum'"):
        cfg = GRPOConfig(output_dir="x", multi_objective_aggregation="normalize_then_sum", scale_rewards="batch")
    assert (cfg.advantage_config().scale, cfg.advantage_config().multi_reward) == ("group", "normalize_then_sum")
    with pytest.raises(ValueError, match="use --advantage-estimator grpo"):
        GRPOConfig(output_dir="x", multi_objective_aggregation="normalize_then_sum", advantage_estimator="rloo")
    with pytest.raises(ValueError, match="multi_objective_aggregation='mean'"):
        GRPOConfig(output_dir="x", multi_objective_aggregation="mean")


def test_a_run_trains_on_trls_normalize_then_sum(tmp_path):
    """One GRPO step on the tiny model: the advantages it trained with (its trajectory sample) are TRL's
    normalize_then_sum of the environment's reward and a function that returns None for half the episodes."""
    from treerl.learners.grpo import train
    from treerl.models import load_default_model
    from treerl.rollout.trajectory import read_all_groups, sample_files

    model, tok = load_default_model()
    scored = []

    def length(completions, completion_ids, **kwargs):
        values = [float(len(ids)) if i % 2 else None for i, ids in enumerate(completion_ids)]
        scored.append((kwargs["env_reward"], values))
        return values

    cfg = GRPOConfig(output_dir=str(tmp_path), steps=1, tasks_per_step=2, group_size=4, max_new_tokens=16,
                     eval_episodes=0, progress=False, num_threads=1, sample_groups=2, sample_every=1,
                     sample_trainer_logprobs=False, multi_objective_aggregation="normalize_then_sum")
    train(cfg, model=model, tokenizer=tok, reward_funcs=[length], reward_weights=[1.0, 0.25])
    env_reward, values = scored[0]
    rows = [[e, NAN if v is None else v] for e, v in zip(env_reward, values)]
    [(_, path)] = sample_files(tmp_path)
    trained = [e.advantage for g in read_all_groups(path) for e in g.episodes]
    assert trained == pytest.approx(trl_reference(rows, 4, [1.0, 0.25]), abs=1e-5)
