"""Reading a sandboxed run from the parent: its output and the bootstrap's status records.

:func:`capture` is the parent's half of :func:`treerl.envs.sandbox.run_python`. Invariants:

- It never waits past the deadline: the pipes are read with ``select`` in short slices,
  and the wall clock is checked between them.
- Both pipes are always read, so a child that writes a lot never blocks on a full pipe;
  only the first ``max_output_bytes`` of each are kept, the rest is read and dropped.
- A run that hits its process limit, or a limit the parent itself watches (``watch``:
  total memory or disk where the kernel could not be asked to enforce them), is stopped at
  once rather than left to spin until the deadline; whatever the run left behind is killed (``kill_survivors``) before the
  pipes are drained, since a leftover child can hold them open.
- ``on_stdout`` is handed the stdout within the limit as it arrives, in place of keeping it
  (``stdout`` is then empty: a caller that reads a long stream piece by piece does not hold
  it twice); when it returns true the run is stopped at once (``stopped``), the way a
  process-limit hit stops it.
- Event records are JSON lines on a pipe (``events_fd``) that any process of the run may
  write, the user code included: unreadable lines are skipped, and only the first
  ``_MAX_STATUS_BYTES`` are kept; the rest is read and dropped, so that the pipe never
  fills and nothing the code writes there lands on a disk.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Captured", "capture", "StatusReader"]

# Status records are small; more than this means the user code wrote into the status fd.
_MAX_STATUS_BYTES = 1 << 20
# How often the read loop wakes to check the child and its status records.
_POLL_S = 0.05
# After the child is gone, how long to wait for its pipes to drain.
_DRAIN_S = 1.0


@dataclass
class Captured:
    """What the parent read from one run."""

    stdout: str
    stderr: str
    truncated: bool
    """Whether stdout or stderr went over ``max_output_bytes`` and was cut."""
    stdout_truncated: bool
    """Whether stdout itself was cut (a judge of the output ignores stderr)."""
    timed_out: bool
    """The main process was still running at the deadline."""
    stopped_early: bool
    """The run was stopped before the deadline because it hit its process limit or a watched limit."""
    records: list[dict]
    """The status records of every process of the run, in the order they were written."""
    stopped: bool = False
    """The run was stopped because ``on_stdout`` asked for it."""


def capture(
    proc: subprocess.Popen,
    events_fd: int,
    *,
    max_output_bytes: int,
    deadline: float,
    kill_survivors: Callable[[], None],
    watch: Callable[[], dict | None] | None = None,
    watch_every_s: float = 0.2,
    on_stdout: Callable[[bytes], bool] | None = None,
) -> Captured:
    """Read the child's output until it exits or the deadline passes, keeping the head.

    ``watch``, called every ``watch_every_s``, returns a record when the run broke a limit
    the parent enforces itself; the record joins ``records`` and the run is stopped.
    ``on_stdout`` is called with each piece of stdout within the limit, as it is read, and
    that stdout is not kept; when it returns true, the run is stopped.
    """
    assert proc.stdout is not None and proc.stderr is not None
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    taken = dict.fromkeys(kept, 0)  # bytes within the limit so far, kept or handed to on_stdout
    cut: set[int] = set()  # the pipes that went over max_output_bytes
    timed_out = stopped_early = stopped = False
    sel = selectors.DefaultSelector()
    for pipe in (proc.stdout, proc.stderr):
        sel.register(pipe.fileno(), selectors.EVENT_READ)
    sel.register(events_fd, selectors.EVENT_READ)
    status = StatusReader()
    watched: list[dict] = []
    next_watch = time.monotonic() + watch_every_s

    def read_ready(timeout: float) -> bool:
        """Read what is ready; True when ``on_stdout`` asked to stop."""
        stop = False
        for key, _ in sel.select(timeout=max(timeout, 0.0)):
            data = os.read(key.fd, 65536)
            if not data:
                sel.unregister(key.fd)
                continue
            if key.fd == events_fd:
                status.feed(data)
                continue
            room = max_output_bytes - taken[key.fd]
            if len(data) > room:
                cut.add(key.fd)
            if room > 0:
                piece = data[:room]
                taken[key.fd] += len(piece)
                if on_stdout is not None and key.fd == proc.stdout.fileno():
                    stop = bool(on_stdout(piece)) or stop
                else:
                    kept[key.fd] += piece
        return stop

    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = proc.poll() is None
                break
            if not sel.get_map():
                # Every pipe closed: wait for the exit itself, still under the deadline.
                try:
                    proc.wait(timeout=remaining)
                except subprocess.TimeoutExpired:
                    timed_out = True
                break
            if read_ready(min(remaining, _POLL_S)) and proc.poll() is None:
                stopped = True
                break
            if any(r.get("event") == "process_limit" for r in status.poll()):
                # A fork bomb that swallows its errors would otherwise spin until the
                # wall clock; the limit has done its job, stop the run now.
                stopped_early = proc.poll() is None
                break
            if watch is not None and time.monotonic() >= next_watch:
                next_watch = time.monotonic() + watch_every_s
                hit = watch()
                if hit is not None:
                    watched.append(hit)
                    stopped_early = proc.poll() is None
                    break
            if proc.poll() is not None:
                break  # exited; a leftover child may still hold the pipes open
        # Whatever is left (background children) dies now, then the pipes drain to EOF.
        kill_survivors()
        drain_until = time.monotonic() + _DRAIN_S
        while sel.get_map() and time.monotonic() < drain_until:
            read_ready(drain_until - time.monotonic())
    finally:
        sel.close()
    return Captured(
        stdout=kept[proc.stdout.fileno()].decode("utf-8", errors="replace"),
        stderr=kept[proc.stderr.fileno()].decode("utf-8", errors="replace"),
        truncated=bool(cut),
        stdout_truncated=proc.stdout.fileno() in cut,
        timed_out=timed_out,
        stopped_early=stopped_early,
        stopped=stopped,
        records=status.poll(final=True) + watched,
    )


class StatusReader:
    """Parses the bootstrap's JSON-lines event records as they arrive, tolerating garbage.

    ``feed(data)`` takes bytes read from the events pipe (beyond ``_MAX_STATUS_BYTES`` in
    all they are dropped); ``poll()`` returns every record parsed so far; ``poll(final=True)``
    also takes a last line that has no newline (the run is over).
    """

    def __init__(self) -> None:
        self._seen = 0
        self._pending = b""
        self.records: list[dict] = []

    def feed(self, data: bytes) -> None:
        room = _MAX_STATUS_BYTES - self._seen
        self._seen += len(data)
        if room > 0:
            self._pending += data[:room]

    def poll(self, final: bool = False) -> list[dict]:
        lines = self._pending.split(b"\n")
        self._pending = b"" if final else lines.pop()
        for line in lines:
            try:
                rec = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(rec, dict):
                self.records.append(rec)
        return self.records
