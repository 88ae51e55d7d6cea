"""Mixed precision and gradient checkpointing on CPU: float32 master weights keep a bfloat16
checkpoint's small updates, autocast runs the forward in bfloat16 with float32 log-probs,
and checkpointing leaves the gradients unchanged (tree attention, LoRA)."""

from __future__ import annotations

import copy

import pytest
import torch

from treerl.learners.forward import packed_logprobs
from treerl.learners.grpo import GRPOConfig, train
from treerl.learners.packing import PackingConfig, pack_groups
from treerl.learners.precision import Precision, enable_gradient_checkpointing, resolve_precision
from treerl.models import load_default_model

RUN = dict(env="treerl/MathVerify-v0", steps=3, tasks_per_step=2, group_size=4, eval_episodes=0, progress=False, num_threads=1,
           learning_rate=1e-6, sample_groups=0, seed=3)


def _bf16_checkpoint(tmp_path):
    """The shipped model saved in bfloat16, as Hub checkpoints usually are."""
    model, tok = load_default_model()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tok.save_pretrained(tmp_path / "bf16")
    return str(tmp_path / "bf16")


def _rollouts(tmp_path):
    """The 3 steps' groups, played once by the float32 model: every run trains on the same data
    (and none pays for sampling in bfloat16 on a CPU, which is slow)."""
    from treerl.learners.samples import write_groups

    model, tok = load_default_model()
    # MathVerify's prompts are short: a bfloat16 backward on a CPU without bfloat16 units is ~15x slower.
    groups = _groups(model, tok, num_tasks=6, group_size=4, env="treerl/MathVerify-v0")
    return str(write_groups(tmp_path / "groups.jsonl", groups))


def _shorter(completion_ids, **kwargs):
    """A reward that varies within every group (shorter is better), so that every step updates."""
    return [-len(ids) / 16 for ids in completion_ids]


def _trained(tmp_path, name, model_path, rollouts, **overrides):
    """(weights before, weights after, model) of 3 steps on ``rollouts`` from the checkpoint at ``model_path``."""
    from treerl.models import load_model

    model, tok = load_model(model_path)
    before = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    train(GRPOConfig(output_dir=str(tmp_path / name), from_rollouts=rollouts, **{**RUN, **overrides}), model=model,
          tokenizer=tok, reward_funcs=[_shorter])
    return before, {k: v.detach().float().clone() for k, v in model.state_dict().items()}, model


def _update_size(before, after):
    """(relative update norm ||dW|| / ||W||, fraction of the weights that changed)."""
    delta = sum(float((after[k] - before[k]).pow(2).sum()) for k in before) ** 0.5
    norm = sum(float(v.pow(2).sum()) for v in before.values()) ** 0.5
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    return delta / norm, changed / sum(v.numel() for v in before.values())


def test_bfloat16_checkpoint_trains_like_float32(tmp_path, capfd):
    from treerl.models import default_model_path

    bf16, rollouts = _bf16_checkpoint(tmp_path), _rollouts(tmp_path)
    before32, after32, _ = _trained(tmp_path, "f32", str(default_model_path()), rollouts)
    size32, frac32 = _update_size(before32, after32)
    assert size32 > 0 and frac32 > 0.5, (size32, frac32)

    # The default: the bfloat16 checkpoint is upcast to float32 master weights.
    before_up, after_up, model = _trained(tmp_path, "upcast", bf16, rollouts)
    assert "precision: weights float32 (checkpoint bfloat16, upcast), optimizer states float32" in capfd.readouterr().err
    assert next(model.parameters()).dtype == torch.float32
    size_up, frac_up = _update_size(before_up, after_up)

    # Mixed precision: bfloat16 autocast for the forward and backward.
    before_mixed, after_mixed, model = _trained(tmp_path, "mixed", bf16, rollouts, bf16=True)
    err = capfd.readouterr().err
    assert "forward/backward bfloat16 autocast, log-probs and loss float32, sampler bfloat16" in err
    assert next(model.parameters()).dtype == torch.float32  # master weights
    size_mixed, frac_mixed = _update_size(before_mixed, after_mixed)

    # The checkpoint's own dtype (the old behaviour): most updates round away.
    before16, after16, model16 = _trained(tmp_path, "pure", bf16, rollouts, dtype="auto")
    assert next(model16.parameters()).dtype == torch.bfloat16
    size16, frac16 = _update_size(before16, after16)
    print(f"relative update after 3 steps at lr 1e-6: float32 {size32:.3g} ({frac32:.1%} of weights changed), "
          f"bf16 checkpoint upcast {size_up:.3g} ({frac_up:.1%}), bf16 autocast {size_mixed:.3g} "
          f"({frac_mixed:.1%}), pure bfloat16 {size16:.3g} ({frac16:.1%})")
    for size, frac in ((size_up, frac_up), (size_mixed, frac_mixed)):
        assert 0.5 < size / size32 < 2.0 and frac > 0.5, (size, frac, size32)
    assert frac16 < 0.2 and not 0.5 < size16 / size32 < 2.0, (size16, frac16, size32)


def test_autocast_keeps_logprobs_float32_and_close():
    from treerl.kernels.tree_attention import enable_tree_attention

    model, tok = load_default_model()
    groups = _groups(model, tok, env="treerl/MathVerify-v0")
    adv = torch.linspace(-1, 1, sum(len(g.episodes) for g in groups))
    batch = pack_groups(groups, adv, PackingConfig(max_tokens_per_row=4096))[0]
    enable_tree_attention(model)
    full = packed_logprobs(model, batch)
    mixed = packed_logprobs(model, batch, precision=resolve_precision("float32", True, False, "cpu"))
    assert mixed.logp.dtype == torch.float32 and mixed.entropy.dtype == torch.float32
    diff = (mixed.logp - full.logp).abs()
    assert diff.mean() < 0.05 and diff.max() < 0.5, (diff.mean(), diff.max())  # bfloat16 matmuls: close, not equal
    assert not torch.equal(mixed.logp, full.logp)  # autocast really ran


def _groups(model, tok, num_tasks=2, group_size=3, env="treerl/Calculator-v0"):
    import asyncio

    from treerl.agents.transformers_policy import TransformersPolicy
    from treerl.rollout.options import EpisodeOptions

    opts = EpisodeOptions(env=env, max_new_tokens=16)
    policy = TransformersPolicy(copy.deepcopy(model), tok, continuous_batching=False)
    try:
        groups, _ = asyncio.run(opts.engine(policy, tok, seed=0).run(opts.env_factory(), opts.env, range(num_tasks),
                                                                      group_size))
    finally:
        policy.close()
    return groups


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_leaves_gradients_unchanged(lora):
    from treerl.kernels.tree_attention import enable_tree_attention

    model, tok = load_default_model()
    groups = _groups(model, tok, env="treerl/MathVerify-v0")
    adv = torch.linspace(-1, 1, sum(len(g.episodes) for g in groups))
    batch = pack_groups(groups, adv, PackingConfig(max_tokens_per_row=4096))[0]
    assert batch.layouts.layouts[0].num_segments > 1  # a real tree, so tree attention is exercised
    grads, kept = [], []
    for checkpointing in (False, True):
        m = copy.deepcopy(model)
        if lora:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(0)
            m = get_peft_model(m, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        enable_tree_attention(m.get_base_model() if lora else m)
        if checkpointing:
            enable_gradient_checkpointing(m)
        m.train()
        saved = []  # what the forward keeps for the backward (a checkpointed layer keeps only its input)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = packed_logprobs(m, batch)
        (out.logp * batch.term_adv).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad})
        kept.append(sum(saved))
    assert kept[1] < 0.7 * kept[0], kept  # checkpointing was on: less kept for the backward
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6, rtol=1e-5), name


def test_precision_options_are_validated():
    with pytest.raises(ValueError, match="drop --bf16 or --fp16"):
        GRPOConfig(output_dir="x", bf16=True, fp16=True)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        GRPOConfig(output_dir="x", dtype="fp8")
    with pytest.raises(ValueError, match="needs float32 master weights"):
        GRPOConfig(output_dir="x", dtype="bfloat16", fp16=True)
    p = resolve_precision("float32", False, True, "cpu")
    assert p.autocast is torch.float16 and p.scaler is not None
    assert isinstance(Precision(None, None).describe(weights=torch.float32), str)


def test_fp16_steps_when_the_first_step_trained_on_nothing():
    """Every group of a first step can have equal rewards (nothing trained, zero gradients): the float16
    scaler has then scaled no loss, and unscaling or stepping must not fail on it."""
    from treerl.learners.precision import resolve_precision

    precision = resolve_precision("float32", False, True, "cpu")
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    precision.unscale(optimizer)
    precision.step(optimizer)  # no loss was scaled yet
    with precision.forward():
        loss = 1e-3 * layer(torch.ones(1, 4)).float().sum()  # scaled by 2**16, its gradients stay finite
    precision.backward(loss)
    precision.unscale(optimizer)  # the scaler now unscales as usual
    before = layer.weight.detach().clone()
    precision.step(optimizer)
    assert not torch.equal(layer.weight, before)
