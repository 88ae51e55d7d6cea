"""Ending child processes: one kill-and-reap routine for every envs module that starts them.

The sandbox, the math-verify worker and isolated tools all run code that may hang, spin
or fork, so they end it with ``SIGKILL`` (a polite signal could be caught) and then reap
it, so that no zombie and no open pipe is left behind. They do it here, the same way:

- A ``subprocess.Popen`` given to :func:`kill_and_reap` must have been started with
  ``start_new_session=True``. Its pid is then also its process group id, and the whole
  group is killed, so whatever it spawned dies with it.
- Until a child is reaped its pid cannot be reused, so signalling that pid (or the group
  and session it names) cannot reach an unrelated process. ``before_reap`` runs in that
  window; the sandbox uses it to sweep its private uid and session.
- A ``multiprocessing`` process (an isolated tool) is, under ``forkserver``, the fork
  server's child rather than ours: its pid may be reused as soon as it has exited. It is
  therefore killed only while it is alive: itself, and the process group it leads when it
  made one (an isolated call does, with ``setsid()``, and stays alive until the parent is
  done with it, so that what it started dies with it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable
from multiprocessing.process import BaseProcess

__all__ = ["send_kill", "kill_and_reap", "akill_and_reap"]


def send_kill(pid: int, *, group: bool = False) -> None:
    """Send ``SIGKILL`` to ``pid``, or with ``group`` to the process group ``pid``.

    A target that is already gone is not an error: ending it is what the caller wanted.
    """
    try:
        if group:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        # PermissionError: the target now runs as a uid we may not signal (a sandbox run
        # that dropped privileges while we are not root); nothing more can be done here.
        pass


def kill_and_reap(
    proc: subprocess.Popen | BaseProcess,
    *,
    timeout_s: float | None = 5.0,
    before_reap: Callable[[], None] | None = None,
) -> None:
    """Kill ``proc`` with ``SIGKILL``, run ``before_reap``, then reap it and close its pipes.

    A ``subprocess.Popen`` loses its whole process group (see the module doc); a
    ``multiprocessing`` process is killed with the process group it leads (if any) while it
    is alive, and one that never started is left as it is. ``timeout_s`` bounds the wait for the exit (``None``: wait as long as it takes); a
    process stuck in the kernel past it stays unreaped, and its pipes are closed anyway.

    >>> import sys
    >>> proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    >>> kill_and_reap(proc)
    >>> proc.returncode == -signal.SIGKILL
    True
    """
    _kill(proc)
    if before_reap is not None:
        before_reap()
    _reap(proc, timeout_s)


async def akill_and_reap(proc: subprocess.Popen | BaseProcess, *, timeout_s: float | None = 5.0) -> None:
    """:func:`kill_and_reap` for coroutines: the kill is sent at once, the wait runs in a worker thread.

    The kill goes out from the event loop itself, not from a worker thread, so that it
    happens even when the caller is cancelled or every worker thread is taken (a timed-out
    sync tool keeps holding one); only waiting for the exit would block the loop.
    """
    _kill(proc)
    await asyncio.to_thread(_reap, proc, timeout_s)


def _kill(proc: subprocess.Popen | BaseProcess) -> None:
    if isinstance(proc, subprocess.Popen):
        send_kill(proc.pid, group=True)
    elif proc.pid is not None and proc.is_alive():
        # is_alive() collects an exit first, so a pid the fork server has already reaped
        # (and that may now be another process's) is never signalled. While it is alive, no
        # group but its own can have its pid as id: none, or the one it leads.
        send_kill(proc.pid, group=True)
        proc.kill()


def _reap(proc: subprocess.Popen | BaseProcess, timeout_s: float | None) -> None:
    if isinstance(proc, subprocess.Popen):
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass  # closing stdin flushes its buffer into a pipe nobody reads any more
    elif proc.pid is not None:  # a process that never started has nothing to reap
        proc.join(timeout_s)
