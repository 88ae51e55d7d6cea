"""TRL's cast_lm_head_to_fp32 (ScaleRL): the LM head's logits in float32 from bfloat16 weights and
hidden states, in the trainer's fused log-prob head and in the transformers sampler."""

from __future__ import annotations

import copy

import pytest
import torch

from treerl.kernels.logprobs import reference_token_logprobs, token_logprobs
from treerl.kernels.triton_logprobs import triton_logprobs_unavailable
from treerl.learners.forward import packed_hidden_states, packed_logprobs
from treerl.learners.grpo import GRPOConfig
from treerl.learners.packing import PackingConfig, pack_groups
from treerl.learners.precision import Precision
from treerl.models import load_default_model

IMPLS = ["chunked", "reference",
         pytest.param("triton", marks=pytest.mark.skipif(triton_logprobs_unavailable("cpu", torch.float32) is not None,
                                                         reason=str(triton_logprobs_unavailable("cpu"))))]


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(9, 32, generator=gen) * 2).bfloat16()  # (N, H)
    weight = torch.randn(300, 32, generator=gen).bfloat16()  # (V, H): logits of size ~10, where bfloat16 rounds by ~0.06
    targets = torch.randint(0, 300, (9,), generator=gen)
    candidates = torch.stack([targets, torch.full((9,), -1), (targets + 7) % 300], 1)  # (N, K)
    return hidden, weight, targets, candidates


@pytest.mark.parametrize("impl", IMPLS)
def test_kernel_fp32_head_is_the_float32_computation(impl):
    hidden, weight, targets, candidates = _inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = token_logprobs(h, w, targets, candidates=candidates, temperature=0.7, chunk_vocab=64, impl=impl,
                         fp32_head=True)
    h32, w32 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    want = reference_token_logprobs(h32, w32, targets, candidates=candidates, temperature=0.7)
    for got, ref in ((out.logp, want.logp), (out.entropy, want.entropy), (out.logp_candidates, want.logp_candidates)):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    # The bfloat16 head of the torch paths rounds every logit: their log-probs are visibly off. (The
    # Triton kernel's logits already are float32 sums of the bfloat16 products; with the option its
    # backward runs in float32 too.)
    plain = token_logprobs(hidden, weight, targets, candidates=candidates, temperature=0.7, chunk_vocab=64, impl=impl)
    assert (plain.logp - want.logp).abs().max() > 1e-3 or impl == "triton"
    # Gradients are the float32 computation's, in the inputs' dtype.
    (out.logp.sum() + 0.1 * out.entropy.sum() + out.logp_candidates.sum()).backward()
    (want.logp.sum() + 0.1 * want.entropy.sum() + want.logp_candidates.sum()).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(h.grad.float(), h32.grad.bfloat16().float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(w.grad.float(), w32.grad.bfloat16().float(), atol=1e-2, rtol=1e-2)


def _bf16_batch():
    from treerl.kernels.tree_attention import enable_tree_attention
    from tests.test_precision import _groups

    model, tok = load_default_model()
    groups = _groups(model, tok)
    adv = torch.linspace(-1, 1, sum(len(g.episodes) for g in groups))
    batch = pack_groups(groups, adv, PackingConfig(max_tokens_per_row=4096))[0]
    model = model.to(torch.bfloat16)
    enable_tree_attention(model)
    return model, batch


def test_trainer_logprobs_of_a_bfloat16_model_use_a_float32_head():
    model, batch = _bf16_batch()
    plain = Precision(weights=None, autocast=None)
    fp32 = Precision(weights=None, autocast=None, fp32_head=True)
    out = packed_logprobs(model, batch, temperature=0.8, precision=fp32)
    # The float32 LM head by hand: the decoder's bfloat16 hidden states and head weights, upcast.
    with torch.no_grad():
        hidden = packed_hidden_states(model, batch)
        at_loss = hidden[batch.loss_row, batch.loss_pos].float()  # (N, H)
        logits = at_loss @ model.lm_head.weight.float().T / 0.8  # (N, V)
        want = logits.log_softmax(-1).gather(1, batch.loss_target[:, None]).squeeze(1)[batch.term_loss]
    torch.testing.assert_close(out.logp_vocab, want, atol=1e-5, rtol=1e-5)
    bf16 = packed_logprobs(model, batch, temperature=0.8, precision=plain)
    assert (bf16.logp_vocab - want).abs().max() > 1e-3


def test_sampler_logits_of_a_bfloat16_model_use_a_float32_head():
    from treerl.agents.transformers_policy import TransformersPolicy

    model, tok = load_default_model()
    model = model.to(torch.bfloat16)  # the shipped model ties its head to the embeddings
    ids = torch.tensor([tok.encode("2 + 2 =")])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[:, -1]  # (1, H) bfloat16
        want = hidden.float() @ model.lm_head.weight.float().T  # (1, V)
        plain = model(input_ids=ids).logits[:, -1].float()
    assert (plain - want).abs().max() > 1e-3
    policy = TransformersPolicy(copy.deepcopy(model), tok, continuous_batching=False, fp32_head=True)
    try:
        assert policy.model.lm_head.weight.dtype == torch.float32
        assert policy.model.model.embed_tokens(ids).dtype == torch.bfloat16  # the decoder still runs in bfloat16
        with torch.no_grad():
            got = policy._forward(ids, positions, None, None)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        policy.set_weights(model.state_dict(), version=1)  # the trainer's weights still load
        assert policy.model.lm_head.weight.dtype == torch.float32
    finally:
        policy.close()


def test_option_by_flag_yaml_and_keyword(tmp_path):
    from treerl.cli import build_parser
    from treerl.config import config_from_args
    from treerl.learners.precision import resolve_precision

    args = build_parser().parse_args(["learn", "--output-dir", "x", "--cast-lm-head-to-fp32", "--dtype", "bfloat16"])
    cfg = config_from_args(GRPOConfig, args)
    assert cfg.cast_lm_head_to_fp32 and GRPOConfig(output_dir="x", cast_lm_head_to_fp32=True).cast_lm_head_to_fp32
    precision = resolve_precision(cfg.dtype, cfg.bf16, cfg.fp16, "cpu", fp32_head=cfg.cast_lm_head_to_fp32)
    assert "log-probs and loss float32 (head cast to float32), sampler bfloat16 (head float32)" in \
        precision.describe()
    # float32 master weights: the trainer's head is float32 already; only a bfloat16 sampler's changes
    mixed = resolve_precision("float32", True, False, "cpu", fp32_head=True).describe()
    assert "log-probs and loss float32, sampler bfloat16 (head float32)" in mixed


def test_sdpo_distillation_logits_use_a_float32_head():
    from treerl.learners.divergences import LMHead, chunked_divergence, full_divergence

    hidden, weight, _, _ = _inputs()
    teacher_hidden = _inputs(seed=1)[0]
    got = chunked_divergence(hidden, LMHead(weight), teacher_hidden, LMHead(weight), mode="full", alpha=0.5,
                             chunk_tokens=4, fp32_head=True)
    want = full_divergence(hidden.float() @ weight.float().T, teacher_hidden.float() @ weight.float().T, alpha=0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = chunked_divergence(hidden, LMHead(weight), teacher_hidden, LMHead(weight), mode="full", alpha=0.5)
    assert (plain - want).abs().max() > 1e-4


def test_a_bfloat16_runs_head_is_held_and_trained_in_float32_as_trl_casts_it(tmp_path):
    """TRL casts the head module itself to float32: with --dtype bfloat16 its weights, their optimizer state
    and the reference's head are float32, so that small updates to it do not round away; the decoder stays
    bfloat16. Off, the head stays bfloat16."""
    from treerl.learners.core import build

    def head_of(cfg):
        run = build(cfg, reference=True)
        try:
            with run:
                run.rollout()
            head = run.model.get_output_embeddings().weight
            return (head.dtype, run.model.model.layers[0].mlp.up_proj.weight.dtype,
                    run.reference.get_output_embeddings().weight.dtype,
                    any(p is head for group in run.optimizer.param_groups for p in group["params"]))
        finally:
            run.policy.close()

    small = dict(dtype="bfloat16", steps=1, tasks_per_step=1, group_size=2, max_new_tokens=4, eval_episodes=0,
                 beta=0.1)
    cast = head_of(GRPOConfig(output_dir=str(tmp_path / "cast"), cast_lm_head_to_fp32=True, **small))
    assert cast == (torch.float32, torch.bfloat16, torch.float32, True)
    plain = head_of(GRPOConfig(output_dir=str(tmp_path / "plain"), **small))
    assert plain[:3] == (torch.bfloat16, torch.bfloat16, torch.bfloat16)
