"""CodeSandbox's generated word-problem tasks (``tasks="word-problems"``)."""

from __future__ import annotations

import numpy as np
import pytest

import treerl
from treerl.envs.builtin.code_sandbox import word_problem_task

ENV = "treerl/CodeSandbox-v0"
KWARGS = {"tasks": "word-problems"}


def _reply(expression: str) -> str:
    return f"```python\ndef solve():\n    return {expression}\n```"



def test_word_problem_tasks_come_from_the_seed_and_their_test_names_the_reference():
    env = treerl.make(ENV, **KWARGS)
    env.reset(seed=7)
    first = env.task
    env.reset(seed=8)
    assert env.task.prompt != first.prompt
    env.reset(seed=7)
    assert env.task.prompt == first.prompt and env.task.info == first.info
    made = word_problem_task(np.random.default_rng(7))
    assert made.info["tests"] == [f"assert solve() == {made.info['expression']}"] and "solve()" in made.prompt
    # The gold solution passes in the real sandbox; a wrong one fails and the feedback shows the reference.
    expression = env.task.info["expression"]
    _, reward, terminated, _, _ = env.step(_reply(expression))
    assert reward == 1.0 and terminated
    env.reset(seed=7)
    _, reward, terminated, _, _ = env.step(_reply("1 + 1" if expression != "1 + 1" else "2 + 2"))
    assert reward == 0.0 and terminated
    assert env.feedback() == f"The final code passed 0 of 1 tests. Failed tests:\n- `assert solve() == {expression}` raised AssertionError"


def test_word_problem_tasks_refuse_a_dataset_and_unknown_sources():
    with pytest.raises(ValueError, match="generates its tasks"):
        treerl.make(ENV, tasks="word-problems", dataset=[{"prompt": "p", "tests": ["assert True"]}])
    with pytest.raises(ValueError, match="not one of"):
        treerl.make(ENV, tasks="words")
    env = treerl.make(ENV)  # the shipped file stays the default
    env.reset(seed=0)
    assert "solve()" not in env.task.prompt
