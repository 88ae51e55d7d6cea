"""The Calculator task generator and its safe evaluator."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treerl.envs.builtin.calculator_tasks import (
    MAX_EXPONENT,
    SYSTEM_PROMPT,
    CalculatorTask,
    calculator,
    evaluate_expression,
    format_number,
    sample_task,
)


def _tasks(seed: int, n: int) -> list[CalculatorTask]:
    rng = np.random.default_rng(seed)
    return [sample_task(rng) for _ in range(n)]


def test_same_seed_same_tasks_and_different_seed_different_tasks():
    assert _tasks(3, 50) == _tasks(3, 50)
    assert _tasks(3, 50) != _tasks(4, 50)


def test_sample_task_depends_only_on_the_generator_state():
    rng = np.random.default_rng(11)
    sample_task(rng)
    state = rng.bit_generator.state
    first = sample_task(rng)
    rng.bit_generator.state = state
    assert sample_task(rng) == first


def test_answers_equal_the_evaluated_expression_and_are_positive_integers():
    for task in _tasks(0, 2000):
        value = evaluate_expression(task.expression)
        assert task.answer == format_number(value) == calculator(task.expression)
        assert isinstance(value, int) and value > 0, task


def test_expression_numbers_appear_in_the_question_in_order():
    for task in _tasks(1, 500):
        expr_numbers = re.findall(r"\d+", task.expression)
        question_numbers = re.findall(r"\d+", task.question)
        # The expression's numbers are a subsequence of the question's (a distractor may sit between).
        it = iter(question_numbers)
        assert all(n in it for n in expr_numbers), task
        assert len(set(expr_numbers)) == len(expr_numbers), task


def test_generator_covers_all_operators_distractors_and_two_step_problems():
    tasks = _tasks(2, 1000)
    for op in "+-*/":
        assert any(op in t.expression for t in tasks), op
    with_distractor = [t for t in tasks if len(re.findall(r"\d+", t.question)) > len(re.findall(r"\d+", t.expression))]
    assert 0.35 < len(with_distractor) / len(tasks) < 0.65
    two_step = [t for t in tasks if len(re.findall(r"\d+", t.expression)) == 3]
    assert 0.25 < len(two_step) / len(tasks) < 0.55


def test_questions_and_prompt_stay_short():
    assert len(SYSTEM_PROMPT) < 100 and "\\boxed{" in SYSTEM_PROMPT
    assert max(len(t.question) for t in _tasks(5, 2000)) < 200


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("12 + 7", 19),
        ("(12 + 7) * 3", 57),
        ("24 / 6", 4),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("-(3 - 5)", 2),
        ("+4", 4),
        ("1.5 * 4", 6.0),
        ("  3*4  ", 12),
    ],
)
def test_evaluate_expression_computes_python_arithmetic(expression, expected):
    value = evaluate_expression(expression)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", "names are not allowed"),
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("(1).real", "attributes are not allowed"),
        ("abs(-3)", "function calls"),
        ("[1, 2]", "unsupported syntax"),
        ("1, 000", "commas are not allowed"),
        ("2 ^ 3", "write 2 ** 3"),
        ("1 < 2", "comparisons are not allowed"),
        ("True + 1", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("1j * 2", "only numbers"),
        ("lambda: 1", "unsupported syntax"),
        ("2 ** 1000", "too large"),
        ("10 ** 10 ** 10", "too large"),
        ("9 ** 99", "too large"),
        ("1e400", "too large"),
        ("10 ** 20 * 10 ** 20", "too large"),
        ("1 / 0", "division by zero"),
        ("1 % 0", "division by zero"),
        ("0 ** -1", "negative power"),
        ("(-8) ** 0.5", "no real value"),
        ("12 + 7 =", "not a valid arithmetic expression"),
        ("", "empty"),
        ("1 + " * 100 + "1", "longer than"),
    ],
)
def test_evaluate_expression_refuses_everything_else(expression, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        evaluate_expression(expression)


def test_exponent_bound_is_enforced_even_for_small_bases():
    assert evaluate_expression(f"1 ** {MAX_EXPONENT}") == 1
    with pytest.raises(ValueError, match="exponent"):
        evaluate_expression(f"1 ** {MAX_EXPONENT + 1}")


def test_non_string_expression_is_a_value_error():
    with pytest.raises(ValueError, match="must be a string"):
        evaluate_expression(12)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "text"),
    [(57, "57"), (4.0, "4"), (-3, "-3"), (3.5, "3.5"), (10 / 3, "3.333333"), (-0.0, "0"), (1e-9, "0"), (1e20, "100000000000000000000")],
)
def test_format_number(value, text):
    assert format_number(value) == text


@pytest.mark.parametrize("value", [math.inf, math.nan, "3", True])
def test_format_number_refuses_non_numbers(value):
    with pytest.raises(ValueError):
        format_number(value)


_small_ints = st.integers(min_value=-1000, max_value=1000)


@settings(max_examples=300, deadline=None)
@given(_small_ints, _small_ints, _small_ints, st.sampled_from(["+", "-", "*"]), st.sampled_from(["+", "-", "*"]))
def test_calculator_agrees_with_exact_integer_arithmetic(a, b, c, op1, op2):
    expression = f"({a} {op1} {b}) {op2} {c}"
    # The reference is Python itself on known-safe integer input: the calculator must never differ.
    assert calculator(expression) == str(eval(expression))  # noqa: S307 - trusted, generated input


@settings(max_examples=300, deadline=None)
@given(_small_ints, _small_ints.filter(lambda x: x != 0))
def test_calculator_division_is_exact_or_rounded_to_six_decimals(a, b):
    text = calculator(f"{a} / {b}")
    if a % b == 0:
        assert text == str(a // b)
    else:
        assert abs(float(text) - a / b) <= 5e-7 + 1e-12  # half a unit in the 6th decimal
        assert len(text.partition(".")[2]) <= 6


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_calculator_either_answers_or_raises_value_error(text):
    try:
        result = calculator(text)
    except ValueError:
        return
    assert isinstance(result, str) and result


def test_calculator_docstring_is_google_style_for_the_tool_schema():
    doc = calculator.__doc__ or ""
    assert doc.startswith("Evaluate an arithmetic expression.")
    assert "Args:\n        expression: Arithmetic using numbers, + - * / and parentheses" in doc
