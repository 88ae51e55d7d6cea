"""Parity of the Triton log-prob kernel with the full-logits reference, forward and backward.

On a machine without CUDA these run under Triton's interpreter (the root conftest.py sets
TRITON_INTERPRET=1 before anything is imported), at shapes small enough for it; on a GPU
they run the compiled kernels. Tolerances:

* float32: 1e-5 absolute on values and gradients (relative 1e-4 on gradients). Both sides
  accumulate in float32; they differ in summation order only (tiles, spans, atomics).
* bfloat16: values within 3e-2 and gradients within 5% of the largest entry of a float32
  reference on the same (rounded) inputs: the tile matmuls run in bfloat16, the logits
  gradient is rounded to bfloat16 before its matmuls (as the torch path does), reductions
  are float32.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from _helpers import LargestAllocation

import treerl.kernels.triton_logprobs as module
from treerl.kernels.logprobs import IMPLS, reference_token_logprobs, select_impl, token_logprobs
from treerl.kernels.triton_logprobs import (
    TritonUnavailableError,
    triton_logprobs_unavailable,
    triton_token_logprobs,
)

OUTPUTS = ("logp", "entropy", "logp_candidates")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
UNAVAILABLE = triton_logprobs_unavailable(DEVICE)
needs_kernel = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"Triton log-prob kernel: {UNAVAILABLE}")


def make_inputs(num_tokens=9, vocab=37, hidden_size=6, num_cand=5, dtype=torch.float32, seed=0, bias=True):
    """Random head inputs on DEVICE; candidate rows hold the target, distinct ids, and some -1 padding."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    rows = []
    for i in range(num_tokens):
        others = torch.randperm(vocab, generator=gen)
        others = others[others != targets[i]][: num_cand - 1]
        row = torch.cat([targets[i : i + 1], others, torch.full((num_cand - 1 - len(others),), -1)])
        num_pad = int(torch.randint(0, num_cand, (), generator=gen))  # 0..K-1 pads, target always kept
        row[num_cand - num_pad :] = -1
        rows.append(row[torch.randperm(num_cand, generator=gen)])  # target not always first
    candidates = torch.stack(rows)  # (N, K)
    return tuple(None if t is None else t.to(DEVICE) for t in (hidden, weight, b, targets, candidates))


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]


def grads(fn, hidden, weight, bias, coefs, **kwargs):
    """Gradients wrt (hidden, weight, bias) of sum_k coef_k * output_k . (a weight per token)."""
    h, w, b = leaves(hidden, weight, bias)
    out = fn(h, w, kwargs.pop("targets"), bias=b, **kwargs)
    token_weights = torch.linspace(-1.0, 2.0, h.shape[0], dtype=out.logp.dtype, device=h.device)
    loss = sum(c * (getattr(out, name) * token_weights).sum() for c, name in zip(coefs, OUTPUTS) if c)
    loss.backward()
    return [t.grad if t is not None else None for t in (h, w, b)]


def assert_outputs_close(out, ref, **tol):
    for name in OUTPUTS:
        got, want = getattr(out, name), getattr(ref, name)
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == torch.float32, name
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want.to(got.dtype), **tol, msg=name)


# --------------------------------------------------------------------------- values


@needs_kernel
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("with_bias", [True, False])
def test_values_match_reference_float32(temperature, with_bias):
    # 37 columns in spans of 8 (tiles of 16 under the interpreter): ragged tiles and spans
    # that end inside a tile; hidden size 20 spans two tiles of the reduction.
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=11, vocab=37, hidden_size=20, bias=with_bias)
    kwargs = dict(bias=bias, temperature=temperature, candidates=candidates)
    out = triton_token_logprobs(hidden, weight, targets, chunk_vocab=8, **kwargs)
    ref = reference_token_logprobs(hidden, weight, targets, **kwargs)
    assert_outputs_close(out, ref, atol=1e-5, rtol=1e-5)
    assert bool((out.logp_candidates >= out.logp - 1e-6).all())  # the kept mass is at most 1


@needs_kernel
def test_values_without_candidates_and_one_span():
    hidden, weight, bias, targets, _ = make_inputs(num_tokens=20, vocab=50)  # two token blocks of 16
    out = triton_token_logprobs(hidden, weight, targets, bias=bias, temperature=0.8)
    ref = reference_token_logprobs(hidden, weight, targets, bias=bias, temperature=0.8)
    assert out.logp_candidates is None
    assert_outputs_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_values_against_float64_with_large_logits():
    # Logits in the hundreds: the online log-sum-exp, the shifted entropy accumulator and
    # the merge of spans must not overflow or cancel.
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=6, vocab=50, hidden_size=4)
    hidden = hidden * 60
    out = triton_token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates, chunk_vocab=7)
    ref = reference_token_logprobs(
        hidden.double(), weight.double(), targets, bias=bias.double(), candidates=candidates
    )
    for name in OUTPUTS:
        value = getattr(out, name)
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value.double(), getattr(ref, name), atol=2e-4, rtol=1e-5, msg=name)


@needs_kernel
def test_entropy_of_uniform_distribution_is_log_vocab():
    zeros_h, zeros_w = torch.zeros(2, 3, device=DEVICE), torch.zeros(10, 3, device=DEVICE)
    out = triton_token_logprobs(zeros_h, zeros_w, torch.tensor([0, 9], device=DEVICE), chunk_vocab=3)
    torch.testing.assert_close(out.entropy, torch.full((2,), math.log(10), device=DEVICE))
    torch.testing.assert_close(out.logp, torch.full((2,), -math.log(10), device=DEVICE))


@needs_kernel
@settings(max_examples=12, deadline=None)
@given(
    num_tokens=st.integers(1, 20),
    vocab=st.integers(1, 40),
    hidden_size=st.integers(1, 20),
    chunk_vocab=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_any_shape_and_span_matches_reference(num_tokens, vocab, hidden_size, chunk_vocab, seed):
    hidden, weight, bias, targets, candidates = make_inputs(
        num_tokens, vocab, hidden_size=hidden_size, num_cand=min(vocab, 4), seed=seed
    )
    kwargs = dict(bias=bias, candidates=candidates, temperature=0.9)
    out = triton_token_logprobs(hidden, weight, targets, chunk_vocab=chunk_vocab, **kwargs)
    assert_outputs_close(out, reference_token_logprobs(hidden, weight, targets, **kwargs), atol=1e-5, rtol=1e-5)
    kwargs = dict(targets=targets, candidates=candidates, temperature=0.9)
    got = grads(triton_token_logprobs, hidden, weight, bias, (1.0, 0.5, 1.0), chunk_vocab=chunk_vocab, **kwargs)
    want = grads(reference_token_logprobs, hidden, weight, bias, (1.0, 0.5, 1.0), **kwargs)
    for name, g, r in zip(("hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4, msg=name)


# --------------------------------------------------------------------------- gradients


@needs_kernel
@pytest.mark.parametrize(
    "coefs",
    [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.7, -0.3, 1.5)],
    ids=["logp", "entropy", "logp_candidates", "weighted_sum"],
)
def test_gradients_match_reference_float32(coefs):
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=20, vocab=41, hidden_size=20)
    kwargs = dict(targets=targets, candidates=candidates, temperature=0.8)
    got = grads(triton_token_logprobs, hidden, weight, bias, coefs, chunk_vocab=12, **kwargs)
    want = grads(reference_token_logprobs, hidden, weight, bias, coefs, **kwargs)
    for name, g, r in zip(("hidden", "weight", "bias"), got, want):
        assert g.dtype == r.dtype, name
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4, msg=name)
        assert g.abs().max() > 1e-3, f"grad wrt {name} is trivially zero; the test would not catch a bug"


@needs_kernel
def test_gradient_from_one_output_and_frozen_head():
    # Unused outputs reach backward as None; a frozen head (LoRA) asks for grad wrt hidden only.
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=7, vocab=30)
    h = hidden.clone().requires_grad_(True)
    out = triton_token_logprobs(h, weight, targets, bias=bias, candidates=candidates, chunk_vocab=8)
    out.entropy.sum().backward()
    h_ref = hidden.clone().requires_grad_(True)
    reference_token_logprobs(h_ref, weight, targets, bias=bias, candidates=candidates).entropy.sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=1e-4)
    # ... and a frozen input with a trainable head (weight only, no bias grad asked for).
    w = weight.clone().requires_grad_(True)
    triton_token_logprobs(hidden, w, targets, bias=bias, chunk_vocab=8).logp.sum().backward()
    w_ref = weight.clone().requires_grad_(True)
    reference_token_logprobs(hidden, w_ref, targets, bias=bias).logp.sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-5, rtol=1e-4)


@needs_kernel
def test_bfloat16_weight_gradient_in_groups_equals_one_group(monkeypatch):
    # A half-precision head's float32 weight gradient is built a group of rows at a time;
    # a tiny group budget forces several launches, which must add up to the same result.
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=8, vocab=40, hidden_size=8)
    hidden, weight, bias = (t.to(torch.bfloat16) for t in (hidden, weight, bias))
    kwargs = dict(targets=targets, candidates=candidates, chunk_vocab=6)
    whole = grads(triton_token_logprobs, hidden, weight, bias, (1.0, 0.3, 0.5), **kwargs)
    monkeypatch.setattr(module, "_WEIGHT_GRAD_GROUP_BYTES", 4 * 8 * 12)  # 12 rows: 2 spans per group
    grouped = grads(triton_token_logprobs, hidden, weight, bias, (1.0, 0.3, 0.5), **kwargs)
    for name, a, b in zip(("hidden", "weight", "bias"), whole, grouped):
        # Float32 atomics may add in another order; bfloat16 rounding can then flip one ulp.
        torch.testing.assert_close(a, b, atol=1e-2 * float(a.abs().max()), rtol=0, msg=name)
        assert a.abs().max() > 1e-3, name


# --------------------------------------------------------------------------- edge cases


@needs_kernel
def test_single_token():
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=1, vocab=9)
    coefs = (1.0, 0.5, -2.0)
    kwargs = dict(targets=targets, candidates=candidates, temperature=1.3)
    got = grads(triton_token_logprobs, hidden, weight, bias, coefs, chunk_vocab=4, **kwargs)
    want = grads(reference_token_logprobs, hidden, weight, bias, coefs, **kwargs)
    for name, g, r in zip(("hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4, msg=name)
    out = triton_token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates, chunk_vocab=4)
    assert_outputs_close(out, reference_token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates),
                         atol=1e-5, rtol=1e-5)


@needs_kernel
def test_candidate_set_of_one_token_gives_zero_logprob_and_zero_gradient():
    hidden, weight, bias, targets, _ = make_inputs(num_tokens=4, vocab=20)
    candidates = torch.stack([targets, torch.full_like(targets, -1)], dim=1)  # target plus padding
    h, w, b = leaves(hidden, weight, bias)
    out = triton_token_logprobs(h, w, targets, bias=b, candidates=candidates, chunk_vocab=6)
    torch.testing.assert_close(out.logp_candidates, torch.zeros(4, device=DEVICE), atol=1e-6, rtol=0)
    out.logp_candidates.sum().backward()
    for t in (h, w, b):
        assert t.grad.abs().max() < 1e-5  # greedy-like sampling: nothing to learn from this term


@needs_kernel
def test_padding_does_not_change_the_result():
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=6, vocab=30)
    padded = torch.cat([candidates, torch.full((6, 3), -1, device=DEVICE)], dim=1)
    a = triton_token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates, chunk_vocab=7)
    b = triton_token_logprobs(hidden, weight, targets, bias=bias, candidates=padded, chunk_vocab=7)
    torch.testing.assert_close(a.logp_candidates, b.logp_candidates, atol=1e-6, rtol=0)
    ref = reference_token_logprobs(hidden, weight, targets, bias=bias, candidates=padded)
    torch.testing.assert_close(b.logp_candidates, ref.logp_candidates, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_full_vocabulary_candidate_set_equals_logp():
    hidden, weight, bias, targets, _ = make_inputs(num_tokens=5, vocab=12)
    candidates = torch.arange(12, device=DEVICE).expand(5, 12).contiguous()
    out = triton_token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates, chunk_vocab=5)
    torch.testing.assert_close(out.logp_candidates, out.logp, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_bfloat16_inputs():
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=8, vocab=40, hidden_size=20)
    hidden, weight, bias = (t.to(torch.bfloat16) for t in (hidden, weight, bias))
    kwargs = dict(candidates=candidates, temperature=0.9)
    out = triton_token_logprobs(hidden, weight, targets, bias=bias, chunk_vocab=16, **kwargs)
    full = reference_token_logprobs(hidden.float(), weight.float(), targets, bias=bias.float(), **kwargs)
    assert_outputs_close(out, full, atol=3e-2, rtol=0)
    coefs = (1.0, 0.3, 0.5)
    got = grads(triton_token_logprobs, hidden, weight, bias, coefs, targets=targets, chunk_vocab=16, **kwargs)
    want = grads(reference_token_logprobs, hidden.float(), weight.float(), bias.float(), coefs, targets=targets,
                 **kwargs)
    for name, g, r in zip(("hidden", "weight", "bias"), got, want):
        assert g.dtype == torch.bfloat16, name
        torch.testing.assert_close(g.float(), r, atol=5e-2 * float(r.abs().max()), rtol=0, msg=name)


@needs_kernel
def test_float16_values():
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=5, vocab=30, hidden_size=8)
    hidden, weight, bias = (t.to(torch.float16) for t in (hidden, weight, bias))
    out = triton_token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates, chunk_vocab=16)
    full = reference_token_logprobs(
        hidden.float(), weight.float(), targets, bias=bias.float(), candidates=candidates
    )
    assert_outputs_close(out, full, atol=1e-2, rtol=0)


@needs_kernel
def test_empty_batch():
    h = torch.zeros(0, 4, device=DEVICE, requires_grad=True)
    w = torch.randn(10, 4, device=DEVICE, requires_grad=True)
    out = triton_token_logprobs(h, w, torch.zeros(0, dtype=torch.long, device=DEVICE))
    assert out.logp.shape == out.entropy.shape == (0,)
    (out.logp.sum() + out.entropy.sum()).backward()
    assert h.grad.shape == (0, 4) and not w.grad.any()


@needs_kernel
def test_no_logits_sized_tensor():
    # 20 tokens x 400 vocab = 8,000 logits. Everything else torch allocates is the size of an
    # input or its gradient (400 x 1 weight, 20 x 8 candidates) or the 6 x 2 x 20 span
    # statistics; the interpreter also views its inputs' storages as bytes (4 per float), so
    # the largest of those is the weight's 1,600 bytes, still a fifth of the logits.
    num_tokens, vocab = 20, 400
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens, vocab, hidden_size=1, num_cand=8)
    h, w, b = leaves(hidden, weight, bias)
    probe = LargestAllocation()
    with probe:
        out = triton_token_logprobs(h, w, targets, bias=b, candidates=candidates, chunk_vocab=200)
        (out.logp.sum() + out.entropy.sum() + out.logp_candidates.sum()).backward()
    assert w.grad is not None and h.grad is not None and b.grad is not None
    assert probe.max_numel <= num_tokens * vocab // 4, (probe.max_numel, probe.worst_op)


# --------------------------------------------------------------------------- dispatch


def test_auto_on_cpu_picks_the_torch_path_and_says_why(caplog):
    # Even where the interpreter could run the kernel on CPU, it is far too slow to pick.
    hidden, weight, _, targets, _ = make_inputs()
    choice = select_impl("auto", torch.zeros(1, 1))
    assert choice.name == "chunked" and "cpu" in choice.reason
    with caplog.at_level("DEBUG", logger="treerl.kernels.logprobs"):
        out = token_logprobs(hidden.cpu(), weight.cpu(), targets.cpu(), impl="auto")
    assert out.choice.name == "chunked"
    assert "impl=chunked (hidden is on cpu" in caplog.text


@needs_kernel
def test_impl_triton_forces_the_kernel():
    if "triton" not in IMPLS:
        pytest.skip("the Triton kernel is not registered in treerl.kernels.logprobs.IMPLS yet")
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=5, vocab=30)
    kwargs = dict(bias=bias, candidates=candidates, temperature=0.7, chunk_vocab=8)
    out = token_logprobs(hidden, weight, targets, impl="triton", **kwargs)
    assert out.choice.name == "triton"
    assert_outputs_close(out, token_logprobs(hidden, weight, targets, impl="chunked", **kwargs), atol=1e-5, rtol=1e-5)


def test_probe_names_what_is_missing():
    probe = module._why_unavailable
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert probe(cuda, torch.bfloat16, interpreted=False, import_error=None) is None
    assert probe(cpu, torch.float32, interpreted=True, import_error=None) is None
    assert "needs CUDA" in probe(cpu, torch.float32, interpreted=False, import_error=None)
    assert "needs CUDA" in probe(torch.device("meta"), None, interpreted=True, import_error=None)
    assert "TRITON_INTERPRET" in probe(cuda, torch.float32, interpreted=True, import_error=None)
    assert "impl='chunked'" in probe(cuda, torch.float64, interpreted=False, import_error=None)
    assert "pip install triton" in probe(cuda, None, interpreted=False, import_error="ImportError: no triton")


def test_direct_call_where_the_kernel_cannot_run_raises_the_reason():
    hidden, weight, _, targets, _ = make_inputs(num_tokens=2, vocab=5)
    with pytest.raises(TritonUnavailableError, match="impl='chunked'"):
        triton_token_logprobs(hidden.double(), weight.double(), targets)


@needs_kernel
def test_bad_chunk_vocab_names_the_fix():
    hidden, weight, _, targets, _ = make_inputs(num_tokens=2, vocab=5)
    with pytest.raises(ValueError, match="chunk_vocab must be an int >= 1"):
        triton_token_logprobs(hidden, weight, targets, chunk_vocab=0)
