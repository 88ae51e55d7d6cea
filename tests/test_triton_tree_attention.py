"""The Triton tree-attention kernels against the torch reference, their block lists, and dispatch.

On a machine without CUDA the kernels run in Triton's interpreter (the root ``conftest.py``
sets ``TRITON_INTERPRET=1`` before anything is imported), at small shapes; on a GPU the
same tests run the compiled kernels. Tolerances, per dtype, against
:func:`reference_tree_attention` in float32 on the same input values:

- float32: ``atol = rtol = 2e-4`` (the interpreter lands near 1e-6; the GPU runs full float32
  matmuls under torch's default ``"highest"`` float32 matmul precision);
- bfloat16: max error of each tensor at most ``2**-6`` of its largest reference entry, two
  bfloat16 steps (the kernel rounds softmax weights and score gradients to bfloat16 before
  its matmuls, as FlashAttention does; a wrong mask or gradient is off by O(1)).
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import treerl.kernels.tree_attention as tree_attention
import treerl.kernels.triton_tree_attention as triton_tree_attention_module
from treerl.kernels.tree_attention import (
    TREE_KWARG,
    TreeAttentionBackend,
    TreeAttentionError,
    choose_backend,
    enable_tree_attention,
    reference_tree_attention,
)
from treerl.kernels.block_sparsity import tree_block_mask, tree_block_sparsity
from treerl.kernels.tree_layout import TreeBatch, TreeLayout
from _helpers import depth_first
from treerl.kernels.triton_tree_attention import (
    MAX_HEAD_DIM,
    compile_for_gpu,
    interpreting,
    triton_tree_attention,
    triton_unavailable,
)


def _kernel_device() -> tuple[str | None, str]:
    """Where the kernels can run in this session, or None and why not."""
    if torch.cuda.is_available():
        why_not = triton_unavailable(torch.device("cuda"))
        return (None, why_not) if why_not else ("cuda", "")
    if interpreting():
        return "cpu", ""
    return None, (
        f"{triton_unavailable(torch.device('cpu'))}, and TRITON_INTERPRET=1 was not set before the kernels "
        "were defined (the root conftest.py sets it on machines without CUDA)"
    )


DEVICE, SKIP_REASON = _kernel_device()
needs_kernel = pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or DEVICE != "cuda",
    reason=SKIP_REASON or "no CUDA device: GPU-sized shapes run on GPU machines only",
)

# -- trees ------------------------------------------------------------------------------------------


def random_tree(seed: int, num_segments: int, max_len: int = 6) -> TreeLayout:
    rng = random.Random(seed)
    parents = [-1] + [rng.randrange(s) for s in range(1, num_segments)]
    return depth_first([rng.randint(1, max_len) for _ in range(num_segments)], parents)


def siblings(num_children: int, prompt_len: int, max_len: int, seed: int = 0) -> TreeLayout:
    rng = random.Random(seed)
    return TreeLayout.from_parents(
        [prompt_len] + [rng.randint(1, max_len) for _ in range(num_children)], [-1] + [0] * num_children
    )


CASES = {
    # every segment one token: a binary-ish tree of 40 single tokens
    "single_tokens": lambda: [depth_first([1] * 40, [-1] + [(s - 1) // 2 for s in range(1, 40)])],
    # a 40-token prompt spans three 16-token blocks; answers of 21 and 3 tokens
    "long_segment": lambda: [TreeLayout.from_parents([40, 21, 3, 2], [-1, 0, 0, 2])],
    # hundreds of one-token siblings of one prompt
    "many_siblings": lambda: [siblings(200, prompt_len=8, max_len=1)],
    # rows of very different lengths, so two rows are mostly padding
    "padding_rows": lambda: [random_tree(1, 12), TreeLayout.from_parents([3, 1], [-1, 0]), siblings(5, 4, 3)],
    # a deep chain with one-token side branches
    "deep_fork": lambda: [depth_first([3] + [1 + i % 3 for i in range(24)], [-1] + [max(0, i - 1) for i in range(24)])],
    "random": lambda: [random_tree(seed, 14) for seed in range(2)],
}


def make_batch(case: str, extra: int = 3) -> TreeBatch:
    layouts = CASES[case]()
    return TreeBatch(layouts, length=max(layout.num_tokens for layout in layouts) + extra)  # always padding


def random_qkv(batch, num_heads=4, num_kv_heads=2, head_dim=64, value_dim=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    value_dim = value_dim or head_dim
    b, t = batch.batch_size, batch.length
    q = torch.randn(b, num_heads, t, head_dim, generator=g)
    k = torch.randn(b, num_kv_heads, t, head_dim, generator=g)
    v = torch.randn(b, num_kv_heads, t, value_dim, generator=g)
    return [x.to(DEVICE or "cpu", dtype) for x in (q, k, v)]


def outputs_and_grads(attend, batch, q, k, v, **kw) -> list[torch.Tensor]:
    """[out, dq, dk, dv] in float32 for a fixed random weighting of the output."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = attend(q, k, v, batch, **kw)  # (B, T, H, Dv)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    (out.float() * weight).sum().backward()
    return [out.detach().float()] + [x.grad.float() for x in (q, k, v)]


def assert_parity(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> None:
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=2e-4, rtol=2e-4, msg=lambda m, name=name: f"{name}: {m}")
        else:
            err, scale = (g - w).abs().max().item(), w.abs().max().item()
            assert err <= 2**-6 * scale, f"{name}: max error {err:.4g} > 2**-6 * max|ref| = {2**-6 * scale:.4g}"


def check_against_reference(batch, dtype=torch.float32, **kw) -> None:
    """Shape keywords go to :func:`random_qkv`, block sizes to the kernel, the rest to both backends."""
    shapes = {k: kw.pop(k) for k in ("num_heads", "num_kv_heads", "head_dim", "value_dim") if k in kw}
    blocks = {k: kw.pop(k) for k in ("block_m", "block_n") if k in kw}
    q, k, v = random_qkv(batch, dtype=dtype, **shapes)
    got = outputs_and_grads(triton_tree_attention, batch, q, k, v, **blocks, **kw)
    # The reference computes in float32 on the very values the kernel saw.
    want = outputs_and_grads(reference_tree_attention, batch, q.float(), k.float(), v.float(), **kw)
    assert_parity(got, want, dtype)


# -- parity with the reference ----------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_matches_reference(case):
    # GQA with two query heads per key/value head; one pair of heads keeps the interpreter quick.
    check_against_reference(make_batch(case), torch.float32, num_heads=2, num_kv_heads=1, scaling=0.2)


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
@needs_kernel
@pytest.mark.parametrize("case", ["padding_rows", "long_segment"])
def test_bfloat16_head_dim_128_matches_reference(case):
    check_against_reference(make_batch(case), torch.bfloat16, head_dim=128)


@needs_kernel
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(3, 3), (4, 1)])
def test_gqa_extremes_match_reference(num_heads, num_kv_heads):
    # One key/value head per query head, and one for all of them (MQA): dk/dv sum over the group.
    check_against_reference(make_batch("random"), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_matches_reference(dtype):
    check_against_reference(make_batch("long_segment"), dtype, sliding_window=5, head_dim=64)


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
@needs_kernel
def test_odd_head_sizes_and_transposed_inputs():
    # transformers hands over (B, T, H, D) projections transposed to (B, H, T, D): strided views,
    # here with head sizes that are not powers of two and a value size unlike the key size.
    batch = make_batch("padding_rows")
    g = torch.Generator().manual_seed(1)
    b, t = batch.batch_size, batch.length
    q = torch.randn(b, t, 4, 24, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(b, t, 2, 24, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(b, t, 2, 40, generator=g).to(DEVICE).transpose(1, 2)
    assert not q.is_contiguous()
    got = outputs_and_grads(triton_tree_attention, batch, q, k, v)
    want = outputs_and_grads(reference_tree_attention, batch, q, k, v)
    assert_parity(got, want, torch.float32)
    assert got[0].shape == (b, t, 4, 40)


@needs_kernel
def test_blocks_of_different_sizes_match_reference():
    # block_m != block_n: the overlap rule of the block mask and the transposed lists of the dk/dv pass.
    batch = make_batch("random")
    for block_m, block_n in ((32, 16), (16, 32)):
        check_against_reference(batch, head_dim=16, block_m=block_m, block_n=block_n)


# -- block sparsity ---------------------------------------------------------------------------------


def dense_block_mask(dense: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """(B, T, T) token mask -> (B, NQB, NKB): any True inside each block."""
    b, t, _ = dense.shape
    nqb, nkb = -(-t // block_m), -(-t // block_n)
    padded = torch.zeros(b, nqb * block_m, nkb * block_n, dtype=torch.bool)
    padded[:, :t, :t] = dense
    return padded.view(b, nqb, block_m, nkb, block_n).any(4).any(2)


@pytest.mark.parametrize("seed", range(10))
def test_block_mask_is_exactly_the_blocks_of_the_dense_mask(seed):
    rng = random.Random(seed)
    layouts = [random_tree(seed * 10 + r, rng.randint(1, 30), max_len=rng.choice([1, 4, 20])) for r in range(3)]
    batch = TreeBatch(layouts, length=max(layout.num_tokens for layout in layouts) + rng.randint(0, 20))
    dense = batch.dense_mask()  # (B, T, T), built from ancestor paths
    for block_m, block_n in ((16, 16), (16, 32), (32, 16), (64, 64)):
        want = dense_block_mask(dense, block_m, block_n)
        assert torch.equal(tree_block_mask(batch, block_m, block_n, "cpu"), want), (block_m, block_n)


@pytest.mark.parametrize("seed", range(3))
def test_block_mask_with_window_keeps_every_needed_block(seed):
    # The 64-token chain has blocks deeper than the window from each other, so something is pruned.
    chain = TreeLayout.from_parents([64], [-1])
    batch = TreeBatch([random_tree(seed, 25, max_len=8), siblings(30, 20, 5, seed), chain])
    depth = batch.position_ids()
    windowed = batch.dense_mask() & (depth[:, :, None] - depth[:, None, :] < 6)
    need = dense_block_mask(windowed, 16, 16)
    got = tree_block_mask(batch, 16, 16, "cpu", sliding_window=6)
    assert not (need & ~got).any()  # never drops a needed block
    assert not (got & ~dense_block_mask(batch.dense_mask(), 16, 16)).any()  # never adds one the tree hides
    assert got.sum() < dense_block_mask(batch.dense_mask(), 16, 16).sum()  # and the window does prune


def test_block_lists_match_the_block_mask():
    batch = make_batch("padding_rows")
    mask = tree_block_mask(batch, 16, 16, "cpu")  # (B, NQB, NKB)
    sp = tree_block_sparsity(batch, 16, 16, "cpu")
    for lists, counts, rows in ((sp.kv_blocks, sp.num_kv_blocks, mask), (sp.q_blocks, sp.num_q_blocks, mask.mT)):
        assert torch.equal(counts.long(), rows.sum(-1))
        for b in range(batch.batch_size):
            for r in range(rows.shape[1]):
                listed = lists[b, r, : counts[b, r]].tolist()
                assert listed == rows[b, r].nonzero().squeeze(1).tolist()  # ascending, exactly the True ones


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
@needs_kernel
def test_kernels_load_only_the_listed_blocks():
    # Hundreds of siblings: each answer block needs the prompt block and its own diagonal only.
    batch = TreeBatch([siblings(200, prompt_len=8, max_len=2)], length=320)
    q, k, v = random_qkv(batch, num_heads=2, num_kv_heads=1, head_dim=16)
    visits: list[torch.Tensor] = []
    outputs_and_grads(triton_tree_attention, batch, q, k, v, block_m=16, block_n=16, record_visits=visits)
    forward, dkdv, dq = (x.cpu().bool() for x in visits)  # (B*H, NQB, NKB), (B*H, NKB, NQB), (B*H, NQB, NKB)
    mask = dense_block_mask(batch.dense_mask(), 16, 16)[0]  # (NQB, NKB)
    for h in range(2):
        assert torch.equal(forward[h], mask), f"forward, head {h}"
        assert torch.equal(dq[h], mask), f"dq, head {h}"
        assert torch.equal(dkdv[h], mask.T), f"dk/dv, head {h}"
    num_blocks = mask.numel()
    causal_blocks = num_blocks // 2 + mask.shape[0] // 2  # what a causal kernel would load
    # At most: the prompt block, the block before (an answer straddling the boundary), the diagonal.
    assert mask.sum(-1).max() <= 3
    assert mask.sum() < causal_blocks / 4  # 44 of the 210 blocks a causal kernel loads
    assert tree_block_sparsity(batch, 16, 16, "cpu").density() == mask.sum().item() / num_blocks


# -- dispatch -----------------------------------------------------------------------------------------

TRITON_BACKEND = TreeAttentionBackend("triton", triton_tree_attention, triton_unavailable)


@pytest.fixture
def triton_in_table(monkeypatch):
    """The backend table with the Triton entry first in AUTO_ORDER, as tree_attention.py will have it."""
    monkeypatch.setitem(tree_attention.BACKENDS, "triton", TRITON_BACKEND)
    order = ("triton",) + tuple(name for name in tree_attention.AUTO_ORDER if name != "triton")
    monkeypatch.setattr(tree_attention, "AUTO_ORDER", order)


def test_probe_says_why_not():
    assert "needs CUDA (device is cpu)" in triton_unavailable(torch.device("cpu"))
    if interpreting():
        assert "TRITON_INTERPRET=1" in triton_unavailable(torch.device("cuda"))


def test_auto_on_cpu_does_not_pick_triton_and_says_why(triton_in_table, caplog):
    name, reason = choose_backend("auto", "cpu")
    assert name == "segment"
    assert "not triton: the Triton tree-attention kernel needs CUDA (device is cpu)" in reason
    with caplog.at_level(logging.INFO, logger="treerl.kernels.tree_attention"):
        choice = enable_tree_attention(tiny_llama(), impl="auto")
    assert choice.impl == "segment" and "not triton" in caplog.text
    forced, why = choose_backend("triton", "cpu")
    assert forced == "triton" and why.startswith("requested impl='triton' although")


@pytest.mark.skipif(DEVICE != "cpu", reason=SKIP_REASON or "the kernels are compiled for CUDA, not interpreted")
def test_forced_triton_on_cpu_under_the_interpreter_says_it_runs_slowly(triton_in_table, caplog):
    # The kernels run forward and backward in the interpreter (the tests above): no "backward will fail".
    with caplog.at_level(logging.INFO, logger="treerl.kernels.tree_attention"):
        choice = enable_tree_attention(tiny_llama(), impl="triton")
    assert choice.impl == "triton" and choice.no_backward is None
    assert "CPU interpreter, forward and backward, but very slowly" in caplog.text
    assert "will fail" not in caplog.text


@pytest.mark.skipif(DEVICE != "cuda", reason=SKIP_REASON or "no CUDA device: auto picks triton on CUDA only")
def test_auto_on_cuda_picks_triton(triton_in_table):
    assert choose_backend("auto", "cuda") == ("triton", "auto on cuda: triton")


VOCAB = 97


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attention_dropout=0.0,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model.float().eval()


def packed_loss_and_grads(impl: str, batch: TreeBatch, input_ids: torch.Tensor, autocast: torch.dtype | None = None):
    model = tiny_llama().to(input_ids.device)
    choice = enable_tree_attention(model, impl=impl)
    assert choice.impl == impl
    with torch.autocast(input_ids.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = model(
            input_ids, position_ids=batch.position_ids(input_ids.device), use_cache=False, **{TREE_KWARG: batch}
        ).logits.float()  # (B, T, V)
    real = batch.is_real(input_ids.device)
    loss = torch.nn.functional.cross_entropy(logits[real], input_ids[real].roll(1), reduction="sum")
    loss.backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


@needs_kernel
def test_forced_triton_runs_a_model_like_segment(triton_in_table):
    # impl="triton" through transformers' attention registration, forward and backward,
    # against the torch `segment` backend on the same tree batch.
    batch = make_batch("long_segment")
    input_ids = torch.randint(0, VOCAB, (batch.batch_size, batch.length), generator=torch.Generator().manual_seed(0))
    input_ids = input_ids.to(DEVICE)
    want_logits, want_grads = packed_loss_and_grads("segment", TreeBatch(batch.layouts, batch.length), input_ids)
    got_logits, got_grads = packed_loss_and_grads("triton", batch, input_ids)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-4, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # a whole run (processes or a model forward): CI's slow tier
@needs_kernel
def test_triton_runs_a_model_under_bfloat16_autocast_like_segment(triton_in_table):
    # The learners' default on a GPU: float32 weights, the decoder under bfloat16 autocast. There
    # RoPE hands attention float32 queries and keys but a bfloat16 value; SDPA (segment) computes in
    # the autocast dtype, and the Triton backend must too rather than refuse the mixed dtypes.
    batch = make_batch("long_segment")
    input_ids = torch.randint(0, VOCAB, (batch.batch_size, batch.length), generator=torch.Generator().manual_seed(0))
    input_ids = input_ids.to(DEVICE)
    bf16 = torch.bfloat16
    want_logits, want_grads = packed_loss_and_grads("segment", TreeBatch(batch.layouts, batch.length), input_ids, bf16)
    got_logits, got_grads = packed_loss_and_grads("triton", batch, input_ids, bf16)
    # bfloat16 rounds differently in the two backends: compare as the bfloat16 parity tests do.
    for name, got, want in [("logits", got_logits, want_logits)] + [(n, got_grads[n], g) for n, g in want_grads.items()]:
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert err <= 2**-5 * scale, f"{name}: max error {err:.4g} > 2**-5 * max|segment| = {2**-5 * scale:.4g}"


# -- refusals -----------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(dropout=0.1), "no attention dropout"),
        (dict(dtype=torch.float64), "cast them to the model's dtype"),
        (dict(head_dim=2 * MAX_HEAD_DIM), "head sizes up to 256"),
        (dict(block_m=24), "block_m must be a power of two"),
        (dict(length=5), "TreeBatch describes 1 rows of 4 tokens"),
    ],
)
def test_refusals_name_the_fix(change, match):
    batch = TreeBatch([TreeLayout.from_parents([2, 2], [-1, 0])])
    t = change.pop("length", batch.length)
    d = change.pop("head_dim", 16)
    dtype = change.pop("dtype", torch.float32)
    q, k, v = (torch.zeros(1, 2, t, d, dtype=dtype, device=DEVICE) for _ in range(3))
    with pytest.raises((TreeAttentionError, ValueError), match=match):
        triton_tree_attention(q, k, v, batch, **change)


def test_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton_tree_attention_module, "_INTERPRETED", False)
    batch = TreeBatch([TreeLayout.from_parents([2], [-1])])
    q = torch.zeros(1, 1, 2, 16)
    with pytest.raises(TreeAttentionError, match="needs CUDA tensors, got cpu; use impl='auto'"):
        triton_tree_attention(q, q, q, batch)


# -- the compiled path, without a GPU ----------------------------------------------------------------

PROGRAMS = Path(__file__).parent / "programs"


def compile_in_fresh_process(cases: list[tuple[int, str, int, bool]]) -> list[dict[str, int]]:
    # The interpreter is on in this process, and @triton.jit fixed that at import: compile elsewhere.
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, str(PROGRAMS / "compile_tree_attention.py"), json.dumps(cases)], env=env,
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cubin_reason() -> str | None:
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError as error:
        return f"Triton has no NVIDIA backend to compile with ({error})"
    return None


# Consumer GPUs of compute capability 8.6 / 8.9 let one block use at most 99 KiB of shared memory.
SHARED_LIMIT = 99 * 1024


@pytest.mark.slow  # a whole run (processes or a model forward): CI's slow tier
@pytest.mark.skipif(_cubin_reason() is not None, reason=_cubin_reason() or "")
def test_kernels_compile_for_hopper():
    # The interpreter runs none of the GPU lowering; this compiles all three kernels to sm_90 code.
    (shared,) = compile_in_fresh_process([(90, "bfloat16", 128, True)])
    assert set(shared) == {"_tree_attn_fwd", "_tree_attn_bwd_dkdv", "_tree_attn_bwd_dq"}
    assert max(shared.values()) <= SHARED_LIMIT, shared


@pytest.mark.slow
@pytest.mark.skipif(_cubin_reason() is not None, reason=_cubin_reason() or "")
def test_kernels_compile_for_ampere_at_every_supported_size():
    cases = [(80, dtype, d, False) for dtype in ("bfloat16", "float32") for d in (64, 128, 256)]
    for case, shared in zip(cases, compile_in_fresh_process(cases)):
        assert max(shared.values()) <= SHARED_LIMIT, (case, shared)


def test_compile_for_gpu_refuses_interpreted_kernels():
    if not interpreting():
        pytest.skip("the kernels are compiled in this session, so there is nothing to refuse")
    with pytest.raises(RuntimeError, match="run it in a process without TRITON_INTERPRET"):
        compile_for_gpu(90, torch.bfloat16, 64)


# -- GPU-sized shapes (compiled kernels only) ---------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.bfloat16, 128), (torch.bfloat16, 64), (torch.float32, 64)])
def test_gpu_shapes_match_reference(dtype, head_dim):
    batch = TreeBatch([siblings(150, prompt_len=700, max_len=40), random_tree(3, 60, max_len=50)])
    check_against_reference(batch, dtype, num_heads=8, num_kv_heads=2, head_dim=head_dim)
