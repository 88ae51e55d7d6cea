"""Work that must not stall the event loop: run it in its own thread, timed on its own execution.

The rollout engine plays many episodes on one event loop. Parsing a reply, validating and
running a synchronous tool, and scoring an answer are plain function calls on model text;
run on the loop, one slow call stalls every sibling episode, and a tool that finished in
time is reported as a ``timeout`` because the loop only noticed after its deadline.
:func:`run_in_thread` runs such a call in a fresh daemon thread and measures its limit on
the call's own execution: the clock starts when the thread starts the work, and a call
that finished within its limit counts as finished, however late the loop got to it.

A thread cannot be killed: a call that overruns is abandoned (its result is dropped) and
keeps its thread until it returns. Calls never queue behind each other: an idle worker
thread takes the call, or a new one is started when all are busy (so one stuck call
delays nothing else), and workers idle for 30 s exit. Work that must be killable belongs
in a process (``@tool(isolate=True)``, :mod:`treerl.envs.sandbox`).

>>> import asyncio
>>> asyncio.run(run_in_thread(sum, [1, 2, 3], timeout=5.0))
6
>>> import time
>>> asyncio.run(run_in_thread(time.sleep, 1.0, timeout=0.05))
Traceback (most recent call last):
...
TimeoutError
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["run_in_thread"]


async def run_in_thread(fn: Callable[..., Any], *args: Any, timeout: float | None = None,
                        prepare: Callable[[], Any] | None = None, name: str = "treerl-work") -> Any:
    """``fn(*args)`` in a fresh daemon thread, awaited without blocking the event loop.

    Args:
        fn: The work. Its exceptions are raised here.
        timeout: Seconds ``fn`` may run, measured from when its thread starts it; a call
            that runs longer raises :class:`TimeoutError` (also when its result arrives
            late). ``None``: no limit.
        prepare: Called first in the same thread, untimed; its result is passed to ``fn``
            as the first argument, and its exceptions are raised here without calling ``fn``
            (a tool's argument validation, which is not the tool's own time).
        name: The thread's name, for debuggers and ``threading.enumerate()``.
    """
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    clock: list[float] = []  # [started, finished], written by the worker thread

    def settle(outcome: tuple[str, Any]) -> None:
        if not done.done():
            done.set_result(outcome)

    def work() -> None:
        outcome: tuple[str, Any]
        try:
            first = (prepare(),) if prepare is not None else ()
            clock.append(time.monotonic())
            try:
                outcome = ("ok", fn(*first, *args))
            finally:
                clock.append(time.monotonic())
        except BaseException as exc:  # handed to the awaiting coroutine, not swallowed
            outcome = ("raised", exc)
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:
            pass  # the event loop is closed: nobody awaits this result any more

    _WORKERS.submit(work, name)
    while not done.done():
        if timeout is None or not clock:
            # Not started yet (or no limit): time spent waiting for a thread is not the work's.
            await asyncio.wait({done}, timeout=timeout)
            continue
        remaining = clock[0] + timeout - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        await asyncio.wait({done}, timeout=remaining)
    status, value = done.result()
    if status == "raised":
        raise value
    if timeout is not None and clock[1] - clock[0] > timeout:
        raise TimeoutError  # it finished, but past its limit
    return value


class _Workers:
    """Threads that run one job at a time: an idle one is reused, a new one starts when all are busy."""

    def __init__(self, idle_s: float = 30.0):
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # the inbox of each idle worker
        self._pid = os.getpid()

    def submit(self, job: Callable[[], None], name: str) -> None:
        with self._lock:
            if self._pid != os.getpid():  # a forked child has none of its parent's threads
                self._idle, self._pid = [], os.getpid()
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="treerl-worker", daemon=True).start()
        inbox.put((job, name))

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            try:
                job, name = inbox.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:
                        self._idle.remove(inbox)
                        return
                job, name = inbox.get()  # handed a job just as it timed out
            threading.current_thread().name = name
            job()
            with self._lock:
                self._idle.append(inbox)


_WORKERS = _Workers()
