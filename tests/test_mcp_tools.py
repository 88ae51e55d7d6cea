"""Tools from a local stdio MCP server of two tools, in a ToolEnv: schemas, validation, calls, errors."""

from __future__ import annotations

import copy
import os
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


def test_a_server_that_dies_mid_run_is_said_once_and_its_calls_are_tool_errors(caplog):
    crashing = Path(__file__).resolve().parent / "programs" / "mcp_crashing_server.py"
    with McpToolset(sys.executable, [str(crashing)], timeout=20) as tools:
        env = McpEnv(tools=tools.tools)
        env.reset(seed=0)
        render = env.parser.render
        errors = []
        for call in (ToolCall("add", {"a": 1, "b": 2}), ToolCall("crash", {}), ToolCall("add", {"a": 1, "b": 2}),
                     ToolCall("add", {"a": 2, "b": 2})):
            *_, info = env.step(render([call]))
            errors.append(info["tool_calls"][0]["error"])
    assert errors == [None, "tool_error", "tool_error", "tool_error"]  # data for the model, never a crash
    said = [r for r in caplog.records if "is gone" in r.getMessage()]
    assert len(said) == 1 and "mcp_crashing_server.py" in said[0].getMessage()
