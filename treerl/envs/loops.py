"""Event loops that end on time, whatever their tasks do with a cancellation.

A task that swallows ``CancelledError`` (a tool's retry loop that catches everything, a
custom ``astep`` that ignores cancellation) cannot be stopped from outside: cancelling it
only asks. ``asyncio.wait_for`` waits for the task to end after asking, and ``asyncio.run``
waits, at shutdown, for every task still pending, so one such task holds a tool call, an
episode or a whole rollout step for as long as it runs, forever if it never ends. Here:

- :func:`run_with_limit` runs an awaitable as its own task and returns at the limit with
  ``TimeoutError``: the task is cancelled and abandoned (held until it ends, its outcome
  dropped), not waited for.
- :func:`run_until_done` is ``asyncio.run`` with a bounded shutdown: the tasks left when the
  main coroutine is done are cancelled and given ``grace_s`` to end; those still running
  are logged by name (the tool or environment) and left behind with the closed loop.

Every rollout that runs its own event loop (a learner's step, ``treerl rollout``, ``treerl
eval``, a sync ``Env.step``) runs it with :func:`run_until_done`.

>>> async def stubborn():
...     while True:
...         try:
...             await asyncio.sleep(10)
...         except asyncio.CancelledError:
...             pass
>>> async def main():
...     try:
...         await run_with_limit(stubborn(), 0.05, name="stubborn")
...     except TimeoutError:
...         return "timed out"
>>> run_until_done(main(), grace_s=0.05)
'timed out'
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

__all__ = ["run_with_limit", "run_until_done", "SHUTDOWN_GRACE_S"]

T = TypeVar("T")

SHUTDOWN_GRACE_S = 2.0
"""How long :func:`run_until_done` waits, by default, for the tasks left at shutdown to end once cancelled."""

_log = logging.getLogger(__name__)
_ABANDONED: set[asyncio.Task] = set()
"""Tasks cancelled and not waited for, that have not ended: held here, since an event loop keeps
only weak references to its tasks (a task collected while pending is logged as destroyed)."""


async def run_with_limit(awaitable: Awaitable[T], timeout: float | None, *, name: str) -> T:
    """Await ``awaitable`` as a task named ``name``, for at most ``timeout`` seconds (``None``: no limit).

    Raises ``TimeoutError`` at the limit, even when the task swallows its cancellation: it is
    cancelled and abandoned, not waited for. Cancelling the caller abandons it too.
    """
    task = asyncio.ensure_future(awaitable)
    if isinstance(task, asyncio.Task):
        task.set_name(name)
    try:
        await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:  # the caller gave up (an episode's own time limit)
        abandon(task)
        raise
    if task.done():
        return task.result()
    abandon(task)
    raise TimeoutError


def abandon(task: asyncio.Future) -> None:
    """Cancel ``task`` without waiting for it to end; hold it until it does."""
    task.cancel()
    _ABANDONED.add(task)
    task.add_done_callback(_forget)


def _forget(task: asyncio.Future) -> None:
    _ABANDONED.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: its outcome is dropped, not logged as never retrieved


def run_until_done(main: Coroutine[Any, Any, T], *, grace_s: float = SHUTDOWN_GRACE_S) -> T:
    """``asyncio.run(main)``, but the tasks still pending when ``main`` is done get ``grace_s`` to end.

    Like ``asyncio.run``, it runs ``main`` on a fresh event loop, then cancels what is left,
    finishes async generators and the default executor, and closes the loop; unlike it, it
    waits at most ``grace_s`` for each of those, so a task that swallows its cancellation
    cannot hold the caller. Such tasks are logged (warning, logger ``treerl.envs.loops``) by
    name and abandoned: they never run again.

    Unlike it, it also runs under a running event loop (a notebook's cell, a synchronous call made
    from a coroutine): ``main`` then runs on a helper thread while the caller waits, and the
    caller's loop is left as it was.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_here(main, grace_s)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = _run_here(main, grace_s)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="treerl-run-until-done")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _run_here(main: Coroutine[Any, Any, T], grace_s: float) -> T:
    """:func:`run_until_done` on a fresh event loop of this thread, which runs none."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_leftovers(loop, grace_s)
            _bounded(loop, loop.shutdown_asyncgens(), grace_s)
            _bounded(loop, loop.shutdown_default_executor(), grace_s)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_leftovers(loop: asyncio.AbstractEventLoop, grace_s: float) -> None:
    left = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not left:
        return
    for task in left:
        task.cancel()
    loop.run_until_complete(asyncio.wait(left, timeout=grace_s))
    stuck = [t for t in left if not t.done()]
    for task in left:
        if task.done() and not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler({"message": "unhandled exception in a task left at shutdown",
                                         "exception": task.exception(), "task": task})
    if stuck:
        _ABANDONED.update(stuck)  # never run again; held so that they are not reported as destroyed
        names = ", ".join(f"{t.get_name()} ({_coroutine_name(t)})" for t in stuck)
        _log.warning("%d task(s) still running %g s after they were cancelled at the end of the event loop were "
                     "abandoned (they swallow CancelledError): %s", len(stuck), grace_s, names)


def _bounded(loop: asyncio.AbstractEventLoop, shutdown: Coroutine[Any, Any, None], grace_s: float) -> None:
    task = loop.create_task(shutdown)
    loop.run_until_complete(asyncio.wait({task}, timeout=grace_s))
    if not task.done():
        abandon(task)


def _coroutine_name(task: asyncio.Task) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", type(coro).__name__)
