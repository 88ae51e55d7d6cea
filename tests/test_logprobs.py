"""Parity, gradients, edge cases and the memory bound of treerl.kernels.logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from _helpers import HostReads, LargestAllocation

from treerl.kernels.logprobs import (
    IMPLS,
    ImplChoice,
    TokenLogprobs,
    reference_token_logprobs,
    select_impl,
    token_logprobs,
)

OUTPUTS = ("logp", "entropy", "logp_candidates")


def make_inputs(num_tokens=9, vocab=37, hidden_size=6, num_cand=5, dtype=torch.float32, seed=0, bias=True):
    """Random head inputs; candidate rows hold the target, distinct ids, and some -1 padding."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    rows = []
    for i in range(num_tokens):
        others = torch.randperm(vocab, generator=gen)
        others = others[others != targets[i]][: num_cand - 1]
        row = torch.cat([targets[i : i + 1], others])
        num_pad = int(torch.randint(0, num_cand, (), generator=gen))  # 0..K-1 pads, target always kept
        row[num_cand - num_pad :] = -1
        rows.append(row[torch.randperm(num_cand, generator=gen)])  # target not always first
    candidates = torch.stack(rows)  # (N, K)
    return hidden, weight, b, targets, candidates


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]


def outputs(out: TokenLogprobs):
    return [getattr(out, name) for name in OUTPUTS]


def grads(fn, hidden, weight, bias, coefs, **kwargs):
    """Gradients wrt (hidden, weight, bias) of sum_k coef_k * output_k . sum(weights per token)."""
    h, w, b = leaves(hidden, weight, bias)
    out = fn(h, w, kwargs.pop("targets"), bias=b, **kwargs)
    token_weights = torch.linspace(-1.0, 2.0, h.shape[0], dtype=out.logp.dtype)
    loss = sum(c * (o * token_weights).sum() for c, o in zip(coefs, outputs(out)) if c)
    loss.backward()
    return [t.grad if t is not None else None for t in (h, w, b)]


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("with_bias", [True, False])
def test_values_match_full_logits_reference_float32(temperature, with_bias):
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=11, vocab=37, bias=with_bias)
    kwargs = dict(bias=bias, temperature=temperature, candidates=candidates)
    # 37 is not a multiple of 8, and 11 tokens not a multiple of 4: ragged last tiles.
    out = token_logprobs(hidden, weight, targets, chunk_tokens=4, chunk_vocab=8, **kwargs)
    ref = reference_token_logprobs(hidden, weight, targets, **kwargs)
    for name in OUTPUTS:
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), atol=1e-5, rtol=1e-5, msg=name)
    assert out.choice == ImplChoice("chunked", out.choice.reason)
    # The kept mass is at most 1, so renormalizing can only raise the log-prob.
    assert bool((out.logp_candidates >= out.logp - 1e-6).all())


def test_values_against_float64_with_large_logits():
    # Logits in the hundreds: the online log-sum-exp and the shifted entropy accumulator
    # must not overflow or cancel; float32 results are compared with a float64 reference.
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=6, vocab=50, hidden_size=4)
    hidden = hidden * 60
    out = token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates, chunk_tokens=4, chunk_vocab=7)
    ref = reference_token_logprobs(
        hidden.double(), weight.double(), targets, bias=bias.double(), candidates=candidates
    )
    for name in OUTPUTS:
        value = getattr(out, name)
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value.double(), getattr(ref, name), atol=2e-4, rtol=1e-5, msg=name)


def test_entropy_of_uniform_distribution_is_log_vocab():
    out = token_logprobs(torch.zeros(2, 3), torch.zeros(10, 3), torch.tensor([0, 9]), chunk_vocab=3)
    torch.testing.assert_close(out.entropy, torch.full((2,), math.log(10)))
    torch.testing.assert_close(out.logp, torch.full((2,), -math.log(10)))
    assert out.logp_candidates is None


@settings(max_examples=25, deadline=None)
@given(
    num_tokens=st.integers(1, 7),
    vocab=st.integers(1, 30),
    chunk_tokens=st.integers(1, 8),
    chunk_vocab=st.integers(1, 32),
    seed=st.integers(0, 2**16),
)
def test_any_tiling_matches_reference(num_tokens, vocab, chunk_tokens, chunk_vocab, seed):
    hidden, weight, bias, targets, candidates = make_inputs(
        num_tokens, vocab, hidden_size=3, num_cand=min(vocab, 4), seed=seed
    )
    kwargs = dict(bias=bias, candidates=candidates, temperature=0.9)
    out = token_logprobs(hidden, weight, targets, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, **kwargs)
    ref = reference_token_logprobs(hidden, weight, targets, **kwargs)
    for name in OUTPUTS:
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), atol=1e-5, rtol=1e-5, msg=name)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(
    "coefs",
    [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.7, -0.3, 1.5)],
    ids=["logp", "entropy", "logp_candidates", "weighted_sum"],
)
def test_gradients_match_reference_float32(coefs):
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=10, vocab=41)
    kwargs = dict(targets=targets, candidates=candidates, temperature=0.8)
    got = grads(token_logprobs, hidden, weight, bias, coefs, chunk_tokens=3, chunk_vocab=8, **kwargs)
    want = grads(reference_token_logprobs, hidden, weight, bias, coefs, **kwargs)
    for name, g, r in zip(("hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4, msg=name)
        assert g.abs().max() > 1e-3, f"grad wrt {name} is trivially zero; the test would not catch a bug"


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("with_candidates", [True, False])
def test_gradcheck_float64(with_bias, with_candidates):
    hidden, weight, bias, targets, candidates = make_inputs(
        num_tokens=4, vocab=9, hidden_size=2, num_cand=4, dtype=torch.float64, bias=with_bias
    )
    candidates = candidates if with_candidates else None

    def fn(h, w, *maybe_b):
        out = token_logprobs(
            h, w, targets, bias=maybe_b[0] if maybe_b else None, candidates=candidates,
            temperature=0.7, chunk_tokens=3, chunk_vocab=4,  # ragged tiles both ways
        )
        return tuple(o for o in outputs(out) if o is not None)

    inputs = leaves(hidden, weight, *([bias] if with_bias else []))
    assert torch.autograd.gradcheck(fn, tuple(inputs))


def test_gradient_from_one_output_only_and_frozen_head():
    # Unused outputs reach backward as None; a frozen head (LoRA) asks for grad wrt hidden only.
    hidden, weight, bias, targets, candidates = make_inputs()
    h = hidden.clone().requires_grad_(True)
    out = token_logprobs(h, weight, targets, bias=bias, candidates=candidates, chunk_vocab=8)
    out.entropy.sum().backward()
    h_ref = hidden.clone().requires_grad_(True)
    reference_token_logprobs(h_ref, weight, targets, bias=bias, candidates=candidates).entropy.sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- edge cases


def test_single_token_and_unit_chunks():
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=1, vocab=9, dtype=torch.float64)
    coefs = (1.0, 0.5, -2.0)
    kwargs = dict(targets=targets, candidates=candidates, temperature=1.3)
    got = grads(token_logprobs, hidden, weight, bias, coefs, chunk_tokens=1, chunk_vocab=1, **kwargs)
    want = grads(reference_token_logprobs, hidden, weight, bias, coefs, **kwargs)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)
    out = token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates, chunk_tokens=1, chunk_vocab=1)
    ref = reference_token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates)
    for name in OUTPUTS:
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), msg=name)


def test_candidate_set_of_one_token_gives_zero_logprob_and_zero_gradient():
    hidden, weight, bias, targets, _ = make_inputs(num_tokens=4, vocab=20)
    candidates = torch.stack([targets, torch.full_like(targets, -1)], dim=1)  # target plus padding
    h, w, b = leaves(hidden, weight, bias)
    out = token_logprobs(h, w, targets, bias=b, candidates=candidates, chunk_vocab=6)
    assert torch.equal(out.logp_candidates, torch.zeros(4))
    out.logp_candidates.sum().backward()
    for t in (h, w, b):
        assert t.grad.abs().max() < 1e-6  # greedy-like sampling: nothing to learn from this term


def test_padding_does_not_change_the_result():
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=6, vocab=30)
    padded = torch.cat([candidates, torch.full((6, 3), -1)], dim=1)
    a = token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates, chunk_vocab=7)
    b = token_logprobs(hidden, weight, targets, bias=bias, candidates=padded, chunk_vocab=7)
    # Same set, wider rows: equal up to the order of a float32 reduction.
    torch.testing.assert_close(a.logp_candidates, b.logp_candidates, atol=1e-6, rtol=0)
    ref = reference_token_logprobs(hidden, weight, targets, bias=bias, candidates=padded)
    torch.testing.assert_close(b.logp_candidates, ref.logp_candidates, atol=1e-5, rtol=1e-5)


def test_full_vocabulary_candidate_set_equals_logp():
    hidden, weight, bias, targets, _ = make_inputs(num_tokens=5, vocab=12)
    candidates = torch.arange(12).expand(5, 12).contiguous()
    out = token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates, chunk_vocab=5)
    torch.testing.assert_close(out.logp_candidates, out.logp)


def test_bfloat16_inputs():
    # Tolerance: both paths round the tile matmul to bfloat16 (8 bits of mantissa), so
    # logits of size ~3 differ by up to ~2e-2 depending on the rounding of the bias add;
    # all reductions are float32. We allow 3e-2 absolute on values and 5e-2 relative to
    # the largest gradient entry.
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=8, vocab=40, hidden_size=8)
    hidden, weight, bias = (t.to(torch.bfloat16) for t in (hidden, weight, bias))
    kwargs = dict(bias=bias, candidates=candidates, temperature=0.9)
    out = token_logprobs(hidden, weight, targets, chunk_tokens=3, chunk_vocab=16, **kwargs)
    full = reference_token_logprobs(hidden.float(), weight.float(), targets, **{**kwargs, "bias": bias.float()})
    for name in OUTPUTS:
        value = getattr(out, name)
        assert value.dtype == torch.float32, "bfloat16 inputs accumulate and return float32"
        torch.testing.assert_close(value, getattr(full, name), atol=3e-2, rtol=0, msg=name)
    coefs = (1.0, 0.3, 0.5)
    got = grads(token_logprobs, hidden, weight, bias, coefs, targets=targets, candidates=candidates, chunk_vocab=16)
    want = grads(
        reference_token_logprobs, hidden.float(), weight.float(), bias.float(), coefs,
        targets=targets, candidates=candidates,
    )
    for name, g, r in zip(("hidden", "weight", "bias"), got, want):
        assert g.dtype == torch.bfloat16, name
        torch.testing.assert_close(g.float(), r, atol=5e-2 * float(r.abs().max()), rtol=0, msg=name)


def test_empty_batch():
    out = token_logprobs(torch.zeros(0, 4), torch.randn(10, 4), torch.zeros(0, dtype=torch.long))
    assert out.logp.shape == out.entropy.shape == (0,)


# --------------------------------------------------------------------------- dispatch and errors


def test_auto_picks_chunked_and_says_why():
    choice = select_impl("auto", torch.zeros(1, 1))
    assert choice.name == "chunked" and "cpu" in choice.reason
    assert select_impl("reference", torch.zeros(1, 1)) == ImplChoice("reference", "requested")
    hidden, weight, _, targets, _ = make_inputs()
    assert token_logprobs(hidden, weight, targets, impl="reference").choice.name == "reference"
    assert set(IMPLS) >= {"chunked", "reference"}


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(impl="cuda"), "impl must be"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(chunk_vocab=0), "chunk_vocab"),
        (dict(chunk_tokens=2.5), "chunk_tokens"),
        (dict(bias=torch.zeros(5)), "bias must be"),
        (dict(candidates=torch.zeros(9, 2)), "candidates must be"),
        (dict(candidates=torch.full((9, 2), 40)), "candidates must be token ids"),
    ],
)
def test_bad_arguments_name_the_fix(change, match):
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=9, vocab=37)
    kwargs = dict(bias=bias, candidates=candidates) | change
    with pytest.raises(ValueError, match=match):
        token_logprobs(hidden, weight, targets, **kwargs)


def test_candidate_sets_must_hold_the_target_once():
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=4, vocab=20)
    missing = candidates.masked_fill(candidates == targets[:, None], -1)
    with pytest.raises(ValueError, match="does not contain its target"):
        token_logprobs(hidden, weight, targets, candidates=missing)
    repeated = torch.stack([targets, targets], dim=1)
    with pytest.raises(ValueError, match="twice"):
        token_logprobs(hidden, weight, targets, candidates=repeated)


def test_shape_and_dtype_errors():
    hidden, weight, _, targets, _ = make_inputs(num_tokens=3, vocab=10)
    with pytest.raises(ValueError, match="hidden must be"):
        token_logprobs(hidden[None], weight, targets)
    with pytest.raises(ValueError, match="weight must be"):
        token_logprobs(hidden, weight.T, targets)
    with pytest.raises(TypeError, match="share one floating dtype"):
        token_logprobs(hidden.double(), weight, targets)
    with pytest.raises(ValueError, match="targets must be"):
        token_logprobs(hidden, weight, targets.int())
    with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 10\)"):
        token_logprobs(hidden, weight, targets + 10)


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_no_tensor_larger_than_one_tile(impl):
    # 32 tokens x 1000 vocab = 32,000 logits; one tile is 16 x 256 = 4,096. Weight-sized
    # tensors (the weight gradient, 1000 x 2) and hidden-sized ones stay below a tile, so
    # anything above the bound is a logits-shaped tensor.
    num_tokens, vocab, chunk_tokens, chunk_vocab = 32, 1000, 16, 256
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens, vocab, hidden_size=2, num_cand=8)
    h, w, b = leaves(hidden, weight, bias)
    probe = LargestAllocation()
    with probe:
        out = token_logprobs(
            h, w, targets, bias=b, candidates=candidates, temperature=0.8,
            chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab, impl=impl,
        )
        (out.logp.sum() + out.entropy.sum() + out.logp_candidates.sum()).backward()
    assert w.grad is not None and h.grad is not None and b.grad is not None
    if impl == "reference":  # the probe sees full logits when they exist
        assert probe.max_numel >= num_tokens * vocab, probe.worst_op
    else:
        assert probe.max_numel <= chunk_tokens * chunk_vocab, (probe.max_numel, probe.worst_op)


def test_default_cpu_tiles_are_cache_sized_and_exact():
    # chunk_vocab=None on CPU takes 1024-wide vocabulary tiles (cache-sized, see CPU_CHUNK_VOCAB):
    # no logits tensor wider than that, and the same values and gradients as full logits.
    num_tokens, vocab = 8, 2500  # three tiles, the last one partial; the weight (2500 x 3) is below a tile
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens, vocab, hidden_size=3, num_cand=6)
    h, w, b = leaves(hidden, weight, bias)
    probe = LargestAllocation()
    with probe:
        out = token_logprobs(h, w, targets, bias=b, candidates=candidates, temperature=0.8)
        (out.logp.sum() + out.entropy.sum() + out.logp_candidates.sum()).backward()
    assert out.choice.name == "chunked"
    assert probe.max_numel <= num_tokens * 1024, (probe.max_numel, probe.worst_op)
    ref = reference_token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates, temperature=0.8)
    for got, want in zip(outputs(out), outputs(ref)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    kwargs = dict(targets=targets, candidates=candidates, temperature=0.8)
    for got, want in zip(grads(token_logprobs, hidden, weight, bias, (1.0, 1.0, 1.0), **kwargs),
                         grads(reference_token_logprobs, hidden, weight, bias, (1.0, 1.0, 1.0), **kwargs)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_implementation_chosen_is_logged_once_at_info(caplog):
    """As the tree-attention backend's: a run that fell back to the chunked path can be seen in its log."""
    import logging

    from treerl.kernels import logprobs as lp

    lp._SAID.clear()
    hidden, weight, targets = torch.randn(3, 8), torch.randn(11, 8), torch.tensor([1, 2, 3])
    with caplog.at_level(logging.INFO, logger="treerl.kernels.logprobs"):
        lp.token_logprobs(hidden, weight, targets)
        lp.token_logprobs(hidden, weight, targets)
    said = [r for r in caplog.records if r.levelno == logging.INFO and "impl=chunked" in r.getMessage()]
    assert len(said) == 1


@pytest.mark.parametrize("with_candidates", [False, True])
def test_input_checks_read_back_once(with_candidates):
    # Each read of a device tensor is a host sync that waits for the decoder's forward: the
    # checks of one call share one read (they took two without candidate sets, six with).
    hidden, weight, bias, targets, candidates = make_inputs(num_tokens=9, vocab=37)
    with HostReads() as reads:
        token_logprobs(hidden, weight, targets, bias=bias, candidates=candidates if with_candidates else None)
    assert reads.count == 1
