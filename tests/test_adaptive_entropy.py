"""TRL's use_adaptive_entropy (Skywork-OR1's adaptive entropy control): after each optimizer step the entropy
coefficient grows by entropy_coef_delta when the step's mean entropy was at or below entropy_target, else shrinks
by it, within [entropy_coef_min, entropy_coef_max]; a step's bonus applies only when the previous optimizer step's
entropy was at or below the target. Resumed runs continue the sequence.

The references are TRL's rule written out by hand, and the mean entropy of the unpacked episodes' terms.
"""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_packed_equals_unpacked import advantages, unpacked_terms
from test_top_entropy_quantile import reference_terms, setup

from treerl.learners.distributed import Ranks
from treerl.learners.entropy_control import AdaptiveEntropy
from treerl.learners.grpo import GRPOConfig, optimize, pack_step, skips_zero_advantage_groups, train


pytestmark = pytest.mark.usefixtures("one_thread")


# -- the rule -----------------------------------------------------------------------------------


def test_the_coefficient_follows_trls_rule_over_known_entropies():
    """Target 0.2, delta 0.1, bounds [0.05, 0.3], starting at 0.1: worked out by hand from TRL's lines."""
    control = AdaptiveEntropy(coef=0.1, target=0.2, coef_min=0.05, coef_max=0.3, delta=0.1)
    entropies = [0.5, 0.2, 0.1, 0.15, 0.19, 0.9, 3.0, 3.0]
    want_coef = [0.05, 0.15, 0.25, 0.3, 0.3, 0.2, 0.1, 0.05]  # 0.1-0.1 -> min 0.05; 0.25+0.1 -> max 0.3
    # The bonus of each optimizer step: the coefficient then, when the step before measured <= 0.2 (none: off).
    want_applied = [0.0, 0.0, 0.15, 0.25, 0.3, 0.3, 0.0, 0.0]
    got_coef, got_applied = [], []
    for entropy in entropies:
        got_applied.append(control.applied_coef())
        control.update(entropy)
        got_coef.append(control.coef)
    assert got_coef == pytest.approx(want_coef) and got_applied == pytest.approx(want_applied)
    assert control.last_entropy == 3.0


def test_the_state_comes_from_the_config_or_from_a_checkpoint():
    cfg = GRPOConfig(output_dir="x", use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=1.5)
    control = AdaptiveEntropy.of_run(cfg, {})
    assert (control.coef, control.last_entropy, control.target, control.delta) == (0.01, math.inf, 1.5, 0.005)
    control.update(1.0)
    extra: dict = {}
    control.save(extra)
    assert AdaptiveEntropy.of_run(cfg, json.loads(json.dumps(extra))) == control
    assert AdaptiveEntropy.of_run(GRPOConfig(output_dir="x", entropy_coef=0.01), extra) is None


# -- one optimizer step -------------------------------------------------------------------------


def _update(model, groups, cfg, control=None):
    """What ``optimize`` does to the weights (SGD at rate 1: the gradient), and its metrics."""
    batches, normalizer = pack_step(groups, advantages(groups), cfg, Ranks(), {}, skip_zero_advantage=False)
    assert len(batches) > 1  # the window's entropy is over every micro-batch
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics: dict[str, float] = {}
    optimize(model, optimizer, scheduler, batches, cfg, "cpu", metrics, normalizer=normalizer,
             entropy_control=control)
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}, metrics


def _assert_same(got, want):
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("rho", [1.0, 0.3])
def test_a_step_measures_its_tokens_mean_entropy_and_applies_the_bonus_only_below_the_target(rho):
    """The entropy is the mean over the step's terms (the kept ones with top_entropy_quantile, as TRL's mask x
    entropy_mask); the step's bonus is the static one at the coefficient when the last entropy was at or below
    the target, and none above it."""
    model, groups, cfg, packed = setup(rho, max_tokens_per_row=48, entropy_coef=0.0)
    terms, keep = reference_terms(model, groups, rho)
    entropy = float(terms["entropy"].detach()[keep].mean())
    coef, target = 0.05, entropy + 0.5
    adaptive = copy.copy(cfg)
    adaptive.use_adaptive_entropy, adaptive.entropy_target = True, target
    static = copy.copy(cfg)
    static.entropy_coef = coef
    without, _ = _update(copy.deepcopy(packed), groups, cfg)
    with_bonus, static_metrics = _update(copy.deepcopy(packed), groups, static)
    assert static_metrics["entropy/coef"] == coef and "entropy/coef_applied" not in static_metrics  # TRL logs it too

    for last, want in ((math.inf, without), (target + 1e-3, without), (target, with_bonus), (0.0, with_bonus)):
        control = AdaptiveEntropy(coef=coef, target=target, coef_min=0.0, coef_max=1.0, delta=0.01,
                                  last_entropy=last)
        got, metrics = _update(copy.deepcopy(packed), groups, adaptive, control)
        _assert_same(got, want)
        assert control.last_entropy == pytest.approx(entropy, rel=1e-5)
        assert control.coef == pytest.approx(coef + 0.01)  # measured below the target: it grows
        assert metrics["entropy/coef"] == control.coef
        assert metrics["entropy/coef_applied"] == (coef if last <= target else 0.0)

    control = AdaptiveEntropy(coef=coef, target=entropy - 0.5, coef_min=0.0, coef_max=1.0, delta=0.01)
    _update(copy.deepcopy(packed), groups, adaptive, control)
    assert control.coef == pytest.approx(coef - 0.01)  # measured above the target: it shrinks


def test_groups_without_advantages_stay_in_the_forward_pass():
    """Their tokens count in the step's entropy, and the bonus may come on, as TRL trains on every completion."""
    assert skips_zero_advantage_groups(GRPOConfig(output_dir="x"), Ranks())
    assert not skips_zero_advantage_groups(GRPOConfig(output_dir="x", use_adaptive_entropy=True), Ranks())


# -- whole runs ---------------------------------------------------------------------------------

TINY = dict(tasks_per_step=1, group_size=2, max_new_tokens=8, temperature=1.5, eval_episodes=0, progress=False,
            num_threads=1, learning_rate=5e-3, save_every=1, sample_groups=0, use_adaptive_entropy=True,
            entropy_coef=0.02, entropy_coef_delta=0.005)


def alternate(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def _load():
    from treerl.models import load_default_model

    return load_default_model()


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("target", "coef", "applied"), [
    (100.0, [0.03, 0.04], [0.025, 0.035]),  # every entropy below: +delta each optimizer step, on from the second
    (0.0, [0.01, 0.0], [0.0, 0.0]),  # every entropy above: -delta down to entropy_coef_min, never applied
])
def test_a_run_counts_num_iterations_optimizer_steps_a_step(tmp_path, target, coef, applied):
    model, tok = _load()
    train(GRPOConfig(output_dir=str(tmp_path), steps=2, num_iterations=2, entropy_target=target, **TINY), model=model,
          tokenizer=tok, reward_funcs=[alternate])
    lines = _metrics(tmp_path)
    assert [m["entropy/coef"] for m in lines] == pytest.approx(coef)
    assert [m["entropy/coef_applied"] for m in lines] == pytest.approx(applied)  # each step's last update's
    state = json.loads((tmp_path / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["extra"]["adaptive_entropy"]["coef"] == pytest.approx(coef[-1])


def test_a_resumed_run_continues_the_sequence(tmp_path):
    """Killed after step 1's checkpoint, a resumed run takes step 2 with the coefficient and gate step 1 left:
    the same coefficients and weights as the run that never stopped."""
    out = tmp_path / "run"
    cfg = dict(output_dir=str(out), steps=2, entropy_target=100.0, **TINY)
    model, tok = _load()
    train(GRPOConfig(**cfg), model=model, tokenizer=tok, reward_funcs=[alternate])
    straight = _metrics(out)
    weights = load_file(str(out / "checkpoints" / "step-2" / "model.safetensors"))
    shutil.rmtree(out / "checkpoints" / "step-2")

    model, tok = _load()
    train(GRPOConfig(**{**cfg, "resume": True}), model=model, tokenizer=tok, reward_funcs=[alternate])
    resumed = _metrics(out)
    assert [m["step"] for m in resumed] == [1, 2]
    assert [m["entropy/coef"] for m in resumed] == pytest.approx([0.025, 0.03])
    assert resumed[1]["entropy/coef_applied"] == straight[1]["entropy/coef_applied"] == pytest.approx(0.025)
    got = load_file(str(out / "checkpoints" / "step-2" / "model.safetensors"))
    for k in weights:
        torch.testing.assert_close(got[k], weights[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("learner", ["sdpo", pytest.param("async_grpo", marks=pytest.mark.slow)])  # processes
def test_sdpo_and_async_grpo_control_their_trainers_entropy_too(tmp_path, learner):
    from treerl.learners.async_grpo import AsyncGRPOConfig, train_async
    from treerl.learners.sdpo import SDPOConfig
    from treerl.learners.sdpo import train as train_sdpo

    config, run = {"sdpo": (SDPOConfig, train_sdpo), "async_grpo": (AsyncGRPOConfig, train_async)}[learner]
    extra = {"teacher": "ema"} if learner == "sdpo" else {"max_staleness": 0}
    model, tok = _load()
    run(config(output_dir=str(tmp_path), steps=2, entropy_target=100.0, **TINY, **extra), model=model,
        tokenizer=tok, reward_funcs=[alternate])
    lines = _metrics(tmp_path)
    assert [m["entropy/coef"] for m in lines] == pytest.approx([0.025, 0.03])
    assert [m["entropy/coef_applied"] for m in lines] == pytest.approx([0.0, 0.025])


def test_treerl_learn_use_adaptive_entropy_on_the_tiny_model(tmp_path):
    from treerl.cli import main

    out = tmp_path / "run"
    assert main(["learn", "--model", "tiny", "--output-dir", str(out), "--steps", "2", "--tasks-per-step", "1",
                 "--group-size", "2", "--max-new-tokens", "8", "--eval-episodes", "0", "--progress", "false",
                 "--num-threads", "1", "--use-adaptive-entropy", "--entropy-coef", "0.01",
                 "--entropy-target", "100"]) == 0
    lines = _metrics(out)
    assert [m["entropy/coef"] for m in lines] == pytest.approx([0.015, 0.02])
    assert all(math.isfinite(m["loss/entropy"]) and m["loss/entropy"] > 0 for m in lines)


# -- the options --------------------------------------------------------------------------------


def test_trls_options_are_taken_as_keywords_flags_and_yaml(tmp_path):
    import treerl
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    cfg = treerl.GRPOConfig(output_dir="x", use_adaptive_entropy=True, entropy_coef_min=0.001, entropy_coef_max=0.1,
                            entropy_coef_delta=0.002, entropy_target=1.5)
    assert (cfg.use_adaptive_entropy, cfg.entropy_coef_min, cfg.entropy_coef_max, cfg.entropy_coef_delta,
            cfg.entropy_target) == (True, 0.001, 0.1, 0.002, 1.5)
    defaults = GRPOConfig(output_dir="x")  # TRL's defaults
    assert (defaults.use_adaptive_entropy, defaults.entropy_coef_min, defaults.entropy_coef_max,
            defaults.entropy_coef_delta, defaults.entropy_target) == (False, 0.0, 1.0, 0.005, 0.2)
    (tmp_path / "c.yaml").write_text("use_adaptive_entropy: true\nentropy_target: 2.5\n")
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml"),
                                      "--entropy-coef-max", "0.5", "--entropy-coef-delta", "0.01"])
    cfg = config_from_args(GRPOConfig, args)
    assert (cfg.use_adaptive_entropy, cfg.entropy_target, cfg.entropy_coef_max, cfg.entropy_coef_delta) == (
        True, 2.5, 0.5, 0.01)


@pytest.mark.parametrize(("given", "message"), [
    (dict(entropy_coef_min=0.5, entropy_coef_max=0.1), "entropy_coef_min=0.5, entropy_coef_max=0.1: the adaptive "
                                                       "entropy coefficient stays in [min, max]"),
    (dict(entropy_coef_min=-0.1), "so they must be finite with 0 <= min <= max"),
    (dict(entropy_coef_delta=-0.005), "entropy_coef_delta=-0.005 must be a finite number >= 0"),
    (dict(entropy_target=-1.0), "entropy_target=-1.0 must be a finite number >= 0"),
    (dict(entropy_target=math.nan), "entropy_target=nan must be a finite number >= 0"),
])
def test_values_that_cannot_work_are_refused(given, message):
    with pytest.raises(ValueError) as info:
        GRPOConfig(output_dir="x", use_adaptive_entropy=True, **given)
    assert message in str(info.value)


def test_trls_log_has_the_coefficient_and_the_loss_its_step_applied():
    """TRL logs entropy_coef; its ``loss`` subtracts the bonus at the coefficient the update applied (0 while the
    gate is shut), not the starting one."""
    from treerl.trainer import _trl_log

    cfg = GRPOConfig(output_dir="x", use_adaptive_entropy=True, entropy_coef=0.5)
    metrics = {"step": 1, "loss/policy": 1.0, "loss/entropy": 2.0, "entropy/coef": 0.3, "entropy/coef_applied": 0.25}
    log = _trl_log(metrics, cfg, per_step=1, rows=8)
    assert log["entropy_coef"] == 0.3 and log["loss"] == pytest.approx(1.0 - 0.25 * 2.0)
