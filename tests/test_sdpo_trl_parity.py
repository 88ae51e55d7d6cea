"""Parity with TRL's experimental SDPO loss functions on one fixed batch: per-token loss and its
gradient, for the sampled-token reverse KL, top-k with a tail bucket, full-vocabulary JSD
(alpha 0.5) and the IS clip. TRL is in the ``bench`` extra; without it these tests skip."""

from __future__ import annotations

import pytest
import torch

trl_sdpo = pytest.importorskip(
    "trl.experimental.sdpo.loss_utils",
    reason="TRL's experimental SDPO (trl >= 1.x, the bench extra: pip install -e '.[bench]') is not installed",
)

from treerl.kernels.logprobs import token_logprobs  # noqa: E402
from treerl.learners.divergences import (  # noqa: E402
    LMHead,
    chunked_divergence,
    importance_clip,
    sampled_token_reverse_kl,
)

B, T, V = 3, 5, 64
TEMPERATURE = 0.8


@pytest.fixture
def batch():
    """Student and teacher logits (B, T, V) and sampled ids (B, T); hidden = logits via an identity head."""
    g = torch.Generator().manual_seed(7)
    student = (torch.randn(B, T, V, generator=g) * 2).requires_grad_()
    teacher = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    return student, teacher, ids


def _ours(student, teacher, ids, mode, **kwargs):
    """Our per-token loss (B, T) from hidden states = logits and an identity LM head."""
    eye = LMHead(torch.eye(V))
    hs, ht = student.reshape(B * T, V), teacher.reshape(B * T, V)
    if mode == "sampled_token":
        s = token_logprobs(hs, eye.weight, ids.reshape(-1), temperature=TEMPERATURE).logp
        with torch.no_grad():
            t = token_logprobs(ht, eye.weight, ids.reshape(-1), temperature=TEMPERATURE).logp
        return sampled_token_reverse_kl(s, t).reshape(B, T)
    return chunked_divergence(hs, eye, ht, eye, mode=mode, temperature=TEMPERATURE, chunk_tokens=4,
                              **kwargs).reshape(B, T)


def _check(ours, theirs, student):
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    weights = torch.linspace(0.5, 1.5, B * T).reshape(B, T)  # any fixed reduction
    g_ours, = torch.autograd.grad((ours * weights).sum(), student, retain_graph=True)
    g_theirs, = torch.autograd.grad((theirs * weights).sum(), student)
    assert torch.allclose(g_ours, g_theirs, atol=1e-5), (g_ours - g_theirs).abs().max()


def test_sampled_token_reverse_kl_equals_trl(batch):
    student, teacher, ids = batch
    theirs = trl_sdpo.compute_sampled_token_self_distillation_loss(
        student / TEMPERATURE, teacher / TEMPERATURE, ids, distillation_alpha=1.0)
    _check(_ours(student, teacher, ids, "sampled_token"), theirs, student)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 0.0])
def test_topk_with_tail_equals_trl(batch, alpha):
    student, teacher, ids = batch
    theirs = trl_sdpo.compute_topk_self_distillation_loss(
        student / TEMPERATURE, teacher / TEMPERATURE, distillation_topk=10, distillation_alpha=alpha,
        distillation_add_tail=True)
    _check(_ours(student, teacher, ids, "topk", alpha=alpha, topk=10, add_tail=True), theirs, student)


def test_topk_renormalized_equals_trl(batch):
    student, teacher, ids = batch
    theirs = trl_sdpo.compute_topk_self_distillation_loss(
        student / TEMPERATURE, teacher / TEMPERATURE, distillation_topk=10, distillation_alpha=0.5,
        distillation_add_tail=False)
    _check(_ours(student, teacher, ids, "topk", alpha=0.5, topk=10, add_tail=False), theirs, student)


@pytest.mark.parametrize("alpha", [0.5, 0.0, 1.0])
def test_full_vocabulary_divergence_equals_trl(batch, alpha):
    student, teacher, ids = batch
    theirs = trl_sdpo.compute_full_logit_self_distillation_loss(
        student / TEMPERATURE, teacher / TEMPERATURE, distillation_alpha=alpha)
    _check(_ours(student, teacher, ids, "full", alpha=alpha), theirs, student)


def test_the_is_clip_equals_trl(batch):
    student, teacher, ids = batch
    per_token = _ours(student, teacher, ids, "topk", alpha=0.5, topk=10, add_tail=True)
    logp = torch.log_softmax(student / TEMPERATURE, -1).gather(-1, ids[..., None]).squeeze(-1)  # (B, T)
    old = logp.detach() + torch.linspace(-1.5, 1.5, B * T).reshape(B, T)  # some ratios beyond the clip
    theirs = trl_sdpo.apply_importance_sampling_clipping(per_token, logp, old, 2.0)
    ours = per_token * importance_clip(logp.reshape(-1), old.reshape(-1), 2.0).reshape(B, T)
    _check(ours, theirs, student)
