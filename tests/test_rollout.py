"""The rollout engine on the shipped tiny model: token-exact trees, branching, limits, storage, resume."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import treerl
from treerl.agents import ChatRenderer, SamplingParams, TransformersPolicy
from treerl.envs import EnvError, Task, ToolEnv
from treerl.rollout.engine import RolloutEngine
from treerl.rollout import Group, GroupWriter, read_all_groups, read_groups, to_flat_records

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)  # small ops on a shared 2-core machine are faster on one thread
    from treerl.models import load_default_model

    return load_default_model()


def run(engine: RolloutEngine, env_id: str, num_tasks: int, group_size: int, **env_kwargs):
    return asyncio.run(engine.run(lambda: treerl.make(env_id, **env_kwargs), env_id, range(num_tasks), group_size))


def test_paths_are_exactly_what_the_model_saw(tiny):
    model, tok = tiny
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=48), seed=1)
    groups, stats = run(engine, "treerl/Calculator-v0", num_tasks=3, group_size=3)
    assert [len(g.episodes) for g in groups] == [3, 3, 3]
    renderer = ChatRenderer(tok, tools=treerl.make("treerl/Calculator-v0").tool_schemas)
    for g in groups:
        prompt = g.segments[0]
        assert prompt.kind == "prompt"
        for e in g.episodes:
            path = e.path()
            assert path[0] is prompt  # every generation hangs off the one shared prompt
            assert [s.kind for s in path[1:]] == ["sampled", "env"] * (len(path) // 2 - 1) + ["sampled"]
            assert not e.extra_leaves  # the tiny model's template is append-only
            # The whole path, decoded, is the conversation rendered by the template, turn after turn.
            history, last = e.messages[:-1], e.messages[-1]
            text = renderer.render(history, add_generation_prompt=True) + last["content"]
            stop = path[-1].finish_reason == "stop"
            assert tok.decode(e.token_ids, skip_special_tokens=False) == text + ("<|im_end|>" if stop else "")
            # The prompt is tokenized exactly as the template renders it, with no re-tokenization after.
            assert prompt.token_ids == renderer.prompt_ids(history[:2])
            assert len(e.sampler_logprobs) == len(e.token_ids) == len(e.sampled_mask)
            assert all(lp <= 0 for lp, m in zip(e.sampler_logprobs, e.sampled_mask) if m)
            assert {v for v in e.policy_versions if v is not None} == {0}
    assert stats.summary()["tree/packing_ratio"] > 1.5  # 3 generations share each prompt


def test_prompt_is_prefilled_once_per_group(tiny):
    model, tok = tiny
    processed = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: processed.append(int((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[-1])),
        with_kwargs=True,
    )
    try:
        engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=8), seed=0)
        groups, _ = run(engine, "treerl/MathVerify-v0", num_tasks=1, group_size=4)
    finally:
        handle.remove()
    prompt_len = len(groups[0].segments[0].token_ids)
    prefill = sum(n for n in processed if n > 1)
    assert prefill == prompt_len  # 4 samples, one prefill of the shared prompt


def test_branching_forks_episodes_after_turn_k(tiny):
    model, tok = tiny
    params = SamplingParams(max_new_tokens=12)
    plain = RolloutEngine(TransformersPolicy(model, tok), tok, params=params, seed=3)
    branched = RolloutEngine(TransformersPolicy(model, tok), tok, params=params, seed=3, branch_at_turn=1, branch_factor=3)
    (g0,), _ = run(plain, "treerl/GuessNumber-v0", num_tasks=1, group_size=2, max_turns=3)
    (g1,), _ = run(branched, "treerl/GuessNumber-v0", num_tasks=1, group_size=2, max_turns=3)
    assert len(g0.episodes) == 2
    survived = [e for e in g0.episodes if e.metrics["turns"] > 1]
    assert len(g1.episodes) == 2 + 2 * len(survived)
    forked = [e for e in g1.episodes if len(e.metrics["generation"]) == 2]
    assert len(forked) == 3 * len(survived)
    for e in forked:  # siblings share everything up to the fork: prompt, first completion, its bridge
        siblings = [s for s in forked if s.metrics["generation"][0] == e.metrics["generation"][0]]
        shared = {tuple(id(seg) for seg in s.path()[:3]) for s in siblings}
        assert len(shared) == 1
    assert g1.packing_ratio > g0.packing_ratio


def test_episode_limits_are_recorded(tiny):
    model, tok = tiny
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=64),
                           max_episode_tokens=120, seed=0)
    groups, stats = run(engine, "treerl/GuessNumber-v0", num_tasks=2, group_size=2, max_turns=20)
    assert stats.terminations  # every episode has a reason
    for g in groups:
        for e in g.episodes:
            assert len(e.token_ids) <= 120
            assert e.termination in {"max_tokens", "correct", "max_turns"}


def test_a_completion_budget_bounds_every_token_after_the_prompt(tiny):
    """TRL's max_completion_length: an episode's completion (turns, tool results and the template's tokens
    between them) ends at max_completion_tokens, each turn sampling at most what is left of it."""
    model, tok = tiny
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=64),
                           max_completion_tokens=40, seed=0)
    groups, _ = run(engine, "treerl/GuessNumber-v0", num_tasks=2, group_size=2, max_turns=20)
    assert groups
    for g in groups:
        prompt = len(g.segments[0].token_ids)
        for e in g.episodes:
            assert len(e.token_ids) - prompt <= 40
            assert e.termination in {"max_tokens", "correct"}
    assert any(e.termination == "max_tokens" and len(e.path()) > 2 for g in groups for e in g.episodes)  # multi-turn
    with pytest.raises(ValueError, match="max_completion_tokens=0 must be >= 1"):
        RolloutEngine(TransformersPolicy(model, tok), tok, max_completion_tokens=0)


class _BrokenEnv(ToolEnv):
    system_prompt = "Say anything."

    def sample_task(self, rng):
        return Task(prompt="hello", answer="x")

    def score(self, task, completion):
        return 0.0

    async def astep(self, action):
        raise RuntimeError("verifier bug")


def test_environment_failure_is_recorded_not_raised(tiny):
    model, tok = tiny
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=4), seed=0)
    (group,), stats = asyncio.run(engine.run(lambda: _BrokenEnv(max_turns=1), "tests/Broken-v0", range(1), 2))
    assert [e.termination for e in group.episodes] == ["env_error", "env_error"]
    assert "verifier bug" in group.episodes[0].metrics["env_error"]


class _BadRewardEnv(treerl.Env):
    """A hand-written Gymnasium-style environment whose reward breaks the contract on some tasks."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.reward = [None, float("inf"), float("nan"), np.float32(0.5)][seed]
        return [{"role": "user", "content": "Say hi."}], {}

    def step(self, action):
        return [], self.reward, True, False, {}


def test_a_reward_that_is_not_a_finite_number_is_an_env_error_not_a_crash(tiny):
    model, tok = tiny
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=4), seed=0)
    groups, stats = asyncio.run(engine.run(_BadRewardEnv, "tests/BadReward-v0", range(4), 1))
    episodes = [g.episodes[0] for g in groups]
    assert [e.termination for e in episodes] == ["env_error", "env_error", "env_error", "terminated"]
    assert all("finite" in e.metrics["env_error"] for e in episodes[:3])
    assert [e.reward for e in episodes] == [0.0, 0.0, 0.0, 0.5]  # numpy scalars are numbers
    assert math.isfinite(stats.summary()["reward/mean"])


class _TextObservationEnv(_BadRewardEnv):
    """A text environment in the style of GEM or TextArena: its observation is a bare string."""

    def step(self, action):
        return "Wrong, try again.", 0.0, False, False, {}


def test_an_observation_that_is_not_a_list_of_messages_is_an_env_error_not_a_render_error(tiny):
    model, tok = tiny
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=4), seed=0)
    (group,), _ = asyncio.run(engine.run(_TextObservationEnv, "tests/TextObs-v0", range(3, 4), 1))
    (episode,) = group.episodes
    assert episode.termination == "env_error"
    assert "observation of type str" in episode.metrics["env_error"]


class _TextResetEnv(_BadRewardEnv):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed, options=options)
        return "Say hi.", {}


def test_a_reset_observation_that_is_not_chat_messages_is_named_as_reset_s_fault(tiny):
    model, tok = tiny
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=4), seed=0)
    with pytest.raises(EnvError, match=r"tests/TextReset-v0: reset\(seed=3\) returned the observation 'Say hi.'"):
        asyncio.run(engine.run(_TextResetEnv, "tests/TextReset-v0", range(3, 4), 1))


class _EndsWithBothFlagsEnv(_BadRewardEnv):
    def step(self, action):
        return [], 1.0, True, self.truncated, {}


def test_a_step_both_terminated_and_truncated_is_recorded_as_terminated(tiny):
    model, tok = tiny
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=4), seed=0)

    def env(truncated):
        e = _EndsWithBothFlagsEnv()
        e.truncated = truncated
        return e

    for truncated in (False, True):
        (group,), _ = asyncio.run(engine.run(lambda: env(truncated), "tests/Both-v0", range(3, 4), 1))
        assert group.episodes[0].termination == "terminated"


def test_storage_roundtrip_and_flat_records(tiny, tmp_path):
    model, tok = tiny
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=24, top_k=20), seed=0)
    groups, _ = run(engine, "treerl/Calculator-v0", num_tasks=2, group_size=2)
    path = tmp_path / "r.jsonl"
    with GroupWriter(path) as writer:
        for g in groups:
            writer.write(g)
    back = list(read_groups(path))
    assert [g.to_json() for g in back] == [g.to_json() for g in groups]
    first = json.loads(path.read_text().splitlines()[0])
    assert first["schema_version"] == 1
    e = back[0].episodes[0]
    sampled = [c for c, m in zip(e.candidates, e.sampled_mask) if m]
    assert all(c is not None and 1 <= len(c) <= 20 for c in sampled)  # top_k bounds the recorded support
    records = list(to_flat_records(back))
    assert len(records) == 4
    r = records[0]
    assert r["prompt_ids"] + r["completion_ids"] == e.token_ids
    assert sum(r["completion_mask"]) == sum(e.sampled_mask)
    # A torn tail (a writer killed mid-line) is skipped by readers and cut by the next writer.
    with open(path, "a") as f:
        f.write('{"schema_version": 1, "task_key": "seed-9", "segm')
    assert len(list(read_groups(path))) == 2
    GroupWriter(path).close()
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 2


def test_read_all_groups_reads_the_same_groups_without_collector_passes(tmp_path):
    """Read groups are kept and each is a cycle (episodes refer back to their group): the cyclic
    collector's passes over them free nothing, and were most of the time of list(read_groups)."""
    import gc

    path = tmp_path / "r.jsonl"
    with GroupWriter(path) as writer:
        for i in range(200):
            g = Group(task_key=f"seed-{i}", env_id="demo")
            root = g.add_segment("prompt", [1, 2, 3])
            for j in range(4):
                leaf = g.add_segment("sampled", [4 + j, 5], parent=root, logprobs=[-0.1, -0.2], policy_version=0)
                g.add_episode(leaf=leaf, reward=float(j), messages=[{"role": "assistant", "content": "x"}])
            writer.write(g)
    passes = []

    def count(phase, info):
        if phase == "start":
            passes.append(info["generation"])

    gc.callbacks.append(count)
    try:
        groups = read_all_groups(path)
        assert len(passes) <= 1 and gc.isenabled()  # the one young-generation pass once collection resumes
        assert [g.to_json() for g in groups] == [g.to_json() for g in read_groups(path)]
        assert groups[3].episodes[1].group is groups[3] and groups[3].episodes[1].token_ids == [1, 2, 3, 5, 5]
        gc.disable()  # a caller's choice is left as it was
        read_all_groups(path)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.remove(count)


def test_same_seed_same_trajectories(tiny):
    model, tok = tiny

    def tokens(seed):
        engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=24), seed=seed)
        groups, _ = run(engine, "treerl/Calculator-v0", num_tasks=2, group_size=2)
        return [e.token_ids for g in groups for e in g.episodes]

    assert tokens(5) == tokens(5)
    assert tokens(5) != tokens(6)


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treerl.cli", *args], capture_output=True, text=True, **kwargs)


@pytest.mark.slow  # five CLI processes, each importing torch: about 14 s
def test_rollout_cli_bad_input_exits_with_a_message(tmp_path):
    r = _cli("rollout", "--env", "treerl/Calculater-v0", "--out", str(tmp_path / "x.jsonl"))
    assert r.returncode != 0 and "Calculator-v0" in r.stderr
    r = _cli("rollout", "--out", str(tmp_path / "x.jsonl"), "--top-p", "0.9")
    assert r.returncode != 0 and "top_k" in r.stderr
    r = _cli("rollout", "--out", str(tmp_path / "x.jsonl"), "--model", str(tmp_path / "nope"))
    assert r.returncode != 0 and "--model" in r.stderr
    r = _cli("rollout", "--num-tasks", "3")
    assert r.returncode != 0 and "--out" in r.stderr
    r = _cli("rollout", "--out", "x.jsonl", "--group-size", "many")
    assert r.returncode != 0 and "group-size" in r.stderr


@pytest.mark.slow  # kill-and-resume: the slow pass of CI runs it
def test_rollout_killed_with_sigkill_resumes_without_duplicates(tmp_path):
    out = tmp_path / "r.jsonl"
    args = ["rollout", "--num-tasks", "6", "--group-size", "2", "--out", str(out), "--max-concurrency", "2",
            "--max-new-tokens", "24", "--progress", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "treerl.cli", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:  # kill once a group is on disk (after the header)
        if out.exists() and out.read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the rollout ended before it could be killed: {proc.stderr.read()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = out.read_text().count("\n") - 1  # groups: the first line is the header
    assert 1 <= written < 6, "the run should have been killed mid-way"
    done = _cli(*args, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    header, *lines = out.read_text().splitlines()
    assert json.loads(header)["run"]["env_id"] == "treerl/Calculator-v0"  # one header, still first
    groups = [Group.from_json(line) for line in lines]  # every other line parses
    keys = [g.task_key for g in groups]
    assert sorted(keys) == sorted(f"seed-{i}" for i in range(6))  # every task exactly once
    assert all(len(g.episodes) == 2 for g in groups)


class _Jittery:
    """An environment whose every step takes a random extra time, different in every run."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def fork(self):
        return _Jittery(self._env.fork())

    async def astep(self, action):
        await asyncio.sleep(int.from_bytes(os.urandom(1), "little") / 255 * 0.03)
        return await self._env.astep(action)


def test_lockstep_batches_and_floats_repeat_whatever_the_tool_latency(tiny):
    model, tok = tiny

    def play():
        policy = TransformersPolicy(model, tok, continuous_batching=False, max_batch_size=4)
        batches = []
        generate = policy.generate
        policy.generate = lambda requests: batches.append([r.seed for r in requests]) or generate(requests)
        engine = RolloutEngine(policy, tok, params=SamplingParams(max_new_tokens=24), seed=3, lockstep=True)
        groups, _ = asyncio.run(engine.run(lambda: _Jittery(treerl.make("treerl/Calculator-v0")),
                                           "treerl/Calculator-v0", range(3), 3))
        segments = [(s.token_ids, s.logprobs) for g in groups for s in g.segments if s.kind == "sampled"]
        return batches, segments, engine._gate.waves

    first, second = play(), play()
    assert first[2] >= 2  # several waves: the episodes took turns
    assert first[0] == second[0]  # the same batches, in the same order
    assert first[1] == second[1]  # hence bit-identical log-probs


def test_an_engine_template_sets_the_call_format_the_environment_reads(tiny):
    # The tokenizer's own template implies hermes; the engine plays Gemma 3's tool-use
    # template, which tells the model to write a Python list of calls.
    from treerl.agents.chat_templates import load_template
    from treerl.envs.parsers import PythonicParser

    model, tok = tiny
    envs = []

    def factory():
        envs.append(treerl.make("treerl/Calculator-v0"))
        return envs[-1]

    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=4), seed=0,
                           chat_template=load_template("gemma3_tools"))
    asyncio.run(engine.run(factory, "treerl/Calculator-v0", range(1), 1))
    assert envs and all(isinstance(env.parser, PythonicParser) for env in envs)


def test_a_run_that_keeps_no_groups_holds_none_while_it_plays(tiny):
    # `treerl rollout` writes each group as it finishes: holding them all until the end made its
    # memory grow with the whole run.
    import gc
    import weakref

    model, tok = tiny
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=2), seed=0,
                           max_concurrency=1)
    finished, alive_at_last = [], []

    def on_group(group):
        finished.append(weakref.ref(group))
        if len(finished) == 4:
            gc.collect()
            alive_at_last.extend(ref() is not None for ref in finished[:-1])

    groups, stats = asyncio.run(engine.run(lambda: treerl.make("treerl/GuessNumber-v0", max_turns=1),
                                           "treerl/GuessNumber-v0", range(4), 1, on_group=on_group, keep=False))
    assert groups == [] and stats.num_groups == 4
    assert alive_at_last == [False, False, False]


class _Reporting(ToolEnv):
    """Reports two numbers per episode through ``episode_metrics()``: whether the final answer was even in length
    (a bool: 0/1) and its length, the latter only when there was a final answer; and a text, which is left out."""

    system_prompt = "Say anything."

    def sample_task(self, rng):
        return Task(prompt="hello", answer="x")

    def score(self, task, completion):
        return float(len(completion) % 2 == 0)

    def episode_metrics(self):
        numbers = {"even": self.final_reward == 1.0, "note": "not a number"}
        if self.final_answer is not None and self.final_answer != "skip":
            numbers["answer_chars"] = len(self.final_answer)
        return numbers


def test_an_environments_episode_metrics_are_recorded_and_averaged_in_the_rollout_summary(tiny):
    from _scripted import ScriptedPolicy

    from treerl.rollout.summary import summary_table

    _, tok = tiny
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    replies = ["ab", "abc", "abcd", "skip"]  # the last one reports no answer_chars: left out of its mean
    policy = ScriptedPolicy(tok, lambda task, g, turn: replies[g], end_id=end_id)
    (group,), stats = asyncio.run(RolloutEngine(policy, tok, seed=0).run(lambda: _Reporting(max_turns=1),
                                                                         "tests/Reporting-v0", range(1), 4))
    recorded = [{k: v for k, v in e.metrics.items() if k.startswith("env/")} for e in group.episodes]
    assert recorded == [{"env/even": 1.0, "env/answer_chars": 2.0}, {"env/even": 0.0, "env/answer_chars": 3.0},
                        {"env/even": 1.0, "env/answer_chars": 4.0}, {"env/even": 1.0}]
    summary = stats.summary()
    assert summary["env_metrics"] == {"env/answer_chars": 3.0, "env/even": 0.75}
    assert "env/answer_chars 3.000, env/even 0.750" in summary_table(summary)
    # Merged over processes, the mean is over all their episodes (not a mean of means).
    from treerl.rollout.summary import RolloutStats

    other = RolloutStats()
    other.env_metrics = {"env/even": [0.0, 0.0, 0.0, 0.0]}
    assert RolloutStats.merge([stats, other]).summary()["env_metrics"]["env/even"] == 0.375
