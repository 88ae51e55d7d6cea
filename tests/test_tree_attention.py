"""Tree attention: layouts, backends against the reference, whole models against unpacked paths."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from treerl.kernels.tree_attention import (
    BACKENDS,
    TREE_KWARG,
    TreeAttentionError,
    choose_backend,
    enable_tree_attention,
    flex_tree_attention,
    reference_tree_attention,
    segment_tree_attention,
    tree_mask_mod,
)
from treerl.kernels.tree_layout import TreeBatch, TreeLayout

from _helpers import HostReads, depth_first

# -- trees -----------------------------------------------------------------------------------------


def random_tree(rng: random.Random, num_segments: int, max_len: int = 4) -> TreeLayout:
    """A random tree laid out depth first (children listed right after their parent's subtree opens)."""
    children: dict[int, list[int]] = {0: []}
    for s in range(1, num_segments):
        parent = rng.randrange(s)
        children.setdefault(parent, []).append(s)
        children[s] = []
    order: list[int] = []
    stack = [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    new_index = {old: new for new, old in enumerate(order)}
    parents = [-1] * num_segments
    for old_parent, kids in children.items():
        for kid in kids:
            parents[new_index[kid]] = new_index[old_parent]
    return TreeLayout.from_parents([rng.randint(1, max_len) for _ in range(num_segments)], parents)


def deep_fork() -> TreeLayout:
    """A chain of 30 segments, each with a one-token side branch: a deep, narrow tree."""
    lens, parents = [4], [-1]
    spine = 0
    for i in range(30):
        lens.append(1 + i % 3)  # the next spine segment
        parents.append(spine)
        spine = len(lens) - 1
        lens.append(1)  # a one-token leaf hanging off it
        parents.append(spine)
    return depth_first(lens, parents)


def many_siblings(num_children: int = 100, prompt_len: int = 6, seed: int = 0) -> TreeLayout:
    rng = random.Random(seed)
    lens = [prompt_len] + [rng.randint(1, 5) for _ in range(num_children)]
    return TreeLayout.from_parents(lens, [-1] + [0] * num_children)


def single_tokens() -> TreeLayout:
    # Every segment is one token: root, two children, grandchildren under each.
    return TreeLayout.from_parents([1] * 7, [-1, 0, 1, 1, 0, 4, 4])


# -- layouts ---------------------------------------------------------------------------------------


def test_layout_positions_paths_and_mask():
    layout = TreeLayout.from_parents([3, 2, 1, 2], [-1, 0, 1, 0])
    assert layout.seg_start.tolist() == [0, 3, 5, 6]
    assert layout.position_ids().tolist() == [0, 1, 2, 3, 4, 5, 3, 4]
    assert layout.subtree_end == [8, 6, 6, 8]
    assert layout.leaf_paths() == [[0, 1, 2], [0, 3]]
    assert layout.path_token_index(3).tolist() == [0, 1, 2, 6, 7]
    mask = layout.dense_mask()
    assert mask[7].tolist() == [True, True, True, False, False, False, True, True]
    assert mask[5].tolist() == [True] * 6 + [False, False]


@pytest.mark.parametrize("seed", range(20))
def test_subtree_end_shortcut_equals_ancestor_mask(seed):
    # The fast backends use `k <= q and q < subtree_end[k]`; the reference builds the mask from paths.
    layout = random_tree(random.Random(seed), num_segments=random.Random(seed).randint(1, 15))
    t = torch.arange(layout.num_tokens)
    shortcut = (t[None, :] <= t[:, None]) & (t[:, None] < layout.subtree_end_of_token()[None, :])
    assert torch.equal(shortcut, layout.dense_mask())


@pytest.mark.parametrize(
    ("lens", "parents", "match"),
    [
        ([2, 0], [-1, 0], "seg_len must be >= 1"),
        ([2, 1], [-1, 1], "seg_parent\\[1\\] is 1"),
        ([2, 1, 1, 1], [-1, 0, -1, 0], "depth-first order"),
        ([2, 1, 1, 1], [-1, 0, 0, 1], "depth-first order"),
        ([], [], "at least one segment"),
    ],
)
def test_layout_rejects_bad_trees(lens, parents, match):
    with pytest.raises(ValueError, match=match):
        TreeLayout.from_parents(lens, parents)


def test_layout_rejects_gapped_starts():
    with pytest.raises(ValueError, match="seg_start\\[1\\] is 3"):
        TreeLayout(torch.tensor([0, 3]), torch.tensor([2, 1]), torch.tensor([-1, 0]))


def test_batch_pads_rows_and_rejects_short_length():
    batch = TreeBatch([TreeLayout.from_parents([2, 1], [-1, 0]), TreeLayout.from_parents([1], [-1])], length=4)
    assert batch.position_ids().tolist() == [[0, 1, 2, 0], [0, 0, 0, 0]]
    assert batch.is_real().tolist() == [[True, True, True, False], [True, False, False, False]]
    # Padding attends to itself only, and nothing real attends to padding.
    assert batch.dense_mask()[1].tolist() == torch.eye(4, dtype=torch.bool).tolist()
    with pytest.raises(ValueError, match="length=2 is shorter than the longest row"):
        TreeBatch([TreeLayout.from_parents([2, 1], [-1, 0])], length=2)


def test_many_siblings_take_few_calls():
    plan = TreeBatch([many_siblings(100)]).segment_plan("cpu")
    assert sum(bucket.num for bucket in plan.buckets) == 101
    assert len(plan.buckets) <= 6


def test_segment_plan_reads_no_tensor_token_by_token():
    # The plan is built from Python lists; iterating a tensor instead made a 0-d tensor and a
    # read per query token (every token of a row of equal-length episodes, its common case).
    layouts = [TreeLayout.from_parents([64, 64, 64], [-1, -1, -1]), TreeLayout.from_parents([8, 4, 4], [-1, 0, 0])]
    for layout in layouts:  # the layouts' own per-segment lists, read once when packed
        layout.num_tokens, layout.seg_depth, layout.subtree_end
    with HostReads() as reads:
        plan = TreeBatch(layouts).segment_plan("cpu")
    assert reads.count == 0
    assert any(bucket.q_start is not None for bucket in plan.buckets)


# -- the attention function alone ----------------------------------------------------------------

CASES = {
    "deep_fork": lambda: [deep_fork()],
    "siblings": lambda: [many_siblings(100)],
    "single_tokens": lambda: [single_tokens()],
    "padded_rows": lambda: [random_tree(random.Random(1), 6), single_tokens(), many_siblings(5, seed=2)],
    "random": lambda: [random_tree(random.Random(s), 10) for s in range(3)],
    # Nothing branches: packed episodes that share nothing, and rows that are one chain each.
    "packed_roots": lambda: [TreeLayout.from_parents([5, 9, 3], [-1, -1, -1]),
                             TreeLayout.from_parents([9, 2, 4, 4], [-1, 0, -1, -1])],
    "chains": lambda: [TreeLayout.from_parents([11], [-1]), TreeLayout.from_parents([4], [-1])],
    "full_chains": lambda: [TreeLayout.from_parents([7], [-1]), TreeLayout.from_parents([7], [-1])],
    # Consecutive segments of equal length: views of the row instead of gathers.
    "equal_roots": lambda: [TreeLayout.from_parents([6, 6, 6], [-1, -1, -1])],
    "equal_siblings": lambda: [TreeLayout.from_parents([5, 4, 4, 4], [-1, 0, 0, 0])],
}


def random_qkv(batch: TreeBatch, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape_q = (batch.batch_size, num_heads, batch.length, head_dim)
    shape_kv = (batch.batch_size, num_kv_heads, batch.length, head_dim)
    return [torch.randn(shape, generator=g, requires_grad=True) for shape in (shape_q, shape_kv, shape_kv)]


def grads_of(attend, batch, q, k, v, **kw):
    out = attend(q, k, v, batch, **kw)  # (B, T, H, D)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * weight).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_reference_equals_each_path_attended_alone(case, num_kv_heads):
    # The reference's mask is checked against the definition: attention along each root-to-leaf path.
    batch = TreeBatch(CASES[case](), length=None)
    q, k, v = random_qkv(batch, num_kv_heads=num_kv_heads)
    out = reference_tree_attention(q, k, v, batch, scaling=0.3)  # (B, T, H, D)
    rep = q.shape[1] // num_kv_heads
    for b, layout in enumerate(batch.layouts):
        for path in layout.leaf_paths():
            idx = layout.path_token_index(path[-1])
            expected = F.scaled_dot_product_attention(
                q[b][:, idx], k[b][:, idx].repeat_interleave(rep, 0), v[b][:, idx].repeat_interleave(rep, 0),
                is_causal=True, scale=0.3,
            )  # (H, P, D)
            torch.testing.assert_close(out[b, idx], expected.transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_segment_matches_reference_outputs_and_grads(case, num_kv_heads, sliding_window):
    layouts = CASES[case]()
    batch = TreeBatch(layouts, length=max(layout.num_tokens for layout in layouts) + 3)  # always some padding
    q, k, v = random_qkv(batch, num_kv_heads=num_kv_heads)
    kw = dict(scaling=0.35, sliding_window=sliding_window)
    want, want_grads = grads_of(reference_tree_attention, batch, q, k, v, **kw)
    got, got_grads = grads_of(segment_tree_attention, batch, q, k, v, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize(("case", "want_causal", "want_masked"), [
    ("full_chains", 1, 0),  # one causal call over the rows as they are, no gather
    ("chains", 3, 0),  # rows of 11 and 4 tokens: each chain and the padding tokens are root buckets
    ("packed_roots", 5, 1),  # root buckets of lengths 5, 9, 3, 4 and the padding; the one child masked
    ("siblings", 1, 5),  # the prompt alone is a root; its 100 children in 5 masked buckets
])
def test_segment_uses_the_causal_kernel_where_nothing_branches(monkeypatch, case, want_causal, want_masked):
    import treerl.kernels.tree_attention as module

    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(module.F, "scaled_dot_product_attention", spy)
    layouts = CASES[case]()
    batch = TreeBatch(layouts)
    q, k, v = random_qkv(batch)
    out = segment_tree_attention(q, k, v, batch)
    monkeypatch.undo()
    torch.testing.assert_close(out, reference_tree_attention(q, k, v, batch), atol=1e-5, rtol=1e-5)
    assert sum(causal and not masked for causal, masked in calls) == want_causal, calls
    assert sum(masked for _, masked in calls) == want_masked, calls


@pytest.mark.parametrize(("case", "want_gathers"), [
    ("equal_roots", 0),  # three packed episodes of 6 tokens: one causal call on a view of the row
    ("equal_siblings", 2),  # the prompt and its 3 children are views; only the children's path keys and values
    ("siblings", 21),  # uneven children: 5 masked buckets gather queries, keys, values and valid outputs; the order
])
def test_segment_gathers_only_what_is_not_consecutive(case, want_gathers):
    class CountGathers(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.count += func.__name__ == "index_select"
            return func(*args, **(kwargs or {}))

    batch = TreeBatch(CASES[case]())
    q, k, v = random_qkv(batch)
    with CountGathers() as counter:
        out = segment_tree_attention(q, k, v, batch)
    assert counter.count == want_gathers
    want, want_grads = grads_of(reference_tree_attention, batch, q, k, v)
    got, got_grads = grads_of(segment_tree_attention, batch, q, k, v)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_segment_builds_each_mask_once_per_batch(monkeypatch):
    import treerl.kernels.tree_attention as module

    masks = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        if kwargs.get("attn_mask") is not None:
            masks.append(kwargs["attn_mask"])
        return real(*args, **kwargs)

    monkeypatch.setattr(module.F, "scaled_dot_product_attention", spy)
    batch = TreeBatch(CASES["equal_siblings"]())
    q, k, v = random_qkv(batch)
    for _ in range(3):  # three layers of one forward
        segment_tree_attention(q, k, v, batch)
    assert len(masks) == 3 and masks[1] is masks[0] and masks[2] is masks[0]
    assert masks[0].dtype == q.dtype  # additive already: SDPA converts nothing per call


def test_segment_handles_different_value_dim():
    batch = TreeBatch([random_tree(random.Random(3), 8)])
    q, k, _ = random_qkv(batch)
    v = torch.randn(k.shape[:-1] + (5,), requires_grad=True)
    want, want_grads = grads_of(reference_tree_attention, batch, q, k, v)
    got, got_grads = grads_of(segment_tree_attention, batch, q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 4])
def test_flex_mask_mod_equals_dense_mask(sliding_window):
    from torch.nn.attention.flex_attention import create_mask

    layouts = [deep_fork(), many_siblings(20), single_tokens()]
    batch = TreeBatch(layouts, length=max(layout.num_tokens for layout in layouts) + 2)
    depth = batch.position_ids()
    mask_mod = tree_mask_mod(batch.subtree_end_of_token("cpu"), depth, sliding_window)
    got = create_mask(mask_mod, batch.batch_size, None, batch.length, batch.length, device="cpu")[:, 0]
    want = batch.dense_mask()
    if sliding_window is not None:
        want &= depth[:, :, None] - depth[:, None, :] < sliding_window
    assert torch.equal(got, want)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", ["padded_rows", "siblings"])
def test_flex_forward_matches_reference_on_cpu(case):
    # Eager FlexAttention runs forward-only on CPU; its backward is exercised on CUDA only.
    batch = TreeBatch(CASES[case]())
    q, k, v = (x.detach() for x in random_qkv(batch, num_kv_heads=2))
    with torch.no_grad():
        want = reference_tree_attention(q, k, v, batch, scaling=0.3)
        got = flex_tree_attention(q, k, v, batch, scaling=0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU paths run on GPU machines only")
@pytest.mark.parametrize("impl", ["triton", "flex", "segment"])
def test_cuda_backend_matches_reference_outputs_and_grads(impl):
    reason = BACKENDS[impl].unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    batch = TreeBatch(CASES["padded_rows"]() + [deep_fork(), many_siblings(100)])
    q, k, v = (x.detach().cuda().requires_grad_() for x in random_qkv(batch, head_dim=16))
    want, want_grads = grads_of(reference_tree_attention, batch, q, k, v, scaling=0.25, sliding_window=None)
    got, got_grads = grads_of(BACKENDS[impl].attend, batch, q, k, v, scaling=0.25, sliding_window=None)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=2e-4)


def test_flex_refuses_dropout():
    batch = TreeBatch([single_tokens()])
    q, k, v = random_qkv(batch)
    with pytest.raises(TreeAttentionError, match="dropout"):
        flex_tree_attention(q, k, v, batch, dropout=0.1)


# -- dispatch ----------------------------------------------------------------------------------------


def test_auto_picks_segment_on_cpu_and_says_why():
    name, reason = choose_backend("auto", "cpu")
    assert name == "segment"
    assert "not flex" in reason and "CUDA" in reason
    assert choose_backend("reference", "cpu") == ("reference", "requested impl='reference'")
    assert "no backward" in choose_backend("flex", "cpu")[1]
    with pytest.raises(ValueError, match="impl='nope' is not a tree-attention backend"):
        choose_backend("nope", "cpu")


def test_flex_is_available_on_cuda_only():
    assert BACKENDS["flex"].unavailable(torch.device("cpu")) is not None
    assert BACKENDS["segment"].unavailable(torch.device("cpu")) is None


# -- whole models -------------------------------------------------------------------------------------

VOCAB = 97


def tiny_model(kind: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=3))
    else:
        raise AssertionError(kind)
    model.set_attn_implementation("sdpa")
    return model.float().eval()


def packed_inputs(seed: int = 0):
    layouts = [
        TreeLayout.from_parents([5, 3, 2, 4, 1], [-1, 0, 1, 0, 3]),  # a fork inside a branch
        many_siblings(6, prompt_len=4, seed=seed),
        single_tokens(),
    ]
    batch = TreeBatch(layouts, length=max(layout.num_tokens for layout in layouts) + 2)
    input_ids = torch.randint(0, VOCAB, (batch.batch_size, batch.length), generator=torch.Generator().manual_seed(seed))
    return batch, input_ids


def path_losses(logits_of_path, batch, input_ids):
    """Sum over every root-to-leaf path of its next-token loss, each path weighted differently.

    ``logits_of_path(b, idx)`` gives the (P, V) logits of the path whose row offsets are ``idx``;
    tokens shared by several paths are counted once per path, as the unpacked batch does.
    """
    total = torch.zeros((), device=input_ids.device)
    n = 0
    for b, layout in enumerate(batch.layouts):
        for path in layout.leaf_paths():
            idx = layout.path_token_index(path[-1])
            if idx.numel() < 2:
                continue
            logits = logits_of_path(b, idx)  # (P, V)
            n += 1
            total = total + (1.0 + 0.1 * n) * F.cross_entropy(logits[:-1], input_ids[b, idx[1:]], reduction="sum")
    return total


def unpacked(model, batch, input_ids):
    """Logits of every path run alone (default attention), and the gradients of the path losses."""
    model.zero_grad()
    path_logits = {}

    def logits_of_path(b, idx):
        out = model(input_ids[b, idx][None], use_cache=False).logits[0]
        path_logits[(b, tuple(idx.tolist()))] = out.detach()
        return out

    path_losses(logits_of_path, batch, input_ids).backward()
    return path_logits, {name: p.grad.clone() for name, p in model.named_parameters()}


def packed(model, batch, input_ids):
    model.zero_grad()
    logits = model(
        input_ids, position_ids=batch.position_ids(input_ids.device), use_cache=False, **{TREE_KWARG: batch}
    ).logits  # (B, T, V)
    path_losses(lambda b, idx: logits[b, idx], batch, input_ids).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("kind", "impl"),
    [("qwen3", "segment"), ("llama", "segment"), ("mistral", "segment"), ("qwen3", "reference")],
)
def test_packed_model_equals_unpacked_paths(kind, impl):
    # Mistral runs every layer with sliding_window=3, so the window is checked end to end too.
    model = tiny_model(kind)
    batch, input_ids = packed_inputs()
    want_logits, want_grads = unpacked(model, batch, input_ids)

    choice = enable_tree_attention(model, impl=impl)
    assert model.config._attn_implementation == choice.attn_implementation
    assert choice.previous == "sdpa"
    got_logits, got_grads = packed(model, batch, input_ids)

    for (b, idx), logits in want_logits.items():
        torch.testing.assert_close(got_logits[b, list(idx)], logits, atol=1e-5, rtol=1e-5)
    assert set(got_grads) == set(want_grads)
    for name in want_grads:
        torch.testing.assert_close(
            got_grads[name], want_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )

    # The unpacked model is back with the previous implementation.
    model.set_attn_implementation(choice.previous)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU paths run on GPU machines only")
def test_packed_model_equals_unpacked_paths_on_cuda_auto():
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity, as on CPU
    model = tiny_model("qwen3").cuda()
    batch, input_ids = packed_inputs()
    input_ids = input_ids.cuda()
    want_logits, want_grads = unpacked(model, batch, input_ids)
    choice = enable_tree_attention(model)
    got_logits, got_grads = packed(model, batch, input_ids)
    for (b, idx), logits in want_logits.items():
        torch.testing.assert_close(got_logits[b, list(idx)], logits, atol=1e-4, rtol=1e-4)
    for name in want_grads:
        torch.testing.assert_close(
            got_grads[name], want_grads[name], atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n} ({choice.impl}): {m}"
        )


def test_transformers_builds_no_mask_of_its_own():
    # Tree depths restart at each branch; transformers' packed-sequence detection would read them
    # as separate sequences. With our names absent from AttentionMaskInterface it must not look.
    from transformers.masking_utils import create_causal_mask

    model = tiny_model("qwen3")
    batch, input_ids = packed_inputs()
    enable_tree_attention(model, impl="segment")
    embeds = model.get_input_embeddings()(input_ids)
    mask = create_causal_mask(
        config=model.config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=batch.position_ids()
    )
    assert mask is None


def test_gradient_checkpointing_keeps_the_tree():
    model = tiny_model("llama")
    batch, input_ids = packed_inputs()
    enable_tree_attention(model, impl="segment")
    _, want = packed(model, batch, input_ids)
    # transformers 5 renamed it; the old name still works but warns.
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    _, got = packed(model, batch, input_ids)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5)


def test_packed_model_catches_a_wrong_tree():
    # A real check: a tree that lies about parents must change the logits.
    model = tiny_model("qwen3")
    batch, input_ids = packed_inputs()
    enable_tree_attention(model, impl="segment")
    with torch.no_grad():
        right = model(input_ids, position_ids=batch.position_ids(), use_cache=False, tree_layout=batch).logits
        flat = TreeBatch([TreeLayout.from_parents([layout.num_tokens], [-1]) for layout in batch.layouts], batch.length)
        wrong = model(input_ids, position_ids=batch.position_ids(), use_cache=False, tree_layout=flat).logits
    assert (right - wrong).abs().max() > 1e-3
    # A plain list of layouts works too (each layer then rebuilds its index tensors).
    with torch.no_grad():
        from_list = model(
            input_ids, position_ids=batch.position_ids(), use_cache=False, tree_layout=list(batch.layouts)
        ).logits
    torch.testing.assert_close(from_list, right, atol=1e-6, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_model_forward_on_cpu():
    model = tiny_model("llama")
    batch, input_ids = packed_inputs()
    enable_tree_attention(model, impl="reference")
    with torch.no_grad():
        want = model(input_ids, position_ids=batch.position_ids(), use_cache=False, tree_layout=batch).logits
    enable_tree_attention(model, impl="flex")
    with torch.no_grad():
        fresh = TreeBatch(batch.layouts, batch.length)  # nothing cached by the other backend
        got = model(input_ids, position_ids=batch.position_ids(), use_cache=False, tree_layout=fresh).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_enable_auto_logs_the_choice(caplog):
    model = tiny_model("qwen3")
    with caplog.at_level(logging.INFO, logger="treerl.kernels.tree_attention"):
        choice = enable_tree_attention(model)
    assert choice.impl == "segment"
    assert choice.attn_implementation == "treerl_tree_segment"
    assert choice.reason in caplog.text


def test_calls_without_tree_or_with_a_mask_are_refused():
    model = tiny_model("qwen3")
    batch, input_ids = packed_inputs()
    enable_tree_attention(model, impl="segment")
    with pytest.raises(TreeAttentionError, match="no `tree_layout`"):
        model(input_ids, use_cache=False)
    mask = torch.ones(batch.batch_size, 1, batch.length, batch.length, dtype=torch.bool)
    with pytest.raises(TreeAttentionError, match="got an attention_mask"):
        model(input_ids, attention_mask=mask, position_ids=batch.position_ids(), use_cache=False, tree_layout=batch)
    short = TreeBatch(batch.layouts)
    with pytest.raises(TreeAttentionError, match="TreeBatch describes 3 rows"):
        model(input_ids, position_ids=batch.position_ids(), use_cache=False, tree_layout=short)


def test_refuses_linear_attention_hybrids():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
    )
    model = Qwen3NextForCausalLM(config)
    with pytest.raises(TreeAttentionError, match="linear_attention"):
        enable_tree_attention(model)


def test_refuses_soft_capping():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )
    with pytest.raises(TreeAttentionError, match="soft-capping"):
        enable_tree_attention(Gemma2ForCausalLM(config))


def test_refuses_attention_sinks_at_once():
    # gpt-oss passes its sinks to the attention function as `s_aux`: refused when enabled, not
    # at the first packed forward (after a learner's start-of-run evaluation).
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
    )
    with pytest.raises(TreeAttentionError, match="attention sinks.*--pack-mode padded"):
        enable_tree_attention(GptOssForCausalLM(config))


def test_refuses_non_transformers_modules():
    with pytest.raises(TreeAttentionError, match="not a transformers PreTrainedModel"):
        enable_tree_attention(torch.nn.Linear(2, 2))
