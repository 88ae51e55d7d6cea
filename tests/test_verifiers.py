"""Verifiers: right answers score 1.0, wrong ones 0.0, and nothing a model writes makes them raise."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from treerl.envs.sandbox import SandboxLimits
from treerl.envs.verifiers import (
    MathVerifier,
    _fast_math_verdict,
    exact_match_reward,
    extract_boxed,
    math_verify_reward,
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
