"""Tree packing: rows, depths, loss positions and terms, budgets and balance.

The exactness of the loss and gradients on a real model is in
``tests/test_packed_equals_unpacked.py``; here the packer is checked against independent
enumerations over random trees (Hypothesis) and on small hand-made cases.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Qwen3Config, Qwen3ForCausalLM

from treerl.learners.forward import PackedForwardError, packed_hidden_states, packed_logprobs, window_normalizer
from treerl.learners.packing import (
    PackedBatch,
    PackingConfig,
    PackingError,
    attention_work,
    pack_groups,
    packing_metrics,
)
from treerl.rollout.trajectory import Group, Segment


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- random trees -----------------------------------------------------------------------------


@st.composite
def groups_strategy(draw):
    """1-3 groups of random trees: any kinds, empty segments, extra leaves, candidate sets.

    Every sampled token gets a distinct sampler log-prob (a multiple of 1/64, exact in
    float32), so a term can be recognised by (episode, target, sampler log-prob).
    """
    counter = iter(range(1, 10_000))
    groups = []
    for g in range(draw(st.integers(1, 3))):
        group = Group(task_key=f"g{g}", env_id="test")
        for s in range(draw(st.integers(1, 8))):
            parent = None if s == 0 or draw(st.integers(0, 5)) == 0 else draw(st.integers(0, s - 1))
            kind = draw(st.sampled_from(["prompt", "sampled", "env"]))
            tokens = draw(st.lists(st.integers(0, 40), min_size=0, max_size=5))
            logprobs = candidates = None
            if kind == "sampled":
                logprobs = [-next(counter) / 64 for _ in tokens]
                if draw(st.booleans()):
                    candidates = [sorted({t, t + 41, t + 42 + draw(st.integers(0, 3))}) for t in tokens]
            group.add_segment(kind, tokens, parent=parent, logprobs=logprobs, candidates=candidates)
        num_segments = len(group.segments)
        for _ in range(draw(st.integers(1, 4))):
            leaf = draw(st.integers(0, num_segments - 1))
            extra = draw(st.lists(st.integers(0, num_segments - 1), max_size=2))
            group.add_episode(leaf=leaf, reward=0.0, extra_leaves=extra)
        groups.append(group)
    return groups


def expected_terms(groups) -> Counter:
    """(episode, target, sampler log-prob) of every term, enumerated along each episode's paths."""
    terms: Counter = Counter()
    episodes = [e for g in groups for e in g.episodes]
    for e, episode in enumerate(episodes):
        seen = set()
        for leaf in [episode.leaf, *episode.extra_leaves]:
            depth = 0
            for segment in episode.path(leaf):
                for off, token in enumerate(segment.token_ids):
                    key = (id(segment), off)
                    if segment.kind == "sampled" and depth > 0 and key not in seen:
                        terms[(e, token, segment.logprobs[off])] += 1
                        seen.add(key)
                    depth += 1
    return terms


def episode_paths(groups):
    """Token sequence of each non-empty path of each episode, by global episode index."""
    out = []
    for e, episode in enumerate(e for g in groups for e in g.episodes):
        for leaf in dict.fromkeys([episode.leaf, *episode.extra_leaves]):  # a leaf named twice is one path
            ids = [t for s in episode.path(leaf) for t in s.token_ids]
            if ids:
                out.append((e, ids))
    return out


def largest_episode(groups) -> int:
    """Tokens of the largest union of one episode's paths (the least budget that can work)."""
    most = 0
    for group in groups:
        for episode in group.episodes:
            segs = set()
            for leaf in [episode.leaf, *episode.extra_leaves]:
                node = leaf
                while node is not None:
                    segs.add(node)
                    node = group.segments[node].parent
            most = max(most, sum(len(group.segments[s].token_ids) for s in segs))
    return most


def longest_path(groups) -> int:
    return max((len(ids) for _, ids in episode_paths(groups)), default=0)


def check_batch_invariants(batch: PackedBatch, budget: int) -> None:
    rows, length = batch.input_ids.shape
    assert batch.position_ids.shape == (rows, length)
    for r, layout in enumerate(batch.layouts.layouts):
        assert layout.num_tokens <= budget
        n = layout.num_tokens
        assert torch.equal(batch.position_ids[r, :n], layout.position_ids())
        assert bool((batch.position_ids[r, n:] == 0).all())
    # Each loss position is the target's immediate predecessor on its path: visible to it,
    # one level shallower, and the only visible key at that depth.
    masks = batch.layouts.dense_mask()  # (B, T, T)
    for n in range(batch.loss_pos.numel()):
        r, pos, target_pos = (int(x[n]) for x in (batch.loss_row, batch.loss_pos, batch.loss_target_pos))
        assert int(batch.input_ids[r, target_pos]) == int(batch.loss_target[n])
        depth = batch.position_ids[r]
        assert int(depth[pos]) == int(depth[target_pos]) - 1
        visible = masks[r, target_pos].nonzero().squeeze(1)
        assert [int(k) for k in visible if int(depth[k]) == int(depth[target_pos]) - 1] == [pos]
    # Candidate rows hold the target; rows without a recorded set hold only the target.
    if batch.loss_candidates is not None:
        holds = (batch.loss_candidates == batch.loss_target[:, None]).any(1)
        assert bool(holds.all())
        only_target = (batch.loss_candidates >= 0).sum(1) == 1
        assert bool(only_target[~batch.loss_has_candidates].all())
    else:
        assert not bool(batch.loss_has_candidates.any())
    assert batch.term_adv.shape == batch.term_episode.shape == batch.term_loss.shape


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=groups_strategy(),
    mode=st.sampled_from(["tree", "flat", "padded"]),
    slack=st.integers(-3, 20),
    rows_per_batch=st.integers(1, 3),
)
def test_packing_keeps_every_term_once_and_every_path_intact(groups, mode, slack, rows_per_batch):
    need = largest_episode(groups) if mode != "padded" else longest_path(groups)
    if mode == "flat":  # a flat episode lays each of its paths out in full, in one row
        per_episode = Counter()
        for e, ids in episode_paths(groups):
            per_episode[e] += len(ids)
        need = max(per_episode.values(), default=0)
    budget = max(1, need + slack)
    adv = torch.arange(sum(len(g.episodes) for g in groups), dtype=torch.float32)
    cfg = PackingConfig(max_tokens_per_row=budget, mode=mode, rows_per_batch=rows_per_batch)
    if budget < need:
        with pytest.raises(PackingError, match="max_tokens_per_row"):
            pack_groups(groups, adv, cfg)
        return
    batches = pack_groups(groups, adv, cfg)

    got: Counter = Counter()
    batch_of_episode: dict[int, int] = {}
    for b, batch in enumerate(batches):
        check_batch_invariants(batch, budget)
        for term in range(batch.num_terms):
            n, e = int(batch.term_loss[term]), int(batch.term_episode[term])
            got[(e, int(batch.loss_target[n]), float(batch.loss_sampler_logp[n]))] += 1
            assert float(batch.term_adv[term]) == float(adv[e])
            assert batch_of_episode.setdefault(e, b) == b, "an episode's terms span two micro-batches"
        if mode == "flat" or mode == "padded":
            assert batch.term_loss.unique().numel() == batch.num_terms  # no sharing
            assert batch.num_tokens == batch.num_path_tokens
        if mode == "padded":
            assert all(layout.num_segments == 1 for layout in batch.layouts.layouts)
    assert got == expected_terms(groups)
    counts = Counter(e for e, _, _ in expected_terms(groups).elements())
    num_episodes = sum(len(g.episodes) for g in groups)
    want_counts = [counts.get(e, 0) for e in range(num_episodes)]
    for batch in batches:
        assert batch.episode_num_tokens.tolist() == want_counts
    if any(want_counts):
        normalizer = window_normalizer(batches)
        assert normalizer.num_tokens == sum(want_counts)
        assert normalizer.num_sequences == sum(1 for c in want_counts if c)

    # Every path of every episode can be read back, depth by depth, from a row of its batch.
    for e, ids in episode_paths(groups):
        found = False
        # An episode without terms may sit in any micro-batch: search them all.
        for batch in [batches[batch_of_episode[e]]] if e in batch_of_episode else batches:
            for r, layout in enumerate(batch.layouts.layouts):
                for path in layout.leaf_paths():
                    index = layout.path_token_index(path[-1])
                    row_ids = batch.input_ids[r, index].tolist()
                    if row_ids[: len(ids)] == ids:
                        assert batch.position_ids[r, index].tolist() == list(range(len(index)))
                        found = True
        assert found, f"episode {e}'s path {ids} is in no row"


@settings(max_examples=30, deadline=None)
@given(groups=groups_strategy())
def test_tree_mode_puts_each_group_once_in_one_row_when_it_fits(groups):
    budget = max(g.num_unique_tokens for g in groups) + 1
    batches = pack_groups(groups, torch.zeros(sum(len(g.episodes) for g in groups)), PackingConfig(budget))
    # Unique tokens of the subtrees the episodes use, each once.
    used = 0
    for g in groups:
        segs = set()
        for episode in g.episodes:
            for leaf in [episode.leaf, *episode.extra_leaves]:
                node = leaf
                while node is not None:
                    segs.add(node)
                    node = g.segments[node].parent
        used += sum(len(g.segments[s].token_ids) for s in segs)
    assert sum(b.num_tokens for b in batches) == used
    assert sum(b.num_path_tokens for b in batches) >= used


# -- hand-made cases ----------------------------------------------------------------------------


def fork_group(prompt_len: int, completions: list[int], start: int = 1) -> Group:
    g = Group(task_key=f"fork{prompt_len}x{len(completions)}", env_id="test")
    root = g.add_segment("prompt", list(range(start, start + prompt_len)))
    for i, n in enumerate(completions):
        tokens = [(start + 7 * i + k) % 50 for k in range(n)]
        leaf = g.add_segment("sampled", tokens, parent=root, logprobs=[-0.5] * n)
        g.add_episode(leaf=leaf, reward=float(i))
    return g


def chain_group(n: int) -> Group:
    g = Group(task_key=f"chain{n}", env_id="test")
    root = g.add_segment("prompt", [1] * (n // 2))
    leaf = g.add_segment("sampled", [2] * (n - n // 2), parent=root, logprobs=[-0.1] * (n - n // 2))
    g.add_episode(leaf=leaf, reward=1.0)
    return g


def test_chains_of_single_children_are_one_layout_segment():
    g = Group(task_key="multi-turn", env_id="test")
    s = g.add_segment("prompt", [1, 2])
    s = g.add_segment("sampled", [3], parent=s, logprobs=[-0.1])
    s = g.add_segment("env", [4, 5], parent=s)
    s = g.add_segment("env", [], parent=s)
    a = g.add_segment("sampled", [6], parent=s, logprobs=[-0.2])
    b = g.add_segment("sampled", [7, 8], parent=s, logprobs=[-0.3, -0.4])
    g.add_episode(leaf=a, reward=1.0)
    g.add_episode(leaf=b, reward=0.0)
    [batch] = pack_groups([g], [1.0, -1.0], PackingConfig(16))
    layout = batch.layouts.layouts[0]
    assert layout.seg_len.tolist() == [5, 1, 2] and layout.seg_parent.tolist() == [-1, 0, 0]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 5, 6]]
    # Token 3 is shared by both episodes: one loss position, two terms. Position 4 (token 5)
    # predicts the first token of both branches.
    assert batch.loss_target.tolist() == [3, 6, 7, 8]
    assert batch.loss_pos.tolist() == [1, 4, 4, 6]
    assert batch.term_loss.tolist() == [0, 1, 0, 2, 3]
    assert batch.term_episode.tolist() == [0, 0, 1, 1, 1]
    assert batch.episode_num_tokens.tolist() == [2, 3]


def test_identical_siblings_are_not_merged():
    g = fork_group(3, [2, 2])
    g.segments[2].token_ids = list(g.segments[1].token_ids)
    [batch] = pack_groups([g], [0.0, 0.0], PackingConfig(16))
    assert batch.num_tokens == 7 and batch.num_terms == 4


def test_group_over_budget_is_split_by_episodes_with_the_prefix_repeated():
    g = fork_group(10, [4, 4, 4, 4])  # 26 unique tokens
    batches = pack_groups([g], torch.zeros(4), PackingConfig(max_tokens_per_row=18, rows_per_batch=4))
    [batch] = batches
    assert [layout.num_tokens for layout in batch.layouts.layouts] == [18, 18]
    assert batch.num_terms == 16
    assert packing_metrics(batches)["tree/packing_ratio"] == pytest.approx(56 / 36)


def test_episode_over_budget_is_refused_with_the_fix():
    g = fork_group(10, [4, 9])
    for mode in ("tree", "flat", "padded"):
        with pytest.raises(PackingError, match=r"episode 1 .*19 tokens.*max_tokens_per_row to at least 19"):
            pack_groups([g], [0.0, 0.0], PackingConfig(max_tokens_per_row=18, mode=mode))


def test_rows_are_balanced_by_attention_work_not_only_length():
    # Four chains and four bushy trees of 30 tokens each: equal lengths, very different work.
    chains = [chain_group(30) for _ in range(4)]
    bushy = [fork_group(2, [2] * 14, start=i) for i in range(4)]
    groups = chains + bushy
    assert {g.num_unique_tokens for g in groups} == {30}
    adv = torch.zeros(sum(len(g.episodes) for g in groups))
    batches = pack_groups(groups, adv, PackingConfig(60, rows_per_batch=8))
    [batch] = batches
    assert batch.batch_size == 4
    assert attention_work([30], [-1]) + attention_work([2] + [2] * 14, [-1] + [0] * 14) == batch.row_work[0]
    assert len(set(batch.row_work)) == 1  # each row: one chain and one bushy tree
    assert packing_metrics(batches)["tree/work_imbalance"] == 1.0


def test_micro_batches_hold_rows_longest_first():
    groups = [fork_group(4, [n]) for n in (3, 9, 5, 7)]
    batches = pack_groups(groups, torch.zeros(4), PackingConfig(max_tokens_per_row=13, rows_per_batch=2))
    lengths = [b.length for b in batches]
    assert lengths == sorted(lengths, reverse=True)
    assert [b.batch_size for b in batches] == [2, 2]


def test_padded_mode_keeps_an_episode_with_several_paths_in_one_micro_batch():
    g = fork_group(3, [2, 2])
    g.episodes[0].extra_leaves = [2]
    batches = pack_groups([g], [1.0, 2.0], PackingConfig(8, mode="padded", rows_per_batch=1))
    rows_of_episode0 = [b.batch_size for b in batches if 0 in b.term_episode.tolist()]
    assert rows_of_episode0 == [2]


def test_config_and_argument_errors_name_the_field_and_fix():
    with pytest.raises(ValueError, match="max_tokens_per_row is 0"):
        PackingConfig(max_tokens_per_row=0)
    with pytest.raises(ValueError, match="mode is 'trie'.*choose one of"):
        PackingConfig(mode="trie")
    with pytest.raises(ValueError, match="rows_per_batch"):
        PackingConfig(rows_per_batch=0)
    with pytest.raises(ValueError, match="pad_token_id"):
        PackingConfig(pad_token_id=-1)
    g = fork_group(3, [2, 2])
    with pytest.raises(ValueError, match="advantages has shape \\(3,\\) but the groups hold 2 episodes"):
        pack_groups([g], [0.0, 1.0, 2.0], PackingConfig())
    g.segments.append(Segment(kind="sampled", token_ids=[1, 2], parent=0, logprobs=None))
    g.add_episode(leaf=3, reward=0.0)
    with pytest.raises(PackingError, match="sampled segment 3 has no sampler log-prob"):
        pack_groups([g], [0.0, 1.0, 2.0], PackingConfig())
    g.episodes[-1].leaf = 9
    g.segments.pop()
    with pytest.raises(PackingError, match="names leaf 9"):
        pack_groups([g], [0.0, 1.0, 2.0], PackingConfig())


def test_to_moves_every_tensor():
    [batch] = pack_groups([fork_group(3, [2, 2])], [1.0, -1.0], PackingConfig(16))
    moved = batch.to("meta")
    assert moved.input_ids.device.type == "meta" and moved.term_adv.device.type == "meta"
    assert moved.layouts is batch.layouts and batch.input_ids.device.type == "cpu"


# -- the forward's refusals ---------------------------------------------------------------------


def tiny_qwen3():
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
    )
    model = Qwen3ForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def test_tree_rows_on_a_model_without_tree_attention_are_refused():
    model = tiny_qwen3()
    [batch] = pack_groups([fork_group(3, [2, 2])], [1.0, -1.0], PackingConfig(16))
    with pytest.raises(PackedForwardError, match="enable_tree_attention.*mode='padded'"):
        packed_hidden_states(model, batch)
    # The same episodes packed one path per row run with the model's own attention.
    [padded] = pack_groups([fork_group(3, [2, 2])], [1.0, -1.0], PackingConfig(16, mode="padded", rows_per_batch=2))
    out = packed_logprobs(model, padded)
    assert out.logp.shape == (4,) and bool(torch.isfinite(out.logp).all())
    assert torch.equal(out.logp, out.logp_vocab)  # no candidate sets recorded


def test_logit_soft_capping_is_refused():
    model = tiny_qwen3()
    model.config.final_logit_softcapping = 30.0
    [batch] = pack_groups([fork_group(3, [2])], [1.0], PackingConfig(16, mode="padded"))
    with pytest.raises(PackedForwardError, match="final_logit_softcapping"):
        packed_logprobs(model, batch)


def test_old_logp_rides_with_the_batch_into_the_loss_inputs():
    from treerl.learners.forward import PackedLogprobs, loss_inputs

    [batch] = pack_groups([fork_group(3, [2, 2])], [1.0, -1.0], PackingConfig(16))
    logp = torch.tensor([-1.0, -2.0, -3.0, -4.0], requires_grad=True)
    out = PackedLogprobs(logp=logp, entropy=torch.zeros(4), logp_vocab=logp)
    assert torch.equal(loss_inputs(batch, out).old_logp, logp.detach())  # on-policy default
    with pytest.raises(ValueError, match="old_logp has shape \\(3,\\) but the batch has 4 terms"):
        batch.with_old_logp(torch.zeros(3))
    stale = batch.with_old_logp(torch.full((4,), -0.5, requires_grad=True))
    assert not stale.term_old_logp.requires_grad and batch.term_old_logp is None
    inputs = loss_inputs(stale, out)
    assert inputs.old_logp.tolist() == [-0.5] * 4
    assert inputs.sampler_logp.tolist() == [-0.5] * 4 and inputs.adv.tolist() == [1.0, 1.0, -1.0, -1.0]
    assert loss_inputs(stale, out, old_logp=torch.zeros(4)).old_logp.tolist() == [0.0] * 4
    assert stale.to("meta").term_old_logp.device.type == "meta"
    assert stale.term_candidates is None and stale.term_target.tolist() == batch.loss_target.tolist()


def test_a_window_that_packed_nothing_reports_no_ratios():
    # A step whose groups were all skipped (zero advantages) trained no row: a packing ratio,
    # fill or balance of 1.0 would be a figure nobody measured, and would drag a run's plots.
    assert packing_metrics([]) == {"tree/rows": 0.0}
    g = fork_group(3, [2, 2])
    assert set(packing_metrics(pack_groups([g], [0.0, 0.0], PackingConfig(16)))) == {
        "tree/packing_ratio", "tree/fill", "tree/rows", "tree/work_imbalance"}
