"""Run untrusted, model-written Python in a separate, limited process.

:func:`run_python` starts ``python -I`` (isolated mode: no ``PYTHON*`` variables, no user
site, no script directory on ``sys.path``) in its own session and process group, with
captured and truncated stdin/stdout/stderr and a minimal environment (``PATH``, ``HOME``,
``TMPDIR``, ``LANG``; nothing inherited, so no tokens or keys are handed in; without a pid
namespace and not as root, though, the code runs as the caller's user and can read the
environment of the caller's processes in ``/proc``, and signal them). A small trusted
bootstrap (:mod:`treerl.envs.sandbox_bootstrap`, run by path) runs first: its outer
process holds the result pipe and never runs user code; its inner process isolates
itself, applies the limits and runs the user code as ``__main__``.

What is enforced, and what is left where the machine refuses (each run says which, in
:attr:`SandboxResult.enforced`, and the log says once per process what is not enforced):

==============  =========================================================================
protection      how (fallback)
==============  =========================================================================
wall clock      The parent's read loop has a deadline, ``timeout_s`` after the run got its
                slot (below); then it kills the run's cgroup, process group, session and
                (as root) private uid. Always enforced.
filesystem      A mount namespace whose root is an empty read-only tmpfs with only the
                interpreter (its prefixes or venv), the system library directories and
                the loader cache bound back read-only, a fresh ``/proc``, a minimal
                ``/dev``; the working directory, ``/tmp`` and ``/dev/shm`` are private.
                Needs root or unprivileged user namespaces (fallback: the host's files
                are visible under ordinary permissions, the working directory is a host
                temporary directory, ``/tmp`` is shared).
pid namespace   The code is pid 1 of its own pid namespace: it sees only its processes,
                and when it exits the kernel kills the rest (fallback: the parent's view;
                not as root, the code may then signal the caller's processes and read
                their ``/proc/<pid>/environ``).
memory          ``RLIMIT_AS``/``RLIMIT_DATA`` per process, and for the whole run a cgroup
                (:mod:`treerl.envs.sandbox_cgroup`) of ``memory_mb + disk_mb``; an OOM kill
                in it -> ``MEMORY``. Fallback: the parent adds up the run's resident memory
                every ``_WATCH_S`` and stops it over ``memory_mb``.
disk            The working directory, ``/tmp`` and ``/dev/shm`` share one tmpfs of
                ``disk_mb``: a full one is ``ENOSPC`` -> ``DISK``. Fallback:
                ``RLIMIT_FSIZE`` per file and the parent's sum of the working directory.
processes       As root: a fresh unprivileged uid/gid per run with ``RLIMIT_NPROC``
                (and ``pids.max`` of the cgroup); not root: ``RLIMIT_NPROC`` over this
                user's current tasks (approximate). ``EAGAIN`` -> ``PROCESS_LIMIT`` at once.
network         A network namespace with no interface up (which also holds abstract unix
                sockets), plus an audit hook that blocks inet ``connect``/``bind``/
                ``sendto``/``sendmsg`` and name lookups -> ``NETWORK`` (fallback: the
                hook alone, which ``ctypes`` gets around).
IPC             An IPC namespace: System V segments and queues die with the run.
privileges      As root a private uid (no groups); in a user namespace every capability
                is dropped; ``no_new_privs`` always.
result          Exit status, main pid and the ``enforced`` table travel on a pipe that
                only the outer process holds; the inner closes it before anything else.
                Event records the code can reach (blocked call, failed fork, how the main
                process ended) can make its own outcome worse, never a failure a success.
==============  =========================================================================

Every run reports what was actually in effect in :attr:`SandboxResult.enforced`;
:func:`sandbox_capabilities` runs a probe and returns the same for this machine.

At most :func:`max_concurrent_runs` runs (default: the CPUs this process may use) go at
once in a process; the others wait for a slot, and the time limit counts from when a run
has one (:attr:`SandboxResult.wait_s` says how long it waited). Without that bound, many
episodes running code at once on few cores starve each other, and even ``print(1)`` can pass
a short wall-clock limit. The limit stays wall clock (a sleeping or blocked program is
stopped too), not CPU time: with at most one run per CPU a run that is not starved by
other work gets about a core, so its wall time is close to its CPU time.

Outcomes are classified by :func:`classify_outcome`: wall time -> ``TIMEOUT``; a blocked
network call -> ``NETWORK``; ``MemoryError``, an OOM kill in the run's cgroup or a kill by
``SIGKILL`` that was not ours -> ``MEMORY``; a full disk quota -> ``DISK``; ``EAGAIN`` on
process creation or "can't start new thread" -> ``PROCESS_LIMIT``; any other non-zero
exit -> ``RUNTIME_ERROR``.

The sandbox protects the machine, not a reward: code under test runs in the same
interpreter as anything run after it and can tamper with it if it tries.

Example:
    >>> result = run_python("print(input()[::-1])", stdin="abc\\n")  # doctest: +SKIP
    >>> result.ok, result.stdout  # doctest: +SKIP
    (True, 'cba\\n')
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import treerl.envs.sandbox_bootstrap as sandbox_bootstrap
from treerl.envs.offload import run_in_thread
from treerl.envs.processes import kill_and_reap, send_kill
from treerl.envs.sandbox_capture import capture
from treerl.envs.sandbox_cgroup import RunCgroup, open_cgroup
from treerl.envs.sandbox_host import (
    TrustedReader,
    chown_tree,
    filesystem_view,
    tree_bytes,
    write_files,
)

__all__ = [
    "SandboxLimits",
    "usable_cpus",
    "SandboxErrorKind",
    "SandboxResult",
    "run_python",
    "arun_python",
    "sandbox_capabilities",
    "classify_outcome",
    "max_concurrent_runs",
    "set_max_concurrent_runs",
]

# Per-run uids come from a range far above ordinary users and the usual subordinate-id
# ranges, so a run's RLIMIT_NPROC and its kill(-1) touch nothing but that run.
_UID_BASE = 2_100_000_000
_UID_SPAN = 1 << 24
# The bootstrap runs as a file, so that linters and tests see it like any module. The child
# reads it as the caller, before it drops privileges, so it may live where the private uid
# cannot look.
_BOOTSTRAP_PATH = Path(sandbox_bootstrap.__file__)
_MIB = 1024 * 1024
# How often the parent's own accounting (total memory without a cgroup, disk without a
# private tmpfs) looks at the run.
_WATCH_S = 0.2
_log = logging.getLogger("treerl.sandbox")
_logged: set[str] = set()


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one sandboxed run."""

    timeout_s: float = 5.0
    """Wall-clock limit for the whole run (interpreter start-up included), in seconds, counted from
    when the run has a slot (see :func:`max_concurrent_runs`), not while it waits for one."""
    memory_mb: int = 512
    """Address-space limit per process (``RLIMIT_AS``), in MiB. The interpreter alone needs ~30."""
    max_processes: int = 16
    """Processes and threads the sandbox may have at once, the main process included."""
    max_output_bytes: int = 64_000
    """Bytes of stdout and of stderr kept (each); the rest is read and dropped."""
    network: bool = False
    """Allow network access. Off by default: model code has no business on the network."""
    disk_mb: int = 128
    """Bytes, in MiB, that the working directory, ``/tmp`` and ``/dev/shm`` may hold in all."""
    namespaces: bool = True
    """Isolate with Linux namespaces where the machine allows (own filesystem view, pid,
    network and IPC namespaces). ``False`` gives what a machine without them gets: rlimits,
    the parent's accounting, cleanup and the network audit hook only (for tests and debugging)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(
                f"SandboxLimits.timeout_s must be > 0, got {self.timeout_s!r}: it is the wall-clock "
                "limit of the run. Pass a positive number of seconds, e.g. timeout_s=5.0."
            )
        if self.memory_mb < 64:
            raise ValueError(
                f"SandboxLimits.memory_mb must be >= 64, got {self.memory_mb!r}: the Python "
                "interpreter alone maps about 30 MiB and would fail to start. Use e.g. memory_mb=512."
            )
        if self.max_processes < 1:
            raise ValueError(
                f"SandboxLimits.max_processes must be >= 1, got {self.max_processes!r}: the main "
                "process counts as one. Use e.g. max_processes=16."
            )
        if self.disk_mb < 1:
            raise ValueError(
                f"SandboxLimits.disk_mb must be >= 1, got {self.disk_mb!r}: it bounds what the code may "
                "write to its working directory, /tmp and /dev/shm together. Use e.g. disk_mb=128."
            )
        if self.max_output_bytes < 0:
            raise ValueError(
                f"SandboxLimits.max_output_bytes must be >= 0, got {self.max_output_bytes!r}. "
                "Use 0 to drop all output or a positive byte count, e.g. 64_000."
            )


class SandboxErrorKind(str, Enum):
    """Why a sandboxed run did not finish cleanly."""

    TIMEOUT = "timeout"
    """The run passed its wall-clock limit and was killed."""
    MEMORY = "memory"
    """An allocation failed under the address-space limit."""
    PROCESS_LIMIT = "process_limit"
    """Creating a process or thread failed under the process limit."""
    NETWORK = "network"
    """The code tried to use the network and was blocked."""
    DISK = "disk"
    """The code wrote more than ``disk_mb`` to its working directory, ``/tmp`` and ``/dev/shm``."""
    RUNTIME_ERROR = "runtime_error"
    """Any other non-zero exit: an uncaught exception, ``sys.exit(1)``, a crash."""


@dataclass
class SandboxResult:
    """What a sandboxed run produced."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The main process's exit status (negative: killed by that signal); ``None`` when the
    sandbox killed it (timeout, process limit)."""
    error: SandboxErrorKind | None
    duration_s: float
    """Seconds from when the run got its slot to its end (what its time limit counts)."""
    truncated: bool = False
    """Whether stdout or stderr went over ``max_output_bytes`` and was cut."""
    stdout_truncated: bool = False
    """Whether stdout itself was cut: what a judge of the printed output must know (it ignores stderr)."""
    stopped: bool = False
    """Whether the run was stopped because ``on_stdout`` asked (then ``exit_code`` and ``error`` are ``None``)."""
    enforced: dict[str, str] = field(default_factory=dict)
    """What was in effect for this run (see the module docstring), as the child reported it."""
    pid: int | None = None
    """The pid of the sandbox's outer process (the bootstrap), also the run's process group
    and session id; the user code runs in its child."""
    uid: int | None = None
    """The private uid the code ran as, when the sandbox dropped privileges."""
    wait_s: float = 0.0
    """Seconds the run waited for a slot before it started (see :func:`max_concurrent_runs`);
    not counted against its time limit."""

    @property
    def ok(self) -> bool:
        """The code ran to completion and exited with status 0."""
        return self.error is None and self.exit_code == 0


def classify_outcome(
    *,
    exit_code: int | None,
    timed_out: bool,
    records: Sequence[Mapping[str, object]],
    main_pid: int,
    stderr: str = "",
) -> SandboxErrorKind | None:
    """Name the outcome of a run from what the parent saw and what the child recorded.

    ``records`` are the bootstrap's event records (any process of the run, the user code
    included, may write them, each tagged with its pid) plus the parent's own
    (``memory_limit``, ``disk_limit``: a whole-run limit was hit); ``exit_code`` (the
    trusted exit status) is ``None`` when the sandbox killed the run. A blocked network
    call wins over everything (the code broke a rule even if it caught the error), then a
    process-limit hit (it is what ends a fork bomb, and a fork bomb often also times out),
    then a whole-run memory or disk limit, then the wall clock; an exit status of 0 is then
    success whatever the records say, and only a failed main process's record names its cause.

    >>> classify_outcome(exit_code=0, timed_out=False, records=[], main_pid=1) is None
    True
    >>> classify_outcome(exit_code=None, timed_out=True, records=[], main_pid=1).value
    'timeout'
    >>> classify_outcome(exit_code=1, timed_out=False, main_pid=7,
    ...                  records=[{"event": "exit", "kind": "memory", "pid": 7}]).value
    'memory'
    """
    events = {r.get("event") for r in records}
    if "network" in events:
        return SandboxErrorKind.NETWORK
    if "process_limit" in events:
        return SandboxErrorKind.PROCESS_LIMIT
    if "memory_limit" in events:
        return SandboxErrorKind.MEMORY
    if "disk_limit" in events:
        return SandboxErrorKind.DISK
    if timed_out:
        return SandboxErrorKind.TIMEOUT
    if exit_code == 0:
        # The exit status comes from the trusted side; records the code wrote cannot undo it.
        return None
    # The bootstrap writes the main process's last record, and only with exit status 1: a
    # record the code forged before it, or with another status, names nothing.
    main_exit = next((r for r in reversed(records) if r.get("event") == "exit" and r.get("pid") == main_pid), None)
    kind = main_exit.get("kind") if main_exit is not None and exit_code == 1 else None
    if kind == "memory":
        return SandboxErrorKind.MEMORY
    if kind == "process_limit":
        return SandboxErrorKind.PROCESS_LIMIT
    if kind == "disk":
        return SandboxErrorKind.DISK
    if main_exit is None:
        # No record: the process died without reaching the bootstrap's handler. A SIGKILL we
        # did not send is the kernel's OOM killer; a MemoryError in C code can end that way too.
        if exit_code == -signal.SIGKILL or stderr.rstrip().endswith("MemoryError"):
            return SandboxErrorKind.MEMORY
    return SandboxErrorKind.RUNTIME_ERROR


def run_python(
    code: str,
    *,
    stdin: str | None = None,
    limits: SandboxLimits = SandboxLimits(),
    files: Mapping[str, str | bytes] | None = None,
    on_stdout: Callable[[bytes], bool] | None = None,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` of a fresh, limited ``python -I`` in a private directory.

    ``files`` maps relative paths (subdirectories allowed) to contents written into the
    working directory before the code starts. Never raises for anything the code does;
    raises ``ValueError`` for a bad ``files`` path (the caller's bug). ``on_stdout``, if
    given, is called with each piece of stdout within ``max_output_bytes`` as it arrives
    (from the thread that runs the code), in place of ``result.stdout``, which stays empty;
    when it returns true the run is stopped there, and the result says ``stopped`` (a caller
    that reads results as they stream and has seen enough). Thread-safe: no
    ``preexec_fn``, all setup happens in the child's bootstrap. Waits for a slot first
    when :func:`max_concurrent_runs` runs are going; ``limits.timeout_s`` counts from then.

    >>> r = run_python("import sys; print(sum(map(int, sys.stdin.read().split())))",
    ...                stdin="1 2 3")  # doctest: +SKIP
    >>> r.ok, r.stdout  # doctest: +SKIP
    (True, '6\\n')
    """
    queued = time.monotonic()
    with _SLOTS.hold():
        return _run_in_slot(code, stdin=stdin, limits=limits, files=files, wait_s=time.monotonic() - queued,
                            on_stdout=on_stdout)


def _run_in_slot(code: str, *, stdin: str | None, limits: SandboxLimits, files: Mapping[str, str | bytes] | None,
                 wait_s: float, on_stdout: Callable[[bytes], bool] | None) -> SandboxResult:
    """:func:`run_python`'s run, once it holds a slot: its clock starts here."""
    start = time.monotonic()
    uid = _pick_uid() if os.geteuid() == 0 else None
    ctl = Path(tempfile.mkdtemp(prefix="treerl-sbx-ctl-"))
    work = Path(tempfile.mkdtemp(prefix="treerl-sbx-"))
    proc: subprocess.Popen | None = None
    result_r, result_w = os.pipe()
    os.set_blocking(result_r, False)
    events_r, events_w = os.pipe()
    child_ends = [result_w, events_w]  # the child's ends of the pipes, closed here once it has them
    group = open_cgroup((limits.memory_mb + limits.disk_mb) * _MIB, limits.max_processes + 1)
    trusted = TrustedReader(result_r)

    def joined() -> bool:  # the run's processes are in its cgroup (the outer process may be refused)
        return group.kind != "none" and "cgroup" not in trusted.enforced

    def contained() -> bool:
        return joined() and trusted.enforced.get("filesystem", "").startswith("private")

    try:
        write_files(work, files or {})
        if uid is not None:
            chown_tree(work, uid)
        (ctl / "main.py").write_text(code, encoding="utf-8")
        binds, links = filesystem_view(limits.network)
        config = {
            "uid": uid,
            "network": limits.network,
            "namespaces": limits.namespaces,
            "memory_bytes": limits.memory_mb * _MIB,
            "disk_bytes": limits.disk_mb * _MIB,
            "nproc": limits.max_processes if uid is not None else _count_user_tasks(os.getuid()) + limits.max_processes,
            "work": str(work),
            "ro_binds": binds,
            "symlinks": links,
            "cgroup_procs": group.procs_files,
            "result_fd": result_w,
            "events_fd": events_w,
        }
        (ctl / "config.json").write_text(json.dumps(config), encoding="utf-8")
        stdin_file = None
        if stdin is not None:
            (ctl / "stdin").write_text(stdin, encoding="utf-8")
            # Read-only even for its owner: reopened through /proc/self/fd/0 for writing, a
            # host file would be disk outside the quota.
            (ctl / "stdin").chmod(0o400)
            stdin_file = open(ctl / "stdin", "rb")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-X", "utf8", str(_BOOTSTRAP_PATH), str(ctl)],
                cwd=work,
                env=_minimal_env(work),
                stdin=stdin_file if stdin_file is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                pass_fds=(result_w, events_w),
            )
        finally:
            if stdin_file is not None:
                stdin_file.close()
            while child_ends:
                os.close(child_ends.pop())
        out = capture(
            proc, events_r, max_output_bytes=limits.max_output_bytes, deadline=start + limits.timeout_s,
            kill_survivors=lambda: _kill_survivors(proc.pid, uid, group, contained()),
            watch=_watch(limits, work, proc.pid, uid, group, joined, trusted), watch_every_s=_WATCH_S,
            on_stdout=on_stdout,
        )
        trusted.poll()
        records = list(out.records)
        if group.oom_kills() and not any(r.get("event") == "memory_limit" for r in records):
            records.append({"event": "memory_limit", "by": "cgroup OOM kill"})
        killed = out.timed_out or out.stopped_early or out.stopped
        exit_code = None if killed else trusted.exit_code(proc.returncode)
        error = None if out.stopped else classify_outcome(
            exit_code=exit_code,
            timed_out=out.timed_out,
            records=records,
            main_pid=trusted.main_pid,
            stderr=out.stderr,
        )
        enforced = dict(trusted.enforced)
        refused = enforced.pop("cgroup", None)
        enforced["memory_total"] = group.description if joined() else (
            f"not enforced by the kernel: {refused or group.description}; each process has RLIMIT_AS, and the "
            f"parent adds up the run's resident memory every {_WATCH_S:g} s and stops it over memory_mb")
        enforced["wall_clock"] = f"{limits.timeout_s:g} s, then every process of the run is killed"
        enforced["result_channel"] = ("exit status, main pid and this table come on a pipe only the sandbox's "
                                      "outer process holds; the code's own event records can only worsen its outcome")
        _log_not_enforced(enforced)
        return SandboxResult(
            stdout=out.stdout,
            stderr=out.stderr,
            exit_code=exit_code,
            error=error,
            duration_s=time.monotonic() - start,
            truncated=out.truncated,
            stdout_truncated=out.stdout_truncated,
            stopped=out.stopped,
            enforced=enforced,
            pid=proc.pid,
            uid=uid,
            wait_s=wait_s,
        )
    finally:
        try:
            if proc is not None:
                _kill_all(proc, uid, group, contained())
        finally:
            # Even if the cleanup above failed: no cgroup, descriptor or directory outlives the call.
            group.close()
            for fd in (result_r, events_r, *child_ends):
                os.close(fd)
            shutil.rmtree(ctl, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)


def _watch(limits: SandboxLimits, work: Path, session: int, uid: int | None, group: RunCgroup,
           joined: Callable[[], bool], trusted: TrustedReader) -> Callable[[], dict | None]:
    """The parent's own accounting, for what the kernel could not be asked to limit on this machine."""

    def check() -> dict | None:
        trusted.poll()
        if group.oom_kills():
            return {"event": "memory_limit", "by": "cgroup OOM kill"}
        if not joined():
            rss = _run_rss(uid=uid, session=session)
            if rss > limits.memory_mb * _MIB:
                return {"event": "memory_limit", "by": f"the parent's accounting: {rss} bytes resident in all"}
        if trusted.enforced.get("filesystem", "").startswith("not enforced"):
            used = tree_bytes(work)
            if used > limits.disk_mb * _MIB:
                return {"event": "disk_limit", "by": f"the parent's accounting: {used} bytes in the working directory"}
        return None

    return check


async def arun_python(
    code: str,
    *,
    stdin: str | None = None,
    limits: SandboxLimits = SandboxLimits(),
    files: Mapping[str, str | bytes] | None = None,
    on_stdout: Callable[[bytes], bool] | None = None,
) -> SandboxResult:
    """:func:`run_python` in a thread of its own, so an event loop keeps serving other episodes.

    Not the loop's default executor: a run that waits for a sandbox slot would hold one of its
    few threads (CPUs + 4), and every ``asyncio.to_thread`` of the loop would queue behind it.
    """
    return await run_in_thread(functools.partial(run_python, code, stdin=stdin, limits=limits, files=files,
                                                 on_stdout=on_stdout),
                               name="treerl-sandbox")


def max_concurrent_runs() -> int:
    """How many sandboxed runs this process lets go at once; the others wait for a slot.

    The default is the number of CPUs this process may use, or the environment variable
    ``TREERL_SANDBOX_MAX_CONCURRENT`` where it is set; :func:`set_max_concurrent_runs`
    overrides both. Waiting for a slot does not count against a run's ``timeout_s``.

    >>> max_concurrent_runs() >= 1
    True
    """
    return _SLOTS.limit()


def set_max_concurrent_runs(n: int | None) -> None:
    """Let at most ``n`` sandboxed runs go at once in this process (``None``: back to the default).

    Takes effect at once, for runs that wait for a slot too; runs already going are not stopped.
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"set_max_concurrent_runs(n={n!r}): n must be an integer >= 1 (runs at once), "
                         "or None for the default (the CPUs this process may use).")
    _SLOTS.set_limit(n)


class _RunSlots:
    """A process-wide bound on the sandboxed runs going at once (``run_python`` is called from many threads)."""

    def __init__(self) -> None:
        self._limit: int | None = None
        self._after_fork()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        # A forked child has none of its parent's threads, so none of the slots they held; the bound
        # its parent set (set_max_concurrent_runs) stays.
        self._cond = threading.Condition()
        self._busy = 0

    def limit(self) -> int:
        return self._limit if self._limit is not None else _default_max_concurrent_runs()

    def set_limit(self, n: int | None) -> None:
        with self._cond:
            self._limit = n
            self._cond.notify_all()

    @contextlib.contextmanager
    def hold(self):
        with self._cond:
            self._cond.wait_for(lambda: self._busy < self.limit())
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify()


def _default_max_concurrent_runs() -> int:
    value = os.environ.get("TREERL_SANDBOX_MAX_CONCURRENT", "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"TREERL_SANDBOX_MAX_CONCURRENT={value!r} must be an integer >= 1 (sandboxed runs "
                             "at once); unset it for the default, the CPUs this process may use.")
        return int(value)
    return usable_cpus()


def usable_cpus() -> int:
    """The CPUs this process may use (its affinity where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_SLOTS = _RunSlots()


def sandbox_capabilities() -> dict[str, str]:
    """What the sandbox enforces on this machine and how, found by running a probe.

    For docs, logs, and tests' skip reasons. Costs one sandboxed run (~50 ms).

    >>> caps = sandbox_capabilities()  # doctest: +SKIP
    >>> caps["network_hook"]  # doctest: +SKIP
    'audit hook blocks inet connect/bind/sendto/sendmsg and name lookups'
    """
    result = run_python("pass", limits=SandboxLimits(timeout_s=30.0))
    caps = {"python": f"{sys.executable} -I (isolated mode)", "cleanup": _cleanup_description()}
    caps.update(result.enforced)
    if not result.ok:
        caps["probe"] = f"failed ({result.error}): {result.stderr[-500:]}"
    return caps


# ---------------------------------------------------------------------------------------
# Parent-side helpers.
# ---------------------------------------------------------------------------------------
def _kill_all(proc: subprocess.Popen, uid: int | None, group: RunCgroup, contained: bool) -> None:
    """Kill every process the run left, then reap the main one and close its pipes."""
    # The sweep goes before the reap: until the main process is reaped, its pid (the
    # session and group id the sweep looks for) cannot be reused by another process.
    kill_and_reap(proc, before_reap=lambda: (group.kill(), _sweep(proc.pid, uid, group, contained)))


def _kill_survivors(session: int, uid: int | None, group: RunCgroup, contained: bool) -> None:
    """Kill the run's cgroup and process group, then sweep its session and private uid until empty.

    The main process is left unreaped: the caller still reads its exit status. Killing it
    also ends the inner process (its parent-death signal), and with it, as pid 1, every
    process of the pid namespace, including those that left the session.
    """
    group.kill()
    send_kill(session, group=True)
    _sweep(session, uid, group, contained)


def _sweep(session: int, uid: int | None, group: RunCgroup, contained: bool) -> None:
    """Kill what escaped the process group: processes of the run's session or private uid.

    ``contained``: the run had a cgroup and no view of ``/sys``, so it could not leave the
    cgroup, and an empty cgroup means nothing is left; that spares a scan of ``/proc``.
    """
    if contained and group.empty(timeout_s=1.0):
        return
    for _ in range(20):
        survivors = _sandbox_pids(uid=uid, session=session)
        if not survivors:
            break
        if uid is not None:
            # kill(-1) from a process of the private uid signals every other process of that
            # uid in one kernel pass, so a fork bomb cannot outrun it, even after setsid().
            # It must be a program the private uid can execute: our own interpreter may
            # live where only the mount namespace made it reachable.
            killer = shutil.which("kill", path="/usr/bin:/bin")
            if killer is not None:
                subprocess.run(
                    [killer, "-KILL", "-1"], user=uid, group=uid, extra_groups=[], env={},
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                )
        for pid in survivors:
            send_kill(pid)
        time.sleep(0.01)


def _sandbox_pids(*, uid: int | None, session: int) -> list[int]:
    """Live (non-zombie) processes that belong to a run: its private uid, or its session."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            owner = entry.stat().st_uid
        except (OSError, IndexError):
            continue
        state, pgrp, sid = fields[0], int(fields[2]), int(fields[3])
        if state == b"Z":
            continue
        if (uid is not None and owner == uid) or sid == session or pgrp == session:
            found.append(int(entry.name))
    return found


def _run_rss(*, uid: int | None, session: int) -> int:
    """Bytes resident in all the run's processes that the parent can find (see ``_sandbox_pids``)."""
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for pid in _sandbox_pids(uid=uid, session=session):
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
    return total


def _log_not_enforced(enforced: Mapping[str, str]) -> None:
    """Say once per process, in the log, each protection this machine does not give."""
    for key, value in enforced.items():
        if "not enforced" in value or "refused" in value:
            line = f"sandbox: {key}: {value}"
            if line not in _logged:
                _logged.add(line)
                _log.warning(line)


def _count_user_tasks(uid: int) -> int:
    """Tasks (processes and threads) of ``uid``: what RLIMIT_NPROC counts for that user."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            total += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:
            continue
    return total


def _pick_uid() -> int:
    """A uid no process is running as, from the private range."""
    for _ in range(100):
        uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
        if not _sandbox_pids(uid=uid, session=-1):
            return uid
    raise RuntimeError("could not find a free sandbox uid; are sandbox processes leaking?")


def _minimal_env(work: Path) -> dict[str, str]:
    # Nothing from the caller's environment: it may hold tokens and keys.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}


def _cleanup_description() -> str:
    if os.geteuid() == 0:
        how = "kill(-1) as the run's private uid" if shutil.which("kill", path="/usr/bin:/bin") else "kill by pid"
        return f"kill the process group, then {how} until no process of the private uid is left"
    return "kill the process group and every process left in the run's session"
