"""The input/output harness: runs a candidate program once per stdin/stdout case, all in one sandboxed run.

:func:`treerl.envs.verifiers.io_test_results` runs this file's source with
:func:`treerl.envs.sandbox.run_python` and sends the job on stdin: a first line with the
byte length of a JSON header, the header ``{"code": str, "timeout_s": float, "cases":
[[input_bytes, keep_bytes], ...]}``, then the cases' inputs (UTF-8), one after another.
The job holds the code and the inputs only: the expected outputs never enter the sandbox.

For each case, in order, the harness forks; the child runs the code as ``__main__`` with
the bootstrap's own :func:`~treerl.envs.sandbox_bootstrap.run_as_main`, with the case's
input as stdin (an unnamed in-memory file, as a judge gives a file), and the harness
writes one line of JSON (ASCII) to its own stdout::

    {"i": INDEX, "pid": CHILD_PID, "exit": STATUS or null, "timed_out": bool, "s": SECONDS,
     "stdout": the first keep_bytes printed, in hex, "cut": bool (it printed more),
     "stderr": the last STDERR_TAIL bytes of stderr, "records": [the case's event records]}

``exit`` is null when the harness killed the child (time limit, process limit). The
records are what the bootstrap's hooks (a blocked network call, a failed fork) and the
child's own end wrote, reduced to what :func:`treerl.envs.sandbox.classify_outcome`
reads; the caller classifies and judges each case from them as it would a run of its own.

Invariants:

- Whatever a case's program does to the harness or to the other cases' runs (it runs
  as the harness's user), it can only change what is reported as printed; the judge is
  the caller, outside, so a program passes a case only by producing its expected output.
  The harness is non-dumpable (no ``/proc/<pid>/fd``, no ptrace for a process of the same
  user); a child keeps only its stdin, stdout, stderr and its own event pipe (on the
  descriptor numbers where the bootstrap's hooks write their records).
- A case ends when its program exits, when it passes ``timeout_s`` (counted from the
  fork), or when it hits the process limit. Then every process it left is killed before
  the next case starts: its process group, then, as pid 1 of the sandbox's pid namespace,
  every other process there (``kill(-1)``), or, without one, as a child subreaper, every
  child left until none is.
- The working directory is emptied after each case; ``/tmp`` and ``/dev/shm`` are not
  (without a private filesystem they are the host's), so files left there stay for the
  next cases, and count against the run's disk quota.
- Memory: a child starts as a copy of the harness (an interpreter, about what a fresh one
  maps) and keeps the per-process ``RLIMIT_AS``; the whole run's memory limit is shared by
  the harness and the case that runs. The inputs are read from the job file one case at a
  time, so a case's address space holds no other case's input.
- Standard library only, never ``treerl``, and only modules the sandbox's bootstrap has
  loaded already: it runs in the sandbox's isolated interpreter, where without a private
  filesystem the private uid may not read the interpreter's files.
  Importing this module does nothing; the work happens only when it runs as ``__main__``.
"""

import errno
import json
import os
import select
import signal
import sys
import time

__all__ = ["main", "STDERR_TAIL"]

STDERR_TAIL = 2000
"""Bytes kept of the end of a case's stderr (its last line names what it raised)."""
_MAX_RECORD_BYTES = 1 << 16
_DRAIN_S = 1.0
_KNOWN_EVENTS = ("network", "process_limit", "memory_limit", "disk_limit")
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
BOOTSTRAP_MODULE = "treerl_sandbox_bootstrap"
"""Where the sandbox's bootstrap, which runs this harness, is in ``sys.modules`` (its ``MODULE_NAME``)."""


class _Job:
    """The job on stdin: the header, and each case's input read from the file when its case runs."""

    def __init__(self, fd):
        try:
            first = os.pread(fd, 32, 0)
            self._data = None
        except OSError as e:
            if e.errno != errno.ESPIPE:
                raise
            self._data = sys.stdin.buffer.read()  # not a file: hold it all
            first = self._data[:32]
        self._fd = fd
        size_line = first.split(b"\n", 1)[0]
        offset = len(size_line) + 1
        self.header = json.loads(self._read(offset, int(size_line)))
        self._offsets = []
        offset += int(size_line)
        for input_bytes, _ in self.header["cases"]:
            self._offsets.append((offset, input_bytes))
            offset += input_bytes

    def _read(self, offset, size):
        if self._data is not None:
            return self._data[offset:offset + size]
        parts = []
        while size > 0:
            part = os.pread(self._fd, min(size, 1 << 20), offset)
            if not part:
                break
            parts.append(part)
            offset += len(part)
            size -= len(part)
        return b"".join(parts)

    def input_file(self, i):
        """Case ``i``'s input in an unnamed file, at offset 0."""
        try:
            fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o600)  # (in the working directory: the disk quota)
        offset, size = self._offsets[i]
        while size > 0:
            chunk = self._read(offset, min(size, 1 << 20))
            if not chunk:
                break
            os.write(fd, chunk)
            offset += len(chunk)
            size -= len(chunk)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd


def _open_descriptors():
    """The descriptors above stderr that this process holds (the bootstrap's event pipe)."""
    found = []
    for fd in range(3, 256):
        try:
            os.fstat(fd)
        except OSError:
            continue
        found.append(fd)
    return found


def _libc():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        return None


def main():
    """Read the job, run every case in order, report each on stdout."""
    job = _Job(0)
    code, timeout_s = job.header["code"], job.header["timeout_s"]
    hook_fds = _open_descriptors()
    libc = _libc()
    if libc is not None:
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of a case come back to us, to be killed
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    work = os.getcwd()
    for i, (_, keep_bytes) in enumerate(job.header["cases"]):
        report = _run_case(job, i, code, keep_bytes, timeout_s, hook_fds, wake_r)
        report["i"] = i
        _write_all(1, (json.dumps(report) + "\n").encode("ascii"))
        _empty(work)


def _run_case(job, i, code, keep_bytes, timeout_s, hook_fds, wake_r):
    stdin_fd = job.input_file(i)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    rec_r, rec_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        # The child never returns into this loop, whatever the code does (it may fork too).
        status = 1
        try:
            status = _child(code, stdin_fd, out_w, err_w, rec_w, hook_fds)
        except BaseException as e:  # the harness's own setup of the child failed: say what, on its stderr
            os.write(2, ("io_test_harness: %r\n" % (e,)).encode("utf-8", "replace"))
        finally:
            os._exit(status)
    try:
        os.setpgid(pid, pid)  # (the child does it too: whichever runs first)
    except OSError:
        pass
    for fd in (stdin_fd, out_w, err_w, rec_w):
        os.close(fd)
    out, err, rec = bytearray(), bytearray(), bytearray()
    cut = False
    reading = {out_r: out, err_r: err, rec_r: rec}

    def read_ready(timeout, extra=()):
        nonlocal cut
        ready, _, _ = select.select(list(reading) + list(extra), [], [], max(timeout, 0.0))
        for fd in ready:
            if fd not in reading:
                continue
            data = os.read(fd, 65536)
            if not data:
                del reading[fd]
            elif fd == out_r:
                room = keep_bytes - len(out)
                cut = cut or len(data) > room
                out.extend(data[:max(room, 0)])
            elif fd == err_r:
                err.extend(data)
                del err[:-STDERR_TAIL]
            elif len(rec) < _MAX_RECORD_BYTES:
                rec.extend(data)
        return ready

    deadline = start + timeout_s
    status, timed_out = None, False
    while True:
        status = _reap(pid)
        if status is not None:
            break
        if b'"process_limit"' in rec and any(r.get("event") == "process_limit" for r in _records(rec)):
            break  # a fork bomb that swallows its errors would spin until the time limit
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        if wake_r in read_ready(remaining, (wake_r,)):
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
    ended = time.monotonic() - start
    status = _kill_leftovers(pid, status)
    if timed_out or status is None or status == "killed":
        exit_code = None
    else:
        exit_code = os.waitstatus_to_exitcode(status)
    drain_until = time.monotonic() + _DRAIN_S
    while reading and time.monotonic() < drain_until:
        read_ready(drain_until - time.monotonic())
    for fd in (out_r, err_r, rec_r):
        os.close(fd)
    return {
        "pid": pid, "exit": exit_code, "timed_out": timed_out, "s": round(ended, 4),
        "stdout": bytes(out).hex(), "cut": cut,
        "stderr": bytes(err).decode("utf-8", "replace"), "records": _reduced(_records(rec), pid),
    }


def _reap(pid):
    """The child's wait status if it has ended, else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return "killed"
    return status if done == pid else None


def _kill_leftovers(pid, status):
    """Kill the case's process group and every other process it left; reap all. Returns the child's status."""
    me_init = os.getpid() == 1
    while True:
        _signal_group(pid)
        if me_init:
            try:
                os.kill(-1, signal.SIGKILL)  # every other process of the pid namespace, wherever it went
            except OSError:
                pass
        else:
            for child in _children():
                _signal_group(child)
                try:
                    os.kill(child, signal.SIGKILL)
                except OSError:
                    pass
        try:
            while True:
                done, wait_status = os.waitpid(-1, os.WNOHANG)
                if done == 0:
                    break
                if done == pid and status is None:
                    status = "killed"  # ended by our kill: no exit status of its own
        except ChildProcessError:
            return status
        time.sleep(0.001)


def _signal_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _children():
    """Our child processes (orphans of a case are ours too: we are a child subreaper)."""
    me, found = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == me:
            found.append(int(name))
    return found


def _records(data):
    records = []
    for line in bytes(data).split(b"\n"):
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _reduced(records, pid):
    """What classify_outcome reads: the events seen, and the child's last exit record."""
    events = {r.get("event") for r in records}
    kept = [{"event": e} for e in _KNOWN_EVENTS if e in events]
    exits = [r for r in records if r.get("event") == "exit" and r.get("pid") == pid]
    if exits:
        kind = exits[-1].get("kind")
        kept.append({"event": "exit", "pid": pid, "kind": kind if isinstance(kind, str) else None})
    return kept


def _empty(path):
    """Remove what a case left in the working directory (never following a link out of it)."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                _empty(entry.path)
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _child(code, stdin_fd, out_w, err_w, rec_w, hook_fds):
    """In the forked child: take the case's descriptors, run the code as __main__, return its exit status."""
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for fd in hook_fds:
        os.dup2(rec_w, fd)  # the bootstrap's hooks write their records here: to this case's pipe
    kept = sorted({0, 1, 2, *hook_fds})
    low = 3
    for fd in kept + [1 << 16]:
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    records_fd = hook_fds[0] if hook_fds else None

    def record(**fields):
        fields["pid"] = os.getpid()
        if records_fd is not None:
            try:
                os.write(records_fd, (json.dumps(fields) + "\n").encode())
            except (OSError, ValueError, TypeError):
                pass

    for fd, name, mode, errors in ((0, "stdin", "r", sys.stdin.errors), (1, "stdout", "w", sys.stdout.errors),
                                   (2, "stderr", "w", sys.stderr.errors)):
        stream = open(fd, mode, buffering=1 if fd == 2 else -1, encoding="utf-8", errors=errors, closefd=False)
        setattr(sys, name, stream)
        setattr(sys, "__%s__" % name, stream)
    # The bootstrap's own way to run a program and record its end (this harness runs under it).
    status = sys.modules[BOOTSTRAP_MODULE].run_as_main(code, record)
    return _finish(status)


def _finish(status):
    """What the interpreter does at exit: join non-daemon threads, run atexit handlers, flush."""
    import atexit
    threading = sys.modules.get("threading")
    if threading is not None and hasattr(threading, "_shutdown"):
        try:
            threading._shutdown()
        except BaseException:
            pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            status = status or 120
    return status & 0xFF if isinstance(status, int) else 1


if __name__ == "__main__":
    main()
