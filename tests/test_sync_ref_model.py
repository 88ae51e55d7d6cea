"""TRL's sync_ref_model (TR-DPO): every ref_model_sync_steps optimizer steps the --beta reference becomes
alpha x the policy + (1 - alpha) x itself; checkpoints keep it, and a resumed run continues with it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from treerl.learners.grpo import GRPOConfig, train

TINY = dict(tasks_per_step=1, group_size=2, max_new_tokens=8, temperature=1.5, eval_episodes=0, progress=False, num_threads=1,
            beta=0.1, learning_rate=5e-3, sync_ref_model=True, save_every=1, sample_groups=0)


def alternate(completions, **kwargs):
    """Rewards 0, 1, 0, 1, ...: every group has advantages, so the policy moves away from the reference."""
    return [float(i % 2) for i in range(len(completions))]


def _load():
    from treerl.models import load_default_model

    return load_default_model()


def _checkpoint(out, step, name):
    return load_file(str(out / "checkpoints" / f"step-{step}" / name))


def _mix(policy, reference, alpha):
    return {k: torch.add(reference[k] * (1.0 - alpha), policy[k], alpha=alpha) for k in policy}


def _assert_weights(got, want):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-7, msg=k)


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_reference_mixes_in_the_policy_every_ref_model_sync_steps_optimizer_steps(tmp_path):
    """A step takes num_iterations=2 optimizer steps, so ref_model_sync_steps=2 syncs at the end of every step
    (counted as steps, it would first sync at step 2): each checkpoint's reference is alpha x its model +
    (1 - alpha) x the reference before."""
    model, tok = _load()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    train(GRPOConfig(output_dir=str(tmp_path), steps=2, num_iterations=2, ref_model_sync_steps=2,
                     ref_model_mixup_alpha=0.6, **TINY), model=model, tokenizer=tok, reward_funcs=[alternate])
    start = {k: start[k] for k in _checkpoint(tmp_path, 1, "model.safetensors")}  # as saved (tied weights once)
    first = _mix(_checkpoint(tmp_path, 1, "model.safetensors"), start, 0.6)
    _assert_weights(_checkpoint(tmp_path, 1, "reference.safetensors"), first)
    second = _mix(_checkpoint(tmp_path, 2, "model.safetensors"), first, 0.6)
    _assert_weights(_checkpoint(tmp_path, 2, "reference.safetensors"), second)
    assert [m["ref/last_sync_step"] for m in _metrics(tmp_path)] == [2, 4]


def test_no_sync_before_ref_model_sync_steps(tmp_path):
    """Optimizer steps 1 and 2 leave the reference the starting weights (no reference in their checkpoints, whose
    KL is to the starting weights); step 3 mixes the policy into those."""
    model, tok = _load()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    train(GRPOConfig(output_dir=str(tmp_path), steps=3, ref_model_sync_steps=3, ref_model_mixup_alpha=0.25, **TINY),
          model=model, tokenizer=tok, reward_funcs=[alternate])
    for step in (1, 2):
        assert not (tmp_path / "checkpoints" / f"step-{step}" / "reference.safetensors").exists()
    trained = _checkpoint(tmp_path, 3, "model.safetensors")
    _assert_weights(_checkpoint(tmp_path, 3, "reference.safetensors"),
                    _mix(trained, {k: start[k] for k in trained}, 0.25))
    assert [m["ref/last_sync_step"] for m in _metrics(tmp_path)] == [0, 0, 3]


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
def test_a_resumed_run_keeps_the_synced_reference(tmp_path):
    """Killed after step 1's checkpoint (its reference synced), a resumed run replays step 2 with the KL, the
    reference and the weights of the run that never stopped."""
    out = tmp_path / "run"
    cfg = dict(output_dir=str(out), steps=2, ref_model_sync_steps=1, **TINY)
    model, tok = _load()
    train(GRPOConfig(**cfg), model=model, tokenizer=tok, reward_funcs=[alternate])
    straight = _metrics(out)
    assert straight[1]["loss/kl"] > 0
    reference, weights = _checkpoint(out, 2, "reference.safetensors"), _checkpoint(out, 2, "model.safetensors")
    shutil.rmtree(out / "checkpoints" / "step-2")  # as a run killed after step 1's checkpoint

    model, tok = _load()
    train(GRPOConfig(**{**cfg, "resume": True}), model=model, tokenizer=tok, reward_funcs=[alternate])
    resumed = _metrics(out)
    assert [m["step"] for m in resumed] == [1, 2]
    assert resumed[1]["loss/kl"] == straight[1]["loss/kl"] and resumed[1]["ref/last_sync_step"] == 2
    _assert_weights(_checkpoint(out, 2, "reference.safetensors"), reference)
    _assert_weights(_checkpoint(out, 2, "model.safetensors"), weights)


def test_the_reference_log_probs_of_a_step_are_its_first_updates(tmp_path, monkeypatch):
    """As TRL computes them once per generation: a step of num_iterations=3 updates runs the reference once per
    micro-batch, so a sync between its updates changes the KL target from the next step on."""
    import treerl.learners.grpo as grpo

    calls = []
    forward = grpo.packed_logprobs

    def counting(model, batch, **kwargs):
        calls.append(model.training)  # the reference is in eval mode, the trained model in train mode
        return forward(model, batch, **kwargs)

    monkeypatch.setattr(grpo, "packed_logprobs", counting)
    model, tok = _load()
    train(GRPOConfig(output_dir=str(tmp_path), steps=1, num_iterations=3, ref_model_sync_steps=1, **TINY),
          model=model, tokenizer=tok, reward_funcs=[alternate])
    assert calls.count(True) == 3 * calls.count(False) > 0
    assert _metrics(tmp_path)[0]["ref/last_sync_step"] == 3


@pytest.mark.parametrize("given, message", [
    (dict(), "sync_ref_model=True with beta=0: the KL term is off, so there is no reference model to synchronize"),
    (dict(beta=0.1, lora_r=4), "sync_ref_model=True with LoRA (lora_r=4): the reference is the base model with its "
                               "adapters off"),
    (dict(beta=0.1, ref_model_sync_steps=0), "ref_model_sync_steps=0 must be a whole number >= 1"),
    (dict(beta=0.1, ref_model_mixup_alpha=1.5), "ref_model_mixup_alpha=1.5 must be in [0, 1]"),
])
def test_refused_where_trl_refuses_it_or_the_values_cannot_work(given, message):
    with pytest.raises(ValueError) as info:
        GRPOConfig(output_dir="x", sync_ref_model=True, **given)
    assert message in str(info.value)


def test_sdpo_refuses_it_beside_the_initial_teacher_and_takes_it_beside_the_others():
    from treerl.learners.async_grpo import AsyncGRPOConfig
    from treerl.learners.sdpo import SDPOConfig

    with pytest.raises(ValueError, match="teacher='initial': the initial teacher is the --beta reference"):
        SDPOConfig(output_dir="x", sync_ref_model=True, beta=0.1, teacher="initial")
    assert SDPOConfig(output_dir="x", sync_ref_model=True, beta=0.1, teacher="ema").sync_ref_model
    assert AsyncGRPOConfig(output_dir="x", sync_ref_model=True, beta=0.1).sync_ref_model


def test_trls_options_are_taken_as_keywords_flags_and_yaml(tmp_path):
    import treerl
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    cfg = treerl.GRPOConfig(output_dir="x", beta=0.04, sync_ref_model=True, ref_model_mixup_alpha=0.9,
                            ref_model_sync_steps=64)
    assert (cfg.sync_ref_model, cfg.ref_model_mixup_alpha, cfg.ref_model_sync_steps) == (True, 0.9, 64)
    # TRL's defaults are treerl's, and a TRL config written out with sync_ref_model=False is taken as it is.
    off = GRPOConfig(output_dir="x", sync_ref_model=False, ref_model_mixup_alpha=0.6, ref_model_sync_steps=512)
    assert (off.sync_ref_model, off.ref_model_mixup_alpha, off.ref_model_sync_steps) == (False, 0.6, 512)
    (tmp_path / "c.yaml").write_text("ref_model_sync_steps: 8\n")
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml"),
                                      "--beta", "0.1", "--sync-ref-model", "true", "--ref-model-mixup-alpha", "0.5"])
    cfg = config_from_args(GRPOConfig, args)
    assert (cfg.sync_ref_model, cfg.ref_model_mixup_alpha, cfg.ref_model_sync_steps) == (True, 0.5, 8)


@pytest.mark.parametrize("learner", ["sdpo", pytest.param("async_grpo", marks=pytest.mark.slow)])  # processes
def test_sdpo_and_async_grpo_sync_their_trainers_reference_too(tmp_path, learner):
    """Both train through the learner core's reference (AsyncGRPO's trainer, not its generators, has one)."""
    from treerl.learners.async_grpo import AsyncGRPOConfig, train_async
    from treerl.learners.sdpo import SDPOConfig
    from treerl.learners.sdpo import train as train_sdpo

    config, run = {"sdpo": (SDPOConfig, train_sdpo), "async_grpo": (AsyncGRPOConfig, train_async)}[learner]
    extra = {"teacher": "ema"} if learner == "sdpo" else {"max_staleness": 0}
    model, tok = _load()
    run(config(output_dir=str(tmp_path), steps=2, ref_model_sync_steps=1, **TINY, **extra), model=model,
        tokenizer=tok, reward_funcs=[alternate])
    first = _checkpoint(tmp_path, 1, "reference.safetensors")
    _assert_weights(_checkpoint(tmp_path, 2, "reference.safetensors"),
                    _mix(_checkpoint(tmp_path, 2, "model.safetensors"), first, 0.6))
    assert [m["ref/last_sync_step"] for m in _metrics(tmp_path)] == [1, 2]


def test_minibatches_count_as_optimizer_steps_and_their_reference_log_probs_are_the_generations(tmp_path):
    """With num_minibatches=2 (TRL's steps_per_generation) a step takes 2 optimizer steps: ref_model_sync_steps=2
    syncs at the end of each step, after its second minibatch's update (as TRL's global_step counts them), and
    every minibatch's reference log-probs come from one pass before the step's first update."""
    model, tok = _load()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    train(GRPOConfig(output_dir=str(tmp_path), steps=1, num_minibatches=2, ref_model_sync_steps=2,
                     **{**TINY, "group_size": 4}),
          model=model, tokenizer=tok, reward_funcs=[alternate],
          callbacks=[lambda step, metrics: calls.append(metrics["ref/last_sync_step"])])
    assert calls == [2]
    start = {k: start[k] for k in _checkpoint(tmp_path, 1, "model.safetensors")}
    _assert_weights(_checkpoint(tmp_path, 1, "reference.safetensors"),
                    _mix(_checkpoint(tmp_path, 1, "model.safetensors"), start, 0.6))
