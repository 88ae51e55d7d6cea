"""The one kill-and-reap helper: nothing it was given, or that this spawned, is left running."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time

from treerl.envs.processes import akill_and_reap, kill_and_reap, send_kill

# A child that starts a grandchild (in the child's process group), prints its pid and waits.
PARENT_OF_SLEEPER = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphaned zombie waits for init, not for us)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _gone_soon(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_kills_the_whole_group_reaps_and_closes_pipes():
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT_OF_SLEEPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )
    grandchild = int(proc.stdout.readline())
    assert _running(grandchild)
    kill_and_reap(proc)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdin.closed and proc.stdout.closed
    assert _gone_soon(grandchild)


def test_the_extra_step_runs_before_the_reap():
    """``before_reap`` sees the killed child still unreaped, so its pid cannot have been reused."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    seen = []
    kill_and_reap(proc, before_reap=lambda: seen.append((proc.returncode, os.path.exists(f"/proc/{proc.pid}"))))
    assert seen == [(None, True)]
    assert proc.returncode == -signal.SIGKILL and not os.path.exists(f"/proc/{proc.pid}")


def test_an_exited_child_is_only_reaped():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    while _running(proc.pid):  # exited but unreaped: a zombie
        time.sleep(0.01)
    kill_and_reap(proc)
    assert proc.returncode == 0


def test_send_kill_to_a_missing_process_is_not_an_error():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    send_kill(proc.pid)
    send_kill(proc.pid, group=True)


def test_multiprocessing_processes_are_killed_alone_and_joined():
    ctx = multiprocessing.get_context("spawn")
    process = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    process.start()
    kill_and_reap(process)
    assert process.exitcode == -signal.SIGKILL and not process.is_alive()
    kill_and_reap(ctx.Process(target=time.sleep, args=(60,)))  # never started: nothing to do


def test_the_async_variant_kills_and_reaps():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    asyncio.run(akill_and_reap(proc))
    assert proc.returncode == -signal.SIGKILL
