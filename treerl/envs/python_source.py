"""One lock around :func:`ast.parse` for every thread that reads Python from model text.

CPython 3.11 keeps the recursion counter of its AST builder in module-wide state, not per
thread. Two threads parsing at once (an environment's ``reset`` on the event loop while a
tool runs in a worker thread) can reset each other's counter, and ``ast.parse`` then raises
``SystemError: AST constructor recursion depth mismatch`` on valid input. Parsing is a few
microseconds for the bounded text we hand it, so serializing it costs nothing measurable.
"""

from __future__ import annotations

import ast
import threading

__all__ = ["parse"]

_PARSE_LOCK = threading.Lock()


def parse(source: str, *, mode: str = "exec", filename: str = "<unknown>") -> ast.AST:
    """:func:`ast.parse`, one thread at a time.

    >>> parse("1 + 2", mode="eval").body.op.__class__.__name__
    'Add'
    """
    with _PARSE_LOCK:
        return ast.parse(source, filename=filename, mode=mode)
