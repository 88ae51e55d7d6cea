"""A Mixture-of-Experts model's load-balancing loss (TRL's router_aux_loss_coef) on packed rows.

The packed forward counts a token shared by k episodes once; weighted by the episode paths through it
(``PackedBatch.token_num_paths``), the load-balancing loss equals transformers' own
``load_balancing_loss_func`` on the unpacked batch (each path its own padded row), value and gradient.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from treerl.kernels.tree_attention import enable_tree_attention
from treerl.learners.forward import packed_logprobs, router_top_k
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

