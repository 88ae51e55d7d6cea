"""Regression tests for model text that stalled, crashed or corrupted runs (each with its reproducer).

Rollouts here are played by a scripted policy (the tokens of fixed replies, one per turn)
on the shipped tokenizer and real environments, so that an adversarial episode is
exactly the text it should be and the other episodes are quick.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import treerl
from treerl.agents.policy import Generation, GenerationRequest, SamplingParams
from treerl.cli import main
from treerl.envs.builtin.calculator import CalculatorEnv
from treerl.envs.builtin.guess_number import GuessNumberEnv
from treerl.envs.builtin.math_verify import MathVerifyEnv
from treerl.envs.parsers import PARSERS, HermesParser, PythonicParser
from treerl.envs.tools import tool
from treerl.envs.verifiers import extract_boxed, math_verify_reward
from treerl.errors import ConfigError, ToolCallError, ToolErrorKind
from treerl.models import load_default_model
from treerl.rollout.engine import RolloutEngine
from treerl.rollout.record import RolloutConfig, record
from treerl.rollout.trajectory import Group, GroupWriter, read_groups, read_header

GOOD = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>',
        "The answer is \\boxed{5}."]


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_model()[1]


class ScriptedPolicy:
    """Replies with fixed texts: ``replies[generation][turn]`` (the last one repeats)."""

    version = 0

    def __init__(self, tokenizer, replies: dict[int, list[str]], default: list[str] = GOOD):
        self.tokenizer, self.replies, self.default = tokenizer, replies, default
        self.turns: dict[str, int] = {}

    async def agenerate(self, request: GenerationRequest) -> Generation:
        await asyncio.sleep(0.01)  # a model takes time; others run meanwhile
        session = request.session or ""
        turn = self.turns.get(session, 0)
        self.turns[session] = turn + 1
        script = self.replies.get(int(session.split("/")[1].split(".")[0]), self.default)
        text = script[min(turn, len(script) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False, verbose=False) + [self.tokenizer.eos_token_id]
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), candidates=None, finish_reason="stop",
                          policy_version=0, num_prompt_tokens_processed=0)

    def generate(self, requests):
        return [asyncio.run(self.agenerate(r)) for r in requests]

    def set_weights(self, weights, version):
        self.version = version

    def end_session(self, session):
        pass

    def close(self):
        pass


def _engine(policy, tokenizer, **kwargs) -> RolloutEngine:
    params = SamplingParams(max_new_tokens=200_000)
    return RolloutEngine(policy, tokenizer, params=params, max_episode_tokens=400_000, **kwargs)


# -- model text can stall a run --------------------------------------------------------------------


def test_issue_reproducers_parse_in_linear_time():
    """1 MB of one marker took 25-46 s; 4 KB of `[f(\\n` 7.2 s; 5,000 open boxes 10-17 s."""
    cases = [("hermes", "<tool_call>"), ("qwen3_coder", "<tool_call>"), ("qwen3_coder", "<function="),
             ("mistral", "[TOOL_CALLS]"), ("llama3_json", '\n{"name":'), ("llama3_json", ";{")]
    for name, marker in cases:
        start = time.thread_time()
        result = PARSERS[name]().parse(marker * (1_000_000 // len(marker)))
        assert time.thread_time() - start < 2.0, (name, marker)
        assert result.calls == [] and len(result.errors) <= 65
    start = time.thread_time()
    assert len(PythonicParser().parse("[f(\n" * 1000).errors) == 65  # 64 lists and the cap's error
    assert extract_boxed("\\boxed{" * 5000) is None
    assert time.thread_time() - start < 2.0


def test_caps_are_malformed_errors_that_name_them():
    parser = HermesParser(max_chars=1000, max_calls=3)
    (error,) = parser.parse("x" * 1001).errors
    assert error.kind is ToolErrorKind.MALFORMED and "max_chars" in error.message and "1,000" in error.message
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    result = parser.parse(call * 5)
    assert len(result.calls) == 3 and "max_calls" in result.errors[-1].message and len(result.errors) == 1
    with pytest.raises(ValueError, match="max_calls"):
        HermesParser(max_calls=0)


class StallingParser(HermesParser):
    """Holds the interpreter for seconds on one reply (pure Python: it even holds the GIL in turns)."""

    def _parse(self, text, tool_schemas):
        if "STALL" in text:
            end = time.monotonic() + 4.0
            while time.monotonic() < end:
                pass
        return super()._parse(text, tool_schemas)


@pytest.mark.parametrize("adversary", ["builtin-parser-1MB", "stalling-parser"])
def test_one_adversarial_episode_does_not_hold_up_the_other_nine(adversary, tokenizer):
    if adversary == "stalling-parser":
        factory = lambda: CalculatorEnv(parser=StallingParser(), parse_timeout_s=0.5)  # noqa: E731
        bad = ["STALL " + GOOD[0], GOOD[1]]
    else:
        factory, bad = CalculatorEnv, ["<tool_call>" * 90_000, GOOD[1]]
    policy = ScriptedPolicy(tokenizer, {0: bad})
    started = time.monotonic()
    (group,), _ = asyncio.run(_engine(policy, tokenizer).run(factory, "treerl/Calculator-v0", [0], 10))
    by_generation = {e.metrics["generation"][0]: e for e in group.episodes}
    others = [by_generation[g] for g in range(1, 10)]
    assert all(e.termination == "final_answer" and e.tool_calls[0]["error"] is None for e in others)
    # On time: they never waited for the adversary (parsed on the loop, the stall was 4 s / 25 s).
    assert max(e.metrics["wall_s"] for e in others) < 3.0, [e.metrics["wall_s"] for e in others]
    first = by_generation[0].tool_calls[0]
    assert first["error"] == "malformed"
    if adversary == "stalling-parser":
        assert "parse_timeout_s" in first["message"]
    assert time.monotonic() - started < 30


def test_a_tool_that_finished_in_time_is_not_a_timeout_when_threads_are_scarce():
    """The limit is measured on the tool's own execution, not on time queued behind other work."""

    @tool(timeout=1.0)
    def quick(x: int) -> int:
        time.sleep(0.1)
        return x

    async def main() -> str:
        loop = asyncio.get_running_loop()
        # More blocking jobs than the default executor has threads (asyncio's default size):
        # a tool queued there would pass its 1 s limit before it ever started.
        blockers = [loop.run_in_executor(None, time.sleep, 1.5) for _ in range(min(32, (os.cpu_count() or 1) + 4) + 1)]
        try:
            return await quick.acall({"x": 7})
        finally:
            await asyncio.gather(*blockers)

    assert asyncio.run(main()) == "7"


def test_a_slow_scorer_times_out_as_zero_reward():
    class SlowScore(CalculatorEnv):
        def score(self, task, completion):
            time.sleep(3.0)
            return 1.0

    env = SlowScore(score_timeout_s=0.3)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("\\boxed{1}")
    assert (reward, terminated, info["metrics"]["score/timeout"]) == (0.0, True, 1)


# -- model text can crash a run or a file ----------------------------------------------------------


@tool
def _float_tool(x: float) -> float:
    return x


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_arguments_are_invalid_arguments(value):
    """JSON readers accept NaN and Infinity (and 1e999 reads as inf): strict JSON refuses them."""
    env = CalculatorEnv()
    env.reset(seed=0)
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": ' + value + "}}\n</tool_call>"
    _, _, _, _, info = env.step(text)
    (call,) = info["tool_calls"]
    assert call["error"] == "invalid_arguments" and "not a JSON number" in call["message"], call
    with pytest.raises(ToolCallError) as exc:
        _float_tool.validate({"x": float(value)})
    assert exc.value.kind is ToolErrorKind.INVALID_ARGUMENTS and "not a JSON number" in exc.value.message


def test_pythonic_infinity_is_invalid_arguments():
    (call,) = PythonicParser().parse("[f(x=-1e999)]").calls
    with pytest.raises(ToolCallError, match="-Infinity, which is not a JSON number"):
        _float_tool.validate(call.arguments)


def test_the_writer_records_what_json_cannot_hold_and_keeps_the_other_groups(tmp_path):
    """NaN arguments made the writer raise 'Out of range float values are not JSON compliant'."""
    out = tmp_path / "r.jsonl"
    with GroupWriter(out) as writer:
        for i, value in enumerate([1.0, float("nan"), 10**5000, {"deep": "x"}, 2.0]):
            group = Group(task_key=f"seed-{i}", env_id="demo")
            leaf = group.add_segment("prompt", [1])
            nested: object = value
            if isinstance(value, dict):
                for _ in range(3000):
                    nested = [nested]
            group.add_episode(leaf=leaf, reward=1.0, tool_calls=[{"name": "f", "arguments": {"x": nested}}],
                              metrics={"object": object()} if i == 3 else {})
            writer.write(group)
    groups = list(read_groups(out))
    assert [g.task_key for g in groups] == [f"seed-{i}" for i in range(5)]
    assert groups[0].episodes[0].tool_calls[0]["arguments"] == {"x": 1.0} and "unencodable" not in groups[0].info
    assert groups[1].episodes[0].tool_calls[0]["arguments"] == {"x": None}
    assert groups[1].info["unencodable"] == [{"path": "episodes[0].tool_calls[0].arguments.x", "value": "float nan"}]
    assert "digits" in groups[2].info["unencodable"][0]["value"]
    assert {d["value"] for d in groups[3].info["unencodable"]} == {"nested more than 100 levels deep",
                                                                     "object of type object"}


def test_one_failing_group_does_not_lose_the_others(tokenizer, tmp_path):
    class Broken(CalculatorEnv):
        def reset(self, *, seed=None, options=None):
            if seed == 2:
                raise RuntimeError("a bug in reset")
            return super().reset(seed=seed, options=options)

    out = tmp_path / "r.jsonl"
    with GroupWriter(out) as writer, pytest.raises(RuntimeError, match="a bug in reset"):
        asyncio.run(_engine(ScriptedPolicy(tokenizer, {}), tokenizer, max_concurrency=2).run(
            Broken, "treerl/Calculator-v0", range(5), 2, writer=writer))
    assert sorted(g.task_key for g in read_groups(out)) == ["seed-0", "seed-1", "seed-3", "seed-4"]


HUGE = "9" * 5000


def test_integers_of_thousands_of_digits_are_typed_errors():
    # pythonic parser (a hex literal is an int without decimal digits to refuse)
    for text in (f"[f(x={HUGE})]", f"[f(x=0x{'f' * 5000})]", "[f(x=" + "-" * 5000 + "1)]", "[f(x=" + "[" * 300 + ")]"):
        result = PythonicParser().parse(text)
        assert result.calls == [] and [e.kind for e in result.errors] == [ToolErrorKind.MALFORMED], text[:20]
    # Tool.validate
    with pytest.raises(ToolCallError) as exc:
        _float_tool.validate({"x": int(HUGE[:4000]) ** 2})
    assert exc.value.kind is ToolErrorKind.INVALID_ARGUMENTS and "too many digits" in exc.value.message
    # environments' step()
    guess = GuessNumberEnv()
    guess.reset(seed=0)
    _, reward, _, _, info = guess.step(f"\\boxed{{{HUGE}}}")
    assert (reward, info["outcome"]) == (0.0, "invalid")
    calc = CalculatorEnv()
    calc.reset(seed=0)
    _, reward, terminated, _, _ = calc.step(f"\\boxed{{{HUGE}}}")
    assert (reward, terminated) == (0.0, True)
    math_env = MathVerifyEnv()
    math_env.reset(seed=0)
    assert math_env.step(f"\\boxed{{{HUGE}}}")[1] == 0.0
    assert math_verify_reward(HUGE, HUGE) == 1.0  # equal texts still agree (math-verify decides)


def test_deep_nesting_is_malformed_in_every_parser():
    for name, prefix in [("hermes", "<tool_call>"), ("llama3_json", "<|python_tag|>"), ("mistral", "[TOOL_CALLS]"),
                         ("pythonic", "[f(a=")]:
        for opener in ("[", "{", "(", "-", "not "):
            result = PARSERS[name]().parse(prefix + opener * 100_000)
            assert result.calls == [] and all(e.kind is ToolErrorKind.MALFORMED for e in result.errors)


# -- resume and files ------------------------------------------------------------------------------


def _rollout(tmp_path, tokenizer, **overrides):
    cfg = RolloutConfig(**{"out": str(tmp_path / "r.jsonl"), "num_tasks": 3, "group_size": 2, "progress": False,
                           **overrides})
    return record(cfg, ScriptedPolicy(tokenizer, {}), tokenizer)


def test_trajectory_header_and_refusing_another_setup(tmp_path, tokenizer):
    _rollout(tmp_path, tokenizer, num_tasks=2)
    header = read_header(tmp_path / "r.jsonl")
    assert header["run"]["env_id"] == "treerl/Calculator-v0" and header["treerl_version"] == treerl.__version__
    assert header["run"]["sampling"]["temperature"] == 1.0 and header["run"]["tokenizer"]["vocab_size"] > 0
    summary = _rollout(tmp_path, tokenizer)  # the same setup resumes: only task 2 is new
    assert summary["skipped_finished_tasks"] == 2 and len(list(read_groups(tmp_path / "r.jsonl"))) == 3
    with pytest.raises(ConfigError, match="env_id: file has 'treerl/Calculator-v0'"):
        _rollout(tmp_path, tokenizer, env="treerl/GuessNumber-v0")
    with pytest.raises(ConfigError, match="sampling"):
        _rollout(tmp_path, tokenizer, temperature=0.5)


def test_a_corrupted_line_is_reported_then_repaired_and_its_task_played_again(tmp_path, tokenizer):
    _rollout(tmp_path, tokenizer)
    path = tmp_path / "r.jsonl"
    lines = path.read_text().splitlines(keepends=True)  # header, then three groups
    lines[2] = lines[2][: len(lines[2]) // 2] + "\n"  # a line cut in the middle of the file
    path.write_text("".join(lines))
    with pytest.raises(ConfigError, match=r"r.jsonl:3: not a valid trajectory line .* --repair"):
        _rollout(tmp_path, tokenizer)
    summary = _rollout(tmp_path, tokenizer, repair=True)
    assert summary["skipped_finished_tasks"] == 2
    assert sorted(g.task_key for g in read_groups(path)) == ["seed-0", "seed-1", "seed-2"]
    (quarantined,) = [json.loads(line) for line in (tmp_path / "r.jsonl.corrupt").read_text().splitlines()]
    assert quarantined["line"] == 3 and quarantined["text"] == lines[2]


def test_files_without_a_header_are_still_read(tmp_path):
    path = tmp_path / "old.jsonl"
    group = Group(task_key="seed-0", env_id="demo")
    group.add_episode(leaf=group.add_segment("prompt", [1]), reward=1.0)
    path.write_text(group.to_json() + "\n")
    assert read_header(path) is None and [g.task_key for g in read_groups(path)] == ["seed-0"]


@pytest.mark.slow
def test_a_kill_while_a_checkpoint_is_written_leaves_a_resumable_run(tmp_path, capsys):
    """A SIGKILL inside save_checkpoint left step-K.tmp, and every later --resume failed."""
    out = tmp_path / "run"
    common = ["learn", "--output-dir", str(out), "--steps", "3", "--tasks-per-step", "1", "--group-size", "2",
              "--max-new-tokens", "16", "--eval-episodes", "0", "--save-every", "1", "--progress", "false"]
    program = Path(__file__).parent / "programs" / "kill_during_checkpoint.py"
    proc = subprocess.Popen([sys.executable, str(program), "--hold-step", "2", *common], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the checkpoint of step 2 is half written
        assert line.strip() == "HOLDING", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1", "step-2.tmp"]
    # Resumed with nothing left to run, the run only removes the unfinished checkpoint ...
    assert main([*[a if a != "3" else "1" for a in common], "--resume", "true"]) == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1"]
    (checkpoints / "step-2.tmp").mkdir()
    (checkpoints / "step-2.tmp" / "model.safetensors").write_bytes(b"half")
    capsys.readouterr()
    # ... and resumed with steps to run, it continues from the last whole one.
    assert main([*common, "--resume", "true"]) == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1", "step-2", "step-3"]
    captured = capsys.readouterr()
    assert "resumed from" in captured.err and "step-1" in captured.err
    assert "held-out evaluation skipped (--eval-episodes 0)" in captured.out and "nan" not in captured.out
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
