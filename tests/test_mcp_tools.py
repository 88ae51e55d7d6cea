"""Tools from a local stdio MCP server of two tools, in a ToolEnv: schemas, validation, calls, errors."""

from __future__ import annotations

import copy
import os
import signal
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="MCP tools need the mcp extra")

from treerl.envs import Task, ToolCall, ToolEnv  # noqa: E402
from treerl.envs.mcp_tools import McpToolset, _result_text  # noqa: E402

SERVER = Path(__file__).resolve().parent / "programs" / "mcp_two_tools.py"
SILENT = Path(__file__).resolve().parent / "programs" / "mcp_silent_server.py"


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def test_a_server_that_never_answers_is_stopped_at_the_startup_timeout(tmp_path):
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not start .* within startup_timeout=1 s"):
        McpToolset(sys.executable, [str(SILENT), str(pid_file)], startup_timeout=1)
    assert time.monotonic() - start < 15  # the timeout, the SDK's grace period and a kill; not 30 s more
    assert not _alive(int(pid_file.read_text()))  # no orphaned server


def test_a_server_that_exits_at_startup_is_named_in_the_error(tmp_path):
    with pytest.raises(RuntimeError, match="mcp_silent_server.py .* did not start: .*Connection closed"):
        McpToolset(sys.executable, [str(SILENT), str(tmp_path / "pid"), "exit"], startup_timeout=30)


def test_images_and_resources_in_a_result_are_named_not_dropped():
    from mcp import types

    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
    result = types.CallToolResult(content=[
        types.ImageContent(type="image", data=png, mimeType="image/png"),
        types.TextContent(type="text", text="a red dot"),
        types.EmbeddedResource(type="resource", resource=types.TextResourceContents(uri="file:///a.txt", text="A")),
        types.EmbeddedResource(type="resource", resource=types.BlobResourceContents(
            uri="file:///a.bin", blob="AAAA", mimeType="application/octet-stream")),
    ])
    assert _result_text(result).splitlines() == [
        "[image/png image, 70 bytes]", "a red dot", "A", "[resource file:///a.bin (application/octet-stream)]"]
    # An image alone was the empty string: the model read nothing at all.
    assert _result_text(types.CallToolResult(content=[result.content[0]])) == "[image/png image, 70 bytes]"


CRASHING = Path(__file__).resolve().parent / "programs" / "mcp_crashing_server.py"


def _errors(env, calls):
    """Each call in a step of its own episode; the error kinds of their records."""
    errors = []
    for call in calls:
        env.reset(seed=0)
        *_, info = env.step(env.parser.render([call]))
        errors.append(info["tool_calls"][0]["error"])
    return errors


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
def test_a_server_that_dies_mid_run_is_restarted_on_the_next_call(caplog):
    """The call that found the server gone is a tool_error (it may be what killed it: never sent again);
    the next call starts a new server process and is answered, as is every call after it."""
    add = ToolCall("add", {"a": 1, "b": 2})
    with McpToolset(sys.executable, [str(CRASHING)], timeout=20, startup_timeout=30) as tools:
        env = McpEnv(tools=tools.tools)
        assert _errors(env, [add, ToolCall("crash", {}), add, add]) == [None, "tool_error", None, None]
        env.reset(seed=0)
        obs, *_ = env.step(env.parser.render([add]))
        assert obs[0]["content"] == "3"
        # Killed from outside, between calls: the same, a forked environment's calls included.
        env.reset(seed=0)
        pid = int(copy.deepcopy(env).step(env.parser.render([ToolCall("pid", {})]))[0][0]["content"])
        os.kill(pid, signal.SIGKILL)
        assert _errors(env, [add, add]) == ["tool_error", None]
        assert not _alive(pid) and tools.num_restarts == 2
    said = [r.getMessage() for r in caplog.records if "mcp_crashing_server.py" in r.getMessage()]
    assert len([m for m in said if "is gone" in m]) == 2 and len([m for m in said if "restarted" in m]) == 2


def test_a_server_that_cannot_stay_up_is_given_up_after_max_restarts(caplog):
    crash, add = ToolCall("crash", {}), ToolCall("add", {"a": 1, "b": 2})
    with McpToolset(sys.executable, [str(CRASHING)], timeout=20, max_restarts=1) as tools:
        env = McpEnv(tools=tools.tools)
        # crash; restart 1 and crash again; no restart 2: every later call fails without one.
        assert _errors(env, [crash, crash, add, add]) == ["tool_error"] * 4
        assert tools.num_restarts == 1
        env.reset(seed=0)
        *_, info = env.step(env.parser.render([add]))
        assert "not restarted again" in info["tool_calls"][0]["message"]
    assert len([r for r in caplog.records if "not restarted again" in r.getMessage()]) == 1
    with pytest.raises(ValueError, match="max_restarts"):
        McpToolset(sys.executable, [str(CRASHING)], max_restarts=-1)
