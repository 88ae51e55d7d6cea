"""A memory and process limit for a whole sandboxed run, not each of its processes: a cgroup.

:func:`open_cgroup` makes one cgroup per run below the caller's own, where the machine
lets it, and the bootstrap's outer process joins it before it forks, so every process of
the run is born inside. Which kind is used (the first that works):

- **cgroup v2** where the caller's cgroup already delegates the ``memory`` and ``pids``
  controllers to its children (``cgroup.subtree_control``); the caller is never moved.
- **cgroup v1** where the ``memory`` (and ``pids``) hierarchies below the caller's own
  cgroups can be written (typically as root).
- **none**: :class:`RunCgroup` says why; each process keeps ``RLIMIT_AS``, and the
  sandbox adds up the run's resident memory itself (see :mod:`treerl.envs.sandbox`).

The memory limit covers the run's processes and the pages of its tmpfs (the working
directory, ``/tmp``, ``/dev/shm``), which the kernel charges to the cgroup of the writer:
the cgroup's limit is ``memory + disk``. Invariant: a cgroup made here is removed by
:meth:`RunCgroup.close` once its processes are gone, and its OOM-kill count is read first.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RunCgroup", "open_cgroup"]

_MOUNTINFO = "/proc/self/mountinfo"


@dataclass
class RunCgroup:
    """The cgroups of one run (none, one v2 directory, or a v1 memory and pids pair)."""

    kind: str
    """``"v2"``, ``"v1"`` or ``"none"``."""
    description: str
    """What is enforced, or why nothing is, in words (for ``SandboxResult.enforced``)."""
    dirs: list[Path] = field(default_factory=list)

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files the outer process writes its pid to."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        """How many processes of the run the kernel killed for going over the memory limit."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):
                try:
                    text = (d / name).read_text()
                except OSError:
                    continue
                for line in text.splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip().isdigit():
                        return int(value)
        return 0

    def kill(self) -> None:
        """Kill every process in the cgroups (v2's ``cgroup.kill``; v1: each listed pid)."""
        for d in self.dirs:
            try:
                (d / "cgroup.kill").write_text("1")
                continue
            except OSError:
                pass
            try:
                pids = (d / "cgroup.procs").read_text().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, PermissionError, ValueError):
                    pass

    def empty(self, timeout_s: float) -> bool:
        """Whether no process is left in the cgroups, killing what is, for up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if not any((d / "cgroup.procs").read_text().split() for d in self.dirs):
                    return bool(self.dirs)
            except OSError:
                return False
            if time.monotonic() > deadline:
                return False
            self.kill()
            time.sleep(0.005)

    def close(self) -> None:
        """Remove the cgroups; processes that are still exiting get a moment to go."""
        for d in self.dirs:
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    self.kill()
                    time.sleep(0.01)


def open_cgroup(memory_bytes: int, max_processes: int) -> RunCgroup:
    """A fresh cgroup for one run with ``memory_bytes`` and ``max_processes`` in all, or ``kind="none"``."""
    mounts = _cgroup_mounts()
    own = _own_cgroups()
    name = f"treerl-sbx-{os.getpid()}-{secrets.token_hex(4)}"
    reasons = []
    v2_mount = mounts.get("cgroup2")
    if v2_mount is not None and "" in own:
        parent = _dir(v2_mount, own[""])
        try:
            delegated = set((parent / "cgroup.subtree_control").read_text().split())
        except OSError:
            delegated = set()
        if {"memory", "pids"} <= delegated:
            made = _make(parent / name, {"memory.max": memory_bytes, "memory.swap.max": 0,
                                         "memory.oom.group": 1, "pids.max": max_processes})
            if isinstance(made, Path):
                return RunCgroup("v2", f"cgroup v2: memory.max = {memory_bytes} bytes, pids.max = {max_processes} "
                                       "for the whole run", [made])
            reasons.append(f"cgroup v2: {made}")
        else:
            reasons.append(f"cgroup v2: {parent} does not delegate memory and pids to its children")
    mem_mount, pids_mount = mounts.get("memory"), mounts.get("pids")
    if mem_mount is not None and "memory" in own:
        made = _make(_dir(mem_mount, own["memory"]) / name,
                     {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes})
        if isinstance(made, Path):
            dirs, pids_note = [made], "no pids cgroup"
            if pids_mount is not None and "pids" in own:
                pids_dir = _make(_dir(pids_mount, own["pids"]) / name, {"pids.max": max_processes})
                if isinstance(pids_dir, Path):
                    dirs.append(pids_dir)
                    pids_note = f"pids.max = {max_processes}"
            return RunCgroup("v1", f"cgroup v1: memory.limit_in_bytes = {memory_bytes} bytes, {pids_note} "
                                   "for the whole run", dirs)
        reasons.append(f"cgroup v1: {made}")
    elif not reasons:
        reasons.append("no cgroup memory controller mounted")
    return RunCgroup("none", "no cgroup for the run (" + "; ".join(reasons) + ")")


def _make(path: Path, settings: dict[str, int]) -> Path | str:
    """Create ``path`` and write ``settings``; the directory, or why not (and nothing left behind)."""
    try:
        path.mkdir()
    except OSError as exc:
        return f"cannot create {path} ({exc.strerror})"
    for key, value in settings.items():
        target = path / key
        if not target.exists():
            continue  # e.g. no swap accounting: memsw/swap files are absent
        try:
            target.write_text(str(value))
        except OSError as exc:
            if key.startswith(("memory.memsw", "memory.swap", "memory.oom")):
                continue  # refinements; the main limit is what matters
            path.rmdir()
            return f"cannot set {key} ({exc.strerror})"
    return path


def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    """(mount point, mounted root) by ``"cgroup2"`` for the unified hierarchy, controller names for v1 ones."""
    found: dict[str, str] = {}
    try:
        lines = Path(_MOUNTINFO).read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, root, point = tail[0], fields[3].rstrip("/"), fields[4]
        if fstype == "cgroup2":
            found.setdefault("cgroup2", (point, root))
        elif fstype == "cgroup":
            for option in tail[2].split(","):
                if option in ("memory", "pids"):
                    found.setdefault(option, (point, root))
    return found


def _dir(mount: tuple[str, str], own: str) -> Path:
    """Where the caller's cgroup ``own`` lies under ``mount`` (whose root may be a subtree)."""
    point, root = mount
    if root and own.startswith(root + "/"):
        own = own[len(root):]
    elif root and own == root:
        own = ""
    return Path(point + own)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under ``""`` the v2 one."""
    own: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return own
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path.rstrip("/")
    return own
