"""The GRPO learner end to end on the shipped tiny model: it trains, logs, checkpoints and resumes."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from treerl.learners.grpo import GRPOConfig, train

SMALL = dict(steps=2, tasks_per_step=2, group_size=4, max_new_tokens=48, eval_episodes=0, progress=False,
             num_threads=1)


def _load():
    from treerl.models import load_default_model

    return load_default_model()


def test_learner_end_to_end(tmp_path):
    model, tok = _load()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(GRPOConfig(output_dir=str(tmp_path), **{**SMALL, "eval_episodes": 4}),
                   model=model, tokenizer=tok)
    assert result.policy_version == 2
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "training must change the parameters"
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        for key in ("reward/mean", "loss/policy", "tree/packing_ratio", "perf/tokens_per_s", "tools/invalid_rate"):
            assert math.isfinite(m[key]), key
    trained = [m for m in lines if m["train/skipped_groups_frac"] < 1.0]
    assert trained, "at least one step must train on something"
    for m in trained:  # metrics of trained terms exist when something was trained
        assert math.isfinite(m["entropy/mean"]) and math.isfinite(m["is/ratio_mean"])
        # The sampler and the trainer compute the same distribution: importance ratios ~ 1.
        assert abs(m["is/ratio_mean"] - 1.0) < 1e-3
    assert lines[-1]["policy/version"] == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_start"]["episodes"] == 4 and summary["eval_end"]["episodes"] == 4
    # The saved model loads with from_pretrained and holds the trained weights.
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(result.model_dir)
    for k, v in saved.state_dict().items():
        assert torch.allclose(v, model.state_dict()[k]), k
    # The checkpoint reloads into a fresh model.
    fresh, _ = _load()
    from safetensors.torch import load_model

    load_model(fresh, str(tmp_path / "checkpoints" / "step-2" / "model.safetensors"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    # The README's table of metrics names every key a step logged (KIND: a tool-call outcome, a diagnostic).
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    documented = set(re.findall(r"`([a-z_]+/[A-Za-z_]+)`", readme)) | {"lr"}
    logged = {re.sub(r"^(tool_calls|diag)/.*", r"\1/KIND", k) for m in lines for k in m if k != "step"}
    assert logged <= documented, sorted(logged - documented)



def test_an_environments_own_metrics_are_logged_as_their_mean_over_the_steps_episodes(tmp_path):
    from treerl.envs import Task, ToolEnv
    from treerl.rollout import read_groups

    class Reporting(ToolEnv):  # two numbers per episode: how much the model wrote, and whether its answer was even
        system_prompt = "Say anything."

        def sample_task(self, rng):
            return Task(prompt="hello", answer="x")

        def score(self, task, completion):
            return float(len(completion) % 2 == 0)

        def episode_metrics(self):
            return {"written": sum(len(m["content"] or "") for m in self.messages if m["role"] == "assistant"),
                    "even": self.final_reward == 1.0}

    model, tok = _load()
    train(GRPOConfig(output_dir=str(tmp_path), **{**SMALL, "group_size": 2, "max_new_tokens": 16}),
          model=model, tokenizer=tok, env_factory=lambda: Reporting(max_turns=1))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for m in lines:  # every group of a step is kept (sample_groups 4 >= tasks_per_step 2)
        episodes = [e for g in read_groups(tmp_path / "trajectories" / f"step-{m['step']:06d}.jsonl")
                    for e in g.episodes]
        assert len(episodes) == 4
        assert all(e.metrics["env/even"] == float(e.rewards[-1] == 1.0) for e in episodes)
        assert m["env/even"] == pytest.approx(sum(e.rewards[-1] for e in episodes) / 4)
        written = [sum(len(m["content"] or "") for m in e.messages if m["role"] == "assistant") for e in episodes]
        assert len(set(written)) > 1 and m["env/written"] == pytest.approx(sum(written) / 4)
    # The README names them, as env/KEY.
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    documented = set(re.findall(r"`([a-z_]+/[A-Za-z_]+)`", readme)) | {"lr"}
    logged = {re.sub(r"^(tool_calls|diag)/.*", r"\1/KIND", re.sub(r"^env/.*", "env/KEY", k)) for m in lines for k in m
              if k != "step"}
    assert logged <= documented, sorted(logged - documented)


def test_reward_functions_with_trl_signature_are_weighted_in(tmp_path):
    model, tok = _load()
    seen = {}

    def short_answers(prompts, completions, completion_ids, answer, log_metric, **kwargs):
        seen.update(n=len(completions), answer=answer[0], prompt_roles=[m["role"] for m in prompts[0]],
                    kinds={type(c).__name__ for c in completions}, ids=len(completion_ids[0]))
        state = kwargs["trainer_state"]  # TRL's: a schedule reads the step
        seen.setdefault("steps", []).append((state.global_step, state.max_steps))
        log_metric("calls", 1.0)
        return [10.0 / (10 + len(ids)) for ids in completion_ids]  # shorter is better, never 0

    train(GRPOConfig(output_dir=str(tmp_path), **{**SMALL, "steps": 2}), model=model, tokenizer=tok,
          reward_funcs=[short_answers], reward_weights=[1.0, 0.5])
    assert seen["steps"] == [(0, 2), (1, 2)]
    assert seen["n"] == 8 and seen["prompt_roles"] == ["system", "user"] and seen["kinds"] == {"list"}
    assert seen["answer"] is not None and seen["ids"] > 0
    metrics = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["reward_fn/calls"] == 1.0 and "reward_fn/short_answers_mean" in metrics
    # reward/mean is the weighted sum trained on (as TRL's `reward`); the environment's own beside it.
    want = 1.0 * metrics["reward/env_mean"] + 0.5 * metrics["reward_fn/short_answers_mean"]
    assert metrics["reward/mean"] == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError, match="reward_weights"):
        train(GRPOConfig(output_dir=str(tmp_path / "x"), **SMALL), model=model, tokenizer=tok,
              reward_funcs=[short_answers], reward_weights=[1.0])


def test_num_iterations_updates_several_times_against_the_first_weights(tmp_path):
    model, tok = _load()
    made = []

    def adamw(params):
        made.append(torch.optim.AdamW(params, lr=0.05))
        return made[-1]

    def schedule(completions, trainer_state, **kwargs):  # TRL's trainer_state counts optimizer steps
        made.append((trainer_state.global_step, trainer_state.max_steps))
        return [0.0] * len(completions)

    train(GRPOConfig(output_dir=str(tmp_path), loss="grpo", num_iterations=3, **{**SMALL, "steps": 1,
                                                                                  "tasks_per_step": 4}),
          model=model, tokenizer=tok, optimizer=adamw, reward_funcs=[schedule])
    optimizer, states = made
    assert states == (0, 3)
    assert {int(state["step"]) for state in optimizer.state.values()} == {3}  # three updates on one step's episodes
    [m] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The last update's ratio is to the weights before the first, which it has left: the clip acts (at
    # num_iterations 1 the ratio is 1 and nothing ever clips).
    assert m["clip/region_frac"] > 0


def test_num_iterations_takes_the_old_log_probs_from_the_first_updates_forward(tmp_path, monkeypatch):
    """Each update forwards each micro-batch once; no forward of its own for the old policy's log-probs."""
    from treerl.learners import grpo

    model, tok = _load()
    forwards, windows = [], []
    packed_logprobs, optimize = grpo.packed_logprobs, grpo.optimize

    def counted_logprobs(m, *args, **kwargs):
        forwards.append(m is model)  # the trained model's (not the reference's)
        return packed_logprobs(m, *args, **kwargs)

    def counted_optimize(m, optimizer, scheduler, batches, *args, **kwargs):
        windows.append(len(batches))
        return optimize(m, optimizer, scheduler, batches, *args, **kwargs)

    monkeypatch.setattr(grpo, "packed_logprobs", counted_logprobs)
    monkeypatch.setattr(grpo, "optimize", counted_optimize)
    train(GRPOConfig(output_dir=str(tmp_path), num_iterations=2, skip_zero_advantage=False, **{**SMALL, "steps": 1}),
          model=model, tokenizer=tok)
    assert len(windows) == 2 and windows[0] > 0
    assert sum(forwards) == sum(windows)


def test_lora_trains_the_adapter_and_the_policy_gets_merged_weights(tmp_path):
    model, tok = _load()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(GRPOConfig(output_dir=str(tmp_path), lora_r=4, learning_rate=1e-2, **{**SMALL, "steps": 1}),
                   model=model, tokenizer=tok)
    assert result.policy_version == 1
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(result.model_dir).state_dict()
    assert set(merged) >= {k for k in base if "lora" not in k}
    differs = [k for k in base if k in merged and not torch.allclose(merged[k], base[k])]
    assert differs and all("proj" in k for k in differs)  # only adapted linear layers moved


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="output_dir is required"):
        GRPOConfig()
    with pytest.raises(ValueError, match="loss="):
        GRPOConfig(output_dir="x", loss="ppo2")
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(output_dir="x", group_size=1)
    with pytest.raises(ValueError, match="top_k"):
        GRPOConfig(output_dir="x", top_p=0.9)


def _learn(args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "treerl.cli", "learn", *args], capture_output=True, text=True,
                          env=env, **kw)


@pytest.mark.slow  # two learn processes: about 17 s
def test_learn_cli_reads_yaml_config_and_flags_override(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("steps: 1\ntasks-per-step: 1\ngroup_size: 2\nmax_new_tokens: 16\neval_episodes: 0\n"
                      "progress: false\n")
    r = _learn(["--config", str(config), "--output-dir", str(tmp_path / "run"), "--group-size", "3"], timeout=300)
    assert r.returncode == 0, r.stderr
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["steps"] == 1 and saved["group_size"] == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    r = _learn(["--config", str(bad), "--output-dir", str(tmp_path / "run2")])
    assert r.returncode != 0 and "stepz" in r.stderr


def test_a_second_run_into_the_same_output_dir_is_refused_unless_it_resumes_or_overwrites(tmp_path, capsys):
    from treerl.cli import main

    out = tmp_path / "run"
    small = ["--output-dir", str(out), "--tasks-per-step", "1", "--group-size", "2", "--max-new-tokens", "16",
             "--eval-episodes", "0", "--progress", "false", "--num-threads", "1", "--save-every", "1"]
    assert main(["learn", "--steps", "2", *small]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert json.loads((out / "config.json").read_text())["learner"] == "grpo"  # treerl compare shows it
    capsys.readouterr()
    # Without --resume the new run would append its steps to the first's and leave its checkpoints behind.
    assert main(["learn", "--steps", "1", *small]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier run (metrics.jsonl, checkpoints, model)" in err and "--overwrite-output-dir" in err
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    (out / "notes.txt").write_text("mine")
    assert main(["learn", "--steps", "1", "--overwrite-output-dir", "true", *small]) == 0
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]  # the first run's step-2 is gone
    assert (out / "notes.txt").read_text() == "mine"  # only what a learner writes is removed


def test_save_total_limit_keeps_the_latest_checkpoints(tmp_path):
    """TRL's save_total_limit: checkpoints older than the N latest are removed as new ones are written."""
    from treerl.cli import main

    out = tmp_path / "run"
    assert main(["learn", "--steps", "3", "--save-steps", "1", "--save-total-limit", "2", "--output-dir", str(out),
                 "--tasks-per-step", "1", "--group-size", "2", "--max-new-tokens", "8", "--eval-episodes", "0",
                 "--progress", "false", "--num-threads", "1"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-3"]


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
def test_resume_starts_over_without_a_checkpoint_and_names_what_does_not_fit(tmp_path, capsys):
    import shutil

    from treerl.cli import main

    out = tmp_path / "run"
    small = ["--output-dir", str(out), "--tasks-per-step", "1", "--group-size", "2", "--max-new-tokens", "16",
             "--eval-episodes", "0", "--progress", "false", "--num-threads", "1"]

    def steps(name="metrics.jsonl"):
        return [json.loads(line)["step"] for line in (out / name).read_text().splitlines()]

    assert main(["learn", "--steps", "2", *small]) == 0
    shutil.rmtree(out / "checkpoints")  # as a run killed before its first checkpoint leaves it
    capsys.readouterr()
    assert main(["learn", "--steps", "2", "--resume", "true", *small]) == 0
    assert "no checkpoint" in capsys.readouterr().err and steps() == [1, 2]  # not 1, 2, 1, 2
    # A resumed run with other settings says which; one whose weights do not fit is one line, exit 2.
    assert main(["learn", "--steps", "3", "--resume", "true", "--seed", "5", *small]) == 0
    assert "seed 0 -> 5" in capsys.readouterr().err and steps() == [1, 2, 3]
    assert main(["learn", "--steps", "4", "--resume", "true", "--lora-r", "4", *small]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "does not fit this run's model" in err[-1] and "--lora-r" in err[-1] and "Traceback" not in "".join(err)


@pytest.mark.slow  # kill-and-resume: the slow pass of CI runs it
def test_killed_run_resumes_to_the_same_weights(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--steps", "6", "--tasks-per-step", "2", "--group-size", "4", "--max-new-tokens", "32",
              "--eval-episodes", "0", "--progress", "false", "--save-every", "1", "--num-threads", "1"]
    straight = _learn([*common, "--output-dir", str(tmp_path / "a")], env=env, timeout=600)
    assert straight.returncode == 0, straight.stderr

    out = tmp_path / "b"
    proc = subprocess.Popen([sys.executable, "-m", "treerl.cli", "learn", *common, "--output-dir", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:  # kill once step 2 is checkpointed
        if (out / "checkpoints" / "step-2").exists():
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "checkpoints" / "step-6").exists()
    resumed = _learn([*common, "--output-dir", str(out), "--resume", "true"], env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    a = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    b = load_file(str(out / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) == [1, 2, 3, 4, 5, 6]  # lines past the checkpoint were replayed, not doubled


@pytest.mark.parametrize("lora_r", [0, 4])
def test_kl_to_a_reference_model_when_beta_is_set(tmp_path, lora_r):
    model, tok = _load()
    train(GRPOConfig(output_dir=str(tmp_path), beta=0.1, learning_rate=5e-3 if lora_r == 0 else 5e-2, lora_r=lora_r,
                     **{**SMALL, "steps": 2}),
          model=model, tokenizer=tok)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
    assert lines[1]["loss/kl"] > 0  # after one update the two differ


def test_diagnostics_fire_with_kind_value_threshold_and_action(tmp_path):
    from treerl.learners.diagnostics import CHECKS, Diagnostics

    d = Diagnostics(tmp_path / "d.jsonl")
    assert (tmp_path / "d.jsonl").read_text() == ""  # there from the start, as the README lists it
    bad = {"reward/zero_std_frac": 1.0, "episode/length_limit_frac": 1.0, "is/ratio_max": 50.0,
           "clip/region_frac": 0.9, "entropy/mean": 0.001}
    fired = d.check(1, bad)
    assert set(fired) == {f"diag/{c.kind}" for c in CHECKS}
    good = {"reward/zero_std_frac": 0.1, "episode/length_limit_frac": 0.0, "is/ratio_max": 1.1,
            "clip/region_frac": 0.01, "entropy/mean": 0.5}
    assert d.check(2, good) == {}
    for step, rate in enumerate([0.0] * 5 + [0.5] * 5, start=3):
        fired = d.check(step, {"tools/invalid_rate": rate})
    assert fired == {"diag/tool_errors_rising": 1.0}
    records = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert {"step", "kind", "value", "threshold", "action"} <= set(records[0])
    assert records[-1]["kind"] == "tool_errors_rising"


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
def test_skipping_zero_advantage_groups_gives_the_same_update():
    import asyncio
    import copy

    import treerl
    from treerl.agents import TransformersPolicy
    from treerl.kernels.tree_attention import enable_tree_attention
    from treerl.learners.distributed import Ranks
    from treerl.learners.grpo import optimize, pack_step
    from treerl.rollout.engine import RolloutEngine

    torch.set_num_threads(1)
    model, tok = _load()
    cfg = GRPOConfig(output_dir="unused", learning_rate=1e-2, max_new_tokens=24)
    engine = RolloutEngine(TransformersPolicy(copy.deepcopy(model), tok), tok, params=cfg.sampling(), seed=0)
    groups, _ = asyncio.run(engine.run(lambda: treerl.make(cfg.env), cfg.env, range(3), 4))
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0] + [0.0] * 4 + [0.3, 0.0, -0.3, 0.0])  # group 1 contributes nothing

    def step(skip: bool, adv: torch.Tensor):
        m = copy.deepcopy(model)
        enable_tree_attention(m, impl="segment")
        # SGD with momentum: Adam's g/|g| would turn float noise in near-zero gradients into
        # lr-sized differences, hiding what is compared here (the gradients).
        opt = torch.optim.SGD(m.parameters(), lr=cfg.learning_rate, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        for _ in range(2):  # two steps, so AdamW's moments carry over as in training
            metrics: dict = {}
            batches, normalizer = pack_step(groups, adv, cfg, Ranks(), metrics, skip_zero_advantage=skip)
            optimize(m, opt, sched, batches, cfg, "cpu", metrics, normalizer=normalizer)
            adv = torch.zeros_like(adv)  # the second step has nothing to learn: momentum alone moves weights
        return m.state_dict(), metrics

    full, _ = step(False, adv)
    skipped, metrics = step(True, adv)
    assert metrics["train/skipped_groups_frac"] == 1.0
    for k in full:
        assert torch.allclose(full[k], skipped[k], atol=1e-6, rtol=1e-5), k


def _equal_batches(a, b) -> bool:
    """Field by field, tensors exactly (the tree layouts by their segments)."""
    import dataclasses

    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for f in dataclasses.fields(x):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if isinstance(u, torch.Tensor):
                if not (u.dtype == v.dtype and torch.equal(u, v)):
                    return False
            elif f.name == "layouts":
                if [(t.seg_len.tolist(), t.seg_parent.tolist()) for t in u.layouts] != [
                        (t.seg_len.tolist(), t.seg_parent.tolist()) for t in v.layouts]:
                    return False
            elif u != v:
                return False
    return True


def test_a_step_that_skips_groups_packs_once_and_trains_on_the_same_batches(monkeypatch):
    """Skipping zero-advantage groups packed the step twice (every group, then the kept ones
    again); one packing now lays the kept groups in rows and counts the skipped ones' terms.
    The batches and the normalizer are exactly those of the two packings."""
    import dataclasses

    import numpy as np

    from treerl.learners import grpo
    from treerl.learners.distributed import Ranks
    from treerl.learners.packing import pack_groups
    from treerl.rollout.trajectory import Group

    def group(key: int, n: int) -> Group:
        g = Group(task_key=str(key), env_id="test")
        root = g.add_segment("prompt", [5, 6, 7, 8 + key])
        for i in range(n):
            turn = g.add_segment("sampled", [20 + i, 30 + key, 40], parent=root, logprobs=[-1.0, -0.5, -0.25],
                                 candidates=[[20 + i, 3], [30 + key], [40, 1, 2]])
            tool = g.add_segment("env", [9, 9], parent=turn)
            g.add_episode(leaf=g.add_segment("sampled", [50 + i] * (i + 1), parent=tool, logprobs=[-0.1] * (i + 1)),
                          reward=float(i))
        return g

    groups = [group(k, n) for k, n in enumerate([2, 3, 2, 4, 1])]
    adv = torch.tensor([0.0, 0.0] + [0.5, -0.25, -0.25] + [0.0, 0.0] + [1.0, 0.0, -1.0, 0.0] + [0.0])
    cfg = GRPOConfig(output_dir="unused", max_tokens_per_row=40)

    # The two packings the step did before, as it did them.
    full = pack_groups(groups, adv, cfg.packing_config())
    want_normalizer = Ranks().normalizer(full)
    starts = np.cumsum([0] + [len(g.episodes) for g in groups])
    keep = [1, 3]
    full_index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in keep])
    sub = pack_groups([groups[i] for i in keep], torch.cat([adv[starts[i]:starts[i + 1]] for i in keep]),
                      cfg.packing_config())
    want = [dataclasses.replace(b, term_episode=full_index[b.term_episode], num_episodes=full[0].num_episodes,
                                episode_num_tokens=full[0].episode_num_tokens) for b in sub]

    calls = []
    monkeypatch.setattr(grpo, "pack_groups", lambda *a, **k: calls.append(1) or pack_groups(*a, **k))
    metrics: dict = {}
    batches, normalizer = grpo.pack_step(groups, adv, cfg, Ranks(), metrics, skip_zero_advantage=True)
    assert len(calls) == 1
    assert len(want) > 1 and _equal_batches(batches, want)
    assert (normalizer.num_tokens, normalizer.num_sequences) == (want_normalizer.num_tokens,
                                                                  want_normalizer.num_sequences)
    assert torch.equal(normalizer.episode_num_tokens, want_normalizer.episode_num_tokens)
    assert metrics["train/skipped_groups_frac"] == 1.0 - 2 / 5

    calls.clear()  # nothing skipped: the one packing of every group; everything skipped: no rows
    batches, normalizer = grpo.pack_step(groups, adv + 1.0, cfg, Ranks(), metrics, skip_zero_advantage=True)
    assert len(calls) == 1 and _equal_batches(batches, pack_groups(groups, adv + 1.0, cfg.packing_config()))
    assert grpo.pack_step(groups, adv * 0, cfg, Ranks(), metrics, skip_zero_advantage=True) == ([], None)


def test_a_learner_step_that_skips_some_groups_packs_once(tmp_path, monkeypatch):
    from treerl.learners import grpo

    model, tok = _load()
    advantages, pack_groups = grpo.advantages, grpo.pack_groups
    calls = []

    def first_group_without_advantage(groups, *args, **kwargs):
        adv = advantages(groups, *args, **kwargs).clone()
        adv[:len(groups[0].episodes)] = 0.0
        adv[len(groups[0].episodes):] = torch.linspace(-1.0, 1.0, len(adv) - len(groups[0].episodes))
        return adv

    monkeypatch.setattr(grpo, "advantages", first_group_without_advantage)
    monkeypatch.setattr(grpo, "pack_groups", lambda *a, **k: calls.append(1) or pack_groups(*a, **k))
    train(GRPOConfig(output_dir=str(tmp_path), **{**SMALL, "steps": 1}), model=model, tokenizer=tok)
    metrics = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["train/skipped_groups_frac"] == 0.5
    assert len(calls) == 1


def test_callbacks_see_each_steps_logged_metrics(tmp_path):
    """TRL users' per-step hooks (TrainerCallback.on_log): train(callbacks=[f]) calls f(step, metrics)."""
    model, tok = _load()
    seen = []
    train(GRPOConfig(output_dir=str(tmp_path), **SMALL), model=model, tokenizer=tok,
          callbacks=[lambda step, metrics: seen.append((step, metrics))])
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [step for step, _ in seen] == [1, 2]
    for (_, metrics), line in zip(seen, logged):
        assert metrics["reward/mean"] == line["reward/mean"] and metrics["policy/version"] == line["policy/version"]


def test_is_ratio_max_is_the_largest_ratio_of_the_step_not_a_mean_over_micro_batches():
    """With several micro-batches (a row each by default), is/ratio_max is the step's largest
    sampler/trainer ratio, as sampler_trainer_mismatch reads it: a spike in one row must not be
    averaged with the others' maxima."""
    import copy

    from treerl.kernels.tree_attention import enable_tree_attention
    from treerl.learners.grpo import optimize
    from treerl.learners.packing import pack_groups
    from treerl.rollout.trajectory import Group

    torch.set_num_threads(1)
    model, _ = _load()
    enable_tree_attention(model, impl="segment")
    cfg = GRPOConfig(output_dir="unused", max_tokens_per_row=16)

    def group(key: str, sampler_logp: float) -> Group:
        g = Group(task_key=key, env_id="test")
        root = g.add_segment("prompt", [5, 6, 7, 8])
        for i in range(2):
            tokens = [20 + i, 30 + i, 40 + i]
            g.add_episode(leaf=g.add_segment("sampled", tokens, parent=root, logprobs=[sampler_logp] * 3),
                          reward=float(i))
        return g

    groups = [group("calm", -3.0), group("spike", -12.0), group("calm-2", -3.0)]
    adv = torch.tensor([-1.0, 1.0] * 3)
    batches = pack_groups(groups, adv, cfg.packing_config())
    assert len(batches) == 3  # one row, one micro-batch, per group

    def ratio_max(some) -> float:
        metrics: dict = {}
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        optimize(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), some, cfg, "cpu", metrics)
        return metrics["is/ratio_max"]

    alone = [ratio_max([b]) for b in batches]
    assert alone[1] > 10 * max(alone[0], alone[2])
    assert ratio_max(batches) == pytest.approx(max(alone))


def test_a_micro_batch_reads_back_only_its_two_input_checks():
    """On an accelerator every value read back from a device tensor is a host sync: the CPU waits
    for the micro-batch's queued forward or backward before it can queue the next. The window's
    metrics are read once after the last micro-batch, so an extra micro-batch adds only the
    range checks of its log-prob targets and loss episodes (it added 14 reads: 10 of them the
    metrics, read one by one)."""
    import copy

    from _helpers import HostReads
    from treerl.kernels.tree_attention import enable_tree_attention
    from treerl.learners.grpo import optimize
    from treerl.learners.packing import pack_groups
    from treerl.rollout.trajectory import Group

    torch.set_num_threads(1)
    model, _ = _load()
    enable_tree_attention(model, impl="segment")
    cfg = GRPOConfig(output_dir="unused", max_tokens_per_row=16)
    groups = []
    for key in range(3):
        g = Group(task_key=str(key), env_id="test")
        root = g.add_segment("prompt", [5, 6, 7, 8])
        for i in range(2):
            g.add_episode(leaf=g.add_segment("sampled", [20 + i, 30 + key, 40], parent=root, logprobs=[-1.0] * 3),
                          reward=float(i))
        groups.append(g)
    batches = pack_groups(groups, torch.tensor([-1.0, 1.0] * 3), cfg.packing_config())
    assert len(batches) == 3

    def reads(some) -> int:
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        optimize(m, opt, sched, some, cfg, "cpu", {})  # builds and caches each layout's attention plan
        with HostReads() as counted:
            optimize(m, opt, sched, some, cfg, "cpu", {})
        return counted.count

    assert reads(batches) - reads(batches[:1]) == 2 * 2


def test_lora_setup_prints_no_other_librarys_deprecation(tmp_path):
    """peft reads an attribute transformers renamed; its FutureWarning on every LoRA run is not the user's to act on."""
    import warnings

    from treerl.learners.core import _apply_lora

    model, _ = _load()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _apply_lora(model, GRPOConfig(output_dir=str(tmp_path), lora_r=4))


def test_lora_target_modules_choose_the_adapted_layers_as_in_trl(tmp_path):
    from treerl.errors import ConfigError
    from treerl.learners.core import _apply_lora

    def adapted(**kwargs):
        model, _ = _load()
        lora = _apply_lora(model, GRPOConfig(output_dir=str(tmp_path), lora_r=4, **kwargs))
        return {name.split(".")[-4] for name, _ in lora.named_parameters() if name.endswith("lora_A.default.weight")}

    assert adapted(lora_target_modules=["q_proj", "v_proj"]) == {"q_proj", "v_proj"}
    assert adapted() == adapted(lora_target_modules=["all-linear"]) and {"q_proj", "down_proj"} <= adapted()
    with pytest.raises(ConfigError, match=r"lora_target_modules: qkv names no module of this model; its linear "
                                          r"layers are .*q_proj"):
        adapted(lora_target_modules=["qkv"])


def test_the_held_out_lines_count_the_episodes_played_when_the_data_has_fewer_rows(tmp_path, capsys):
    from treerl.cli import main

    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(2)))
    assert main(["learn", "--env", "treerl/MathVerify-v0", "--env-kwargs", json.dumps({"data_path": str(data)}),
                 "--eval-env-kwargs", json.dumps({"data_path": str(data)}), "--eval-episodes", "4",
                 "--steps", "1", "--tasks-per-step", "1", "--group-size", "2", "--max-new-tokens", "8",
                 "--progress", "false", "--num-threads", "1", "--output-dir", str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    # Each of the 2 rows is played once: "over 4" claimed episodes that never ran.
    assert "over 2 held-out episodes" in err
    assert "over 2 episodes" in out


def test_eval_every_evaluates_during_training_and_a_resumed_run_continues_the_schedule(tmp_path, capsys):
    """TRL's eval_strategy="steps": the held-out figures every N steps in that step's metrics (under eval/, the names
    of summary.json's), step 0 the start's; a run resumed from a checkpoint neither repeats nor skips one."""
    import shutil

    from treerl.cli import main

    out = tmp_path / "run"
    small = ["--output-dir", str(out), "--tasks-per-step", "1", "--group-size", "2", "--max-new-tokens", "8",
             "--eval-episodes", "2", "--eval-every", "2", "--save-every", "1", "--progress", "false",
             "--num-threads", "1"]

    def evaluated():
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [m["step"] for m in lines], {m["step"]: m for m in lines if "eval/success_rate" in m}

    assert main(["learn", "--steps", "3", *small]) == 0
    steps, evals = evaluated()
    # and at the last step, as transformers' Trainer evaluates at the end of training: the end's figures
    assert steps == [0, 1, 2, 3] and sorted(evals) == [0, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_end"]["wall_s"] == evals[3]["eval/wall_s"]
    assert evals[0]["eval/success_rate"] == summary["eval_start"]["success_rate"]  # step 0: the start's figures
    assert evals[2]["eval/episodes"] == 2 and {"eval/reward/mean", "eval/reward/std"} <= set(evals[2])
    assert "eval at step 2: success rate" in capsys.readouterr().err
    shutil.rmtree(out / "checkpoints" / "step-3")  # as a run killed after step 3, before its checkpoint
    assert main(["learn", "--steps", "4", "--resume", "true", *small]) == 0
    steps, evals = evaluated()
    assert steps == [0, 1, 2, 3, 4] and sorted(evals) == [0, 2, 4]
    # An evaluation at the last step is the one at the end: the same weights are not evaluated twice.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_end"]["wall_s"] == evals[4]["eval/wall_s"]
    err = capsys.readouterr().err
    assert "warning: resuming with settings" not in err and "eval at step 2" not in err


def test_eval_on_start_false_and_eval_every_without_episodes(tmp_path, capsys):
    from treerl.cli import main
    from treerl.errors import ConfigError

    small = ["--tasks-per-step", "1", "--group-size", "2", "--max-new-tokens", "8", "--steps", "1", "--progress",
             "false", "--num-threads", "1"]
    out = tmp_path / "run"
    assert main(["learn", "--eval-episodes", "2", "--eval-every", "1", "--eval-on-start", "false", "--output-dir",
                 str(out), *small]) == 0
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_start"] is None and summary["eval_end"]["episodes"] == 2
    assert "held-out success rate at the end: " in capsys.readouterr().out  # said without a start to compare
    with pytest.raises(ConfigError, match="eval_every=1 evaluates the held-out episodes every N steps, but "
                                          "eval_episodes=0 plays none"):
        train(GRPOConfig(output_dir=str(tmp_path / "none"), **{**SMALL, "eval_every": 1}))
