"""The math-verify worker: imports math-verify once, then answers one JSON request per line.

:class:`treerl.envs.verifiers.MathVerifier` runs this file by path as
``python -I math_verify_worker.py MEMORY_BYTES`` with an empty environment, in a session
of its own. The protocol on stdin/stdout, one JSON document per line:

- the worker writes ``ready`` once math-verify is imported;
- each request ``{"completion": str, "gold": str}`` gets ``{"ok": bool}``, or
  ``{"ok": false, "error": "<exception type>"}`` when parsing or comparing failed.

Invariants: it imports math-verify (and the standard library), never ``treerl``; the
address-space limit is set after the import and before the first request, so a huge
expression fails with ``MemoryError`` instead of swapping; math-verify's own timeouts are
off (they use ``signal.alarm``) because the parent enforces the time limit by killing the
worker; gold goes first in ``verify(gold, answer)``, since the comparison is not
symmetric. Importing this module does nothing: the work happens only when it runs as a
script.
"""

import json
import logging
import resource
import sys

__all__ = ["main"]


def main(argv: list[str]) -> None:
    """Serve requests from stdin until it closes; ``argv[1]`` is the address-space limit in bytes."""
    logging.disable(logging.CRITICAL)
    from math_verify import parse, verify

    limit = int(argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def parse_gold(gold):
        # A bare gold ("1<x<2") is wrapped in $...$ so that math-verify reads it as LaTeX
        # instead of picking the first number.
        if "$" in gold or "\\boxed" in gold or "\\(" in gold or "\\[" in gold:
            return parse(gold, parsing_timeout=None)
        return parse("$" + gold + "$", parsing_timeout=None) or parse(gold, parsing_timeout=None)

    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            gold = parse_gold(req["gold"])
            answer = parse(req["completion"], parsing_timeout=None)
            ok = bool(gold) and bool(answer) and bool(verify(gold, answer, timeout_seconds=None))
            out.write(json.dumps({"ok": ok}) + "\n")
        except BaseException as e:  # MemoryError, RecursionError, anything sympy throws
            out.write(json.dumps({"ok": False, "error": type(e).__name__}) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv)
