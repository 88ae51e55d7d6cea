"""The core guarantee of tree packing: the loss and every parameter gradient of a packed
batch equal those of the same episodes trained unpacked (one padded row per path), for
every policy loss, on real tiny transformers models.

The unpacked reference below shares no code with the packer: it walks each episode's
root-to-leaf paths with the trajectory's own views, runs the plain model with its default
attention and full logits, and picks the log-probs of the sampled tokens by hand.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from treerl.kernels.tree_attention import enable_tree_attention
from treerl.learners.forward import loss_inputs, packed_logprobs, window_normalizer
from treerl.learners.losses import POLICY_LOSSES, LossConfig, LossInputs, LossNormalizer, compute_loss
from treerl.learners.packing import PackingConfig, pack_groups
from treerl.rollout.trajectory import Group

VOCAB = 101
TEMPERATURE = 0.8


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(kind: str) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=False))
    elif kind == "llama":  # tied head: the embedding gets gradient from both ends
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    else:
        raise AssertionError(kind)
    model.set_attn_implementation("sdpa")
    return model.float().eval()


# -- episodes ---------------------------------------------------------------------------------


def build_groups(seed: int = 0) -> list[Group]:
    """Multi-turn branched trees with env tokens, candidate sets, an empty glue segment,
    token-identical siblings, a re-rendered episode (extra leaf), an episode with no sampled
    token, a tree that starts with a sampled token, and a group too big for one row.

    Sampler log-probs are placeholders here; :func:`calibrate` sets them near the model's.
    """
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    def sampled(g, n, parent, candidates=False, tokens=None):
        tokens = toks(n) if tokens is None else tokens
        cands = None
        if candidates:
            cands = [[t, *rng.sample([c for c in range(VOCAB) if c != t], rng.randrange(1, 6))] for t in tokens]
        return g.add_segment("sampled", tokens, parent=parent, logprobs=[0.0] * len(tokens), candidates=cands)

    # Group 0: a multi-turn tree forked after a tool result, plus the odd cases.
    g0 = Group(task_key="multi-turn", env_id="test")
    prompt = g0.add_segment("prompt", toks(7))
    turn1 = sampled(g0, 4, prompt)
    tool = g0.add_segment("env", toks(3), parent=turn1)
    g0.add_episode(leaf=sampled(g0, 3, tool), reward=1.0)  # shares turn1 and the tool result with the next
    g0.add_episode(leaf=sampled(g0, 4, tool, candidates=True), reward=0.0)
    other = sampled(g0, 3, prompt)
    glue = g0.add_segment("env", [], parent=other)  # empty glue: the next first token is predicted by `other`
    g0.add_episode(leaf=sampled(g0, 3, glue), reward=0.5)
    twin = sampled(g0, 3, prompt, tokens=list(g0.segments[other].token_ids))  # same text as `other`
    g0.add_episode(leaf=twin, reward=0.0)
    first = sampled(g0, 3, prompt)
    old_obs = g0.add_segment("env", toks(2), parent=first)
    old_turn = sampled(g0, 2, old_obs)  # the context before the chat template re-rendered
    new_obs = g0.add_segment("env", toks(4), parent=first)
    g0.add_episode(leaf=sampled(g0, 3, new_obs), reward=1.0, extra_leaves=[old_turn])

    # Group 1: samples of one prompt, some with candidate sets; one produced no token.
    g1 = Group(task_key="candidates", env_id="test")
    p1 = g1.add_segment("prompt", toks(5))
    for n, cands in ((4, True), (3, False), (5, True)):
        g1.add_episode(leaf=sampled(g1, n, p1, candidates=cands), reward=float(n))
    g1.add_episode(leaf=p1, reward=0.0)

    # Group 2: longer than the row budget of the tests, so it is split by episodes.
    g2 = Group(task_key="too-big", env_id="test")
    p2 = g2.add_segment("prompt", toks(20))
    for r in range(4):
        g2.add_episode(leaf=sampled(g2, 8, p2), reward=float(r % 2))

    # Group 3: no prompt; the very first token has no context to be predicted from.
    g3 = Group(task_key="no-prompt", env_id="test")
    s = sampled(g3, 4, None)
    g3.add_episode(leaf=sampled(g3, 2, s), reward=1.0)
    g3.add_episode(leaf=g3.add_segment("env", toks(2), parent=s), reward=0.0)
    return [g0, g1, g2, g3]


def episodes_of(groups):
    return [e for g in groups for e in g.episodes]


def advantages(groups) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(len(episodes_of(groups)), generator=gen)


# -- the unpacked reference -------------------------------------------------------------------


def unpacked_rows(groups):
    """Per path row: (episode, token ids, [(index, segment, offset) of new sampled tokens])."""
    rows = []
    for e, episode in enumerate(episodes_of(groups)):
        seen = set()
        for leaf in [episode.leaf, *episode.extra_leaves]:
            ids, picks = [], []
            for segment in episode.path(leaf):
                for off, token in enumerate(segment.token_ids):
                    key = (id(segment), off)
                    if segment.kind == "sampled" and key not in seen and ids:
                        picks.append((len(ids), segment, off))
                    seen.add(key)
                    ids.append(token)
            rows.append((e, ids, picks))
    return rows


def unpacked_terms(model, groups):
    """Terms of every episode from plain padded rows and full logits."""
    rows = [r for r in unpacked_rows(groups) if r[1]]
    length = max(len(ids) for _, ids, _ in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for r, (_, ids, _) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        mask[r, : len(ids)] = 1
    z = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits.float() / TEMPERATURE  # (R, L, V)
    logp_all = z.log_softmax(-1)
    logp, entropy, episode, sampler, segments = [], [], [], [], []
    for r, (e, ids, picks) in enumerate(rows):
        for index, segment, off in picks:
            target = ids[index]
            z_prev = z[r, index - 1]  # the position before a token predicts it
            if segment.candidates is not None:
                cands = torch.tensor(segment.candidates[off])
                logp.append(z_prev[target] - z_prev[cands].logsumexp(0))
            else:
                logp.append(logp_all[r, index - 1, target])
            entropy.append(-(logp_all[r, index - 1].exp() * logp_all[r, index - 1]).sum())
            episode.append(e)
            sampler.append(segment.logprobs[off])
            segments.append((segment, off))
    return {
        "logp": torch.stack(logp),
        "entropy": torch.stack(entropy),
        "episode": torch.tensor(episode),
        "sampler_logp": torch.tensor(sampler, dtype=torch.float32),
        "sources": segments,
    }


def calibrate(model, groups, seed: int = 0) -> None:
    """Set the sampler log-probs near the model's own, as a real sampler's would be."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        terms = unpacked_terms(model, groups)
    noise = 0.1 * torch.randn(len(terms["sources"]), generator=gen)
    for (segment, off), value in zip(terms["sources"], (terms["logp"] + noise).tolist()):
        segment.logprobs[off] = value


def reference_normalizer(episode: torch.Tensor, num_episodes: int) -> LossNormalizer:
    counts = torch.zeros(num_episodes, dtype=torch.long)
    for e in episode.tolist():
        counts[e] += 1
    return LossNormalizer(
        num_tokens=int(counts.sum()), num_sequences=int((counts > 0).sum()), episode_num_tokens=counts
    )


def loss_config(name: str) -> LossConfig:
    return LossConfig(policy_loss=name, max_completion_length=32, beta=0.05, entropy_coef=0.01)


def policies(logp: torch.Tensor, sampler_logp: torch.Tensor):
    """old, reference-model and IS weights as fixed functions of per-term values, so both sides agree."""
    old = logp.detach() + 0.25 * torch.sin(1000.0 * sampler_logp)
    ref = logp.detach() - 0.1 * torch.cos(1000.0 * sampler_logp)
    is_weight = torch.exp(logp.detach() - sampler_logp).clamp(max=2.0)
    return old, ref, is_weight


def unpacked_loss_and_grads(model, groups, name):
    model.zero_grad()
    terms = unpacked_terms(model, groups)
    num_episodes = len(episodes_of(groups))
    old, ref, is_weight = policies(terms["logp"], terms["sampler_logp"])
    inputs = LossInputs(
        logp=terms["logp"], old_logp=old, sampler_logp=terms["sampler_logp"],
        adv=advantages(groups)[terms["episode"]], episode=terms["episode"], num_episodes=num_episodes,
        ref_logp=ref, entropy=terms["entropy"], is_weight=is_weight,
    )
    normalizer = reference_normalizer(terms["episode"], num_episodes)
    loss = compute_loss(inputs, loss_config(name), normalizer).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, terms, normalizer


def packed_loss_and_grads(model, groups, name, cfg: PackingConfig):
    model.zero_grad()
    batches = pack_groups(groups, advantages(groups), cfg)
    normalizer = window_normalizer(batches)
    total = torch.zeros(())
    per_term = []
    for batch in batches:
        out = packed_logprobs(model, batch, temperature=TEMPERATURE)
        old, ref, is_weight = policies(out.logp, batch.term_sampler_logp)
        inputs = loss_inputs(batch, out, old_logp=old, ref_logp=ref, is_weight=is_weight)
        loss = compute_loss(inputs, loss_config(name), normalizer).loss
        loss.backward()  # micro-batches accumulate, as a learner's window does
        total = total + loss.detach()
        per_term.append((batch.term_episode, batch.term_sampler_logp, out.logp.detach(), out.entropy.detach()))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads, batches, normalizer, per_term


def sorted_terms(episode, sampler, *values):
    """Order terms by (episode, sampler log-prob): the sampler log-probs are distinct floats."""
    key = episode.double() * 1000.0 + sampler.double()
    order = key.argsort()
    return [episode[order], sampler[order], *(v[order] for v in values)]


def check_equal(kind, name, cfg):
    model = tiny_model(kind)
    groups = build_groups()
    calibrate(model, groups)
    want_loss, want_grads, terms, want_norm = unpacked_loss_and_grads(model, groups, name)

    packed_model = copy.deepcopy(model)
    if cfg.mode != "padded":
        enable_tree_attention(packed_model, impl="segment")
    got_loss, got_grads, batches, got_norm, per_term = packed_loss_and_grads(packed_model, groups, name, cfg)

    # Nothing lost or duplicated: the same (episode, token) terms with the same log-probs.
    got = sorted_terms(*(torch.cat(parts) for parts in zip(*per_term)))
    want = sorted_terms(terms["episode"], terms["sampler_logp"], terms["logp"].detach(), terms["entropy"].detach())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[3], want[3], atol=1e-5, rtol=0)
    assert got_norm.num_tokens == want_norm.num_tokens and got_norm.num_sequences == want_norm.num_sequences
    assert torch.equal(got_norm.episode_num_tokens, want_norm.episode_num_tokens)

    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=0)
    assert set(got_grads) == set(want_grads) == {n for n, _ in model.named_parameters()}
    for param, want_grad in want_grads.items():
        torch.testing.assert_close(
            got_grads[param], want_grad, atol=1e-5, rtol=0, msg=lambda m, param=param: f"{name} {param}: {m}"
        )
    # A real check: the gradients are not all zero, and the packing did share tokens.
    assert sum(float(g.abs().sum()) for g in want_grads.values()) > 1e-3
    return batches


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_packed_tree_equals_unpacked(kind, name):
    # A 48-token budget: group 2 (52 tokens) is split by episodes, two rows per micro-batch.
    batches = check_equal(kind, name, PackingConfig(max_tokens_per_row=48, rows_per_batch=2))
    assert len(batches) >= 2
    # One packed position predicts several episodes' first tokens; shared sampled tokens are one position.
    assert any(len(set(zip(b.loss_row.tolist(), b.loss_pos.tolist()))) < b.loss_pos.numel() for b in batches)
    assert any(b.term_loss.unique().numel() < b.num_terms for b in batches)
    assert sum(b.num_tokens for b in batches) < sum(b.num_path_tokens for b in batches)


@pytest.mark.parametrize(
    ("mode", "name"), [("flat", "grpo"), ("flat", "vespo"), ("padded", "dapo"), ("padded", "gspo")]
)
def test_flat_and_padded_equal_unpacked(mode, name):
    # `padded` runs the model with its own attention (no tree attention enabled).
    batches = check_equal("qwen3", name, PackingConfig(max_tokens_per_row=48, rows_per_batch=3, mode=mode))
    assert sum(b.num_tokens for b in batches) == sum(b.num_path_tokens for b in batches)
    if mode == "padded":
        assert all(layout.num_segments == 1 for b in batches for layout in b.layouts.layouts)


def test_one_row_per_group_is_the_same_as_many_micro_batches():
    # Everything in one micro-batch gives the same gradients as the split window above.
    check_equal("qwen3", "grpo", PackingConfig(max_tokens_per_row=128, rows_per_batch=8))


def test_reference_under_lora_is_the_base_with_its_adapters_off_not_a_copy():
    """With LoRA the KL reference (and SDPO's initial teacher) is the trained model with its adapters
    switched off, as TRL's under PEFT: the starting weights' log-probs, without a second model."""
    from peft import LoraConfig, get_peft_model

    from treerl.learners.core import AdaptersOff

    base = tiny_model("qwen3")
    start = copy.deepcopy(base)
    enable_tree_attention(start)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    enable_tree_attention(lora.get_base_model())
    torch.manual_seed(1)
    for name, p in lora.named_parameters():
        if "lora_B" in name:  # trained adapters: the model has moved away from the start
            p.data.normal_(0, 0.5)
    lora.train()
    reference = AdaptersOff(lora)
    assert list(reference.parameters()) == []  # no weights of its own
    [batch] = pack_groups(build_groups()[:1], torch.zeros(len(episodes_of(build_groups()[:1]))), PackingConfig())
    expected = packed_logprobs(start, batch, temperature=TEMPERATURE).logp
    got = packed_logprobs(reference, batch, temperature=TEMPERATURE).logp
    trained = packed_logprobs(lora, batch, temperature=TEMPERATURE).logp
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(trained, expected, atol=1e-2)
    assert not got.requires_grad and lora.training  # no graph, and the trained model is back in train mode


def cut_episodes(groups) -> list[int]:
    """Mark three episodes as cut by a token limit, as the rollout engine records it: one whose last turn
    stopped at max_new_tokens (it shares its first turn with a sibling), one that reached max_episode_tokens
    (it has an extra leaf), one of the group split over rows."""
    episodes = episodes_of(groups)
    episodes[1].path()[-1].finish_reason = "length"
    episodes[4].termination = "max_tokens"
    episodes[10].path()[-1].finish_reason = "length"
    assert [i for i, e in enumerate(episodes) if e.cut_by_token_limit] == [1, 4, 10]
    return [1, 4, 10]


@pytest.mark.parametrize(("mode", "name"), [*(("tree", name) for name in sorted(POLICY_LOSSES)),
                                            ("flat", "dapo"), ("padded", "grpo")])
def test_mask_truncated_completions_drops_the_cut_episodes_terms_and_tokens_but_not_their_count(mode, name):
    """TRL's mask_truncated_completions zeroes a truncated completion's mask: none of its tokens adds to the
    loss or to the token count (DAPO's denominator), but a sequence mean still divides by every completion.
    The packed step's loss and gradients are those of the unpacked terms of the other episodes with those
    counts, in every loss (KL and entropy terms included); the advantages are not touched."""
    from treerl.learners.distributed import Ranks
    from treerl.learners.grpo import GRPOConfig, pack_step

    model = tiny_model("qwen3")
    groups = build_groups()
    calibrate(model, groups)
    masked = cut_episodes(groups)
    num_episodes = len(episodes_of(groups))

    model.zero_grad()
    terms = unpacked_terms(model, groups)
    keep = torch.tensor([e not in masked for e in terms["episode"].tolist()])
    old, ref, is_weight = policies(terms["logp"][keep], terms["sampler_logp"][keep])
    inputs = LossInputs(
        logp=terms["logp"][keep], old_logp=old, sampler_logp=terms["sampler_logp"][keep],
        adv=advantages(groups)[terms["episode"][keep]], episode=terms["episode"][keep], num_episodes=num_episodes,
        ref_logp=ref, entropy=terms["entropy"][keep], is_weight=is_weight,
    )
    every = reference_normalizer(terms["episode"], num_episodes)
    kept = reference_normalizer(terms["episode"][keep], num_episodes)
    want_norm = LossNormalizer(num_tokens=kept.num_tokens, num_sequences=every.num_sequences,
                               episode_num_tokens=kept.episode_num_tokens)
    want_loss = compute_loss(inputs, loss_config(name), want_norm).loss
    want_loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    packed_model = copy.deepcopy(model)
    packed_model.zero_grad()
    if mode != "padded":
        enable_tree_attention(packed_model, impl="segment")
    cfg = GRPOConfig(output_dir="unused", loss=name, max_tokens_per_row=48, pack_mode=mode,
                     mask_truncated_completions=True)
    metrics: dict = {}
    adv = advantages(groups)
    batches, normalizer = pack_step(groups, adv, cfg, Ranks(), metrics, skip_zero_advantage=False)
    assert torch.equal(adv, advantages(groups))
    assert not set(torch.cat([b.term_episode for b in batches]).tolist()) & set(masked)
    assert normalizer.num_tokens == want_norm.num_tokens < every.num_tokens
    assert normalizer.num_sequences == every.num_sequences == 14  # every episode with a sampled token
    assert torch.equal(normalizer.episode_num_tokens, want_norm.episode_num_tokens)
    assert metrics["train/masked_episodes_frac"] == pytest.approx(3 / num_episodes)
    got_loss = torch.zeros(())
    for batch in batches:
        out = packed_logprobs(packed_model, batch, temperature=TEMPERATURE)
        old, ref, is_weight = policies(out.logp, batch.term_sampler_logp)
        loss = compute_loss(loss_inputs(batch, out, old_logp=old, ref_logp=ref, is_weight=is_weight),
                            loss_config(name), normalizer).loss
        loss.backward()
        got_loss = got_loss + loss.detach()
    torch.testing.assert_close(got_loss, want_loss.detach(), atol=1e-5, rtol=0)
    for param, want_grad in want_grads.items():
        got = packed_model.get_parameter(param).grad
        torch.testing.assert_close(got, want_grad, atol=1e-5, rtol=0, msg=lambda m, param=param: f"{param}: {m}")
    assert sum(float(g.abs().sum()) for g in want_grads.values()) > 1e-3
