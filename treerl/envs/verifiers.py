"""Verifiers: turn a completion and a gold answer into a reward.

Every reward function here returns a float and never raises for anything a model wrote
(a bad rollout is data): unparsable text, pathological expressions, hangs and crashes
all score 0.0. They raise ``ValueError`` only for the caller's own mistakes (no tests).

- :func:`math_verify_reward` checks mathematical equivalence with math-verify (``1/2`` vs
  ``0.5`` vs ``\\frac{1}{2}``). math-verify's own timeouts use ``signal.alarm``, which only
  works in the main thread, so they are turned off (``parsing_timeout=None``,
  ``timeout_seconds=None``) and the time limit is enforced from outside: parsing and
  comparing run in a warm worker process (:class:`MathVerifier`, running
  :mod:`treerl.envs.math_verify_worker`) that is killed and replaced when it overruns.
  That works from worker threads and event loops alike and also bounds memory (sympy can
  try to build ``9^{9^{9^{9}}}``). Plain numbers skip the worker: integer or decimal
  answers are compared in process, exactly.
- :func:`exact_match_reward` and :func:`numeric_reward` are cheap string and number checks.

A completion is the model's text, or the chat messages a reward function receives (TRL's
conversational completions: tool calls, tool results, then the answer): then the last
assistant message's text is the one checked.
- :func:`unit_test_reward` runs candidate code and assert-style tests in the sandbox
  (:mod:`treerl.envs.unit_test_harness`); :func:`unit_test_results` says which tests
  failed and what they raised.
- :func:`io_test_reward` runs candidate code as a program per stdin/stdout case (all cases in
  one sandboxed run, :mod:`treerl.envs.io_test_harness`) and judges its output outside the
  sandbox, where the code cannot reach the judge;
  :func:`io_test_results` says which cases failed and how.

Costs measured on a 2-core CPU: the in-process fast path is a few microseconds; a worker
round trip is about 1 ms on top of math-verify's own work; starting a worker (importing
sympy) takes 1-2 s, paid once, and again after each timeout.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import secrets
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import treerl.envs.math_verify_worker as math_verify_worker
import treerl.envs.io_test_harness as io_test_harness
import treerl.envs.unit_test_harness as unit_test_harness
from treerl.envs.processes import kill_and_reap
from treerl.envs.sandbox import SandboxErrorKind, SandboxLimits, SandboxResult, classify_outcome, run_python

__all__ = [
    "extract_boxed",
    "math_verify_reward",
    "exact_match_reward",
    "numeric_reward",
    "unit_test_reward",
    "unit_test_results",
    "UnitTestReport",
    "io_test_reward",
    "io_test_results",
    "io_case",
    "outputs_match",
    "MathVerifier",
]


# --- answer extraction ------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_OR_ESCAPE = re.compile(r"\\[\s\S]|[{}]")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces and all.

    Returns ``None`` when there is none whose braces close. One pass over the text matches
    every brace (an escape ``\\{``, ``\\}`` or ``\\\\`` is a literal character), so the
    work is linear however many boxes are left open.

    >>> extract_boxed(r"so $x = \\boxed{\\frac{1}{2}}$.")
    '\\\\frac{1}{2}'
    >>> extract_boxed(r"\\boxed{1} then \\boxed{ {2} }")
    '{2}'
    >>> extract_boxed("no box") is None
    True
    """
    if not isinstance(text, str):
        return None
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    # A box's "{" is never the second character of an escape (it follows "boxed" or a
    # space), so a scan from the first box reads every later box's brace as a brace.
    opens = {m.end() - 1 for m in boxes}
    closing: dict[int, int] = {}
    stack: list[int] = []
    for token in _BRACE_OR_ESCAPE.finditer(text, boxes[0].end() - 1):
        char = token.group()
        if char == "{":
            stack.append(token.start())
        elif char == "}" and stack:  # (an escape: \{ and \} are literal braces, \\ is a line break)
            opened = stack.pop()
            if opened in opens:
                closing[opened] = token.start()
    for match in reversed(boxes):
        end = closing.get(match.end() - 1)
        if end is not None:
            return text[match.end() : end].strip()
    return None


def _completion_text(completion: Any) -> Any:
    """The text to check: ``completion`` itself, or the content of the last assistant message of a list of
    chat messages (``None`` when it has none); anything else is returned as is, for the caller to refuse."""
    if isinstance(completion, list):
        replies = [m for m in completion if isinstance(m, Mapping) and m.get("role") == "assistant"]
        content = replies[-1].get("content") if replies else None
        return content if isinstance(content, str) else None
    return completion


def _final_answer(text: str) -> str:
    boxed = extract_boxed(text)
    return boxed if boxed is not None else text


# --- exact match ------------------------------------------------------------------------

_TEXT_WRAPPER = re.compile(r"^\\(?:text|textbf|mathrm)\{(.*)\}$", re.DOTALL)


def _normalize(answer: str) -> str:
    answer = answer.strip().rstrip(".,;:!?").strip()
    if len(answer) >= 2 and answer[0] == answer[-1] == "$":
        answer = answer[1:-1].strip()
    wrapped = _TEXT_WRAPPER.match(answer)
    if wrapped:
        answer = wrapped.group(1)
    answer = " ".join(answer.split()).lower()
    return answer.rstrip(".,;:!?").strip()


def exact_match_reward(completion: str, gold: str, *, normalize: bool = True) -> float:
    """1.0 when the answer equals the gold answer, else 0.0.

    The answer is the last ``\\boxed{}`` when there is one, else the whole completion (the
    same rule applies to ``gold``). ``normalize`` collapses whitespace, lowercases, and
    drops surrounding ``$...$``, ``\\text{...}`` and trailing punctuation.

    >>> exact_match_reward(r"The capital is \\boxed{Paris}.", "paris")
    1.0
    >>> exact_match_reward("  Paris. ", "Paris", normalize=False)
    0.0
    """
    completion = _completion_text(completion)
    if not isinstance(completion, str) or not isinstance(gold, str):
        return 0.0
    answer, target = _final_answer(completion), _final_answer(gold)
    if normalize:
        answer, target = _normalize(answer), _normalize(target)
    return 1.0 if answer == target else 0.0


# --- numbers ----------------------------------------------------------------------------

# Thousands separators only in groups of three, so "1,2,3" is three numbers, not 123.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\s*\{\s*([^{}]+?)\s*\}\s*\{\s*([^{}]+?)\s*\}$")
_SLASH = re.compile(r"^([^/]+)/([^/]+)$")
_DECORATION = re.compile(r"\\[,!;: ]|\\(?:left|right)|\\\$|\$|\\%|%|\\text\{[^{}]*\}|\s")


def _parse_number(text: str) -> float | None:
    """A number written as ``1,234.5``, ``-3``, ``1e-3``, ``1/2``, ``\\frac{1}{2}`` or ``50\\%``."""
    cleaned = _DECORATION.sub("", text)
    if not cleaned:
        return None
    frac = _FRAC.match(cleaned)
    slash = _SLASH.match(cleaned)
    try:
        if frac:
            num, den = _parse_number(frac.group(2)), _parse_number(frac.group(3))
            value = num / den if num is not None and den else None
            return -value if value is not None and frac.group(1) else value
        if slash:
            num, den = _parse_number(slash.group(1)), _parse_number(slash.group(2))
            return num / den if num is not None and den else None
        if _NUMBER.fullmatch(cleaned):
            return float(cleaned.replace(",", ""))
    except (ValueError, OverflowError, ZeroDivisionError):
        return None
    return None


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return _parse_number(found[-1]) if found else None


def numeric_reward(completion: str, gold: float | str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1.0 when the answer is numerically close to ``gold``, else 0.0.

    The answer is the ``\\boxed{}`` content parsed as a number (fractions, ``\\frac``,
    thousands separators and ``%`` allowed), else the last number in the completion.

    >>> numeric_reward("... so she pays 1,250 dollars.", 1250)
    1.0
    >>> numeric_reward(r"\\boxed{\\frac{1}{3}}", "0.3333333333")
    1.0
    """
    try:
        if isinstance(gold, str):
            boxed = extract_boxed(gold)
            target = _parse_number(boxed if boxed is not None else gold)
            if target is None:
                target = _last_number(gold)
        else:
            target = float(gold)
        completion = _completion_text(completion)
        if not isinstance(completion, str) or target is None:
            return 0.0
        boxed = extract_boxed(completion)
        answer = _parse_number(boxed) if boxed is not None else None
        if answer is None:
            answer = _last_number(boxed if boxed is not None else completion)
        if answer is None or not (math.isfinite(answer) and math.isfinite(target)):
            return 0.0
        return 1.0 if math.isclose(answer, target, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0
    except (TypeError, ValueError, OverflowError):
        return 0.0


# --- math-verify --------------------------------------------------------------------------

_INT = re.compile(r"[-+]?\d+")
# One way to match each string: "\d+\.?\d*" backtracks quadratically on long digit runs.
_DECIMAL = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def _fast_math_verdict(completion: str, gold: str) -> float | None:
    """Decide plain-number cases in process; ``None`` means "ask math-verify".

    Equal exact values always agree with math-verify. Unequal integers are always unequal
    for it too; unequal decimals are not decided here, because math-verify rounds floats.
    """
    answer = extract_boxed(completion)
    if answer is None:
        answer = completion
    target = extract_boxed(gold)
    if target is None:
        target = gold
    answer, target = answer.strip().strip("$").strip(), target.strip().strip("$").strip()
    if not (_DECIMAL.fullmatch(answer) and _DECIMAL.fullmatch(target)):
        return None
    # Decimal compares decimal strings exactly, with no limit on their digits (int() and
    # Fraction() refuse more than sys.get_int_max_str_digits()).
    if Decimal(answer) == Decimal(target):
        return 1.0
    if _INT.fullmatch(answer) and _INT.fullmatch(target):
        return 0.0
    return None


# The worker and the unit-test harness are module files, so that linters and tests see them.
# The worker runs by path; the harness is sandboxed code, which run_python takes as text.
_WORKER_PATH = Path(math_verify_worker.__file__)
_HARNESS_PATH = Path(unit_test_harness.__file__)


class MathVerifier:
    """A warm math-verify worker process with a per-call time limit.

    Calls are serialized (one worker); create several verifiers for parallel scoring.
    A call that overruns kills the worker; the next call starts a fresh one. Safe to use
    from any thread and after ``fork`` (a forked child starts its own worker).

    math-verify evaluates extracted expressions with sympy's ``parse_expr`` (an ``eval``
    behind a tokenizer). The worker is a separate ``python -I`` process with an
    address-space limit and an empty environment, but it runs as the caller's user, not
    under the sandbox's private uid.

    >>> with MathVerifier() as verifier:  # doctest: +SKIP
    ...     verifier.score(r"so \\boxed{\\frac{1}{2}}", "0.5")
    1.0
    """

    def __init__(self, *, memory_mb: int = 2048, startup_timeout_s: float = 120.0):
        if memory_mb < 256:
            raise ValueError(
                f"MathVerifier.memory_mb must be >= 256, got {memory_mb!r}: sympy alone needs "
                "about 150 MiB of address space. Use e.g. memory_mb=2048."
            )
        self.memory_mb = memory_mb
        """Address-space limit of the worker, so a huge expression fails instead of swapping."""
        self.startup_timeout_s = startup_timeout_s
        """How long a worker may take to import math-verify (not counted in a call's timeout)."""
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = os.getpid()
        self.num_restarts = 0
        """How many workers were killed for overrunning (or dying)."""

    def score(self, completion: str, gold: str, *, timeout_s: float = 5.0) -> float:
        """1.0 if math-verify finds ``completion``'s answer equivalent to ``gold``, else 0.0."""
        if not isinstance(completion, str) or not isinstance(gold, str):
            return 0.0
        if "\x00" in completion or "\x00" in gold:
            return 0.0
        request = (json.dumps({"completion": completion, "gold": gold}) + "\n").encode()
        with self._lock:
            proc = self._ensure_worker()
            if proc is None:
                return 0.0
            try:
                assert proc.stdin is not None
                proc.stdin.write(request)
                proc.stdin.flush()
                line = self._read_line(proc, time.monotonic() + timeout_s)
            except (OSError, ValueError):
                line = None
            if line is None:
                self._kill_worker()
                self.num_restarts += 1
                return 0.0
        try:
            return 1.0 if json.loads(line).get("ok") is True else 0.0
        except (ValueError, AttributeError):
            return 0.0

    def close(self) -> None:
        """Stop the worker. The verifier can still be used; it starts a new one."""
        with self._lock:
            self._kill_worker()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure_worker(self) -> subprocess.Popen | None:
        if self._owner_pid != os.getpid():
            # Forked: the pipes belong to the parent's worker. Forget it, start our own.
            self._proc, self._owner_pid = None, os.getpid()
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:
            self._kill_worker()
        proc = subprocess.Popen(
            [sys.executable, "-I", str(_WORKER_PATH), str(self.memory_mb * 1024 * 1024)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,  # so a kill takes anything it spawned with it
        )
        self._proc = proc
        if self._read_line(proc, time.monotonic() + self.startup_timeout_s) != b"ready\n":
            self._kill_worker()
            return None
        return proc

    @staticmethod
    def _read_line(proc: subprocess.Popen, deadline: float) -> bytes | None:
        """One line from the worker, or ``None`` if it does not come before the deadline."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buf = b""
        while not buf.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            buf += chunk
        return buf

    def _kill_worker(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            kill_and_reap(proc)


# One shared worker for the plain function: starting one costs seconds (sympy), scoring
# then costs about a millisecond. Created on first use, stopped at interpreter exit.
_default_verifier: MathVerifier | None = None
_default_lock = threading.Lock()


def _shared_verifier() -> MathVerifier:
    global _default_verifier
    with _default_lock:
        if _default_verifier is None:
            _default_verifier = MathVerifier()
            atexit.register(_default_verifier.close)
        return _default_verifier


def math_verify_reward(completion: str, gold: str, *, timeout_s: float = 5.0) -> float:
    """1.0 if the completion's final answer is mathematically equivalent to ``gold``, else 0.0.

    Uses math-verify with the gold answer first (``verify(gold, answer)``; the comparison
    is not symmetric). Plain integers and decimals are decided in process; everything else
    goes to a shared warm worker (see :class:`MathVerifier`) that is killed and replaced
    when it takes longer than ``timeout_s``. Never raises: hangs, crashes and garbage are 0.0.

    >>> math_verify_reward(r"... so the answer is $\\boxed{\\frac{1}{2}}$.", "0.5")  # doctest: +SKIP
    1.0
    >>> math_verify_reward(r"\\boxed{42}", "42")
    1.0
    >>> math_verify_reward([{"role": "assistant", "content": r"\\boxed{42}"}], "42")  # a reward function's completion
    1.0
    """
    completion = _completion_text(completion)
    if not isinstance(completion, str) or not isinstance(gold, str):
        return 0.0
    fast = _fast_math_verdict(completion, gold)
    if fast is not None:
        return fast
    return _shared_verifier().score(completion, gold, timeout_s=timeout_s)


# --- unit tests -------------------------------------------------------------------------

@dataclass
class UnitTestReport:
    """Which tests a candidate passed, and what the others raised."""

    passed: list[bool]
    """Per test, whether it ran without raising."""
    errors: list[str | None]
    """Per test, what it raised (``"AssertionError"``, ``"NameError: name 'x' is not defined"``,
    ``"timed out"``), ``"not run"`` for a test never reached, None when it passed."""
    code_error: str | None = None
    """What the candidate's code itself raised (then every test failed), if it did."""

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


def unit_test_reward(code: str, tests: Sequence[str], *, limits: SandboxLimits = SandboxLimits()) -> float:
    """The fraction of ``tests`` (assert statements or small snippets) that pass for ``code``.

    Runs ``code`` once, then each test in the same namespace, in one sandboxed process
    (:func:`~treerl.envs.sandbox.run_python`). A test passes when it runs without raising;
    a failing, crashing or hanging test fails alone (each gets an equal share of the time
    left under ``limits.timeout_s``). If ``code`` itself raises, every test fails.
    The sandbox protects the machine, not the reward: code that sets out to fool its own
    tests (e.g. objects whose ``__eq__`` is always true) is not detected.

    >>> unit_test_reward("def add(a, b):\\n    return a + b",
    ...                  ["assert add(1, 2) == 3", "assert add(2, 2) == 5"])  # doctest: +SKIP
    0.5
    """
    return unit_test_results(code, tests, limits=limits).fraction


def unit_test_results(code: str, tests: Sequence[str], *, limits: SandboxLimits = SandboxLimits()) -> UnitTestReport:
    """:func:`unit_test_reward`'s run, test by test: which passed and what the others raised."""
    if isinstance(tests, str) or not tests:
        raise ValueError(
            "unit_test_reward(tests=...) needs a non-empty sequence of test snippets, got "
            f"{tests!r}. Pass a list such as ['assert add(1, 2) == 3']."
        )
    if not isinstance(code, str):
        return UnitTestReport([False] * len(tests), ["not run"] * len(tests), "the code is not text")
    nonce = secrets.token_hex(16)
    # Leave part of the wall clock for interpreter start-up and reporting.
    budget_s = max(limits.timeout_s * 0.9 - 0.2, limits.timeout_s * 0.5)
    job = {"nonce": nonce, "code": code, "tests": [str(t) for t in tests], "budget_s": budget_s}
    result = run_python(_HARNESS_PATH.read_text(encoding="utf-8"), stdin=json.dumps(job), limits=limits)
    passed, errors = [False] * len(tests), ["not run"] * len(tests)
    code_error = None
    for line in result.stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) != 4 or parts[0] != nonce:
            continue
        try:
            message = json.loads(parts[3])
        except json.JSONDecodeError:
            continue
        if parts[1] == "code":
            code_error = str(message)
        elif parts[1].isdigit() and int(parts[1]) < len(tests):
            i = int(parts[1])
            passed[i] = parts[2] == "1"
            errors[i] = None if passed[i] else str(message)
    if code_error is None and result.error is not None and not any(passed) and all(e == "not run" for e in errors):
        code_error = result.error.value  # the whole run was stopped (timeout, memory, a crash)
    return UnitTestReport(passed, errors, code_error)


# --- input/output tests -----------------------------------------------------------------

_NUMBER_TOKEN = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_SHOWN_CHARS = 200
"""How much of an input, an expected output or a printed one a failure message shows."""


def outputs_match(expected: str, got: str, *, float_tol: float | None = 1e-6) -> bool:
    """Whether a program's output ``got`` matches ``expected``, as a judge's standard checker reads them.

    Both are compared as sequences of whitespace-separated tokens, so line breaks, runs of
    spaces and trailing newlines do not matter. Tokens are equal as text, or, where
    ``float_tol`` is not ``None`` and at least one of the two is a decimal with a point or
    an exponent, as numbers: within ``float_tol`` relative to an expected decimal (absolute
    below 1), within ``float_tol`` of an expected integer (so ``1000001.0`` is not
    ``1000000``, which a relative tolerance would pass). Two integers must match exactly.

    >>> outputs_match("3\\n1 2\\n", "3 1  2")
    True
    >>> outputs_match("0.333333", "0.33333333")
    True
    >>> outputs_match("10", "10.0000001")
    True
    >>> outputs_match("10", "11"), outputs_match("yes", "YES")
    (False, False)
    """
    want, have = expected.split(), got.split()
    if len(want) != len(have):
        return False
    for a, b in zip(want, have):
        if a == b:
            continue
        if float_tol is None or not (_NUMBER_TOKEN.fullmatch(a) and _NUMBER_TOKEN.fullmatch(b)):
            return False
        if not any(c in token for token in (a, b) for c in ".eE"):
            return False  # two integers that differ
        x, y = float(a), float(b)
        if not (math.isfinite(x) and math.isfinite(y)):
            return False
        if not any(c in a for c in ".eE"):
            # An integer answer: the printed number must be that integer, up to float_tol, compared
            # exactly (a float would round a large one's last digits away).
            if abs(Decimal(b) - Decimal(a)) > Decimal(repr(float_tol)):
                return False
        elif abs(x - y) > float_tol * max(1.0, abs(x)):
            return False
    return True


def _shown(text: str) -> str:
    """``text`` for a failure message: at most ``_SHOWN_CHARS`` characters, as a repr."""
    return repr(text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "...")


def io_case(case: Any) -> dict[str, str]:
    """One input/output case as ``{"input": str, "output": str}``.

    Takes a mapping with ``input`` and ``output`` (each text, or a list of lines, as some
    datasets store them). Raises ``ValueError`` for anything else (the caller's data).

    >>> io_case({"input": "1 2", "output": ["3"], "testtype": "stdin"})
    {'input': '1 2', 'output': '3'}
    """
    if not isinstance(case, Mapping) or "input" not in case or "output" not in case:
        raise ValueError(f"An input/output test case is a mapping with 'input' and 'output', got {case!r:.200}.")
    fields = {}
    for key in ("input", "output"):
        value = case[key]
        if isinstance(value, list) and all(isinstance(line, str) for line in value):
            value = "\n".join(value)
        if not isinstance(value, str):
            raise ValueError(f"An input/output test case's {key!r} must be text or a list of lines, got {value!r:.200}.")
        fields[key] = value
    return fields


def _judge(result: Any, expected: str, float_tol: float | None) -> str | None:
    """What went wrong in one case's run (None when it passed), in one line."""
    if result.error is SandboxErrorKind.TIMEOUT:
        return "timed out"
    if result.error is not None:
        lines = result.stderr.strip().splitlines()
        detail = f": {lines[-1][:300]}" if lines else ""
        return f"{result.error.value}{detail}"
    if result.stdout_truncated:  # (stderr is not judged: debug output there is no failure)
        return "printed more than the output limit"
    if outputs_match(expected, result.stdout, float_tol=float_tol):
        return None
    if not result.stdout.strip():
        return f"expected {_shown(expected)}, printed nothing"
    return f"expected {_shown(expected)}, got {_shown(result.stdout)}"


def io_test_results(code: str, cases: Sequence[Mapping[str, Any]], *, limits: SandboxLimits = SandboxLimits(),
                    float_tol: float | None = 1e-6, stop_at_failure: bool = False) -> UnitTestReport:
    """Run ``code`` as a program once per case, with the case's ``input`` on stdin, and judge its stdout.

    All the cases run in one sandboxed run (:func:`~treerl.envs.sandbox.run_python` of
    :mod:`treerl.envs.io_test_harness`), one after another, each in a process of its own
    forked for it, under ``limits.timeout_s`` each (the run's own limit covers them all),
    ``limits.memory_mb`` of address space, and ``limits.max_processes``; what a case left
    behind is killed before the next starts. The output is compared here, outside the
    sandbox (:func:`outputs_match`): the harness is given the code, the inputs and how many
    bytes of output to keep, never an expected output, so whatever a program does to the
    harness or to the other cases' runs (it runs as the same user), it can only change what
    is reported as printed, and it passes a case only by printing that case's right answer.
    (Unlike :func:`unit_test_results`, where the tests run beside the code, which can reach
    their runner.) A case that raises, times out or prints something else fails alone;
    ``errors`` says how (``"expected '3', got '4'"``, ``"timed out"``,
    ``"runtime_error: ValueError: ..."``). Only stdout is judged, and a case keeps at least
    twice its expected output's bytes of it, however small ``limits.max_output_bytes``.
    With ``stop_at_failure`` (a judge's verdict, an all-or-nothing reward), the results are
    judged as they arrive and the run is stopped at the first failed case: the rest are
    ``"not run"``.

    A program that ends the harness itself (it can without a pid namespace, where the
    harness is not protected as the namespace's init) fails the case it was running; the
    next cases run in a new harness, and when it stalls the harness until the whole run's
    time limit, every case not yet reported fails.

    >>> io_test_results("print(sum(map(int, input().split())))",
    ...                 [{"input": "1 2", "output": "3"}, {"input": "2 2", "output": "5"}]).passed  # doctest: +SKIP
    [True, False]
    """
    if isinstance(cases, (str, Mapping)) or not cases:
        raise ValueError(
            f"io_test_results(cases=...) needs a non-empty sequence of cases, got {cases!r:.200}. "
            "Pass a list such as [{'input': '1 2', 'output': '3'}]."
        )
    checked = [io_case(case) for case in cases]
    if not isinstance(code, str):
        return UnitTestReport([False] * len(checked), ["not run"] * len(checked), "the code is not text")
    # A right answer may be longer than the output kept (judges' outputs run to megabytes):
    # keep twice the expected output, room for other whitespace, so the limit cuts only floods.
    rooms = [max(limits.max_output_bytes, 2 * len(case["output"].encode())) for case in checked]
    errors: list[str | None] = ["not run"] * len(checked)
    first = 0
    while first < len(checked):

        def judge(i: int, result: SandboxResult) -> bool:
            errors[i] = _judge(result, checked[i]["output"], float_tol)
            return stop_at_failure and errors[i] is not None

        todo = range(first, len(checked))
        reported, run = _run_io_harness(code, [checked[i]["input"] for i in todo], [rooms[i] for i in todo],
                                        limits, lambda k, result: judge(first + k, result))
        first += reported
        if run.stopped or first == len(checked):
            break
        # The run ended before it reported this case: the case's program ended its harness.
        errors[first] = "runtime_error: stopped its harness" if run.error is None else _judge(run, "", float_tol)
        if run.error is SandboxErrorKind.TIMEOUT or stop_at_failure:
            break  # it stalled the harness: no second run for the rest
        first += 1
    return UnitTestReport([error is None for error in errors], errors)


_IO_HARNESS_PATH = Path(io_test_harness.__file__)
_CASE_SLACK_S = 0.2
"""Seconds a case may take in the harness beyond its time limit: killing what it left, reporting."""
_START_SLACK_S = 5.0
"""Seconds the harness run may take beyond its cases: starting the sandbox and the interpreter."""


def _run_io_harness(code: str, inputs: Sequence[str], rooms: Sequence[int], limits: SandboxLimits,
                    on_case: Callable[[int, SandboxResult], bool]) -> tuple[int, SandboxResult]:
    """Run ``code`` on each input in one sandboxed harness run; ``on_case(k, result)`` as each case is reported.

    ``rooms[k]`` is how many bytes of the ``k``-th case's stdout to keep. ``on_case`` gets a
    :class:`~treerl.envs.sandbox.SandboxResult` per case, in order, while the run goes on;
    when it returns true the run is stopped, and no later case is reported. Returns how many
    cases were reported, and the run (``stopped`` when ``on_case`` asked).
    """
    encoded = [text.encode() for text in inputs]
    header = json.dumps({"code": code, "timeout_s": limits.timeout_s,
                         "cases": [[len(data), room] for data, room in zip(encoded, rooms)]})
    job = f"{len(header)}\n{header}" + "".join(inputs)  # (the header is ASCII: its length is its bytes)
    frame_bytes = 4 * io_test_harness.STDERR_TAIL + 8192  # a frame without its stdout, at most
    run_limits = replace(
        limits,
        timeout_s=len(inputs) * (limits.timeout_s + _CASE_SLACK_S) + _START_SLACK_S,
        max_processes=limits.max_processes + 1,  # the harness, beside what a case may start
        max_output_bytes=sum(2 * room + frame_bytes for room in rooms),  # stdout in hex
    )
    pending, reported, broken, stopping = bytearray(), 0, False, False

    def on_stdout(data: bytes) -> bool:
        # After a stop the sandbox still drains stdout: the cases in it were not asked for.
        nonlocal reported, broken, stopping
        if broken or stopping:
            return False
        pending.extend(data)
        while (end := pending.find(b"\n")) >= 0:
            line = bytes(pending[:end])
            del pending[: end + 1]
            result = _case_result(line, reported)
            if result is None:
                broken = True  # not the harness's line: trust nothing after it
                return True
            reported += 1
            if on_case(reported - 1, result):
                stopping = True
                return True
        return False

    run = run_python(_IO_HARNESS_PATH.read_text(encoding="utf-8"), stdin=job, limits=run_limits, on_stdout=on_stdout)
    if broken:
        run = replace(run, stopped=False, error=SandboxErrorKind.RUNTIME_ERROR,
                      stderr="the harness's report is unreadable")
    elif stopping:  # (also when the harness had ended by then, and the sandbox had nothing to stop)
        run = replace(run, stopped=True)
    return reported, run


def _case_result(line: bytes, index: int) -> SandboxResult | None:
    """One case's result from the harness's report line, or None when it is not the ``index``-th case's."""
    try:
        frame = json.loads(line)
        if frame["i"] != index:
            return None
        stdout = bytes.fromhex(frame["stdout"]).decode("utf-8", errors="replace")
        records = [r for r in frame["records"] if isinstance(r, dict)]
        exit_code, stderr = frame["exit"], str(frame["stderr"])
        error = classify_outcome(exit_code=exit_code, timed_out=bool(frame["timed_out"]), records=records,
                                 main_pid=frame["pid"], stderr=stderr)
        return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, error=error,
                             duration_s=float(frame["s"]), truncated=bool(frame["cut"]),
                             stdout_truncated=bool(frame["cut"]))
    except (ValueError, KeyError, TypeError):
        return None


def io_test_reward(code: str, cases: Sequence[Mapping[str, Any]], *, limits: SandboxLimits = SandboxLimits(),
                   float_tol: float | None = 1e-6) -> float:
    """The fraction of input/output ``cases`` whose output ``code`` prints (see :func:`io_test_results`).

    >>> io_test_reward("print(int(input()) * 2)", [{"input": "2", "output": "4"}])  # doctest: +SKIP
    1.0
    """
    return io_test_results(code, cases, limits=limits, float_tol=float_tol).fraction
