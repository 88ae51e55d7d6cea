"""The parent's side of a sandboxed run's surroundings: the filesystem view, staged files, the result pipe.

:func:`treerl.envs.sandbox.run_python` uses these; the bootstrap
(:mod:`treerl.envs.sandbox_bootstrap`) builds the view from :func:`filesystem_view` and
writes the records that :class:`TrustedReader` reads. Invariants:

- The view lists only what the interpreter needs to start and import: its prefixes (or,
  for a system prefix such as ``/usr``, only ``lib/pythonX.Y``), its executable under the
  name it was started by, the system library directories and the loader's cache. Never a
  home directory, the project checkout (an editable install's path stays out) or ``/etc``
  beyond what name lookups and TLS need when the network is allowed.
- The result pipe is written only by the bootstrap's outer process, which never runs user
  code: what it says (exit status, main pid, what was enforced) is trusted.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

__all__ = ["TrustedReader", "filesystem_view", "write_files", "chown_tree", "tree_bytes"]


class TrustedReader:
    """The records of the result pipe, which only the bootstrap's outer process can write."""

    def __init__(self, fd: int):
        self._fd, self._buf = fd, b""
        self.records: list[dict] = []

    def poll(self) -> None:
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        self.records += [json.loads(line) for line in lines if line.strip()]

    def _last(self, event: str) -> dict | None:
        return next((r for r in reversed(self.records) if r.get("event") == event), None)

    @property
    def enforced(self) -> dict[str, str]:
        setup = self._last("setup")
        if setup is not None:
            return setup["enforced"]
        failed = self._last("setup_failed")
        return {"setup": "failed: " + (failed["detail"][-500:] if failed else "the sandbox did not start")}

    @property
    def main_pid(self) -> int:
        setup = self._last("setup")
        return setup["main_pid"] if setup is not None else -1

    def exit_code(self, outer_returncode: int | None) -> int | None:
        """The user code's exit status as the outer process saw it, else the outer's own."""
        record = self._last("exit")
        return record["code"] if record is not None else outer_returncode


@functools.lru_cache(maxsize=2)
def filesystem_view(network: bool) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """What the sandbox's filesystem view holds: read-only binds (source, target), and top-level symlinks.

    The interpreter (its prefixes, or only ``lib/pythonX.Y`` of a system prefix such as
    ``/usr``), its executable, the system library directories the interpreter and its
    extension modules load from, and the loader's cache; with ``network`` also what name
    lookups and TLS read from ``/etc``. Nothing else: no home, no checkout, no ``/etc/passwd``.
    """
    import site

    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    wanted, links = set(), []
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        real = os.path.realpath(prefix)
        if real in ("/", "/usr", "/usr/local"):
            wanted.update(os.path.join(real, lib, version) for lib in ("lib", "lib64"))
        else:
            wanted.add(real)
    wanted.update({os.path.realpath(sys.executable), *site.getsitepackages(), "/etc/ld.so.cache"})
    for lib in ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib"):
        if os.path.islink(lib) and os.path.dirname(lib) == "/":
            links.append((lib, os.readlink(lib)))
        wanted.add(lib)
    if network:
        wanted.update({"/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates"})
    binds: list[tuple[str, str]] = []

    def covered(path: str) -> bool:
        return any(path == t or path.startswith(t.rstrip("/") + "/") for _, t in binds)

    for path in sorted({os.path.realpath(p) for p in wanted if os.path.exists(p)}, key=len):
        if not covered(path):
            binds.append((path, path))
    # The interpreter under the name it was started by (a venv's or the system's symlink), so
    # that code which starts sys.executable finds it.
    exe = os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))
    if not covered(exe):
        binds.append((os.path.realpath(sys.executable), exe))
    return tuple(binds), tuple(links)


def write_files(work: Path, files: Mapping[str, str | bytes]) -> None:
    for name, content in files.items():
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ValueError(
                f"run_python(files=...): {name!r} is not a relative path inside the working "
                "directory. Use paths like 'data/input.txt' (no leading '/', no '..')."
            )
        target = work.joinpath(*rel.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content, encoding="utf-8")


def chown_tree(root: Path, uid: int) -> None:
    os.chown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, uid)


def tree_bytes(root: Path) -> int:
    """Bytes allocated on disk under ``root`` (files the code may still be writing included)."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total
