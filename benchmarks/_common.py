"""Shared by the benchmark scripts: their section of BENCHMARKS.md, and peak-memory readings on CPU."""

from __future__ import annotations

import re
import resource
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"


def write_section(section: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace (or append) one ``## ...`` section of BENCHMARKS.md, leaving every other section as it was."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{section}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: block + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + block
    path.write_text(text)


def publish(section: str, body: str, *, no_write: bool) -> None:
    """Print the section; write it to BENCHMARKS.md too unless ``no_write`` (``--no-write``)."""
    if no_write:
        print(section + "\n\n" + body)
    else:
        write_section(section, body)
        print(body)


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command that measured a section, as it was typed (``--no-write`` aside): ``python benchmarks/SCRIPT ARGS``.

    >>> command_line("bench_x.py", ["--runs", "2", "--no-write", "--note", "a b"])
    "python benchmarks/bench_x.py --runs 2 --note 'a b'"
    """
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--no-write"]
    return " ".join(["python", f"benchmarks/{script}", *map(shlex.quote, args)])


def _proc_status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(match.group(1))


def _ru_maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def reset_rss_peak() -> int:
    """Restart the resident-set high-water mark at the current RSS and return it, in bytes.

    On Linux, writing 5 to /proc/self/clear_refs resets VmHWM to VmRSS. Elsewhere the
    peak cannot be reset; ru_maxrss (KiB on Linux, bytes on macOS) is the fallback.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _proc_status_kib("VmRSS") * 1024
    except OSError:
        return _ru_maxrss_bytes()


def rss_peak() -> int:
    """The resident-set high-water mark in bytes (see :func:`reset_rss_peak`)."""
    try:
        return _proc_status_kib("VmHWM") * 1024
    except OSError:
        return _ru_maxrss_bytes()


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"
