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
be forked: the copies share the one connection. A server that dies mid-run is started again on
the next call (at most ``max_restarts`` times in a row without a call answered).

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

    A server that dies mid-run (it crashed, or was killed) is started again on the next call:
    the call that found it gone fails as a ``tool_error`` (it may be what killed it, so it is
    not sent again), the next one restarts the server and goes to the new process. After
    ``max_restarts`` restarts in a row with no call answered in between (a server that cannot
    stay up), every call fails as a ``tool_error`` without another try. Each death, restart
    and the giving up is logged as a warning.

    Args:
        command: The program that runs the server (e.g. ``sys.executable``).
        args: Its arguments (e.g. the server script's path).
        env: Its environment variables (default: the MCP SDK's safe default set).
        timeout: Seconds one call may take (the tools' timeout).
        startup_timeout: Seconds to wait for the server to start and list its tools (at a
            restart too: a call waits for the restart up to its own ``timeout``, the restart
            goes on for the calls after it).
        max_restarts: Restarts in a row, with no call answered in between, before the
            toolset gives the server up (0: never restart).
    """

    def __init__(self, command: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
                 timeout: float | None = 30.0, startup_timeout: float = 60.0, max_restarts: int = 3):
        try:
            from mcp import ClientSession, StdioServerParameters
            from mcp.client.stdio import stdio_client
        except ImportError as exc:
            raise MissingExtraError(f"MCP tools need the mcp package ({exc.name} is missing): "
                              "pip install 'treerl[mcp]'") from None
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"McpToolset(max_restarts={max_restarts!r}): use an int >= 0 (0: never restart).")
        self._params = StdioServerParameters(command=command, args=list(args), env=dict(env) if env else None)
        self._client, self._session_class = stdio_client, ClientSession
        self._server = " ".join([command, *map(str, args)])
        self.startup_timeout, self.max_restarts = startup_timeout, max_restarts
        self.num_restarts = 0
        """Restarts so far (all of them, for a run's report)."""
        self._restarts_in_a_row = 0
        # The connection's state, read and written on its loop only.
        self._scope: Any = None
        self._connection: asyncio.Task | None = None
        self._closing = False
        self._session: Any = None
        self._gone: BaseException | None = None
        """Why the current session's server is gone (None while it serves)."""
        self._restarting: asyncio.Task | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="treerl-mcp", daemon=True)
        self._thread.start()
        try:
            listed = asyncio.run_coroutine_threadsafe(self._open(), self._loop).result()
        except BaseException:
            self.close()
            raise
        self.tools: list[Tool] = [
            Tool.from_schema(t.name, _field(t, "input_schema", "inputSchema"), self._caller(t.name),
                             description=t.description or "", timeout=timeout)
            for t in listed.tools
        ]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    # -- on the connection's loop ---------------------------------------------------------------

    async def _open(self) -> Any:
        """Start the server and list its tools, within ``startup_timeout``; returns the listing."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        self._connection = loop.create_task(self._serve(ready))
        try:
            return await asyncio.wait_for(asyncio.shield(ready), self.startup_timeout)
        except asyncio.TimeoutError:
            ready.cancel()  # nobody reads how the stopped connection ended
            await self._stop()
            raise TimeoutError(f"MCP server `{self._server}` did not start and list its tools within "
                               f"startup_timeout={self.startup_timeout:g} s; it was stopped.") from None
        except Exception as exc:
            await self._stop()
            raise RuntimeError(f"MCP server `{self._server}` did not start: {_reason(exc)} (its own messages, if "
                               "any, are on stderr above).") from exc

    async def _serve(self, ready: asyncio.Future) -> None:
        """One connection: the server process and its session, held open until cancelled."""
        import anyio

        try:
            # Cancelling this scope ends the connection from any state, a server that never
            # answered included; the SDK then stops the server process (stdin closed, then killed).
            with anyio.CancelScope() as self._scope:
                if self._closing:
                    self._scope.cancel()
                async with self._client(self._params) as (read, write):
                    async with self._session_class(read, write) as session:
                        await session.initialize()
                        self._session, self._gone = session, None
                        ready.set_result(await session.list_tools())
                        await anyio.sleep_forever()
        except Exception as exc:  # before the listing: _open raises it; after: the calls report the death
            if not ready.done():
                ready.set_exception(exc)
        if not ready.done():
            ready.set_exception(TimeoutError("stopped before it listed its tools"))

    async def _stop(self) -> None:
        """End the current connection (and its server process), waiting until it has."""
        if self._scope is not None:
            self._scope.cancel()
        if self._connection is not None:
            await asyncio.gather(self._connection, return_exceptions=True)

    async def _call(self, name: str, arguments: dict[str, Any]) -> Any:
        if self._gone is not None:
            if self._restarts_in_a_row >= self.max_restarts:
                raise ToolCallError(ToolErrorKind.TOOL_ERROR, f"The MCP server of tool {name!r} is gone "
                                    f"({_reason(self._gone)}) and is not restarted again.", tool_name=name)
            if self._restarting is None:  # one restart for all the calls waiting on it
                self._restarting = asyncio.get_running_loop().create_task(self._restart())
            await asyncio.shield(self._restarting)  # a call that times out leaves the restart running
        session = self._session
        try:
            result = await session.call_tool(name, arguments)
        except Exception as exc:
            if session is self._session and self._gone is None and not self._closing and _is_gone(exc):
                self._gone = exc
                if self._restarts_in_a_row < self.max_restarts:
                    logger.warning("MCP server `%s` is gone (%s): this call fails as tool_error; the next call "
                                   "restarts it.", self._server, _reason(exc))
                else:
                    self._say_given_up()
            raise
        self._restarts_in_a_row = 0
        return result

    async def _restart(self) -> None:
        """A new server process and session for the one that is gone (its calls wait for it)."""
        try:
            self._restarts_in_a_row += 1
            self.num_restarts += 1
            await self._stop()
            try:
                await self._open()
            except Exception as exc:
                logger.warning("MCP server `%s` did not restart: %s", self._server, exc)
                if self._restarts_in_a_row >= self.max_restarts:
                    self._say_given_up()
                raise
            logger.warning("MCP server `%s` restarted (restart %d in a row; max_restarts=%d).", self._server,
                           self._restarts_in_a_row, self.max_restarts)
        finally:
            self._restarting = None

    def _say_given_up(self) -> None:
        logger.warning("MCP server `%s` is gone after %d restarts in a row with no call answered (max_restarts=%d): "
                       "it is not restarted again; every call to its tools fails as tool_error from now on, which "
                       "the model is scored on.", self._server, self._restarts_in_a_row, self.max_restarts)

    # -- on any loop ------------------------------------------------------------------------------

    def _caller(self, name: str):
        async def call(**arguments: Any) -> str:
            future = asyncio.run_coroutine_threadsafe(self._call(name, arguments), self._loop)
            result = await asyncio.wrap_future(future)
            text = _result_text(result)
            if _field(result, "is_error", "isError"):
                raise ToolCallError(ToolErrorKind.TOOL_ERROR, text, tool_name=name)
            return text

        call.__name__ = name
        return call

    def close(self) -> None:
        """Stop the server and the connection's thread."""
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shut_down(), self._loop).result(timeout=30)
            except (RuntimeError, concurrent.futures.TimeoutError):  # the loop closed already, or a stuck SDK
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    async def _shut_down(self) -> None:  # on the connection's loop
        self._closing = True
        await self._stop()

    def __enter__(self) -> McpToolset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __deepcopy__(self, memo: dict) -> McpToolset:
        return self  # forked environments share the connection


def _is_gone(exc: BaseException) -> bool:
    """Whether a failed call says the connection to the server ended (it exited, or was killed)."""
    return "Connection closed" in str(exc) or "closed" in type(exc).__name__.lower() \
        or "broken" in type(exc).__name__.lower()


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
