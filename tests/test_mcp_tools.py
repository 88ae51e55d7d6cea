"""Tools from a local stdio MCP server of two tools, in a ToolEnv: schemas, validation, calls, errors."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="MCP tools need the mcp extra")

from treerl.envs import Task, ToolCall, ToolEnv  # noqa: E402
from treerl.envs.mcp_tools import McpToolset  # noqa: E402

SERVER = Path(__file__).resolve().parent / "programs" / "mcp_two_tools.py"


class McpEnv(ToolEnv):
    """Answer with the sum; the tools come from the MCP server."""

    def sample_task(self, rng):
        return Task(prompt="What is 2 + 3?", answer="5")

    def score(self, task, completion):
        return float(completion.strip() == task.answer)


@pytest.fixture(scope="module")
def toolset():
    with McpToolset(sys.executable, [str(SERVER)], timeout=20) as tools:
        yield tools


def test_the_servers_schemas_are_the_tool_specs(toolset):
    by_name = {t.name: t for t in toolset.tools}
    assert sorted(by_name) == ["add", "shout"]
    add = by_name["add"].schema["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["required"] == ["a", "b"]
    assert add["parameters"]["properties"]["a"]["type"] == "integer"


def test_an_environment_runs_mcp_tools_and_turns_failures_into_observations(toolset):
    env = McpEnv(tools=toolset.tools)
    env.reset(seed=0)
    forked = copy.deepcopy(env)  # forks share the connection
    render = env.parser.render
    obs, reward, terminated, truncated, info = env.step(render([ToolCall("add", {"a": 2, "b": 3}),
                                                               ToolCall("shout", {"text": "hi", "times": 2})]))
    assert [o["content"] for o in obs] == ["5", "HI HI"]
    assert [r["error"] for r in info["tool_calls"]] == [None, None]
    # Invalid arguments are refused by the server's schema before any call; the server's own
    # error comes back as tool_error; neither raises.
    obs, *_, info = forked.step(render([ToolCall("add", {"a": "two", "b": 3}), ToolCall("shout", {"text": ""})]))
    assert [r["error"] for r in info["tool_calls"]] == ["invalid_arguments", "tool_error"]
    assert "'a'" in obs[0]["content"] and "nothing to shout" in obs[1]["content"]
    *_, info = env.step("5")
    assert info["termination"] == "final_answer"
