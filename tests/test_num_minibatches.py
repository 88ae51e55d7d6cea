"""``num_minibatches``, TRL's ``steps_per_generation`` beyond its default: one generation, several optimizer steps.

TRL 1.16 generates ``generation_batch_size = per_device_train_batch_size x processes x steps_per_generation``
completions at once, computes their advantages together, shuffles them and splits them into
``steps_per_generation`` chunks, taking an optimizer step every ``gradient_accumulation_steps`` chunks, the
whole buffer ``num_iterations`` times. Here a step is the generation and ``num_minibatches`` (TRL's
``steps_per_generation / gradient_accumulation_steps``) its optimizer steps per pass.

The reference of the update is independent of the learner: plain padded rows of the chosen episodes, the
loss of each minibatch in turn, an SGD step after each, the old log-probs taken before the first.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_packed_equals_unpacked import TEMPERATURE, advantages, build_groups, calibrate, episodes_of, tiny_model
from test_packed_equals_unpacked import cut_episodes, unpacked_terms

from treerl.cli import build_parser, main
from treerl.config import config_from_args
from treerl.kernels.tree_attention import enable_tree_attention
from treerl.learners.async_grpo import AsyncGRPOConfig
from treerl.learners.core import make_scheduler
from treerl.learners.distributed import Ranks
from treerl.learners.grpo import (GRPOConfig, minibatch_split, optimize, optimize_minibatches, pack_minibatches,
                                  pack_step, train)
from treerl.learners.losses import LossInputs, LossNormalizer, compute_loss
from treerl.learners.packed_batch import packing_metrics
from treerl.learners.sdpo import SDPOConfig

SMALL = dict(steps=2, tasks_per_step=2, group_size=4, max_new_tokens=32, eval_episodes=0, progress=False,
             num_threads=1, sample_groups=0)


pytestmark = pytest.mark.usefixtures("one_thread")


# -- the split ----------------------------------------------------------------------------------


def test_the_split_puts_every_episode_in_exactly_one_minibatch_in_an_order_drawn_from_the_seed():
    parts = minibatch_split(12, 3, seed=(7, 2))
    assert [len(p) for p in parts] == [4, 4, 4]
    assert sorted(i for p in parts for i in p.tolist()) == list(range(12))
    again = minibatch_split(12, 3, seed=(7, 2))
    assert [p.tolist() for p in parts] == [p.tolist() for p in again]  # the run's seed and the step decide
    assert [p.tolist() for p in parts] != [p.tolist() for p in minibatch_split(12, 3, seed=(7, 3))]
    assert [p.tolist() for p in parts] != [p.tolist() for p in minibatch_split(12, 3, seed=(8, 2))]
    assert sorted(i for p in parts for i in p.tolist()) != [i for p in parts for i in p.tolist()]  # shuffled
    uneven = minibatch_split(7, 3, seed=(0, 0))  # groups of uneven size (branching, a server's)
    assert [len(p) for p in uneven] == [3, 2, 2] and sorted(i for p in uneven for i in p) == list(range(7))


def test_each_minibatch_packs_its_own_episodes_sharing_their_prefixes():
    groups = build_groups()
    cfg = GRPOConfig(output_dir="unused", tasks_per_step=3, group_size=5, num_minibatches=3, max_tokens_per_row=48)
    minibatches = pack_minibatches(groups, advantages(groups), cfg, Ranks(), {}, skip_zero_advantage=False,
                                   seed=(0, 0))
    parts = minibatch_split(len(episodes_of(groups)), 3, seed=(0, 0))
    with_terms = {e for e, episode in enumerate(episodes_of(groups)) if episode.num_sampled_tokens > 0}
    for (batches, normalizer), part in zip(minibatches, parts):
        trained = {int(e) for b in batches for e in b.term_episode}
        assert trained == set(part.tolist()) & with_terms  # its episodes' terms, and no other's
        assert normalizer.episode_num_tokens[sorted(trained)].gt(0).all()
    assert any(packing_metrics(batches)["tree/packing_ratio"] > 1 for batches, _ in minibatches)  # prompts once


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_every_minibatch_divides_the_steps_token_count_and_counts_its_own_sequences(mask_truncated):
    """TRL's normalizer: the generation's token count over the optimizer steps; each minibatch's own episodes.
    One episode a minibatch: those of groups whose advantages are all 0 are left out of the rows, and their
    tokens still count; cut episodes (mask_truncated_completions) count as sequences, not tokens."""
    groups = build_groups()
    cut = cut_episodes(groups) if mask_truncated else []
    adv = advantages(groups)
    adv[9:] = 0.0  # groups 2 and 3: nothing to learn, left out of the forward pass
    cfg = GRPOConfig(output_dir="unused", tasks_per_step=3, group_size=5, num_minibatches=15, max_tokens_per_row=48,
                     mask_truncated_completions=mask_truncated)
    [_, whole] = pack_step(groups, adv, GRPOConfig(output_dir="unused", mask_truncated_completions=mask_truncated),
                           Ranks(), {}, skip_zero_advantage=False)
    parts = minibatch_split(15, 15, seed=(3, 1))
    for skip in (False, True):
        metrics: dict[str, float] = {}
        minibatches = pack_minibatches(groups, adv, cfg, Ranks(), metrics, skip_zero_advantage=skip, seed=(3, 1))
        for (batches, normalizer), [e] in zip(minibatches, parts):
            trained = int(whole.episode_num_tokens[e]) > 0 and not (skip and e >= 9)
            assert bool(batches) == trained and (normalizer is None) == (not trained)
            if trained:
                assert normalizer.num_tokens == pytest.approx(whole.num_tokens / 15)
                assert normalizer.num_sequences == 1
        assert metrics.get("train/skipped_groups_frac", 0.0) == (0.5 if skip else 0.0)
        assert metrics.get("train/masked_episodes_frac", 0.0) == pytest.approx(len(cut) / 15)


# -- the update ---------------------------------------------------------------------------------


def reference_update(model, groups, parts, cfg: GRPOConfig, lr: float, old_from_generation: bool = True):
    """SGD on each minibatch in turn, ``num_iterations`` passes, from plain padded rows: TRL's token count of
    the generation / the number of minibatches, the minibatch's own sequences."""
    adv = advantages(groups)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with torch.no_grad():
        at_generation = unpacked_terms(model, groups)
    num_tokens = at_generation["episode"].numel() / len(parts)
    for _ in range(cfg.num_iterations):
        for part in parts:
            terms = unpacked_terms(model, groups)
            mine = torch.isin(terms["episode"], torch.as_tensor(part))
            episode = terms["episode"][mine]
            counts = torch.bincount(episode, minlength=len(adv))
            old = at_generation["logp"] if old_from_generation else terms["logp"].detach()
            inputs = LossInputs(logp=terms["logp"][mine], old_logp=old[mine], sampler_logp=terms["sampler_logp"][mine],
                                adv=adv[episode], episode=episode, num_episodes=len(adv))
            normalizer = LossNormalizer(num_tokens=num_tokens, num_sequences=int((counts > 0).sum()),
                                        episode_num_tokens=counts)
            optimizer.zero_grad()
            compute_loss(inputs, cfg.loss_config(), normalizer).loss.backward()
            optimizer.step()


@pytest.mark.parametrize(("loss", "num_iterations"), [("dapo", 1), ("grpo", 1), ("dr_grpo", 1), ("dapo", 2)])
def test_the_update_is_one_optimizer_step_on_each_minibatch_in_turn(loss, num_iterations):
    """Three minibatches of the 15 episodes (prefix-sharing trees, a group split across rows), each its own SGD
    step, the old policy the weights that sampled: the same weights as the independent loop."""
    model = tiny_model("qwen3")
    groups = build_groups()
    calibrate(model, groups)
    cfg = GRPOConfig(output_dir="unused", temperature=TEMPERATURE, loss=loss, num_minibatches=3, tasks_per_step=3,
                     group_size=5, num_iterations=num_iterations, max_grad_norm=0.0, is_mode="off",
                     max_tokens_per_row=48, max_completion_length=32)
    packed = copy.deepcopy(model)
    enable_tree_attention(packed, impl="segment")
    start = copy.deepcopy(model)
    lr = 0.5

    minibatches = pack_minibatches(groups, advantages(groups), cfg, Ranks(), {}, skip_zero_advantage=False,
                                   seed=(0, 5))
    optimizer = torch.optim.SGD(packed.parameters(), lr=lr)
    metrics: dict[str, float] = {}
    optimize_minibatches(packed, optimizer, make_scheduler(optimizer, cfg), minibatches, cfg, "cpu", metrics)
    parts = [p.tolist() for p in minibatch_split(len(episodes_of(groups)), 3, seed=(0, 5))]
    reference_update(model, groups, parts, cfg, lr)

    got, want = dict(packed.named_parameters()), dict(model.named_parameters())
    moved = sum(float((want[n] - p).detach().abs().sum()) for n, p in start.named_parameters())
    assert moved > 1e-2
    for name, param in want.items():
        torch.testing.assert_close(got[name], param, atol=2e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    # The old policy matters: taking each minibatch's own weights as the old ones moves them elsewhere.
    other = copy.deepcopy(start)
    reference_update(other, groups, parts, cfg, lr, old_from_generation=False)
    assert max(float((dict(other.named_parameters())[n] - p).detach().abs().max()) for n, p in want.items()) > 1e-3
    assert metrics["lr"] == lr and metrics["loss/policy"] == metrics["loss/policy"]


def test_each_optimizer_steps_entropy_bonus_is_the_token_mean_of_its_own_minibatch():
    """TRL's bonus is the mean entropy over the tokens of the batch it is computed on, whatever the loss's
    normalizer: a minibatch of more tokens than the step's average gets no larger a bonus (its dapo token count is
    the step's / K, TRL's policy normalizer, which the bonus does not share)."""
    model = tiny_model("qwen3")
    groups = build_groups()
    calibrate(model, groups)
    enable_tree_attention(model, impl="segment")
    cfg = GRPOConfig(output_dir="unused", temperature=TEMPERATURE, num_minibatches=3, tasks_per_step=3, group_size=5,
                     entropy_coef=0.1, is_mode="off", max_tokens_per_row=48)
    minibatches = pack_minibatches(groups, advantages(groups), cfg, Ranks(), {}, skip_zero_advantage=False,
                                   seed=(0, 5))
    assert len({sum(b.num_terms for b in batches) for batches, _ in minibatches}) > 1  # minibatches of unequal size
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = make_scheduler(optimizer, cfg)
    for batches, normalizer in minibatches:
        metrics: dict[str, float] = {}
        optimize(model, optimizer, scheduler, batches, cfg, "cpu", metrics, normalizer=normalizer)
        assert metrics["loss/entropy"] == pytest.approx(metrics["entropy/mean"], rel=1e-5)


# -- TRL's options ------------------------------------------------------------------------------


def test_trls_steps_per_generation_and_generation_batch_size_set_the_step_and_its_minibatches(tmp_path, monkeypatch):
    """TRL's generation is per_device_train_batch_size x processes x steps_per_generation completions (or
    generation_batch_size); an optimizer step every gradient_accumulation_steps micro-batches of it."""
    cfg = GRPOConfig(output_dir="x", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                     steps_per_generation=4, num_generations=4)
    assert (cfg.tasks_per_step, cfg.group_size, cfg.num_minibatches) == (4, 4, 2)  # 16 completions, steps of 8
    assert cfg.optimizer_steps_per_step() == 2
    cfg = GRPOConfig(output_dir="x", generation_batch_size=32, num_generations=4)  # TRL's batch of 8, accumulation 1
    assert (cfg.tasks_per_step, cfg.num_minibatches) == (8, 4)
    cfg = GRPOConfig(output_dir="x", generation_batch_size=16, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, num_generations=4)
    assert (cfg.tasks_per_step, cfg.num_minibatches) == (4, 2)
    assert GRPOConfig(output_dir="x", steps_per_generation=2, num_generations=4).num_minibatches == 2
    # Chunks split groups, as TRL's: 2 completions per optimizer step, a group of 4
    cfg = GRPOConfig(output_dir="x", per_device_train_batch_size=2, steps_per_generation=2, num_generations=4)
    assert (cfg.tasks_per_step, cfg.num_minibatches) == (1, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")  # accelerate launch: every process's completions
    cfg = GRPOConfig(output_dir="x", per_device_train_batch_size=2, steps_per_generation=4, num_generations=4)
    assert (cfg.tasks_per_step, cfg.num_minibatches) == (4, 4)
    monkeypatch.delenv("WORLD_SIZE")
    # TRL's max_steps, save_steps, eval_steps and warmup_ratio count optimizer steps: num_iterations x minibatches
    cfg = GRPOConfig(output_dir="x", max_steps=8, save_steps=4, eval_strategy="steps", eval_steps=4,
                     warmup_ratio=0.25, num_iterations=2, steps_per_generation=2, num_generations=4)
    assert (cfg.steps, cfg.save_every, cfg.eval_every, cfg.warmup_steps) == (2, 1, 1, 2)
    schedule = make_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                              GRPOConfig(output_dir="x", steps=2, num_minibatches=2, lr_scheduler_type="linear"))
    rates = []
    for _ in range(4):
        schedule.optimizer.step()
        schedule.step()
        rates.append(schedule.get_last_lr()[0])
    assert rates == pytest.approx([0.75, 0.5, 0.25, 0.0])  # the run's 2 x 2 optimizer steps
    (tmp_path / "c.yaml").write_text("per_device_train_batch_size: 4\ngeneration_batch_size: 16\n"
                                     "gradient_accumulation_steps: 2\nnum_generations: 4\nmax_steps: 6\n")
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml")])
    cfg = config_from_args(GRPOConfig, args)
    assert (cfg.tasks_per_step, cfg.num_minibatches, cfg.steps) == (4, 2, 3)
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--per-device-train-batch-size", "4",
                                      "--steps-per-generation", "4", "--num-generations", "4"])
    assert (config_from_args(GRPOConfig, args).tasks_per_step, config_from_args(GRPOConfig, args).num_minibatches) \
        == (4, 4)


@pytest.mark.parametrize(("options", "error", "said"), [
    (dict(gradient_accumulation_steps=2, steps_per_generation=3), ValueError,
     "steps_per_generation=3 is not a multiple of gradient_accumulation_steps=2: TRL would take an optimizer step "
     "on the completions of two generations"),
    (dict(gradient_accumulation_steps=4, steps_per_generation=2), ValueError,
     "steps_per_generation=2 is not a multiple of gradient_accumulation_steps=4"),
    (dict(generation_batch_size=12, gradient_accumulation_steps=2, per_device_train_batch_size=4, num_generations=4),
     ValueError, r"generation_batch_size=12 \(steps_per_generation=3\) is not a multiple"),
    (dict(generation_batch_size=20), ValueError,
     r"generation_batch_size=20 must be divisible by per_device_train_batch_size x processes = 8 x 1"),
    (dict(generation_batch_size=24, num_generations=16), ValueError, "= 24 completions per generation must be "
                                                                     "divisible by num_generations=16"),
    (dict(generation_batch_size=16, steps_per_generation=2), ValueError,
     "generation_batch_size and steps_per_generation set the same thing"),
    (dict(steps_per_generation=2, tasks_per_step=2), TypeError, "steps_per_generation and tasks_per_step set the "
                                                               "same thing; keep one"),
    (dict(steps_per_generation=2, num_minibatches=2), TypeError, "steps_per_generation and num_minibatches set the "
                                                                 "same thing"),
    (dict(steps_per_generation=0), ValueError, "steps_per_generation=0 must be a whole number >= 1"),
    (dict(num_minibatches=3), ValueError, "num_minibatches=3 must be a whole number >= 1 that divides tasks_per_step "
                                          "x group_size = 64"),
    (dict(num_minibatches=0), ValueError, "num_minibatches=0 must be a whole number >= 1"),
    (dict(max_steps=6, num_minibatches=4), ValueError, "max_steps=6 counts optimizer steps .TRL's., and "
                                                       "num_minibatches=4 of them per step here: give a multiple of 4"),
    (dict(save_steps=3, num_minibatches=2, num_iterations=2), ValueError,
     "save_steps=3 counts optimizer steps .TRL's., and num_iterations=2 x num_minibatches=2 of them per step"),
])
def test_values_that_cannot_work_are_refused_with_the_fix(options, error, said):
    with pytest.raises(error, match=said):
        GRPOConfig(output_dir="x", **options)


def test_sdpo_refuses_it_and_async_grpo_takes_it_with_the_clipped_objective():
    with pytest.raises(ValueError, match="num_minibatches=2 .TRL's steps_per_generation / gradient_accumulation_steps."
                                         ": SDPO takes one update per step"):
        SDPOConfig(output_dir="x", steps_per_generation=2, num_generations=4)
    with pytest.raises(ValueError, match="num_minibatches=2 .* score centering .* use --objective clipped"):
        AsyncGRPOConfig(output_dir="x", num_minibatches=2)
    assert AsyncGRPOConfig(output_dir="x", num_minibatches=2, objective="clipped").optimizer_steps_per_step() == 2


# -- whole runs ---------------------------------------------------------------------------------


def _load():
    from treerl.models import load_default_model

    return load_default_model()


def test_a_step_takes_an_optimizer_step_per_minibatch_and_trl_counts_them(tmp_path):
    model, tok = _load()
    made = []

    def adamw(params):
        made.append(torch.optim.AdamW(params, lr=1e-3))
        return made[-1]

    def schedule(completions, trainer_state, **kwargs):  # TRL's trainer_state counts optimizer steps
        made.append((trainer_state.global_step, trainer_state.max_steps))
        return [float(len(c) % 3) for c in completions]

    train(GRPOConfig(output_dir=str(tmp_path), num_minibatches=2, skip_zero_advantage=False, **SMALL),
          model=model, tokenizer=tok, optimizer=adamw, reward_funcs=[schedule])
    optimizer, *states = made
    assert states == [(0, 4), (2, 4)]
    assert {int(state["step"]) for state in optimizer.state.values()} == {4}  # 2 steps x 2 minibatches
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and all(m["loss/policy"] == m["loss/policy"] for m in lines)


def test_treerl_learn_takes_trls_batch_options(tmp_path):
    """``treerl learn`` with TRL's flags: 8 completions a generation (2 tasks x 4), an optimizer step on each
    half; --max-steps 4 is 2 steps, and the linear schedule reaches 0 at the 4th optimizer step."""
    out = tmp_path / "run"
    assert main(["learn", "--output-dir", str(out), "--per-device-train-batch-size", "4", "--steps-per-generation",
                 "2", "--num-generations", "4", "--max-steps", "4", "--lr-scheduler-type", "linear",
                 "--learning-rate", "1e-3", "--max-new-tokens", "32", "--eval-episodes", "0", "--progress", "false",
                 "--num-threads", "1", "--sample-groups", "0"]) in (0, None)
    config = json.loads((out / "config.json").read_text())
    assert (config["tasks_per_step"], config["num_minibatches"], config["steps"]) == (2, 2, 2)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert [m["lr"] for m in lines] == pytest.approx([7.5e-4, 2.5e-4])  # each step's last update: 2nd and 4th of 4


def test_a_trl_script_with_steps_per_generation_runs(tmp_path):
    from treerl import GRPOConfig as TRLConfig
    from treerl import GRPOTrainer

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    args = TRLConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                     steps_per_generation=2, num_generations=2, max_new_tokens=8, progress=False, sample_groups=0)
    assert (args.tasks_per_step, args.num_minibatches, args.steps) == (2, 2, 1)
    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=args,
                          train_dataset=[{"prompt": f"What is {i} + {i}?"} for i in range(4)])
    result = trainer.train()
    assert (result.steps, result.global_step) == (1, 2)  # one generation, two optimizer steps (TRL's count)
    assert trainer.state.global_step == 2 and trainer.state.max_steps == 2
