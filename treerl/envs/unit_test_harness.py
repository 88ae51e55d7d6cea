"""The unit-test harness: runs a candidate's code once, then each test in its namespace, in the sandbox.

:func:`treerl.envs.verifiers.unit_test_reward` runs this file's source with
:func:`treerl.envs.sandbox.run_python` and sends the job on stdin as one JSON object:
``{"nonce": str, "code": str, "tests": [str, ...], "budget_s": float}``. For each test
that was run it writes one line ``NONCE INDEX PASSED`` (``PASSED`` is ``1`` or ``0``) to
the original stdout; tests that were never reached write nothing and count as failed.

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
        signal.setitimer(signal.ITIMER_REAL, max(share, 0.001))
        try:
            exec(compile(source, "<candidate>", "exec"), namespace)
            return True
        except BaseException:
            return False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    if run(code, (deadline - time.monotonic()) / 2):
        for i, test in enumerate(tests):
            share = (deadline - time.monotonic()) / (len(tests) - i)
            passed = run(test, share)
            os.write(out, ("%s %d %d\n" % (nonce, i, passed)).encode())


if __name__ == "__main__":
    main()
