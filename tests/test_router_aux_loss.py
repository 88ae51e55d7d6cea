"""TRL's router_aux_loss_coef: a Mixture-of-Experts model's load-balancing loss is added to the loss.

The packed forward counts a token shared by k episodes once; weighted by the episode paths through it
(``PackedBatch.token_num_paths``), the load-balancing loss equals transformers' own
``load_balancing_loss_func`` on the unpacked batch (each path its own padded row), value and gradient.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from treerl.errors import ConfigError
from treerl.kernels.tree_attention import enable_tree_attention
from treerl.learners.forward import packed_logprobs, router_aux_loss_coef, router_top_k
from treerl.learners.grpo import GRPOConfig, optimize
from treerl.learners.losses import load_balancing_loss
from treerl.learners.packing import PackingConfig, pack_groups
from treerl.rollout.trajectory import Group

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 101


def tiny_moe(vocab_size: int = VOCAB, **overrides) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                            **overrides)
    model = Qwen3MoeForCausalLM(config).float()
    model.set_attn_implementation("sdpa")
    return model


def routers(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [layer.mlp.gate.weight for layer in model.model.layers]


def build_groups(seed: int = 0) -> list[Group]:
    """Two groups: a multi-turn tree forked after a tool result, with a re-rendered episode (an extra leaf) and
    one straight from the prompt; and a plain group of three generations sharing a prompt."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    def sampled(g, n, parent):
        return g.add_segment("sampled", toks(n), parent=parent, logprobs=[-1.0] * n)

    g0 = Group(task_key="tree", env_id="test")
    prompt = g0.add_segment("prompt", toks(9))
    turn1 = sampled(g0, 5, prompt)
    tool = g0.add_segment("env", toks(4), parent=turn1)
    g0.add_episode(leaf=sampled(g0, 6, tool), reward=1.0)
    g0.add_episode(leaf=sampled(g0, 3, tool), reward=0.0)
    rerendered = g0.add_segment("env", toks(3), parent=prompt)
    g0.add_episode(leaf=sampled(g0, 4, rerendered), reward=0.5, extra_leaves=[turn1])
    g0.add_episode(leaf=sampled(g0, 7, prompt), reward=0.0)

    g1 = Group(task_key="plain", env_id="test")
    prompt = g1.add_segment("prompt", toks(6))
    for n, reward in ((5, 1.0), (2, 0.0), (8, 0.0)):
        g1.add_episode(leaf=sampled(g1, n, prompt), reward=reward)
    return [g0, g1]


def unpacked_rows(groups: list[Group]) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, L) ids and attention mask: each episode's root-to-leaf paths, one right-padded row each, built from the
    trajectory's own views, with no code of the packer."""
    paths = []
    for group in groups:
        for episode in group.episodes:
            for leaf in dict.fromkeys((episode.leaf, *episode.extra_leaves)):
                paths.append([t for seg in group.path(leaf) for t in seg.token_ids])
    length = max(map(len, paths))
    ids = torch.zeros((len(paths), length), dtype=torch.long)
    mask = torch.zeros((len(paths), length), dtype=torch.long)
    for r, path in enumerate(paths):
        ids[r, :len(path)] = torch.tensor(path)
        mask[r, :len(path)] = 1
    return ids, mask


@pytest.mark.parametrize("mode", ["tree", "flat", "padded"])
def test_the_packed_load_balancing_loss_is_transformers_on_the_unpacked_batch(mode):
    reference = tiny_moe()
    with torch.no_grad():  # routers that prefer some experts, as trained ones do: a loss well above its minimum
        for weight in routers(reference):
            weight.mul_(30)
    packed = copy.deepcopy(reference)
    enable_tree_attention(packed)
    groups = build_groups()
    episodes = [e for g in groups for e in g.episodes]
    # One micro-batch (TRL's loss is per forward) of several rows, the shorter ones padded.
    [batch] = pack_groups(groups, [1.0] * len(episodes), PackingConfig(max_tokens_per_row=48, mode=mode,
                                                                       rows_per_batch=16))
    assert batch.batch_size > 1 and (batch.token_num_paths == 0).any()
    out = packed_logprobs(packed, batch, router_top_k=router_top_k(packed))
    out.aux_loss.backward()

    ids, mask = unpacked_rows(groups)
    theirs = reference(input_ids=ids, attention_mask=mask, output_router_logits=True)
    theirs.aux_loss.backward()  # transformers' load_balancing_loss_func over the padded batch

    assert batch.token_num_paths.sum() == mask.sum() == batch.num_path_tokens
    torch.testing.assert_close(out.aux_loss, theirs.aux_loss, rtol=1e-5, atol=1e-6)
    for ours, their in zip(routers(packed), routers(reference)):
        torch.testing.assert_close(ours.grad, their.grad, rtol=1e-4, atol=1e-7)
    if mode == "tree":  # sharing is what the weights undo: each packed token counted once is another value
        with torch.no_grad():
            logits = packed.get_decoder()(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                          tree_layout=batch.layouts, output_router_logits=True).router_logits
        once = load_balancing_loss(logits, 2, (batch.token_num_paths > 0).float())
        assert abs(once.item() - theirs.aux_loss.item()) > 1e-2


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_loss_adds_coef_times_the_micro_batch_mean_and_its_gradient_reaches_the_routers(checkpointing):
    """One optimizer step (plain SGD at lr 1, no clipping: the update is minus the gradient) at router_aux_loss_coef
    0 and 0.5: the routers' updates differ by 0.5 x the gradient of the mean over the micro-batches of their
    load-balancing losses, computed apart; the policy loss is the same, and loss/aux logs that mean."""
    from treerl.learners.precision import enable_gradient_checkpointing

    base = tiny_moe()
    enable_tree_attention(base)
    groups = build_groups()
    adv = [1.0, -1.0, 0.5, -0.5, 1.0, -0.5, -0.5]
    batches = pack_groups(groups, adv, PackingConfig(max_tokens_per_row=48))
    assert len(batches) == 2

    def one_step(coef):
        model = copy.deepcopy(base)
        if checkpointing:
            enable_gradient_checkpointing(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        metrics = {}
        cfg = GRPOConfig(output_dir="unused", router_aux_loss_coef=coef, max_grad_norm=0.0)
        optimize(model, optimizer, scheduler, batches, cfg, "cpu", metrics)
        return model, metrics

    off, off_metrics = one_step(0.0)
    on, on_metrics = one_step(0.5)
    apart = copy.deepcopy(base)
    aux = sum(packed_logprobs(apart, b, router_top_k=2).aux_loss for b in batches) / len(batches)
    aux.backward()

    assert "loss/aux" not in off_metrics
    assert on_metrics["loss/aux"] == pytest.approx(aux.item(), rel=1e-5)
    assert on_metrics["loss/policy"] == pytest.approx(off_metrics["loss/policy"], rel=1e-5)
    for w_off, w_on, w_apart in zip(routers(off), routers(on), routers(apart)):
        assert w_apart.grad.abs().max() > 1e-4
        torch.testing.assert_close(w_off - w_on, 0.5 * w_apart.grad, rtol=1e-3, atol=1e-6)


def test_a_tiny_moe_trained_by_grpo_trainer_adds_its_configs_coefficient_and_logs_trls_aux_loss(tmp_path):
    """TRL's default (router_aux_loss_coef unset): the model config's 0.001, which config.json records; each step
    logs loss/aux, and a TRL callback's logs name it aux_loss and count it in the loss."""
    from treerl import GRPOTrainer
    from treerl.models import load_default_model

    _, tok = load_default_model()
    model = tiny_moe(vocab_size=len(tok))
    before = [w.detach().clone() for w in routers(model)]
    logged = []

    class Keep:
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs))

    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2,
                      per_device_train_batch_size=2, max_completion_length=8, learning_rate=1e-2, use_cpu=True,
                      report_to="none", disable_tqdm=True, sample_groups=0, optim="adamw_torch", num_threads=1)
    trainer = GRPOTrainer(model=model, processing_class=tok, args=args, callbacks=[Keep()],
                          reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          train_dataset=[{"prompt": "1 + 1?"}, {"prompt": "2 + 2?"}])
    result = trainer.train()

    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["router_aux_loss_coef"] == 0.001
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and all(0 < m["loss/aux"] < float("inf") for m in lines)
    steps = [logs for logs in logged if "aux_loss" in logs]
    assert [logs["aux_loss"] for logs in steps] == [m["loss/aux"] for m in lines]
    for logs, m in zip(steps, lines):
        assert logs["loss"] == pytest.approx(m["loss/policy"] + 0.001 * m["loss/aux"])
    assert result.training_loss == pytest.approx(steps[0]["loss"])
    assert all(not torch.equal(b, w) for b, w in zip(before, routers(model)))


def test_unset_takes_a_moe_configs_coefficient_and_a_dense_model_refuses_another_than_0(tmp_path):
    from treerl.learners import train
    from treerl.models import load_default_model

    moe = tiny_moe()
    assert router_aux_loss_coef(moe, None) == 0.001 and router_top_k(moe) == 2  # Qwen3MoeConfig's defaults
    assert router_aux_loss_coef(moe, 0.0) == 0.0 and router_aux_loss_coef(moe, 0.25) == 0.25
    assert router_aux_loss_coef(tiny_moe(router_aux_loss_coef=0.0), None) == 0.0
    dense, tok = load_default_model()
    assert router_aux_loss_coef(dense, None) == router_aux_loss_coef(dense, 0.0) == 0.0  # nothing to add
    with pytest.raises(ConfigError, match=r"router_aux_loss_coef=0.01: Qwen3ForCausalLM is not a Mixture-of-Experts "
                                          r"model .* drop --router-aux-loss-coef"):
        train(GRPOConfig(output_dir=str(tmp_path / "out"), router_aux_loss_coef=0.01, eval_episodes=0),
              model=dense, tokenizer=tok)


@pytest.mark.parametrize("learner", ["grpo", "sdpo", "async_grpo"])
def test_router_aux_loss_coef_is_a_flag_and_a_yaml_key_of_every_learner(learner, tmp_path):
    from treerl.cli import build_parser
    from treerl.config import config_from_args
    from treerl.learners.core import LEARNERS

    flags = ["learn", "--learner", learner, "--output-dir", str(tmp_path / "out")]
    cls = LEARNERS[learner].config
    cfg = config_from_args(cls, build_parser(learner).parse_args([*flags, "--router-aux-loss-coef", "0.01"]))
    assert cfg.router_aux_loss_coef == 0.01
    (tmp_path / "c.yaml").write_text("router_aux_loss_coef: 0.02\n")
    cfg = config_from_args(cls, build_parser(learner).parse_args([*flags, "--config", str(tmp_path / "c.yaml")]))
    assert cfg.router_aux_loss_coef == 0.02
    assert cls(output_dir="x").router_aux_loss_coef is None  # TRL's default: the model config's own


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), True])
def test_a_negative_or_non_finite_coefficient_is_refused(value):
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=.* must be a finite number >= 0"):
        GRPOConfig(output_dir="x", router_aux_loss_coef=value)
