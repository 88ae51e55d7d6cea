"""Isolated tool calls: each call of an ``isolate=True`` tool runs in a fresh process, killed on timeout.

A thread running a sync tool cannot be stopped, and an async tool that blocks the event
loop cannot be cancelled; a process can be killed. :func:`run_isolated` starts one
(``forkserver`` where available, else ``spawn``), sends it the function and the
arguments, and kills and reaps it (:func:`treerl.envs.processes.akill_and_reap`) when the
call is over, whatever its outcome, with the processes it started: the call's process leads
its own process group (see :func:`_isolated_main`).

The child finds the function by module and qualified name, or unpickles it
(:func:`function_payload` decides once, when the tool is defined); the arguments must
be picklable. The child sends ``("ready", None)`` once the function is loaded and then
one outcome, which :meth:`treerl.envs.tools.Tool.acall` turns into a result or an error:

- ``("text", str)``: the result, already turned into text in the child;
- ``("tool_call_error", (kind, message))``: the tool raised a ``ToolCallError`` itself;
- ``("error", message)``: the tool raised (``"ValueError: ..."``) or its process died;
- ``("bug", message)``: the function could not be loaded, or its result cannot become text.

The time limit counts from ``ready``, so that interpreter start-up and imports do not eat
a short limit; start-up itself gets ``_ISOLATE_STARTUP_S``.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import multiprocessing
import os
import pickle
import runpy
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from treerl.envs.processes import akill_and_reap
from treerl.envs.schema import result_text
from treerl.errors import ToolCallError

__all__ = ["function_payload", "run_isolated"]

USER_FILE_PREFIX = "treerl_user_module:"
"""The module name ``--import FILE.py`` runs a file under (followed by its absolute path)."""

_MP_CONTEXT = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
# The time limit of an isolated call counts from when the function is ready to run in the
# child, so that process start-up (interpreter, imports) does not eat a short limit; start-up
# itself gets this much before the call is given up as timed out.
_ISOLATE_STARTUP_S = 60.0


def function_payload(fn: Callable[..., Any], name: str) -> tuple[str, Any]:
    """How a child process finds ``fn``: by module and name, else the pickled function.

    Under ``@tool`` the module's attribute is the Tool, not the function, so pickle's own
    by-reference lookup would fail; the child resolves the name itself (see ``_resolve``).
    ``TypeError`` (naming tool ``name``) when ``fn`` can be neither imported nor pickled.
    """
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and qualname and "<" not in qualname:
        return "ref", (module, qualname)
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(
            f"tool {name!r} has isolate=True but its function can be neither imported by name nor pickled "
            f"({exc}); define it at module level"
        ) from exc
    return "pickle", fn


async def run_isolated(
    payload: tuple[str, Any], kwargs: dict[str, Any], *, name: str, timeout: float | None
) -> tuple[str, Any]:
    """Run one call of the function ``payload`` names in a fresh process; kill it on timeout.

    Returns the child's outcome (see the module doc). Raises ``TimeoutError`` when the
    call ran past ``timeout`` seconds (or start-up past ``_ISOLATE_STARTUP_S``), and
    ``TypeError`` (naming tool ``name``) when the arguments cannot be pickled.
    """
    try:
        request = pickle.dumps((payload, kwargs))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"tool {name!r} has isolate=True but its arguments cannot be pickled: {exc}") from exc
    ctx = multiprocessing.get_context(_MP_CONTEXT)
    # Two-way: the child waits on its end for ours to close (see _isolated_main).
    receiver, sender = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_isolated_main, args=(request, sender), daemon=True, name=f"tool-{name}")
    try:
        await asyncio.to_thread(process.start)
        sender.close()  # so that the child's exit shows here as end of file
        first = await _receive(receiver, _ISOLATE_STARTUP_S)
        if first is None:
            raise TimeoutError
        if first[0] == "error":  # it died before the function was even loaded: the setup, not the call
            return "bug", _died_loading(payload, name)
        if first[0] != "ready":
            return first
        outcome = await _receive(receiver, timeout)
        if outcome is None:
            raise TimeoutError
        return outcome
    finally:
        await akill_and_reap(process, timeout_s=None)
        receiver.close()


def _died_loading(payload: tuple[str, Any], name: str) -> str:
    """Why an isolated tool's process may have exited while loading the tool (its stderr has the detail)."""
    message = f"tool {name!r} has isolate=True, and its process exited while loading the tool (see its stderr)"
    if payload[0] == "ref" and payload[1][0] in ("__main__", "__mp_main__"):
        message += (": the tool is defined in the script being run, which the tool's process runs again to "
                    "find it; put the script's own work under `if __name__ == \"__main__\":` or define the "
                    "tool in a module")
    return message


def _resolve(payload: tuple[str, Any]) -> Callable[..., Any]:
    how, what = payload
    if how == "pickle":
        return what
    module, qualname = what
    if module.startswith(USER_FILE_PREFIX) and module not in sys.modules:
        # A file run by `treerl ... --import path.py` (runpy names it "treerl_user_module:<path>"):
        # it cannot be imported by that name, so the child runs the file again.
        namespace = runpy.run_path(module[len(USER_FILE_PREFIX):], run_name=module)
        target: Any = SimpleNamespace(**namespace)
    else:
        target = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    # Under @tool this is the Tool, which calls its function unchanged when called.
    return target


def _isolated_main(request: bytes, conn: Any) -> None:
    """Entry point of an isolated call's process: resolve, report ready, run, send the outcome.

    The process leads its own session and process group, so that what the tool starts (a
    subprocess, a server) is killed with it; and it stays alive after its outcome until the
    parent closes the pipe (the parent kills the group first), so that the group's id is
    still its own when the kill comes. A child that calls ``setsid()`` itself escapes this.
    """
    os.setsid()
    conn.send(_call(request, conn))
    try:
        conn.poll(None)  # the parent never writes: this returns at end of file, when it is done (or gone)
    except OSError:
        pass


def _call(request: bytes, conn: Any) -> tuple[str, Any]:
    """Resolve the function, report ready, run it: the outcome to send (see the module doc)."""
    try:
        payload, kwargs = pickle.loads(request)
        fn = _resolve(payload)
    except Exception as exc:  # reported to the parent, which raises it as a bug
        return "bug", f"the isolated tool could not be loaded in its process: {type(exc).__name__}: {exc}"
    conn.send(("ready", None))
    try:
        result = fn(**kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(_await(result))
    except ToolCallError as exc:
        return "tool_call_error", (exc.kind, exc.message)
    except Exception as exc:  # the tool's failure is the model's observation
        return "raised_text", f"{type(exc).__name__}: {exc}"
    try:
        return "text", result_text(result, getattr(fn, "__name__", "tool"))
    except TypeError as exc:
        return "bug", str(exc)


async def _await(awaitable: Any) -> Any:
    return await awaitable


async def _receive(conn: Any, timeout: float | None) -> tuple[str, Any] | None:
    """The next message from a child, ``None`` on timeout; a dead child reads as an error outcome."""
    if not await asyncio.to_thread(conn.poll, timeout):
        return None
    try:
        message = conn.recv()
    except (EOFError, OSError):
        return "error", "The tool crashed: its process exited before returning a result."
    if message[0] == "raised_text":
        return "error", message[1]
    return message
