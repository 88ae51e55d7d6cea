"""Verifiers: right answers score 1.0, wrong ones 0.0, and nothing a model writes makes them raise."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from treerl.envs.sandbox import SandboxLimits
from treerl.envs.verifiers import (
    MathVerifier,
    _fast_math_verdict,
    exact_match_reward,
    extract_boxed,
    io_test_results,
    io_test_reward,
    math_verify_reward,
    outputs_match,
    numeric_reward,
    unit_test_reward,
)

GARBAGE = [
    "",
    "   ",
    r"\boxed{",
    r"\boxed{}",
    "}}}{{{",
    "{" * 2000,
    r"\boxed{" * 200,
    "$$$$",
    "\x00\x01\x02",
    "π ≈ 3.14159… ∞ ∑ 🙂",
    r"\frac{1}{0}",
    r"\boxed{\frac{}{}}",
    "x" * 100_000,
    r"\begin{pmatrix} 1 & 2 \\ 3",
]


# --- extract_boxed ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{1}, finally \boxed{2}", "2"),
        (r"\boxed{ \{1, 2\} }", r"\{1, 2\}"),
        (r"\boxed{a_{i_{j}} + {b}}", r"a_{i_{j}} + {b}"),
        (r"\fbox{7}", "7"),
        (r"\boxed {x}", "x"),
        (r"\boxed{1} and an unclosed \boxed{2", "1"),
        ("no box here", None),
        (r"\boxed{", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_boxed_never_raises():
    for text in GARBAGE + [None, 42]:  # type: ignore[list-item]
        result = extract_boxed(text)  # type: ignore[arg-type]
        assert result is None or isinstance(result, str)


# --- exact_match_reward -------------------------------------------------------------------


def test_exact_match_normalizes_and_prefers_boxed():
    assert exact_match_reward(r"Thinking about it... The capital is \boxed{Paris}.", "paris") == 1.0
    assert exact_match_reward("  New   York. ", "new york") == 1.0
    assert exact_match_reward(r"$\text{Yes}$!", "yes") == 1.0
    assert exact_match_reward(r"\boxed{London}", "Paris") == 0.0
    # The boxed answer wins over the rest of the text, which also says Paris.
    assert exact_match_reward(r"Paris? No: \boxed{Lyon}", "Paris") == 0.0
    assert exact_match_reward("Paris", r"\boxed{Paris}") == 1.0


def test_exact_match_without_normalization_is_strict():
    assert exact_match_reward("Paris", "Paris", normalize=False) == 1.0
    assert exact_match_reward("Paris.", "Paris", normalize=False) == 0.0
    assert exact_match_reward("paris", "Paris", normalize=False) == 0.0


def test_exact_match_garbage_scores_zero():
    for text in GARBAGE:
        assert exact_match_reward(text, "Paris") == 0.0
    assert exact_match_reward(None, "Paris") == 0.0  # type: ignore[arg-type]


# --- numeric_reward -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("She pays 1,250 dollars in total.", 1250),
        (r"\boxed{\frac{1}{3}}", "0.333333333"),
        (r"\boxed{\dfrac{3}{4}}", 0.75),
        (r"\boxed{-\frac{1}{2}}", -0.5),
        (r"\boxed{1/2}", "1/2"),
        (r"\boxed{50\%}", 50),
        (r"\boxed{\$12.50}", "12.5"),
        ("The result is 2.5e3", 2500.0),
        ("answer: .5", 0.5),
        ("first 3 then 4", 4),
        (r"\boxed{x = 7}", "7"),
        ("42", r"\boxed{42}"),
    ],
)
def test_numeric_reward_correct(completion, gold):
    assert numeric_reward(completion, gold) == 1.0


def test_numeric_reward_incorrect_and_tolerances():
    assert numeric_reward("The answer is 41", 42) == 0.0
    assert numeric_reward(r"\boxed{3}", "4") == 0.0
    assert numeric_reward("1,2,3", 123) == 0.0  # a list, not a thousands separator
    assert numeric_reward("3.14", 3.14159) == 0.0
    assert numeric_reward("3.14", 3.14159, rel_tol=1e-3) == 1.0
    assert numeric_reward(r"\boxed{4}", 3) == 0.0  # the boxed answer wins over other numbers


def test_numeric_reward_garbage_scores_zero():
    for text in GARBAGE:
        assert numeric_reward(text, 1.0) == 0.0
    assert numeric_reward("nan", float("nan")) == 0.0
    assert numeric_reward("5", "not a number") == 0.0
    assert numeric_reward(None, 5) == 0.0  # type: ignore[arg-type]
    assert numeric_reward("1" * 400, 1.0) == 0.0  # overflows to inf


# --- math_verify_reward -------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, gold",
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{\dfrac{1}{2}}", "1/2"),
        (r"\boxed{\sqrt{4}}", "2"),
        (r"so $x = \boxed{\frac{\pi}{2}}$", r"\pi/2"),
        (r"\boxed{2x+2}", "2(x+1)"),
        (r"\boxed{42}", "42"),
        (r"\boxed{1,000}", "1000"),
    ],
)
def test_math_verify_accepts_equivalent_forms(completion, gold):
    assert math_verify_reward(completion, gold) == 1.0


@pytest.mark.parametrize(
    "completion, gold",
    [(r"\boxed{\frac{1}{3}}", "0.5"), (r"\boxed{41}", "42"), (r"\boxed{2x+1}", "2(x+1)"), ("no answer at all", "7")],
)
def test_math_verify_rejects_wrong_answers(completion, gold):
    assert math_verify_reward(completion, gold) == 0.0


def test_math_verify_puts_gold_first():
    """math-verify is not symmetric: a relation as gold accepts an interval answer, not vice versa."""
    assert math_verify_reward(r"\boxed{(1,2)}", "1<x<2") == 1.0
    assert math_verify_reward(r"\boxed{1<x<2}", "(1,2)") == 0.0


def test_fast_path_agrees_with_math_verify():
    pairs = [("42", "42"), ("41", "42"), ("0.5", "0.50"), ("-3", "-3"), ("+7", "7"), ("10", "10.0"), ("1", "2")]
    with MathVerifier() as verifier:
        for answer, gold in pairs:
            fast = _fast_math_verdict(rf"\boxed{{{answer}}}", gold)
            assert fast is not None, (answer, gold)
            assert fast == verifier.score(rf"\boxed{{{answer}}}", gold), (answer, gold)
    # Unequal decimals are left to math-verify, which rounds floats.
    assert _fast_math_verdict(r"\boxed{0.3333333}", "0.33333333") is None
    assert _fast_math_verdict(r"\boxed{\frac{1}{2}}", "0.5") is None


def test_math_verify_from_worker_threads():
    # math-verify's own timeouts use signal.alarm and fail outside the main thread.
    cases = [(r"\boxed{\frac{1}{2}}", "0.5", 1.0), (r"\boxed{\sqrt{9}}", "3", 1.0), (r"\boxed{x^2}", "x^3", 0.0)] * 4
    with ThreadPoolExecutor(max_workers=4) as pool:
        scores = list(pool.map(lambda c: math_verify_reward(c[0], c[1]), cases))
    assert scores == [c[2] for c in cases]


def test_math_verify_from_an_event_loop():
    async def main():
        return await asyncio.gather(
            asyncio.to_thread(math_verify_reward, r"\boxed{\frac{2}{4}}", "0.5"),
            asyncio.to_thread(math_verify_reward, r"\boxed{3}", r"\frac{6}{2}"),
        )

    assert asyncio.run(main()) == [1.0, 1.0]


def test_pathological_expression_times_out_and_the_worker_is_replaced():
    with MathVerifier() as verifier:
        assert verifier.score(r"\boxed{\sqrt{16}}", "4", timeout_s=30.0) == 1.0  # warm
        start = time.monotonic()
        assert verifier.score(r"\boxed{9^{9^{9^{9}}}}", "1", timeout_s=1.0) == 0.0
        assert time.monotonic() - start < 3.0
        assert verifier.num_restarts == 1
        # The next call gets a fresh worker and a correct answer.
        assert verifier.score(r"\boxed{\sqrt{16}}", "4", timeout_s=30.0) == 1.0


def test_pathological_expression_in_a_worker_thread_times_out():
    with MathVerifier() as verifier, ThreadPoolExecutor(max_workers=1) as pool:
        verifier.score(r"\boxed{\frac{1}{2}}", "0.5", timeout_s=30.0)  # warm
        start = time.monotonic()
        score = pool.submit(verifier.score, r"\boxed{2^{2^{2^{2^{2^{2}}}}}}", "3", timeout_s=1.0).result()
        assert score == 0.0
        assert time.monotonic() - start < 3.0


def test_math_verify_garbage_never_raises():
    for text in GARBAGE:
        assert math_verify_reward(text, "1", timeout_s=2.0) == 0.0
    # As gold too, minus the two huge strings that only time out (covered above and below).
    for text in [g for g in GARBAGE if len(g) < 1000]:
        assert math_verify_reward("1", text, timeout_s=2.0) == 0.0
    assert math_verify_reward(None, "1") == 0.0  # type: ignore[arg-type]
    assert math_verify_reward("1", None) == 0.0  # type: ignore[arg-type]


def _child_commands() -> list[list[str]]:
    """The command lines of this process's live children."""
    commands = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")[:-1]
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid():
            commands.append(argv)
    return commands


def test_the_worker_is_a_module_file_run_by_path():
    """No program travels in a string: the worker's command line names its module's file."""
    import treerl.envs.math_verify_worker

    with MathVerifier(memory_mb=1024) as verifier:
        assert verifier.score(r"so \boxed{\frac{1}{2}}", "0.5") == 1.0
        commands = _child_commands()
    assert [sys.executable, "-I", treerl.envs.math_verify_worker.__file__, str(1024 * 1024 * 1024)] in commands


def test_math_verifier_config_is_validated():
    with pytest.raises(ValueError, match="MathVerifier.memory_mb"):
        MathVerifier(memory_mb=16)


# --- unit_test_reward ---------------------------------------------------------------------

ADD = "def add(a, b):\n    return a + b\n"


def test_unit_tests_all_pass():
    assert unit_test_reward(ADD, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]) == 1.0


def test_unit_tests_partial_credit_and_failures_do_not_stop_the_rest():
    tests = [
        "assert add(1, 2) == 3",
        "assert add(2, 2) == 5",  # fails
        "raise SystemExit(1)",  # tries to end the run
        "add(1)",  # TypeError
        "assert add('a', 'b') == 'ab'",
    ]
    assert unit_test_reward(ADD, tests) == pytest.approx(2 / 5)


def test_a_hanging_test_fails_alone():
    tests = ["assert add(1, 2) == 3", "while True:\n    pass", "assert add(2, 3) == 5"]
    start = time.monotonic()
    assert unit_test_reward(ADD, tests, limits=SandboxLimits(timeout_s=3.0)) == pytest.approx(2 / 3)
    assert time.monotonic() - start < 4.0


def test_broken_candidate_scores_zero():
    tests = ["assert add(1, 2) == 3"]
    assert unit_test_reward("def add(a, b) return a + b", tests) == 0.0  # syntax error
    assert unit_test_reward(ADD + "raise RuntimeError('boom')", tests) == 0.0
    assert unit_test_reward("while True:\n    pass", tests, limits=SandboxLimits(timeout_s=2.0)) == 0.0
    assert unit_test_reward("import os\nos._exit(0)", tests) == 0.0


def test_noisy_candidate_output_does_not_hide_results():
    code = ADD + "print('x' * 1_000_000)\nimport sys\nprint('noise', file=sys.stderr)\n"
    assert unit_test_reward(code, ["assert add(1, 2) == 3"], limits=SandboxLimits(max_output_bytes=1000)) == 1.0


def test_printed_fake_results_do_not_count():
    code = ADD + "for i in range(5):\n    print('0' * 32, i, 1)\n"
    assert unit_test_reward(code, ["assert add(1, 2) == 4"]) == 0.0


def test_tests_run_in_the_sandbox():
    code = "import socket\ndef fetch():\n    return socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
    assert unit_test_reward(code, ["fetch()"]) == 0.0


def test_the_candidate_sees_neither_the_job_nor_the_nonce():
    """The harness takes its job from stdin before the candidate runs, and keeps the nonce to itself."""
    code = "import sys, __main__\nSTDIN = sys.stdin.read()\nNAMES = set(vars(__main__)) | set(globals())\n"
    tests = ["assert STDIN == ''", "assert not any('nonce' in name for name in NAMES)"]
    assert unit_test_reward(code, tests) == 1.0


def test_unit_tests_need_tests():
    with pytest.raises(ValueError, match="non-empty"):
        unit_test_reward(ADD, [])
    with pytest.raises(ValueError, match="non-empty"):
        unit_test_reward(ADD, "assert add(1, 2) == 3")  # a string, not a list of tests


def test_unit_test_garbage_code_scores_zero():
    for text in GARBAGE[:10]:
        assert unit_test_reward(text, ["assert add(1, 2) == 3"]) == 0.0


# --- io_test_reward -------------------------------------------------------------------------

SUM = "print(sum(map(int, input().split())))\n"

# Walks up from the candidate's code to whatever runs it, and writes a passing result line
# for every test in the runner's own format: what code set on fooling its judge would do.
FORGER = """
import sys, os
frame = sys._getframe()
while frame is not None and "nonce" not in frame.f_locals:
    frame = frame.f_back
if frame is not None:
    found = frame.f_locals
    for i in range(len(found["tests"])):
        os.write(found["out"], ("%s %d 1 \\"\\"\\n" % (found["nonce"], i)).encode())
os._exit(0)
"""


def test_io_tests_pass_a_case_only_when_the_program_prints_its_output():
    cases = [{"input": "1 2", "output": "3"}, {"input": "2 2\n", "output": "5"}, {"input": "-7 7", "output": "0\n"}]
    report = io_test_results(SUM, cases)
    assert report.passed == [True, False, True] and report.code_error is None
    assert report.errors == [None, "expected '5', got '4\\n'", None]
    assert io_test_reward(SUM, cases) == pytest.approx(2 / 3)


def test_io_test_failures_say_how_each_case_failed():
    cases = [{"input": "1", "output": "1"}]
    limits = SandboxLimits(timeout_s=2.0)
    assert io_test_results("while True:\n    pass", cases, limits=limits).errors == ["timed out"]
    raised = io_test_results("int('x')", cases).errors[0]
    assert raised.startswith("runtime_error: ValueError: invalid literal for int()")
    assert io_test_results("x = input()", cases).errors == ["expected '1', printed nothing"]
    flood = io_test_results("print('1' * 100_000)", cases, limits=SandboxLimits(max_output_bytes=1000))
    assert flood.errors == ["printed more than the output limit"]
    assert io_test_results(None, cases).code_error == "the code is not text"


def test_io_tests_keep_room_for_an_expected_output_longer_than_the_output_limit():
    count = "n = int(input())\nprint('\\n'.join(map(str, range(n))))"
    out = "\n".join(map(str, range(20_000)))  # 109 kB, past the default 64 kB of kept output
    assert io_test_results(count, [{"input": "20000", "output": out}]).passed == [True]
    flood = "print('1' * 500_000)"  # the room is not endless
    assert io_test_results(flood, [{"input": "", "output": out}]).errors == ["printed more than the output limit"]


def test_io_tests_ignore_what_a_program_writes_to_stderr():
    # Debug output on stderr past the output limit: a judge reads stdout only.
    chatty = "import sys\nfor i in range(20_000):\n    print('debug', i, file=sys.stderr)\nprint(3)"
    assert io_test_results(chatty, [{"input": "", "output": "3"}]).passed == [True]


def test_io_tests_compare_tokens_and_decimals_as_a_judge_does():
    assert outputs_match("1 2\n3\n", "1\n2 3")  # whitespace and line breaks do not matter
    assert not outputs_match("1 2 3", "1 2")
    assert outputs_match("0.3333333333", "0.333333333")
    assert outputs_match("2.5e3", "2500")  # a decimal against an integer, as numbers
    assert not outputs_match("0.5", "0.6") and not outputs_match("12", "13")
    assert not outputs_match("1000000000000000000000", "1000000000000000000001")  # integers exactly
    assert not outputs_match("0.3333333333", "0.333333333", float_tol=None)
    assert not outputs_match("1.0", "nan") and not outputs_match("1e999", "2e999")  # never within a tolerance
    assert outputs_match("YES", "YES") and not outputs_match("YES", "yes")


def test_io_tests_hold_an_integer_answer_printed_as_a_decimal_to_its_value():
    # The relative tolerance is for decimal answers: a wrong integer printed with a point must not
    # pass as "close" (1000001.0 is within 1e-6 of 1000000 relative, and wrong).
    assert not outputs_match("1000000", "1000001.0")
    assert not outputs_match("998244353", "998244000.0")
    assert not outputs_match("123456789012345678", "123456789012345677.0")  # past a float's digits
    assert outputs_match("10", "10.0") and outputs_match("10", "10.0000001") and outputs_match("10", "1e1")
    assert outputs_match("5 7", "5.0 7.0") and not outputs_match("5 1000000", "5.0 1000001")  # every token
    assert outputs_match("1000000.0", "1000000.5")  # a decimal answer keeps its relative tolerance
    assert not outputs_match("10", "10.0000001", float_tol=None)


def test_io_tests_keep_the_expected_output_out_of_the_sandbox(monkeypatch):
    """The judge is this process: the expected outputs never reach the code's process, so a program
    that goes looking for its judge (the way the unit-test harness can be found and fooled) finds none.
    All of a call's cases go to one sandboxed run, which is given their inputs only."""
    import treerl.envs.verifiers as verifiers

    sent = []
    real = verifiers.run_python

    def recording(code, **kwargs):
        sent.append(repr((code, kwargs)))
        return real(code, **kwargs)

    monkeypatch.setattr(verifiers, "run_python", recording)
    secrets = [f"forty-two-7f3a-{i}" for i in range(3)]
    cases = [{"input": f"hello-{i}", "output": secret} for i, secret in enumerate(secrets)]
    assert io_test_results("print(input())", cases).passed == [False] * 3
    assert len(sent) == 1 and all(f"hello-{i}" in sent[0] for i in range(3))
    assert not any(secret in call for call in sent for secret in secrets)
    assert io_test_reward(FORGER, [{"input": "1 2", "output": "3"}]) == 0.0


# Case 0 tries every way back to the harness's report (its stdout through /proc, every descriptor
# it holds) and writes results there that pass both cases; case 1 then prints a wrong answer.
REPORT_FORGER = """
import json, os
x = input()
if x == "0":
    lines = "".join(json.dumps({"i": i, "pid": 1, "exit": 0, "timed_out": False, "s": 0.0, "cut": False,
                                "stdout": str(i).encode().hex(), "stderr": "", "records": []}) + "\\n"
                    for i in range(2)).encode()
    targets = ["/proc/%d/fd/1" % os.getppid(), "/proc/1/fd/1"]
    for path in targets:
        try:
            with open(path, "wb") as f:
                f.write(lines)
        except OSError:
            pass
    for fd in range(3, 64):
        try:
            os.write(fd, lines)
        except OSError:
            pass
    print(0)
else:
    print("not", x)
"""


@pytest.mark.parametrize("namespaces", [True, False])
def test_io_test_cases_cannot_write_results_for_other_cases(namespaces):
    cases = [{"input": "0", "output": "0"}, {"input": "1", "output": "1"}]
    report = io_test_results(REPORT_FORGER, cases, limits=SandboxLimits(namespaces=namespaces))
    assert report.passed == [True, False]
    assert report.errors[1] == "expected '1', got 'not 1\\n'"


# One program whose cases hang, raise, flood, fork-bomb, run out of memory, or leave a process
# behind (which case 7 looks for); the cases between them must pass as if they ran alone.
MISBEHAVING = """
import os, sys, time
x = input()
if x == "1":
    while True:
        pass
if x == "2":
    raise ValueError("bad")
if x == "3":
    while True:
        sys.stdout.write("1" * 65536)
if x == "4":
    while True:
        try:
            os.fork()
        except OSError:
            pass
if x == "5":
    data = bytearray(8 << 30)
if x == "6":
    child = os.fork()
    if child == 0:
        os.setsid()
        time.sleep(60)
        os._exit(0)
    with open(PID_FILE, "w") as f:
        f.write(str(child))
if x == "7":
    try:
        os.kill(int(open(PID_FILE).read()), 0)
        x = "left alive"
    except (ProcessLookupError, PermissionError):
        pass
print(x)
"""


@pytest.mark.parametrize("namespaces", [True, False])
def test_io_test_cases_that_hang_crash_flood_or_fork_bomb_fail_alone(namespaces):
    cases = [{"input": str(i), "output": str(i)} for i in range(9)]
    limits = SandboxLimits(timeout_s=1.0, namespaces=namespaces)
    code = MISBEHAVING.replace("PID_FILE", repr(f"/tmp/treerl-io-test-{uuid.uuid4().hex}"))
    report = io_test_results(code, cases, limits=limits)
    assert report.errors == [None, "timed out", "runtime_error: ValueError: bad", "timed out", "process_limit",
                             "memory: MemoryError", None, None, None]


def test_io_test_cases_that_end_their_harness_fail_alone():
    # Without a pid namespace the harness is not its namespace's init, and a case can kill it:
    # that case fails, and the next ones run in a new harness.
    code = "import os, signal\nx = input()\nif x == '1':\n    os.kill(os.getppid(), signal.SIGKILL)\nprint(x)"
    cases = [{"input": str(i), "output": str(i)} for i in range(4)]
    report = io_test_results(code, cases, limits=SandboxLimits(namespaces=False))
    assert report.passed == [True, False, True, True]


def test_io_tests_stop_at_the_first_failure_as_results_arrive():
    # Every case after the failed one would take 1 s: judged as they arrive, the run stops at once.
    code = "import time\nx = input()\nif x != '1':\n    time.sleep(1)\nprint(x if x != '1' else 'no')"
    cases = [{"input": str(i), "output": str(i)} for i in range(1, 6)]
    start = time.monotonic()
    report = io_test_results(code, cases, limits=SandboxLimits(timeout_s=3.0), stop_at_failure=True)
    assert time.monotonic() - start < 1.0
    assert report.errors == ["expected '1', got 'no\\n'"] + ["not run"] * 4


def test_the_io_harness_finds_the_bootstrap_under_the_name_it_registers():
    import treerl.envs.io_test_harness as harness
    import treerl.envs.sandbox_bootstrap as bootstrap

    assert harness.BOOTSTRAP_MODULE == bootstrap.MODULE_NAME  # else every case would fail with a KeyError


def test_the_unit_test_harness_can_be_fooled_and_io_tests_cannot():
    """Why CodeSandbox reads stdin/stdout cases: assert tests run beside the candidate, which can
    reach their runner; this pins that known weakness, so that a fix to it shows up here."""
    assert unit_test_reward(FORGER, ["assert False", "assert False"]) == 1.0
    assert io_test_reward(FORGER, [{"input": "", "output": "ok"}, {"input": "", "output": "ok"}]) == 0.0


def test_io_tests_can_stop_at_the_first_failed_case(monkeypatch):
    monkeypatch.setenv("TREERL_SANDBOX_MAX_CONCURRENT", "1")
    cases = [{"input": str(i), "output": str(i)} for i in range(6)]
    code = "x = input()\nprint(x if x != '1' else 'no')"
    report = io_test_results(code, cases, stop_at_failure=True)
    assert report.passed == [True, False, False, False, False, False]
    assert report.errors[2:] == ["not run"] * 4
    assert io_test_results(code, cases).passed == [True, False, True, True, True, True]


def test_io_tests_judge_nothing_after_the_run_was_asked_to_stop(monkeypatch):
    """The sandbox drains stdout after a stop (its reader may hold later cases' lines, or read them
    while the harness is killed): those cases stay "not run", whatever arrives."""
    import json

    import treerl.envs.verifiers as verifiers
    from treerl.envs.sandbox import SandboxResult

    def line(i, printed):
        return json.dumps({"i": i, "pid": 7, "exit": 0, "timed_out": False, "s": 0.0, "cut": False,
                           "stdout": printed.encode().hex(), "stderr": "", "records": []}).encode() + b"\n"

    def streamed(code, *, on_stdout, **kwargs):
        stopped = on_stdout(line(0, "no\n") + line(1, "1\n"))  # one read: the failure and the next case
        on_stdout(line(2, "2\n"))  # read while the harness is killed
        return SandboxResult(stdout="", stderr="", exit_code=None, error=None, duration_s=0.0, stopped=stopped)

    monkeypatch.setattr(verifiers, "run_python", streamed)
    cases = [{"input": str(i), "output": str(i)} for i in range(4)]
    report = io_test_results("print(input())", cases, stop_at_failure=True)
    assert report.errors == ["expected '0', got 'no\\n'", "not run", "not run", "not run"]

    def ended(code, *, on_stdout, **kwargs):  # the harness had exited: nothing left to stop
        on_stdout(line(0, "no\n") + line(1, "1\n"))
        return SandboxResult(stdout="", stderr="", exit_code=0, error=None, duration_s=0.0)

    monkeypatch.setattr(verifiers, "run_python", ended)
    report = io_test_results("print(input())", cases, stop_at_failure=True)
    assert report.errors == ["expected '0', got 'no\\n'", "not run", "not run", "not run"]


def test_io_tests_need_cases():
    for bad in ([], "1 2", {"input": "1", "output": "2"}):
        with pytest.raises(ValueError, match="non-empty sequence"):
            io_test_reward(SUM, bad)
    with pytest.raises(ValueError, match="'input' and 'output'"):
        io_test_reward(SUM, [{"stdin": "1 2", "stdout": "3"}])
    with pytest.raises(ValueError, match="text or a list of lines"):
        io_test_reward(SUM, [{"input": 1, "output": 3}])


def test_verifiers_read_a_completion_given_as_chat_messages():
    # What a reward function receives (TRL's conversational completions): the last assistant reply counts.
    messages = [{"role": "assistant", "content": "<tool_call>...</tool_call>"},
                {"role": "tool", "content": "4"},
                {"role": "assistant", "content": r"So the total is \boxed{\frac{1}{2}}."}]
    assert math_verify_reward(messages, "0.5") == 1.0
    assert numeric_reward(messages, 0.5) == 1.0
    assert exact_match_reward(messages[:1] + [{"role": "assistant", "content": r"\boxed{Paris}"}], "paris") == 1.0
    assert math_verify_reward(messages[:2], "4") == 0.0  # the tool said 4; the model answered nothing
    assert math_verify_reward([], "1") == 0.0 and math_verify_reward([{"role": "assistant"}], "1") == 0.0
