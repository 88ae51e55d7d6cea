"""Tools from an MCP server: its JSON Schemas become the tool specs, validated like ``@tool`` functions.

:class:`McpToolset` starts an MCP server (a local command spoken to over stdio), lists its
tools, and gives one :class:`~treerl.envs.tools.Tool` per server tool
(:meth:`Tool.from_schema`): the model sees the server's own name, description and
``inputSchema``; a call is validated against that schema with the same errors as a
``@tool`` function's (``invalid_arguments`` never reaches the server), then sent to the
server under the tool's timeout. A result the server marks as an error comes back to the
model as a ``tool_error``.

The connection lives on a thread of its own with its own event loop, so the tools can be
awaited from any loop (the rollout engine's, a test's) and environments that hold them can
be forked: the copies share the one connection.

    toolset = McpToolset("python", ["my_mcp_server.py"])
    env = ToolEnv(tools=toolset.tools, ...)      # or a ToolEnv subclass taking them
    ...
    toolset.close()

It needs the ``mcp`` extra (``pip install 'treerl[mcp]'``), imported when a toolset starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from treerl.envs.tools import Tool
from treerl.errors import MissingExtraError, ToolCallError, ToolErrorKind

logger = logging.getLogger(__name__)

__all__ = ["McpToolset"]


class McpToolset:
    """The tools of one MCP server started as ``command args`` (stdio transport).

    Args:
        command: The program that runs the server (e.g. ``sys.executable``).
        args: Its arguments (e.g. the server script's path).
        env: Its environment variables (default: the MCP SDK's safe default set).
        timeout: Seconds one call may take (the tools' timeout).
        startup_timeout: Seconds to wait for the server to start and list its tools.
    """

    def __init__(self, command: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
                 timeout: float | None = 30.0, startup_timeout: float = 60.0):
        try:
            from mcp import ClientSession, StdioServerParameters
            from mcp.client.stdio import stdio_client
        except ImportError as exc:
            raise MissingExtraError(f"MCP tools need the mcp package ({exc.name} is missing): "
                              "pip install 'treerl[mcp]'") from None
        self._params = StdioServerParameters(command=command, args=list(args), env=dict(env) if env else None)
        self._client, self._session_class = stdio_client, ClientSession
        self._loop = asyncio.new_event_loop()
        self._scope: Any = None
        self._closing = False
        self._session: Any = None
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="treerl-mcp", daemon=True)
        self._thread.start()
        server = self._server = " ".join([command, *map(str, args)])
        self._gone = False
        try:
            listed = ready.result(timeout=startup_timeout)
        except concurrent.futures.TimeoutError:
            self.close()
            raise TimeoutError(f"MCP server `{server}` did not start and list its tools within "
                               f"startup_timeout={startup_timeout:g} s; it was stopped.") from None
        except Exception as exc:
            self.close()
            raise RuntimeError(f"MCP server `{server}` did not start: {_reason(exc)} (its own messages, if any, "
                               "are on stderr above).") from exc
        except BaseException:
            self.close()
            raise
        self.tools: list[Tool] = [
            Tool.from_schema(t.name, _field(t, "input_schema", "inputSchema"), self._caller(t.name),
                             description=t.description or "", timeout=timeout)
            for t in listed.tools
        ]

    def _run(self, ready: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve(ready))
        except BaseException as exc:  # a server that never started: the constructor raises it
            if not ready.done():
                ready.set_exception(exc)
        finally:
            self._loop.close()

    async def _serve(self, ready: concurrent.futures.Future) -> None:
        import anyio

        # Cancelling this scope ends the connection from any state, a server that never
        # answered included; the SDK then stops the server process (stdin closed, then killed).
        with anyio.CancelScope() as self._scope:
            if self._closing:
                self._scope.cancel()
            async with self._client(self._params) as (read, write):
                async with self._session_class(read, write) as session:
                    await session.initialize()
                    self._session = session
                    ready.set_result(await session.list_tools())
                    await anyio.sleep_forever()
        if not ready.done():
            ready.set_exception(TimeoutError("stopped before it listed its tools"))

    def _caller(self, name: str):
        async def call(**arguments: Any) -> str:
            try:
                future = asyncio.run_coroutine_threadsafe(self._session.call_tool(name, arguments), self._loop)
                result = await asyncio.wrap_future(future)
            except Exception as exc:
                self._say_if_gone(exc)
                raise
            text = _result_text(result)
            if _field(result, "is_error", "isError"):
                raise ToolCallError(ToolErrorKind.TOOL_ERROR, text, tool_name=name)
            return text

        call.__name__ = name
        return call

    def _say_if_gone(self, exc: BaseException) -> None:
        """Once, loudly: a server that exited fails every later call as the model's tool_error."""
        gone = not self._thread.is_alive() or "Connection closed" in str(exc) or "closed" in type(exc).__name__.lower()
        if gone and not self._closing and not self._gone:
            self._gone = True
            logger.warning("MCP server `%s` is gone (%s): every call to its tools fails as tool_error from now on, "
                           "which the model is scored on; restart the run once the server is fixed.",
                           self._server, _reason(exc))

    def close(self) -> None:
        """Stop the server and the connection's thread."""
        if self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._cancel)
            except RuntimeError:  # the loop already closed: the connection ended on its own
                pass
            self._thread.join(timeout=30)

    def _cancel(self) -> None:  # on the connection's loop
        self._closing = True
        if self._scope is not None:
            self._scope.cancel()

    def __enter__(self) -> McpToolset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __deepcopy__(self, memo: dict) -> McpToolset:
        return self  # forked environments share the connection


def _result_text(result: Any) -> str:
    """The text of a ``CallToolResult``: its content blocks in order, else its structured content as JSON.

    The model reads text only: an image, audio or binary resource is a line that says what
    came back (``[image/png image, 70 bytes]``) rather than nothing.
    """
    blocks = getattr(result, "content", None) or []
    if blocks:
        return "\n".join(_block_text(block) for block in blocks)
    structured = _field(result, "structured_content", "structuredContent")
    return json.dumps(structured, ensure_ascii=False) if structured is not None else ""


def _block_text(block: Any) -> str:
    kind = getattr(block, "type", "")
    if kind == "text":
        return block.text
    if kind in ("image", "audio"):
        size = len((block.data or "").rstrip("=")) * 3 // 4  # base64 to bytes
        return f"[{_field(block, 'mime_type', 'mimeType') or kind} {kind}, {size} bytes]"
    if kind == "resource":
        resource = block.resource
        text = getattr(resource, "text", None)
        if text is not None:
            return text
        return f"[resource {resource.uri} ({_field(resource, 'mime_type', 'mimeType') or 'binary'})]"
    if kind == "resource_link":
        return f"[resource link {block.uri}]"
    return f"[{kind or type(block).__name__} content]"


def _reason(exc: BaseException) -> str:
    """The innermost message of ``exc``: the MCP SDK wraps a server's early exit in task-group errors."""
    while len(getattr(exc, "exceptions", ())) == 1:  # an exception group of one
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def _field(obj: Any, name: str, legacy: str) -> Any:
    """A field of an MCP SDK object under its name in mcp 2 (snake case) or mcp 1 (camel case)."""
    value = getattr(obj, name, None)
    return value if value is not None else getattr(obj, legacy, None)
