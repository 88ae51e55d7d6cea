"""TRL's ``top_entropy_quantile`` ("Beyond the 80/20 Rule", https://arxiv.org/abs/2506.01939): only the
terms whose entropy reaches the step's ``1 - rho`` quantile add policy loss. The threshold is over every
term of the step (all micro-batches, all ranks), the mask drops the policy term (and the entropy bonus, then
a mean over the kept terms), never the KL or the normalizers, and 1.0 is the unmasked path.

The references are independent of the learner: ``torch.quantile`` on the unpacked episodes' entropies, and
the loss of only the kept terms of those episodes.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from test_packed_equals_unpacked import (TEMPERATURE, advantages, build_groups, calibrate, episodes_of,
                                         reference_normalizer, tiny_model, unpacked_terms)

from treerl.kernels.tree_attention import enable_tree_attention
from treerl.learners.distributed import Ranks
from treerl.learners.grpo import GRPOConfig, optimize, pack_step, skips_zero_advantage_groups, step_entropy_threshold
from treerl.learners.losses import LossInputs, LossNormalizer, compute_loss, high_entropy_threshold


pytestmark = pytest.mark.usefixtures("one_thread")


# -- the threshold ------------------------------------------------------------------------------


def test_the_threshold_is_the_quantile_of_known_entropies_and_keeps_those_at_or_above_it():
    entropy = torch.tensor([0.1, 0.5, 0.3, 0.9, 0.7])  # sorted: 0.1 0.3 0.5 0.7 0.9
    # rho 0.4: the 0.6 quantile, at rank 0.6 x 4 = 2.4: 0.5 + 0.4 x (0.7 - 0.5) = 0.58
    assert high_entropy_threshold(entropy, 0.4).item() == pytest.approx(0.58)
    assert (entropy >= high_entropy_threshold(entropy, 0.4)).tolist() == [False, False, False, True, True]
    # rho 0.5: the median, 0.5 itself, is kept (>=, as TRL)
    assert (entropy >= high_entropy_threshold(entropy, 0.5)).tolist() == [False, True, False, True, True]
    # rho 1: the minimum, every term; rho 0: the maximum, every term that ties with it
    assert bool((entropy >= high_entropy_threshold(entropy, 1.0)).all())
    ties = torch.tensor([2.0, 1.0, 2.0, 0.5])
    assert (ties >= high_entropy_threshold(ties, 0.0)).tolist() == [True, False, True, False]
    assert high_entropy_threshold(torch.tensor([0.3]), 0.2).item() == pytest.approx(0.3)
    # The same number as torch.quantile (TRL's call), which refuses more than 2**24 values.
    gen = torch.Generator().manual_seed(0)
    for n in (2, 7, 100, 1001):
        values = 5 * torch.rand(n, generator=gen)
        for rho in (0.0, 0.1, 0.2, 1 / 3, 0.5, 0.9, 1.0):
            assert torch.equal(high_entropy_threshold(values, rho), torch.quantile(values, 1 - rho))


class TwoRanks:
    """The collectives of rank 0 of two, rank 1 holding ``other``."""

    enabled = True

    def __init__(self, other: torch.Tensor):
        self.other = other

    def gather(self, obj):
        return [obj, self.other]


def test_the_step_threshold_pools_every_micro_batch_and_every_rank():
    mine = [torch.tensor([0.1, 0.9]), torch.tensor([0.4])]
    theirs = torch.tensor([0.2, 0.8, 0.6, 0.3, 0.5, 0.7])
    everything = torch.cat([*mine, theirs])
    threshold, kept = step_entropy_threshold(mine, 0.2, TwoRanks(theirs))
    assert torch.equal(threshold, torch.quantile(everything, 0.8))
    assert kept == pytest.approx(float((everything >= threshold).sum()) / 9) == pytest.approx(2 / 9)
    threshold, kept = step_entropy_threshold(mine, 0.2, Ranks())  # one process: its own terms only
    assert torch.equal(threshold, torch.quantile(torch.cat(mine), 0.8)) and kept == pytest.approx(1 / 3)


# -- the loss -----------------------------------------------------------------------------------


def learner_update(model, groups, cfg: GRPOConfig, ref_model=None):
    """What ``optimize`` does to the weights (SGD at rate 1, no clipping: the gradient), its metrics, batches."""
    batches, normalizer = pack_step(groups, advantages(groups), cfg, Ranks(), {}, skip_zero_advantage=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics: dict[str, float] = {}
    optimize(model, optimizer, scheduler, batches, cfg, "cpu", metrics, ref_model=ref_model, normalizer=normalizer)
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}, metrics, batches


def setup(rho: float, **kwargs):
    model = tiny_model("qwen3")
    groups = build_groups()
    calibrate(model, groups)
    cfg = GRPOConfig(output_dir="unused", temperature=TEMPERATURE, top_entropy_quantile=rho, max_grad_norm=0.0,
                     is_mode="off", **kwargs)
    packed = copy.deepcopy(model)
    enable_tree_attention(packed, impl="segment")
    return model, groups, cfg, packed


def reference_terms(model, groups, rho):
    """The unpacked episodes' terms, and which TRL keeps: torch.quantile over all of them."""
    terms = unpacked_terms(model, groups)
    entropy = terms["entropy"].detach()
    keep = entropy >= torch.quantile(entropy, 1 - rho)
    return terms, keep


def reference_inputs(groups, terms, keep, **kwargs) -> LossInputs:
    logp = terms["logp"][keep]
    return LossInputs(logp=logp, old_logp=logp.detach(), sampler_logp=terms["sampler_logp"][keep],
                      adv=advantages(groups)[terms["episode"][keep]], episode=terms["episode"][keep],
                      num_episodes=len(episodes_of(groups)), **kwargs)


def check_close(got: dict, want: dict):
    assert set(got) == set(want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=2e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert sum(float(g.abs().sum()) for g in want.values()) > 1e-3


@pytest.mark.parametrize(("loss", "row_tokens"), [("dapo", 48), ("grpo", 48), ("dr_grpo", 48), ("cispo", 48),
                                                  ("dapo", 4096)])
def test_the_update_is_the_gradient_of_the_loss_of_the_kept_tokens_only(loss, row_tokens):
    """The step's terms in several micro-batches (48-token rows: a pass without gradients first gives the
    threshold) or in one (its own forward gives it): the update is the gradient of the policy loss of the
    tokens at or above the step's quantile, over the normalizer of every token."""
    rho = 0.3
    model, groups, cfg, packed = setup(rho, loss=loss, max_tokens_per_row=row_tokens)
    terms, keep = reference_terms(model, groups, rho)
    normalizer = reference_normalizer(terms["episode"], len(episodes_of(groups)))
    compute_loss(reference_inputs(groups, terms, keep), cfg.loss_config(), normalizer).loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}

    got, metrics, batches = learner_update(packed, groups, cfg)
    assert (len(batches) > 1) == (row_tokens == 48)
    assert 0 < int(keep.sum()) < keep.numel() and metrics["entropy/kept_frac"] == pytest.approx(keep.float().mean())
    check_close(got, want)


def test_the_kl_keeps_every_token_and_the_entropy_bonus_is_a_mean_over_the_kept_ones():
    """As TRL: the KL term is added after the mask (every token), the entropy bonus takes the mask's tokens
    and divides by their number (TRL's mean over ``mask * entropy_mask``)."""
    rho, beta, entropy_coef = 0.3, 0.05, 0.01
    model, groups, cfg, packed = setup(rho, loss="dapo", max_tokens_per_row=48, beta=beta, entropy_coef=entropy_coef)
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    terms, keep = reference_terms(model, groups, rho)
    ref_logp = unpacked_terms(ref_model, groups)["logp"].detach()
    every = torch.ones_like(keep)
    normalizer = reference_normalizer(terms["episode"], len(episodes_of(groups)))
    no_kl = cfg.loss_config()
    no_kl.beta = 0.0
    no_kl.entropy_coef = 0.0
    policy = compute_loss(reference_inputs(groups, terms, keep), no_kl, normalizer).loss
    with_kl = copy.copy(no_kl)
    with_kl.beta = beta
    kl = (compute_loss(reference_inputs(groups, terms, every, ref_logp=ref_logp), with_kl, normalizer).loss
          - compute_loss(reference_inputs(groups, terms, every), no_kl, normalizer).loss)
    bonus = terms["entropy"][keep].mean()
    (policy + kl - entropy_coef * bonus).backward()
    want = {n: p.grad for n, p in model.named_parameters()}

    packed_ref = copy.deepcopy(ref_model)
    enable_tree_attention(packed_ref, impl="segment")
    got, metrics, _ = learner_update(packed, groups, cfg, ref_model=packed_ref)
    assert metrics["loss/entropy"] == pytest.approx(float(bonus.detach()), abs=1e-5)
    assert metrics["loss/kl"] > 0
    check_close(got, want)


def test_quantile_one_is_the_unmasked_path():
    """1.0 (TRL's default) masks nothing and takes no extra pass; an all-true mask is bit for bit no mask."""
    model, groups, cfg, packed = setup(1.0, max_tokens_per_row=48)
    forwards = []
    packed.get_decoder().register_forward_hook(lambda *_: forwards.append(1))
    _, metrics, batches = learner_update(packed, groups, cfg)
    assert len(forwards) == len(batches) > 1 and "entropy/kept_frac" not in metrics
    _, groups_masked, cfg_masked, masked = setup(0.3, max_tokens_per_row=48)
    forwards.clear()
    masked.get_decoder().register_forward_hook(lambda *_: forwards.append(1))
    learner_update(masked, groups_masked, cfg_masked)
    assert len(forwards) == 2 * len(batches)  # below 1: one pass without gradients first

    terms = unpacked_terms(model, groups)
    inputs = reference_inputs(groups, terms, torch.ones(terms["logp"].shape[0], dtype=torch.bool),
                              entropy=terms["entropy"])
    normalizer = reference_normalizer(terms["episode"], len(episodes_of(groups)))
    loss_cfg = GRPOConfig(output_dir="unused", beta=0.0, entropy_coef=0.01).loss_config()
    plain = compute_loss(inputs, loss_cfg, normalizer)
    (plain_grad,) = torch.autograd.grad(plain.loss, inputs.logp, retain_graph=True)
    inputs.entropy_mask = torch.ones_like(inputs.logp, dtype=torch.bool)
    kept_all = LossNormalizer(num_tokens=normalizer.num_tokens, num_sequences=normalizer.num_sequences,
                              episode_num_tokens=normalizer.episode_num_tokens, entropy_kept_frac=1.0)
    masked_out = compute_loss(inputs, loss_cfg, kept_all)
    (masked_grad,) = torch.autograd.grad(masked_out.loss, inputs.logp)
    assert torch.equal(plain.loss, masked_out.loss) and torch.equal(plain_grad, masked_grad)


def test_zero_advantage_groups_stay_in_the_pass_below_one():
    """Their tokens are part of the step's entropy quantile, so they cannot be left out of the forward."""
    assert skips_zero_advantage_groups(GRPOConfig(output_dir="x"), Ranks())
    assert not skips_zero_advantage_groups(GRPOConfig(output_dir="x", top_entropy_quantile=0.2), Ranks())


# -- the options --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan])
def test_values_outside_zero_to_one_are_refused(value):
    from treerl.learners.async_grpo import AsyncGRPOConfig
    from treerl.learners.sdpo import SDPOConfig

    for config in (GRPOConfig, SDPOConfig, AsyncGRPOConfig):
        with pytest.raises(ValueError, match=r"top_entropy_quantile=.* must be in \[0, 1\]"):
            config(output_dir="x", top_entropy_quantile=value)
    for config in (GRPOConfig, SDPOConfig, AsyncGRPOConfig):
        assert config(output_dir="x", top_entropy_quantile=0.2).top_entropy_quantile == 0.2


@pytest.mark.parametrize("learner", ["grpo", "sdpo", pytest.param("async_grpo", marks=pytest.mark.slow)])  # 30 s
def test_learn_cli_trains_with_top_entropy_quantile(tmp_path, learner):
    """Every learner on the shared loss path takes it (SDPO's policy part, AsyncGRPO's update)."""
    from treerl.cli import main

    out = tmp_path / "run"
    assert main(["learn", "--learner", learner, "--output-dir", str(out), "--steps", "2", "--tasks-per-step", "2",
                 "--group-size", "4", "--max-new-tokens", "24", "--eval-episodes", "0", "--progress", "false",
                 "--num-threads", "1", "--top-entropy-quantile", "0.2"]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        # About a fifth of the terms (more where entropies tie), never none.
        assert 0.0 < m["entropy/kept_frac"] < 0.5 and math.isfinite(m["loss/policy"])
    assert json.loads((out / "config.json").read_text())["top_entropy_quantile"] == 0.2


def test_a_trl_script_sets_it_in_grpo_config(tmp_path):
    from treerl import GRPOConfig as TrainerConfig
    from treerl import GRPOTrainer

    args = TrainerConfig(output_dir=str(tmp_path / "out"), max_steps=2, num_generations=4, tasks_per_step=2,
                         max_new_tokens=16, progress=False, sample_groups=0, top_entropy_quantile=0.2)
    trainer = GRPOTrainer(model="tiny", reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=[{"prompt": f"What is {i} + {i}?"} for i in range(4)])
    assert trainer.train().steps == 2
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 < m["entropy/kept_frac"] < 0.5 for m in lines)


@pytest.mark.parametrize("rho", [0.0, 0.3])
def test_with_dropout_the_mask_keeps_the_share_its_threshold_counted(monkeypatch, rho):
    """Dropout on (LoRA's, or the model's) makes the training forward's entropies differ from the pass without
    gradients that gave the threshold: the mask comes from that pass, so it keeps exactly the share logged (and
    dividing the entropy bonus), and rho 0 still trains on the highest-entropy term."""
    import treerl.learners.grpo as grpo

    model, groups, cfg, packed = setup(rho, loss="dapo", max_tokens_per_row=48)
    for layer in packed.model.layers:
        layer.self_attn.attention_dropout = 0.5
    kept, terms = [], []
    real = grpo.compute_loss

    def spy(inputs, loss_cfg, normalizer):
        kept.append(int(inputs.entropy_mask.sum()))
        terms.append(inputs.entropy_mask.numel())
        return real(inputs, loss_cfg, normalizer)

    monkeypatch.setattr(grpo, "compute_loss", spy)
    torch.manual_seed(0)
    _, metrics, batches = learner_update(packed, groups, cfg)
    assert len(batches) > 1 and sum(kept) >= 1
    assert sum(kept) == round(metrics["entropy/kept_frac"] * sum(terms))
