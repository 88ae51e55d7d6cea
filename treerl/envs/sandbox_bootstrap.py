"""The sandbox's bootstrap: trusted code that runs first in the child, then hands over to the user code.

:func:`treerl.envs.sandbox.run_python` runs this file by path as
``python -I -B -X utf8 sandbox_bootstrap.py CONTROL_DIR``. Two processes come of it:

- The **outer** process (the one the parent started) joins the run's cgroups, enters a
  new pid namespace (inside a new user namespace when not root) and forks. It never runs
  user code. It alone holds the *result descriptor* (``cfg["result_fd"]``, a pipe to the
  parent): on it, it writes the inner process's host pid, the setup record the inner
  process hands it, and the inner process's exit status, then exits with that status.
  It makes itself non-dumpable, so that even without a pid namespace a process of the
  same user can neither ptrace it nor open its descriptors through ``/proc``.
- The **inner** process (pid 1 of the new pid namespace) closes the result descriptor
  first thing, builds the filesystem view (a new mount namespace whose root is an empty
  tmpfs with the interpreter and the system libraries bound back read-only, a fresh
  ``/proc``, a minimal ``/dev``, and the working directory, ``/tmp`` and ``/dev/shm`` on
  one size-limited tmpfs: the disk quota), enters new network and IPC namespaces, sets
  the rlimits, drops every privilege (a private uid as root; an empty capability set in
  a user namespace), sends the setup record to the outer process on a pipe it then
  closes, and runs the user code as ``__main__``.

The user code can still append *event* records (a blocked network call, a failed fork,
how the main process ended) to the events pipe (``cfg["events_fd"]``), because the hooks
that write them run in its own process. The parent therefore takes only hints from them
that can make the run's own outcome worse, never better: the exit status, what was
enforced and the main pid come from the result descriptor.

Invariants:

- Standard library only, and never ``treerl``: it runs in an isolated interpreter under
  the run's memory limit, before and beside untrusted code, and must not depend on what
  else is installed.
- Everything it needs from the control directory (``config.json``, ``main.py``) is read
  before the filesystem view replaces the root, and the whole file is compiled by the
  interpreter before its first line runs, so nothing is read from disk afterwards.
- Each step that the OS refuses is recorded in ``enforced`` with the reason, and the run
  goes on with what is left (the parent logs what was not enforced).
- Importing it does nothing: the work happens only when it runs as a script.
"""

import _posixsubprocess  # here, while the interpreter's files are still readable (see _inner)
import builtins
import errno
import json
import linecache
import os
import resource
import select  # (for treerl.envs.io_test_harness, which runs as user code: without a private filesystem,
import signal  # the private uid may not read the interpreter's files)
import sys
import types

__all__ = ["main", "run_as_main", "MODULE_NAME"]

MODULE_NAME = "treerl_sandbox_bootstrap"
"""The name this module is also known by in ``sys.modules`` once it runs (as ``__main__``): user code it
runs, such as :mod:`treerl.envs.io_test_harness`, reaches :func:`run_as_main` through it."""

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
# statvfs flags -> mount flags: a read-only remount inside a user namespace must keep the
# flags the kernel locked on the original mount, or it is refused.
_LOCKED_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                 (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}


class _Refused(Exception):
    """A namespace or mount call the OS refused; the message says which and why."""


def main():
    """Run as the outer process: set up, fork the inner one, report, relay its exit status."""
    ctl = sys.argv[1]
    with open(os.path.join(ctl, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    with open(os.path.join(ctl, "main.py"), encoding="utf-8") as f:
        source = f.read()
    result_fd = cfg["result_fd"]
    events_fd = cfg["events_fd"]
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def report(**fields):
        try:
            os.write(result_fd, (json.dumps(fields) + "\n").encode())
        except OSError:
            pass

    enforced = {}
    for procs in cfg["cgroup_procs"]:
        # Before the fork, so that every process of the run is born inside the cgroups.
        try:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:
            enforced["cgroup"] = "joining %s refused (%s)" % (procs, e.strerror)
    pid_ns = _enter_pid_namespace(libc, cfg, enforced)
    setup_r, setup_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(result_fd)
        os.close(setup_r)
        return _inner(libc, cfg, ctl, source, events_fd, setup_w, enforced, pid_ns)
    os.close(setup_w)
    os.close(events_fd)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    report(event="started", inner_pid=child)
    data = b""
    while True:
        chunk = os.read(setup_r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(setup_r)
    try:
        setup = json.loads(data)
        report(event="setup", enforced=setup["enforced"], main_pid=setup["pid"])
    except (ValueError, KeyError, TypeError):
        report(event="setup_failed", detail=data[-2000:].decode("utf-8", "replace"))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            status = None
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status) if status is not None else 1
    report(event="exit", code=code)
    if code < 0:
        # Die of the same signal, so that the parent sees what the user code saw.
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    # Nothing is buffered here and nothing needs finalizing: skip the interpreter's
    # shutdown, which would cost as much again as the user code's own.
    os._exit(code)


def _enter_pid_namespace(libc, cfg, enforced):
    """As root a new pid namespace; otherwise first a user namespace that maps our own ids."""
    import ctypes
    if not cfg["namespaces"]:
        enforced["pid_namespace"] = "not enforced: namespaces turned off (SandboxLimits.namespaces=False)"
        return False
    if cfg["uid"] is None:
        real_uid, real_gid = os.getuid(), os.getgid()
        if libc.unshare(CLONE_NEWUSER) != 0:
            enforced["user_namespace"] = "refused (%s)" % os.strerror(ctypes.get_errno())
            enforced["pid_namespace"] = "not enforced: no user namespace, so no pid namespace"
            return False
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (real_uid, real_uid)),
                               ("gid_map", "%d %d 1" % (real_gid, real_gid))):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
        except OSError as e:
            enforced["user_namespace"] = "id maps refused (%s)" % e.strerror
        else:
            enforced["user_namespace"] = "private, the caller's ids mapped, every capability dropped before user code"
    if libc.unshare(CLONE_NEWPID) != 0:
        enforced["pid_namespace"] = "not enforced: unshare refused (%s)" % os.strerror(ctypes.get_errno())
        return False
    enforced["pid_namespace"] = "private: the code is pid 1 and sees only its own processes"
    return True


def _inner(libc, cfg, ctl, source, events_fd, setup_w, enforced, pid_ns):
    """Run as the inner process: isolate, limit, drop privileges, hand over to the user code."""
    import ctypes
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the outer process's death ends the run

    def record(**fields):
        fields["pid"] = os.getpid()
        try:
            os.write(events_fd, (json.dumps(fields) + "\n").encode())
        except (OSError, ValueError, TypeError):
            pass

    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # under memory pressure the sandbox's processes go first
    except OSError:
        pass
    # Allowed to make namespaces: as root, or with every capability inside a user namespace.
    privileged = cfg["namespaces"] and (
        cfg["uid"] is not None or enforced.get("user_namespace", "").startswith("private"))
    flags = CLONE_NEWNS | CLONE_NEWIPC | (0 if cfg["network"] else CLONE_NEWNET)
    if privileged and libc.unshare(flags) == 0:
        enforced["ipc_namespace"] = "private: SysV shared memory and queues die with the run"
        enforced["network_namespace"] = "off (network allowed)" if cfg["network"] else "private, no interfaces up"
        try:
            _build_root(libc, cfg, ctl, pid_ns)
            enforced["filesystem"] = ("private root: only the interpreter, the system libraries and the "
                                      "working directory; private /tmp and /dev/shm")
            enforced["disk"] = "%d bytes in all for the working directory, /tmp and /dev/shm (tmpfs)" % cfg["disk_bytes"]
            enforced["proc"] = "fresh /proc of the pid namespace" if pid_ns else "not mounted (no pid namespace)"
            workdir = cfg["work"]
        except _Refused as e:
            enforced["filesystem"] = "not enforced: %s" % e
            workdir = None
    else:
        why = (os.strerror(ctypes.get_errno()) if privileged else "no user namespace" if cfg["namespaces"]
               else "turned off")
        enforced["filesystem"] = "not enforced: no mount namespace (%s); the host filesystem is visible" % why
        enforced["network_namespace"] = "off (network allowed)" if cfg["network"] else (
            "not enforced (%s); audit hook only" % why)
        workdir = None
    if workdir is None:
        # The fallback: the parent's directory on the host disk, each file capped.
        workdir = cfg["work"]
        resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["disk_bytes"], cfg["disk_bytes"]))
        enforced["disk"] = "RLIMIT_FSIZE = %d bytes per file; the parent adds up the working directory" % cfg["disk_bytes"]
    os.chdir(workdir)

    def lower(which, value):
        # Only ever lower: a hard limit already below ours stays (raising it needs root).
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))
        return value

    mem = cfg["memory_bytes"]
    for which in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        mem = lower(which, mem)
    lower(resource.RLIMIT_CORE, 0)
    nproc = lower(resource.RLIMIT_NPROC, cfg["nproc"])
    enforced["memory"] = "RLIMIT_AS and RLIMIT_DATA = %d bytes per process" % mem
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    uid = cfg["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # from root to a non-zero uid: every capability goes with it
        enforced["user"] = "private uid/gid %d, no supplementary groups, no_new_privs" % uid
        enforced["processes"] = "RLIMIT_NPROC = %d on the private uid" % nproc
    else:
        if privileged:
            _drop_capabilities(libc)
        enforced["user"] = "the caller's user (not root, cannot switch), %sno_new_privs" % (
            "no capabilities, " if privileged else "")
        enforced["processes"] = "RLIMIT_NPROC = %d (this user's tasks + max_processes)" % nproc

    if not cfg["network"]:
        INET = (2, 10)  # AF_INET, AF_INET6: AF_UNIX sockets stay usable.
        on_socket = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
        on_name = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
                   "socket.gethostbyaddr", "socket.getnameinfo"}

        def block(event, target):
            record(event="network", call=event, target=repr(target)[:200])
            raise PermissionError("network access is disabled in this sandbox (%s %r)" % (event, target))

        def audit(event, args):
            if event in on_socket and getattr(args[0], "family", None) in INET:
                block(event, args[1] if len(args) > 1 else None)
            elif event in on_name:
                block(event, args[0] if args else None)

        sys.addaudithook(audit)
        enforced["network_hook"] = "audit hook blocks inet connect/bind/sendto/sendmsg and name lookups"
    os.write(setup_w, json.dumps({"enforced": enforced, "pid": os.getpid()}).encode())
    os.close(setup_w)  # the last word to the trusted side: nothing of the user code reaches it

    def tracked(fn, name):
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    record(event="process_limit", call=name)
                raise
        wrapper.__name__ = wrapper.__qualname__ = fn.__name__
        wrapper.__doc__ = fn.__doc__
        return wrapper

    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, tracked(getattr(os, name), "os." + name))
    _posixsubprocess.fork_exec = tracked(_posixsubprocess.fork_exec, "subprocess")

    del cfg
    return run_as_main(source, record)


def run_as_main(source, record):
    """Run ``source`` as the script ``__main__`` (file ``<sandbox>``, its own ``argv`` and tracebacks),
    ``record`` how it ended (``event="exit"`` with ``kind``: ``ok``, ``exit``, ``memory``,
    ``process_limit``, ``disk`` or ``exception``) and return its exit status.

    The user code's way in, and :mod:`treerl.envs.io_test_harness`'s for each case's program: that
    harness runs as user code under this bootstrap, which it finds in ``sys.modules[MODULE_NAME]``.
    """
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = ["<sandbox>"]
    linecache.cache["<sandbox>"] = (len(source), None, source.splitlines(True), "<sandbox>")
    try:
        exec(compile(source, "<sandbox>", "exec"), main.__dict__)
    except SystemExit as e:
        code = e.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        record(event="exit", kind="exit", code=code)
        return code
    except BaseException as e:
        if isinstance(e, MemoryError):
            kind = "memory"
        elif (isinstance(e, OSError) and e.errno == errno.EAGAIN) or (
                isinstance(e, RuntimeError) and "can't start new thread" in str(e)):
            kind = "process_limit"
        elif isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            kind = "disk"
        else:
            kind = "exception"
        record(event="exit", kind=kind, exc_type=type(e).__name__)
        if e.__traceback__ is not None:
            e.__traceback__ = e.__traceback__.tb_next  # hide this function's own frame
        sys.excepthook(type(e), e, e.__traceback__)
        return 1
    record(event="exit", kind="ok", code=0)
    return 0


def _build_root(libc, cfg, ctl, pid_ns):
    """Make a new root of empty tmpfs, bind back what the interpreter needs, and pivot into it."""
    import ctypes

    def mount(source, target, fstype, flags, data=None):
        if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                      data and data.encode()) != 0:
            raise _Refused("mount %s on %s: %s" % (source or fstype, target, os.strerror(ctypes.get_errno())))

    def bind(source, target, read_only):
        if os.path.isdir(source):
            os.makedirs(target, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            open(target, "a").close()
        mount(source, target, None, MS_BIND | MS_REC)
        if read_only:
            locked = os.statvfs(source).f_flag
            extra = sum(ms for st, ms in _LOCKED_FLAGS if locked & st)
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra)

    mount(None, "/", None, MS_REC | MS_PRIVATE)
    new_root, scratch = os.path.join(ctl, "root"), os.path.join(ctl, "scratch")
    os.mkdir(new_root, 0o755)
    os.mkdir(scratch, 0o755)
    mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=%d" % cfg["disk_bytes"])
    owner = cfg["uid"] if cfg["uid"] is not None else os.getuid()
    for name, mode in (("work", 0o700), ("tmp", 0o1777), ("shm", 0o1777)):
        path = os.path.join(scratch, name)
        os.mkdir(path)
        os.chmod(path, mode)
        os.chown(path, owner, owner)
    _copy_tree(cfg["work"], os.path.join(scratch, "work"), owner)
    # The private /tmp first: an interpreter or venv that lives under /tmp is bound on top of it.
    bind(os.path.join(scratch, "tmp"), new_root + "/tmp", False)
    for source, target in cfg["ro_binds"]:
        bind(source, new_root + target, True)
    for link, target in cfg["symlinks"]:
        os.symlink(target, new_root + link)
    dev = new_root + "/dev"
    os.mkdir(dev, 0o755)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in ("null", "zero", "full", "random", "urandom"):
        bind("/dev/" + name, dev + "/" + name, False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, dev + "/" + name)
    bind(os.path.join(scratch, "shm"), dev + "/shm", False)
    bind(os.path.join(scratch, "work"), new_root + cfg["work"], False)
    os.mkdir(new_root + "/proc", 0o555)
    if pid_ns:
        mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    nr = _PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise _Refused("pivot_root: unknown system call number on %s" % os.uname().machine)
    os.chdir(new_root)
    # pivot_root(".", "."): the old root ends up stacked on the new one, and is detached next.
    if libc.syscall(nr, b".", b".") != 0:
        raise _Refused("pivot_root: %s" % os.strerror(ctypes.get_errno()))
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise _Refused("detaching the old root: %s" % os.strerror(ctypes.get_errno()))
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _copy_tree(src, dst, owner):
    """Copy the parent's staged files into the sandbox's working directory, owned by ``owner``."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target_dir = dst if rel == "." else os.path.join(dst, rel)
        for name in dirnames:
            os.mkdir(os.path.join(target_dir, name), 0o755)
            os.chown(os.path.join(target_dir, name), owner, owner)
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as fin:
                data = fin.read()
            path = os.path.join(target_dir, name)
            with open(path, "wb") as fout:
                fout.write(data)
            os.chown(path, owner, owner)


def _drop_capabilities(libc):
    """Empty every capability set: in a user namespace the process has them all until now."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset refused; not running user code with capabilities")


if __name__ == "__main__":
    sys.modules[MODULE_NAME] = sys.modules[__name__]
    sys.exit(main())
