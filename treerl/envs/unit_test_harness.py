"""The unit-test harness: runs a candidate's code once, then each test in its namespace, in the sandbox.

:func:`treerl.envs.verifiers.unit_test_reward` runs this file's source with
:func:`treerl.envs.sandbox.run_python` and sends the job on stdin as one JSON object:
``{"nonce": str, "code": str, "tests": [str, ...], "budget_s": float}``. For each test
that was run it writes one line ``NONCE INDEX PASSED ERROR`` (``PASSED`` is ``1`` or ``0``,
``ERROR`` a JSON string naming what the failed test raised, ``""`` when it passed) to the
original stdout; when the code itself raises, one line ``NONCE code 0 ERROR``. Tests that
were never reached write nothing and count as failed.

Invariants:

- The candidate's stdout goes to ``/dev/null``, so that it cannot push the results past
  the sandbox's output limit; only lines tagged with the run's nonce count, and the nonce
  is kept out of the candidate's namespace. (The sandbox protects the machine, not the
  reward: code set on fooling its tests can still reach it.)
- The code gets half of the budget; each test then gets an equal share of the time that
  is left, enforced with ``SIGALRM``, so one hanging test fails alone and the rest run.
- A test passes when it runs without raising anything (``BaseException`` included).
- Standard library only, never ``treerl``: it runs in the sandbox's isolated interpreter.
  Importing this module does nothing; the work happens only when it runs as ``__main__``.
"""

import builtins
import json
import os
import signal
import sys
import time

__all__ = ["main"]


class _TestTimeout(BaseException):
    """Raised by the alarm when a piece of code overruns its share of the budget."""


def _describe(exc):
    """What a failed piece of code raised, in one short line (what a teacher reads)."""
    if isinstance(exc, _TestTimeout):
        return "timed out"
    text = str(exc)
    line = type(exc).__name__ + (": " + text if text else "")
    return line if len(line) <= 300 else line[:297] + "..."


def _alarm(signum, frame):
    raise _TestTimeout()


def main() -> None:
    """Read the job from stdin, run the code and the tests, report each test's outcome."""
    job = json.loads(sys.stdin.read())
    nonce, code, tests = job["nonce"], job["code"], job["tests"]
    deadline = time.monotonic() + job["budget_s"]
    out = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    signal.signal(signal.SIGALRM, _alarm)
    namespace = {"__name__": "__main__", "__builtins__": builtins}

    def run(source, share):
        """None when ``source`` ran through, else what it raised."""
        signal.setitimer(signal.ITIMER_REAL, max(share, 0.001))
        try:
            exec(compile(source, "<candidate>", "exec"), namespace)
            return None
        except BaseException as exc:
            return _describe(exc)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    error = run(code, (deadline - time.monotonic()) / 2)
    if error is not None:
        os.write(out, ("%s code 0 %s\n" % (nonce, json.dumps(error))).encode())
        return
    for i, test in enumerate(tests):
        share = (deadline - time.monotonic()) / (len(tests) - i)
        error = run(test, share)
        os.write(out, ("%s %d %d %s\n" % (nonce, i, error is None, json.dumps(error or ""))).encode())


if __name__ == "__main__":
    main()
