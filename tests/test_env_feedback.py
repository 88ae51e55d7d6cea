"""Environments say what went wrong (``feedback()``), and the rollout engine records it in the
episode's metrics: tool errors, Calculator's gold check, CodeSandbox's failed tests, GuessNumber's
higher/lower history, and a custom environment's own hook."""

from __future__ import annotations

import asyncio

import pytest
from _scripted import ScriptedPolicy

import treerl
from treerl.envs import Task, ToolCall, ToolEnv
from treerl.models import load_default_model
from treerl.rollout.engine import RolloutEngine


def _play(env, actions):
    for action in actions:
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            break
    return env.feedback()


def test_calculator_feedback_is_the_gold_check_and_the_tool_errors():
    env = treerl.make("treerl/Calculator-v0")
    env.reset(seed=3)
    assert _play(env, env.gold_actions(env.task)) is None  # a solved task: nothing to say
    env.reset(seed=3)
    text = _play(env, ['<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>',
                       "So it is \\boxed{7}."])
    assert "calculator: invalid_arguments" in text  # the failed call and why
    assert "\\boxed{7} is wrong. The correct answer is 5." in text
    quiet = treerl.make("treerl/Calculator-v0", feedback_reveals_answer=False)
    quiet.reset(seed=3)
    text = _play(quiet, ["\\boxed{7}"])
    assert "is wrong" in text and "correct answer" not in text
    short = treerl.make("treerl/Calculator-v0", max_turns=1)
    short.reset(seed=3)
    assert "no final answer within 1 turns" in _play(short, ["I am not sure."])


def test_code_sandbox_feedback_names_the_failed_tests_and_what_they_raised():
    env = treerl.make("treerl/CodeSandbox-v0")
    env.reset(options={"task_index": 0})  # add(a, b)
    wrong = _play(env, ["```python\ndef add(a, b):\n    return abs(a) + b\n```"])
    assert wrong == ("The final code passed 2 of 3 tests. Failed tests:\n"
                     "- `assert add(-1, 1) == 0` raised AssertionError")
    env.reset(options={"task_index": 0})
    broken = _play(env, ["```python\ndef add(a, b):\n    return a + b\nundefined_name\n```"])
    assert "raised NameError: name 'undefined_name' is not defined" in broken
    env.reset(options={"task_index": 0})
    assert _play(env, env.gold_actions(env.task)) is None


def test_guess_number_feedback_is_the_history():
    env = treerl.make("treerl/GuessNumber-v0", high=64)
    env.reset(options={"secret": 40})
    text = _play(env, ["\\boxed{32}", "\\boxed{48}", "banana"])
    assert text == ("Your guesses and the answers: 32 (higher), 48 (lower), no number (not a valid guess). "
                    "The number is between 33 and 47.")
    env.reset(options={"secret": 40})
    assert _play(env, ["\\boxed{40}"]) is None


class _Judged(ToolEnv):
    """A custom environment with its own verdict."""

    system_prompt = "Answer yes or no."

    def sample_task(self, rng):
        return Task(prompt="Is the sky green?", answer="no")

    def score(self, task, completion):
        return float(completion.strip().lower().startswith(task.answer))

    def answer_feedback(self, task, completion, reward):
        return None if reward else f"A judge says: {completion!r} is not right."


class _Raising(_Judged):
    def feedback(self):
        raise RuntimeError("feedback bug")


class _RaisingClose(_Judged):
    def close(self):
        raise RuntimeError("close bug")


@pytest.fixture(scope="module")
def tiny():
    return load_default_model()


def _engine(tok, lines):
    policy = ScriptedPolicy(tok, lambda task, g, turn: lines[g], end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    return RolloutEngine(policy, tok, seed=0)


def test_the_engine_records_feedback_in_the_episode_metrics(tiny):
    _, tok = tiny
    engine = _engine(tok, ["no", "yes"])
    (group,), _ = asyncio.run(engine.run(lambda: _Judged(max_turns=1), "tests/Judged-v0", range(1), 2))
    assert "feedback" not in group.episodes[0].metrics
    assert group.episodes[1].metrics["feedback"] == "A judge says: 'yes' is not right."
    line = group.to_json()  # the trajectory file holds it, schema unchanged
    assert '"feedback":"A judge says' in line and type(group).from_json(line).episodes[1].metrics["feedback"]


def test_an_environment_whose_feedback_raises_is_logged_not_fatal(tiny, caplog):
    _, tok = tiny
    (group,), _ = asyncio.run(_engine(tok, ["yes"]).run(lambda: _Raising(max_turns=1), "tests/R-v0", range(1), 1))
    assert group.episodes[0].termination == "final_answer" and "feedback" not in group.episodes[0].metrics
    assert "feedback bug" in caplog.text


def test_an_environment_whose_close_raises_is_logged_not_fatal(tiny, caplog):
    """The episode is over when close() runs: a bug there is logged, and the group and the run go on."""
    _, tok = tiny
    groups, _ = asyncio.run(_engine(tok, ["yes", "no"]).run(lambda: _RaisingClose(max_turns=1), "tests/C-v0", range(2), 2))
    assert [e.termination for g in groups for e in g.episodes] == ["final_answer"] * 4
    assert "raised in close(): RuntimeError: close bug" in caplog.text


def test_the_calculator_records_tool_errors_through_the_engine(tiny):
    _, tok = tiny
    call = treerl.make("treerl/Calculator-v0").parser.render([ToolCall("calculator", {"expression": "2 +"})])
    policy = ScriptedPolicy(tok, lambda task, g, turn: [call, "\\boxed{1}"][turn],
                            end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    (group,), _ = asyncio.run(RolloutEngine(policy, tok, seed=0).run(
        lambda: treerl.make("treerl/Calculator-v0"), "treerl/Calculator-v0", range(1), 1))
    text = group.episodes[0].metrics["feedback"]
    assert "calculator: tool_error" in text and "is wrong. The correct answer is" in text
