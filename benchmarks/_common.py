"""Shared by the benchmark scripts: writing their section of BENCHMARKS.md."""

from __future__ import annotations

import re
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
