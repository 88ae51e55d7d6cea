"""SDPO's divergences against loop-written references, the top-k form with k = V against the full
form, and the chunked path: equal values and gradients, and no (M, V) tensor."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import LargestAllocation

from treerl.learners.divergences import (
    LMHead,
    add_tail_bucket,
    chunked_divergence,
    full_divergence,
    generalized_jsd,
    importance_clip,
    sampled_token_reverse_kl,
    topk_divergence,
)


def _softmax_row(z: list[float]) -> list[float]:
    top = max(z)
    e = [math.exp(v - top) for v in z]
    return [v / sum(e) for v in e]


def _loop_divergence(s: list[float], t: list[float], alpha: float) -> float:
    """D_alpha of two probability lists, one term at a time (the textbook definitions)."""
    def kl(p, q):
        return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)

    if alpha == 0.0:
        return kl(t, s)
    if alpha == 1.0:
        return kl(s, t)
    m = [(1 - alpha) * si + alpha * ti for si, ti in zip(s, t)]
    return (1 - alpha) * kl(s, m) + alpha * kl(t, m)


def _loop_topk(zs: list[float], zt: list[float], alpha: float, k: int, tail: bool) -> float:
    s, t = _softmax_row(zs), _softmax_row(zt)
    ids = sorted(range(len(zs)), key=lambda i: -zs[i])[:k]
    sk, tk = [s[i] for i in ids], [t[i] for i in ids]
    if tail:
        sk.append(max(1.0 - sum(sk), -math.expm1(-1e-7)))
        tk.append(max(1.0 - sum(tk), -math.expm1(-1e-7)))
    else:
        sk = [v / sum(sk) for v in sk]
        tk = [v / sum(tk) for v in tk]
    return _loop_divergence(sk, tk, alpha)


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 40, generator=g, dtype=torch.float64) * 2, torch.randn(6, 40, generator=g,
                                                                                  dtype=torch.float64) * 2


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
def test_full_divergence_matches_a_loop(logits, alpha):
    zs, zt = logits
    got = full_divergence(zs, zt, alpha=alpha)
    want = [_loop_divergence(_softmax_row(a.tolist()), _softmax_row(b.tolist()), alpha) for a, b in zip(zs, zt)]
    assert torch.allclose(got, torch.tensor(want, dtype=got.dtype), atol=1e-10)
    assert (got >= 0).all()


@pytest.mark.parametrize("alpha,tail", [(0.0, True), (0.5, True), (1.0, False), (0.5, False)])
def test_topk_divergence_matches_a_loop(logits, alpha, tail):
    zs, zt = logits
    got = topk_divergence(zs, zt, alpha=alpha, topk=7, add_tail=tail)
    want = [_loop_topk(a.tolist(), b.tolist(), alpha, 7, tail) for a, b in zip(zs, zt)]
    assert torch.allclose(got, torch.tensor(want, dtype=got.dtype), atol=1e-9)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False])
def test_topk_with_k_equal_to_the_vocabulary_is_the_full_divergence(logits, alpha, tail):
    zs, zt = (z.float().requires_grad_() for z in logits)
    full = full_divergence(zs, zt.detach(), alpha=alpha)
    topk = topk_divergence(zs, zt.detach(), alpha=alpha, topk=zs.shape[-1], add_tail=tail)
    assert torch.allclose(topk, full, atol=1e-5)
    g_full, = torch.autograd.grad(full.sum(), zs)
    g_topk, = torch.autograd.grad(topk.sum(), zs)
    assert torch.allclose(g_topk, g_full, atol=1e-5)


def test_the_generalized_jsd_is_symmetric_at_one_half_and_zero_on_equal_inputs(logits):
    s, t = (z.log_softmax(-1) for z in logits)
    assert torch.allclose(generalized_jsd(s, t, 0.5), generalized_jsd(t, s, 0.5), atol=1e-12)
    assert torch.allclose(generalized_jsd(s, s, 0.3), torch.zeros(6, dtype=s.dtype), atol=1e-12)
    assert float(generalized_jsd(s, t, 0.5).max()) <= math.log(2) + 1e-12  # JSD is bounded by log 2
    with pytest.raises(ValueError, match="alpha"):
        generalized_jsd(s, t, 1.5)


def test_the_tail_bucket_holds_the_missing_mass():
    logp = torch.log(torch.tensor([[0.5, 0.2], [0.7, 0.3]]))
    out = add_tail_bucket(logp).exp()
    assert torch.allclose(out.sum(-1), torch.ones(2))
    assert out[1, 2] > 0  # a support holding everything still gets a finite, tiny tail


def test_sampled_token_reverse_kl_has_the_reinforce_gradient():
    s = torch.tensor([-0.2, -1.5, -3.0], requires_grad=True)
    t = torch.tensor([-1.0, -1.0, -0.5])
    loss = sampled_token_reverse_kl(s, t)
    assert torch.allclose(loss.detach(), (s - t).detach() * s.detach())
    loss.sum().backward()
    for i in range(3):  # d/ds_i [(s_i - t_i) s_i] with the first factor held fixed
        assert math.isclose(float(s.grad[i]), float(s.detach()[i] - t[i]), abs_tol=1e-7)


def test_the_importance_clip_is_detached_and_bounded():
    logp = torch.tensor([0.0, -1.0, -5.0, 30.0], requires_grad=True)
    w = importance_clip(logp, torch.tensor([-1.0, -1.0, -1.0, 0.0]), 2.0)
    assert not w.requires_grad
    assert torch.allclose(w, torch.tensor([2.0, 1.0, math.exp(-4.0), 2.0]))
    assert torch.equal(importance_clip(logp, logp.detach(), None), torch.ones(4))


@pytest.mark.parametrize("mode", ["full", "topk"])
def test_chunked_equals_unchunked_with_gradients_and_never_builds_the_batch_logits(mode):
    g = torch.Generator().manual_seed(1)
    num_terms, hidden, vocab = 48, 16, 500
    weight = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    bias = torch.randn(vocab, generator=g, requires_grad=True)
    teacher_weight = weight.detach() + 0.1 * torch.randn(vocab, hidden, generator=g)
    hs = torch.randn(num_terms, hidden, generator=g, requires_grad=True)
    ht = torch.randn(num_terms, hidden, generator=g)
    kwargs = dict(mode=mode, alpha=0.5, topk=20, temperature=0.7)

    with LargestAllocation() as probe:
        chunked = chunked_divergence(hs, LMHead(weight, bias), ht, LMHead(teacher_weight), chunk_tokens=8, **kwargs)
        grads = torch.autograd.grad(chunked.sum(), (hs, weight, bias))
    assert probe.max_numel < num_terms * vocab, probe.worst_op  # chunks of 8 rows: never (M, V)

    zs = (hs @ weight.T + bias) / 0.7
    zt = (ht @ teacher_weight.T) / 0.7
    whole = (full_divergence(zs, zt, alpha=0.5) if mode == "full"
             else topk_divergence(zs, zt, alpha=0.5, topk=20, add_tail=True))
    want = torch.autograd.grad(whole.sum(), (hs, weight, bias))
    assert torch.allclose(chunked, whole, atol=1e-5)
    for got, ref in zip(grads, want):
        assert torch.allclose(got, ref, atol=1e-5)


def test_chunked_divergence_refuses_what_it_cannot_compute():
    h = torch.zeros(2, 4)
    head = LMHead(torch.zeros(5, 4))
    with pytest.raises(ValueError, match="sampled_token"):
        chunked_divergence(h, head, h, head, mode="sampled_token", alpha=1.0)
    with pytest.raises(ValueError, match="same terms"):
        chunked_divergence(h, head, torch.zeros(3, 4), head, mode="full", alpha=1.0)
