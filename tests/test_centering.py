"""Score centering: against a loop-written reference, and zero in expectation under the sampler."""

from __future__ import annotations

import math

import pytest
import torch

from treerl.learners.centering import score_centering
from treerl.learners.importance import ImportanceConfig
from treerl.learners.losses import LossConfig, LossInputs, LossNormalizer, compute_loss

V = 8  # vocabulary of the toy distributions


def _weight(ratio: float, cfg: ImportanceConfig) -> float:
    if cfg.mode == "truncate":
        return min(max(ratio, cfg.ratio_low), cfg.ratio_high)
    if cfg.mode == "mask":
        return ratio if cfg.ratio_low <= ratio <= cfg.ratio_high else 0.0
    return 1.0


def reference(z: list[float], y: list[float], head: list[int], exact: bool, cfg: ImportanceConfig,
              temperature: float = 1.0) -> tuple[float, list[float]]:
    """C and dC/dz for trainer logits z and sampler logits y at one position, with plain loops.

    exact: the sampler drew from softmax(y) restricted to ``head`` (its whole support) and the
    trainer renormalizes over it; else the sampler drew from softmax(y) over the vocabulary and
    recorded the ``head`` ids only.
    """
    zs = [v / temperature for v in z]
    support = head if exact else range(V)
    log_norm_p = math.log(sum(math.exp(zs[v]) for v in support))
    log_norm_q = math.log(sum(math.exp(y[v]) for v in support))
    p = {v: math.exp(zs[v] - log_norm_p) for v in support}  # trainer over its support
    q = {v: math.exp(y[v] - log_norm_q) for v in support}  # sampler
    mass = {v: q[v] * _weight(p[v] / q[v], cfg) for v in head}
    if exact:
        alpha = 1.0
    else:
        tail_q = 1.0 - sum(q[v] for v in head)
        tail_p = 1.0 - sum(p[v] for v in head)
        if tail_q < 1e-5 and tail_p <= 1e-5:
            alpha = 1.0
        else:
            rho = tail_q / max(tail_p, 1e-5)
            alpha = rho * _weight(1.0 / rho, cfg) if rho > 0 else 0.0
    coef = {v: mass[v] - alpha * p[v] for v in head}
    value = sum(coef[v] * math.log(p[v]) for v in head)
    # d log p_v / d z_u = (1[u == v] - p_u) / T over the support, 0 outside it
    grad = [0.0] * V
    for v in head:
        for u in support:
            grad[u] += coef[v] * ((1.0 if u == v else 0.0) - p[u]) / temperature
    return value, grad


def _case(seed: int, exact: bool, k: int):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(V, generator=g) * 1.5
    y = z + torch.randn(V, generator=g) * 0.8  # an off-policy sampler
    order = torch.argsort(y, descending=True)
    head = order[:k].tolist()
    return z, y, head


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("cfg", [ImportanceConfig(ratio_high=1.3), ImportanceConfig(mode="mask", ratio_low=0.5,
                                                                                     ratio_high=1.5),
                                 ImportanceConfig(mode="off"), ImportanceConfig(ratio_high=100.0)])
def test_centering_matches_the_loop_reference(exact, cfg):
    terms_z, rows_t, rows_s, flags, expected = [], [], [], [], []
    for seed in range(6):
        z, y, head = _case(seed, exact, k=4 if exact else 3)
        z = z.clone().requires_grad_(True)
        terms_z.append(z)
        rows_t.append(torch.log_softmax(z, -1)[head])  # the trainer's vocabulary log-probs at the head ids
        support = torch.tensor(head) if exact else torch.arange(V)
        q_logp = torch.full((V,), -math.inf)
        q_logp[support] = torch.log_softmax(y[support], -1)
        rows_s.append(q_logp[head])
        flags.append(exact)
        expected.append(reference(z.tolist(), y.tolist(), head, exact, cfg))
    out = score_centering(torch.stack(rows_t), torch.stack(rows_s), torch.tensor(flags), cfg)
    for m, (value, grad) in enumerate(expected):
        assert out.terms[m].item() == pytest.approx(value, abs=1e-5)
        (got,) = torch.autograd.grad(out.terms[m], terms_z[m], retain_graph=True)
        assert got.tolist() == pytest.approx(grad, abs=1e-5)
    if cfg.ratio_high == 100.0 and cfg.mode == "truncate":  # nothing truncated: nothing to center
        assert out.metrics["centering/coef_abs_sum"].item() == pytest.approx(0.0, abs=1e-6)


def test_padding_and_missing_heads_contribute_nothing():
    z, y, head = _case(3, True, k=3)
    row = torch.log_softmax(z, -1)[head]
    q = torch.log_softmax(y[head], -1)
    pad = torch.tensor([-math.inf])
    trainer = torch.stack([torch.cat([row, pad]), torch.full((4,), -math.inf)])
    sampler = torch.stack([torch.cat([q, pad]), torch.full((4,), -math.inf)])  # the second term recorded nothing
    cfg = ImportanceConfig(ratio_high=1.2)
    out = score_centering(trainer, sampler, torch.tensor([True, False]), cfg)
    alone = score_centering(row[None], q[None], torch.tensor([True]), cfg)
    assert out.terms[0].item() == pytest.approx(alone.terms[0].item(), abs=1e-6)
    assert out.terms[1].item() == 0.0


def _score(z: torch.Tensor, v: int, support: list[int]) -> torch.Tensor:
    """grad_z log p(v), p renormalized over ``support``."""
    z = z.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(torch.log_softmax(z[support], -1)[support.index(v)], z)
    return grad


def _centering_grad(z: torch.Tensor, y: torch.Tensor, support: list[int], cfg: ImportanceConfig) -> torch.Tensor:
    z = z.clone().requires_grad_(True)
    out = score_centering(torch.log_softmax(z, -1)[support][None], torch.log_softmax(y[support], -1)[None],
                          torch.tensor([True]), cfg)
    (grad,) = torch.autograd.grad(out.terms[0], z)
    return grad


def test_centered_score_has_zero_expectation_under_the_sampler():
    """Per token the policy gradient is A (w(a) grad log p(a) - grad C): its score part must have mean 0."""
    cfg = ImportanceConfig(ratio_high=1.2)  # truncation binds for some tokens
    z, y, support = _case(1, True, k=5)
    p = torch.softmax(z[support], -1)
    q = torch.softmax(y[support], -1)
    w = torch.clamp(p / q, max=cfg.ratio_high)
    centering = _centering_grad(z, y, support, cfg)
    scores = torch.stack([_score(z, v, support) for v in support])  # (S, V)
    drift = (q[:, None] * w[:, None] * scores).sum(0)  # E_q[w grad log p] without centering
    assert drift.abs().max() > 1e-2, "the truncated weight must bias the plain score for this test to mean anything"
    centered = (q[:, None] * (w[:, None] * scores - centering)).sum(0)
    assert centered.abs().max() < 1e-6
    # The same by sampling, as a learner sees it.
    draws = torch.multinomial(q, 20_000, replacement=True, generator=torch.Generator().manual_seed(0))
    estimate = (w[draws, None] * scores[draws] - centering).mean(0)
    assert estimate.abs().max() < 0.1 * drift.abs().max()


def test_on_policy_the_centering_vanishes_and_the_score_has_mean_zero():
    cfg = ImportanceConfig(ratio_high=2.0)
    z, _, support = _case(2, True, k=5)
    assert _centering_grad(z, z.clone(), support, cfg).abs().max() == 0.0
    p = torch.softmax(z[support], -1)
    scores = torch.stack([_score(z, v, support) for v in support])
    assert (p[:, None] * scores).sum(0).abs().max() < 1e-6
    # Over the whole vocabulary with a recorded head: the tail model is exact on-policy too.
    head = torch.argsort(z, descending=True)[:3].tolist()
    logp = torch.log_softmax(z, -1)[head][None]
    out = score_centering(logp, logp.clone(), torch.tensor([False]), cfg)
    assert out.metrics["centering/coef_abs_sum"].item() == 0.0


def test_the_loss_adds_the_advantage_times_the_centering():
    logp = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    centering = torch.tensor([0.3, -0.2, 0.4])
    common = dict(logp=logp, old_logp=logp.detach(), sampler_logp=logp.detach(), adv=torch.tensor([1.0, 1.0, -1.0]),
                  episode=torch.tensor([0, 0, 1]), num_episodes=2)
    plain = LossInputs(**common)
    with_c = LossInputs(**common, centering=centering)
    norm = LossNormalizer.from_inputs(plain)
    diff = compute_loss(with_c, LossConfig(), norm).loss - compute_loss(plain, LossConfig(), norm).loss
    assert diff.item() == pytest.approx((0.3 - 0.2 - 0.4) / 3)  # token mean of adv * C


# -- the head's log-probs in the packed forward -----------------------------------------------------


def test_packed_forward_gives_the_head_logprobs_of_a_plain_forward():
    """``packed_logprobs(head=True)``: the vocabulary log-probs of each term's recorded head ids, with gradient."""
    import copy

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from treerl.kernels.tree_attention import enable_tree_attention
    from treerl.learners.forward import packed_logprobs
    from treerl.learners.packing import PackingConfig, pack_groups
    from treerl.rollout.trajectory import Group

    torch.manual_seed(0)
    vocab, temperature = 53, 0.7
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         tie_word_embeddings=False)).float().eval()
    model.set_attn_implementation("sdpa")
    group = Group(task_key="t", env_id="e")
    root = group.add_segment("prompt", [3, 7, 9, 11])
    exact = group.add_segment("sampled", [5, 8], parent=root, logprobs=[-0.5, -0.7], candidates=[[5, 6], [8, 2, 4]],
                              top_logprobs=[[-0.5, -0.9], [-0.7, -1.0, -2.0]])
    head = group.add_segment("sampled", [12, 13, 14], parent=root, logprobs=[-1.0] * 3,
                             top_ids=[[12, 1], [13, 40], [30, 14]], top_logprobs=[[-1.0, -1.5]] * 3)
    group.add_episode(leaf=exact, reward=1.0)
    group.add_episode(leaf=head, reward=0.0)
    [batch] = pack_groups([group], torch.tensor([0.5, -0.5]), PackingConfig(max_tokens_per_row=64))
    assert batch.loss_head_exact.tolist() == [True, True, False, False, False]

    packed = copy.deepcopy(model)
    enable_tree_attention(packed, impl="reference")
    out = packed_logprobs(packed, batch, temperature=temperature, head=True)
    weights = torch.randn(out.head_logp.shape)
    valid = torch.isfinite(out.head_logp)
    (out.head_logp.where(valid, 0.0) * weights).sum().backward()

    expected, rows = [], []
    for leaf, heads in ((exact, [[5, 6], [8, 2, 4]]), (head, [[12, 1], [13, 40], [30, 14]])):
        ids = [t for s in group.path(leaf) for t in s.token_ids]
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0] / temperature, -1)  # (T, V)
        first = len(ids) - len(heads)
        for j, h in enumerate(heads):
            expected.append(torch.nn.functional.pad(logp[first - 1 + j, h], (0, 3 - len(h)), value=-math.inf))
    reference = torch.stack(expected)  # (M, K), terms in packing order
    assert torch.equal(torch.isfinite(reference), valid)
    torch.testing.assert_close(out.head_logp[valid], reference[valid], atol=1e-5, rtol=0)
    (reference.where(valid, 0.0) * weights).sum().backward()
    torch.testing.assert_close(packed.lm_head.weight.grad, model.lm_head.weight.grad, atol=1e-5, rtol=0)
