"""The sandbox's bootstrap: trusted code that runs first in the child, then hands over to the user code.

:func:`treerl.envs.sandbox.run_python` runs this file by path as
``python -I -B -X utf8 sandbox_bootstrap.py CONTROL_DIR``. It runs as the caller's user,
applies the limits (namespaces, mounts, rlimits, the private uid, the network audit
hook), then runs the user code as ``__main__`` and appends one JSON status record per
event (setup, blocked network call, failed fork, exit), each tagged with its pid, to
``CONTROL_DIR/status.jsonl``, which the parent reads.

Invariants:

- Standard library only, and never ``treerl``: it runs in an isolated interpreter under
  the run's memory limit, before and beside untrusted code, and must not depend on what
  else is installed.
- Everything it needs from the control directory (``config.json``: ``uid``, ``network``,
  ``memory_bytes``, ``nproc``, ``mount_plan``; ``main.py``: the user code) is read before
  privileges are dropped, because that directory is ``0700``.
- The interpreter reads and compiles this whole file, as the caller, before its first
  line runs; the privilege drop and the mount changes that come later therefore need not
  keep the file readable.
- Importing it does nothing: the work happens only when it runs as a script.
"""

import builtins
import errno
import json
import linecache
import os
import resource
import sys
import types

__all__ = ["main"]


def main():
    """Apply the limits, run the user code, return its exit status (``sys.argv[1]``: the control dir)."""
    ctl = sys.argv[1]
    with open(os.path.join(ctl, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    with open(os.path.join(ctl, "main.py"), encoding="utf-8") as f:
        source = f.read()
    status_fd = os.open(os.path.join(ctl, "status.jsonl"), os.O_WRONLY | os.O_APPEND)
    _dumps, _write, _getpid = json.dumps, os.write, os.getpid

    def record(**fields):
        fields["pid"] = _getpid()
        try:
            _write(status_fd, (_dumps(fields) + "\n").encode())
        except (OSError, ValueError, TypeError):
            pass

    enforced = {}
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
    MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 4096, 16384, 1 << 18, 2

    def why():
        return os.strerror(ctypes.get_errno())

    uid = cfg["uid"]
    if uid is not None:
        # Root: a private mount namespace (to make the interpreter reachable for the
        # unprivileged uid) and, unless allowed, a private network namespace.
        flags = CLONE_NEWNS | (0 if cfg["network"] else CLONE_NEWNET)
        if libc.unshare(flags) != 0:
            enforced["namespaces"] = "unshare refused (%s)" % why()
        else:
            enforced["network_namespace"] = "off (network allowed)" if cfg["network"] else "private"
            ok = libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0
            for hidden, exposed in cfg["mount_plan"] if ok else []:
                # Bind each exposed tree aside, hide its closed parent under a tmpfs, and
                # bind the tree back at its original path inside that tmpfs.
                stages = []
                for i, path in enumerate(exposed):
                    stage = os.path.join(ctl, "stage%d" % i)
                    os.mkdir(stage)
                    ok = ok and libc.mount(path.encode(), stage.encode(), None, MS_BIND | MS_REC, None) == 0
                    stages.append(stage)
                ok = ok and libc.mount(b"tmpfs", hidden.encode(), b"tmpfs", 0, b"mode=0755") == 0
                for stage, path in zip(stages, exposed):
                    if ok:
                        os.makedirs(path, mode=0o755, exist_ok=True)
                        ok = libc.mount(stage.encode(), path.encode(), None, MS_BIND | MS_REC, None) == 0
                    libc.umount2(stage.encode(), MNT_DETACH)
            enforced["mounts"] = ("private; hidden and rebound: " + ", ".join(h for h, _ in cfg["mount_plan"])
                                  if cfg["mount_plan"] else "private") if ok else "refused (%s)" % why()
    elif not cfg["network"]:
        # Not root: a user namespace makes a network namespace possible where the kernel
        # allows unprivileged user namespaces. Map our own ids so nothing looks different.
        real_uid, real_gid = os.getuid(), os.getgid()
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            try:
                for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (real_uid, real_uid)),
                                   ("gid_map", "%d %d 1" % (real_gid, real_gid))):
                    with open("/proc/self/" + name, "w") as f:
                        f.write(text)
            except OSError:
                pass
            enforced["network_namespace"] = "private (user namespace)"
        else:
            enforced["network_namespace"] = "unavailable (%s); audit hook only" % why()
    else:
        enforced["network_namespace"] = "off (network allowed)"

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
    cfg["nproc"] = lower(resource.RLIMIT_NPROC, cfg["nproc"])
    enforced["memory"] = "RLIMIT_AS and RLIMIT_DATA = %d bytes" % mem
    if uid is not None:
        PR_SET_NO_NEW_PRIVS = 38
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        enforced["user"] = "private uid/gid %d, no supplementary groups, no_new_privs" % uid
        enforced["processes"] = "RLIMIT_NPROC = %d on the private uid" % cfg["nproc"]
    else:
        enforced["user"] = "the caller's user (not root, cannot switch)"
        enforced["processes"] = "RLIMIT_NPROC = %d (this user's tasks + max_processes)" % cfg["nproc"]

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
    record(event="setup", enforced=enforced)

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
    import _posixsubprocess
    _posixsubprocess.fork_exec = tracked(_posixsubprocess.fork_exec, "subprocess")

    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = ["<sandbox>"]
    linecache.cache["<sandbox>"] = (len(source), None, source.splitlines(True), "<sandbox>")
    del cfg, f
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
        else:
            kind = "exception"
        record(event="exit", kind=kind, exc_type=type(e).__name__)
        if e.__traceback__ is not None:
            e.__traceback__ = e.__traceback__.tb_next  # hide the bootstrap's own frame
        sys.excepthook(type(e), e, e.__traceback__)
        return 1
    record(event="exit", kind="ok", code=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
