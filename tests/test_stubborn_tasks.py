"""A tool or an environment step that swallows its cancellation cannot hold a rollout past its limits.

Each stubborn coroutine gives up after ``_STUBBORN_S``, so a run that waits for it is slow,
not hung: the tests assert that nothing waits that long.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from _scripted import ScriptedPolicy

import treerl
from treerl.envs import Task, ToolCall, ToolEnv, get_parser, tool
from treerl.envs.loops import run_until_done
from treerl.models import load_default_model
from treerl.rollout.engine import RolloutEngine
from treerl.rollout.record import RolloutConfig, record
from treerl.rollout.trajectory import read_groups

_STUBBORN_S = 8.0


async def _swallow_cancellation() -> str:
    end = time.monotonic() + _STUBBORN_S
    while time.monotonic() < end:
        try:
            await asyncio.sleep(end - time.monotonic())
        except asyncio.CancelledError:  # a retry loop that catches everything
            pass
    return "late"


@tool(timeout=0.2)
async def stubborn(x: int) -> str:
    """A tool that ignores being cancelled.

    Args:
        x: Anything.
    """
    return await _swallow_cancellation()


class _StubbornToolEnv(ToolEnv):
    def __init__(self, **kwargs):
        super().__init__(tools=[stubborn], dataset=[Task(prompt="Call stubborn.", answer="1")], parser="hermes",
                         **kwargs)

    def score(self, task, completion):
        return 1.0


class _StubbornStepEnv(treerl.Env):
    """A hand-written environment whose astep swallows its cancellation."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return [{"role": "user", "content": "Say hi."}], {}

    async def astep(self, action):
        await _swallow_cancellation()
        return [], 1.0, True, False, {}


_CALL = get_parser("hermes").render([ToolCall("stubborn", {"x": 1})])


@pytest.fixture(scope="module")
def tok():
    return load_default_model()[1]


def _policy(tok, script):
    return ScriptedPolicy(tok, script, end_id=tok.convert_tokens_to_ids("<|im_end|>"))


def test_a_sync_step_returns_at_the_tool_limit_when_the_tool_swallows_cancellation(caplog):
    env = _StubbornToolEnv()
    env.reset(seed=0)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="treerl.envs.loops"):
        _, _, terminated, _, info = env.step(_CALL)  # run_sync: its own event loop, closed at the end
    assert time.monotonic() - start < _STUBBORN_S / 2
    assert not terminated and info["tool_calls"][0]["error"] == "timeout"
    assert "tool 'stubborn'" in caplog.text  # the abandoned task is named


def test_an_astep_that_swallows_cancellation_ends_the_episode_at_its_time_limit(tok, caplog):
    engine = RolloutEngine(_policy(tok, lambda task, g, turn: "hi"), tok, max_episode_seconds=0.3, seed=0)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="treerl.envs.loops"):
        (group,), _ = run_until_done(engine.run(_StubbornStepEnv, "tests/StubbornStep-v0", range(1), 2), grace_s=0.2)
    assert time.monotonic() - start < _STUBBORN_S / 2
    assert [e.termination for e in group.episodes] == ["timeout", "timeout"]
    assert "env 'tests/StubbornStep-v0' step" in caplog.text


def test_treerl_rollout_finishes_when_a_tool_swallows_cancellation(tok, tmp_path):
    treerl.register("tests/StubbornTool-v0", _StubbornToolEnv, override=True)
    cfg = RolloutConfig(env="tests/StubbornTool-v0", out=str(tmp_path / "r.jsonl"), num_tasks=1, group_size=2,
                        progress=False)
    start = time.monotonic()
    summary = record(cfg, _policy(tok, lambda task, g, turn: [_CALL, "done"][turn]), tok)
    assert time.monotonic() - start < _STUBBORN_S / 2
    assert summary["episodes"] == 2
    (group,) = read_groups(tmp_path / "r.jsonl")
    assert [[c["error"] for c in e.tool_calls] for e in group.episodes] == [["timeout"], ["timeout"]]


def test_run_until_done_under_a_running_loop_runs_and_leaves_the_callers_loop_as_it_was():
    """A notebook's cell runs under the kernel's event loop: treerl.evaluate or a learner's step, which
    run their rollout with run_until_done, must run there (on a helper thread) and leave the caller's
    loop set for its thread, not fail half-way after replacing it."""
    async def answer():
        return 42

    async def cell():
        return run_until_done(answer())

    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        assert loop.run_until_complete(cell()) == 42
        assert asyncio.get_event_loop() is loop
    finally:
        asyncio.set_event_loop(None)
        loop.close()
