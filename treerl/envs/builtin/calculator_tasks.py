"""Arithmetic word problems and a safe calculator for ``treerl/Calculator-v0``.

The environment asks one question per episode; the model calls :func:`calculator` with an
expression, reads the result from a ``tool`` message and answers with ``\\boxed{number}``.
Everything here is pure and deterministic given a ``numpy.random.Generator``, so the same
seed gives the same task in the environment, in the tiny model's training data and in tests.

Questions are short and built from a few templates whose word cues ("more", "gives",
"in each", "equally among") map to one operator each. Half of them carry a distractor number
("Mia is 9 years old.") that belongs in no expression. That gives a policy three separate
token-level choices to get right (operator, operands, the number it copies into the answer),
which is what the shipped tiny model is deliberately imperfect at, and what RL then fixes.

>>> import numpy as np
>>> task = sample_task(np.random.default_rng(0))
>>> task.answer == format_number(evaluate_expression(task.expression))
True
>>> calculator("(12 + 7) * 3")
'57'
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Callable

import numpy as np

from treerl.envs.python_source import parse as parse_python

__all__ = [
    "SYSTEM_PROMPT",
    "CalculatorTask",
    "sample_task",
    "evaluate_expression",
    "format_number",
    "calculator",
    "MAX_EXPRESSION_LENGTH",
    "MAX_MAGNITUDE",
    "MAX_EXPONENT",
]

SYSTEM_PROMPT = "Use the calculator tool, then answer with \\boxed{number}."

MAX_EXPRESSION_LENGTH = 200
"""Longer expressions are refused: they are never needed here and bound the parser's work."""
MAX_MAGNITUDE = 10**30
"""Any literal or intermediate result larger than this in absolute value is refused."""
MAX_EXPONENT = 100
"""``a ** b`` is refused when ``abs(b)`` exceeds this (and when the result would be too large)."""


@dataclass(frozen=True)
class CalculatorTask:
    """One arithmetic word problem.

    >>> CalculatorTask("Ana has 2 apples and buys 3 more. How many?", "2 + 3", "5").answer
    '5'
    """

    question: str
    """The word problem in English."""
    expression: str
    """The gold expression, e.g. ``"(12 + 7) * 3"``; numbers appear in question order."""
    answer: str
    """The canonical integer answer as text, ``format_number(evaluate_expression(expression))``."""


# --- the safe evaluator -------------------------------------------------------------------


def _true_divide(a: int | float, b: int | float) -> int | float:
    # Exact integer division stays an int so "24 / 6" answers "4", not "4.0".
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return a / b


def _power(a: int | float, b: int | float) -> int | float:
    if abs(b) > MAX_EXPONENT:
        raise ValueError(f"exponent {format_number(b)} is too large; exponents may be at most {MAX_EXPONENT}")
    if abs(a) > 1 and abs(b) * math.log10(abs(a)) > math.log10(MAX_MAGNITUDE):
        raise ValueError(f"{format_number(a)} ** {format_number(b)} is too large to compute")
    if a == 0 and b < 0:
        raise ValueError("0 cannot be raised to a negative power")
    result = a**b
    if isinstance(result, complex):
        raise ValueError("a negative number to a fractional power has no real value")
    return result


_BINARY_OPS: dict[type[ast.operator], Callable[[int | float, int | float], int | float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: _true_divide,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}

_HINTS: dict[type[ast.AST], str] = {
    ast.Name: "names are not allowed; write the numbers themselves",
    ast.Call: "function calls are not allowed; use only + - * / // % ** and parentheses",
    ast.Attribute: "attributes are not allowed; use only numbers and + - * / // % **",
    ast.Tuple: "commas are not allowed; write 1000 rather than 1,000",
    ast.Compare: "comparisons are not allowed; write only the expression, without = or <",
    ast.BitXor: "^ is not a power here; write 2 ** 3 for two cubed",
}


def _check_magnitude(value: int | float) -> int | float:
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a number in the expression is too large (the limit is 1e{int(math.log10(MAX_MAGNITUDE))})")
    return value


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        # bool is an int subclass: refuse "True + 1" like any other name.
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"only numbers are allowed, not {node.value!r}")
        return _check_magnitude(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _eval_node(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return _check_magnitude(_BINARY_OPS[type(node.op)](left, right))
    kind = type(node.op) if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node)
    hint = _HINTS.get(kind, "use only numbers, + - * / // % **, parentheses and unary minus")
    raise ValueError(f"unsupported syntax ({kind.__name__}): {hint}")


def evaluate_expression(expression: str) -> int | float:
    """Evaluate arithmetic safely: numbers, ``+ - * / // % **``, parentheses, unary minus.

    The expression is parsed with :mod:`ast` and walked node by node; nothing is executed.
    ``/`` of two integers that divide exactly gives an ``int``. Anything else (names, calls,
    attributes, huge powers or numbers, division by zero, bad syntax) raises ``ValueError``
    with a message that says what to write instead; the message is meant for the model.

    >>> evaluate_expression("(12 + 7) * 3")
    57
    >>> evaluate_expression("7 / 2")
    3.5
    >>> evaluate_expression("__import__('os')")
    Traceback (most recent call last):
    ...
    ValueError: unsupported syntax (Call): function calls are not allowed; use only + - * / // % ** and parentheses
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError('the expression is empty; write arithmetic such as "(3 + 4) * 2"')
    if len(text) > MAX_EXPRESSION_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_LENGTH} characters; split the work into steps")
    try:
        tree = parse_python(text, mode="eval")
    except SyntaxError:
        raise ValueError(f'not a valid arithmetic expression: {text!r}; write something like "(3 + 4) * 2"') from None
    return _eval_node(tree.body)


def format_number(value: int | float) -> str:
    """The canonical text of a number, as tool results and gold answers show it.

    Integers (and integral floats) print without a decimal point; other floats are rounded
    to 6 decimals with trailing zeros dropped.

    >>> format_number(57), format_number(4.0), format_number(10 / 3), format_number(-0.0)
    ('57', '4', '3.333333', '0')
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"format_number expects an int or float, got {type(value).__name__}")
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise ValueError(f"cannot format {value!r}: it is not a finite number")
    # Floats this large are integral; fixed notation keeps "1e+20" out of answers.
    if value.is_integer() or abs(value) >= 1e15:
        return str(int(value))
    text = f"{round(value, 6):.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Arithmetic using numbers, + - * / and parentheses, e.g. "(3 + 4) * 2".
    """
    # Raises ValueError for anything that is not plain arithmetic; the environment turns
    # that into a tool-error observation whose text is the message.
    return format_number(evaluate_expression(expression))


# --- the task generator -------------------------------------------------------------------

_NAMES = ("Ana", "Ben", "Carla", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ines", "Jack",
          "Kim", "Leo", "Mia", "Noah", "Omar", "Pia", "Sam", "Tara", "Uma", "Zoe")  # fmt: skip
_ITEMS = ("apples", "books", "cards", "coins", "cookies", "eggs", "marbles", "pencils",
          "stamps", "stickers", "shells", "toys")  # fmt: skip
_CONTAINERS = ("bags", "boxes", "jars", "packs", "baskets")

# (expression pattern, question template). Numbers a, b, c appear in the question in the
# same order as in the expression, so copying them is a matter of position, not reordering.
_ONE_STEP: dict[str, tuple[str, ...]] = {
    "a + b": (
        "{name} has {a} {item}. {name} buys {b} more. How many {item} does {name} have now?",
        "{name} had {a} {item} and found {b} more. How many {item} does {name} have in total?",
        "There are {a} {item} in one box and {b} {item} in another. How many {item} are there altogether?",
        "{name} collected {a} {item} on Monday and {b} {item} on Tuesday. How many {item} did {name} collect?",
    ),
    "a - b": (
        "{name} has {a} {item} and gives {b} to a friend. How many {item} are left?",
        "{name} had {a} {item} and lost {b} of them. How many {item} does {name} have now?",
        "There were {a} {item} in a jar. {name} took out {b}. How many {item} remain in the jar?",
        "{name} needs {a} {item} and already has {b}. How many more {item} does {name} need?",
    ),
    "a * b": (
        "{name} buys {a} {container} with {b} {item} in each. How many {item} does {name} buy?",
        "There are {a} rows with {b} {item} in every row. How many {item} are there?",
        "Each of {a} friends gives {name} {b} {item}. How many {item} does {name} get?",
    ),
    "a / b": (
        "{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
        "{name} packs {a} {item} into {container} of {b}. How many {container} does {name} fill?",
        "{a} {item} are split into {b} equal groups. How many {item} are in each group?",
    ),
}
_TWO_STEP: dict[str, tuple[str, ...]] = {
    "a + b - c": ("{name} has {a} {item}, buys {b} more and then gives away {c}. How many {item} are left?",),
    "(a + b) * c": ("Each of the {container} holds {a} red and {b} blue {item}. How many {item} are in {c} {container}?",),
    "a * b + c": ("{name} buys {a} {container} of {b} {item} and finds {c} more. How many {item} does {name} have?",),
    "a * b - c": ("{name} buys {a} {container} of {b} {item} and eats {c}. How many {item} are left?",),
    "(a + b) / c": (
        "{name} has {a} {item}, buys {b} more and shares them equally among {c} friends. "
        "How many {item} does each friend get?",
    ),
}
_DISTRACTORS = (
    "{name} is {d} years old.",
    "It is {d} degrees outside.",
    "{name} also has {d} {other_item}.",
)

_TWO_STEP_FRACTION = 0.4
_DISTRACTOR_FRACTION = 0.5


def _int(rng: np.random.Generator, low: int, high: int) -> int:
    """A uniform integer in ``[low, high]`` (inclusive), as a plain Python int."""
    return int(rng.integers(low, high + 1))


def _operands(pattern: str, rng: np.random.Generator) -> dict[str, int]:
    # Ranges keep every answer a positive integer below a few thousand, and every operand
    # at least 2 so that a wrong operator almost always gives a wrong answer.
    if pattern == "a + b":
        return {"a": _int(rng, 2, 60), "b": _int(rng, 2, 60)}
    if pattern == "a - b":
        a = _int(rng, 10, 90)
        return {"a": a, "b": _int(rng, 2, a - 2)}
    if pattern == "a * b":
        return {"a": _int(rng, 2, 12), "b": _int(rng, 2, 12)}
    if pattern == "a / b":
        b = _int(rng, 2, 10)
        return {"a": b * _int(rng, 2, 12), "b": b}
    if pattern == "a + b - c":
        a, b = _int(rng, 2, 40), _int(rng, 2, 40)
        return {"a": a, "b": b, "c": _int(rng, 2, a + b - 2)}
    if pattern == "(a + b) * c":
        return {"a": _int(rng, 2, 12), "b": _int(rng, 2, 12), "c": _int(rng, 2, 9)}
    if pattern == "a * b + c":
        return {"a": _int(rng, 2, 12), "b": _int(rng, 2, 12), "c": _int(rng, 2, 30)}
    if pattern == "a * b - c":
        a, b = _int(rng, 2, 12), _int(rng, 3, 12)
        return {"a": a, "b": b, "c": _int(rng, 2, a * b - 2)}
    if pattern == "(a + b) / c":
        c = _int(rng, 2, 9)
        total = c * _int(rng, 2, 12)
        a = _int(rng, 2, total - 2)
        return {"a": a, "b": total - a, "c": c}
    raise AssertionError(f"no operand ranges for {pattern!r}")


def _pick(rng: np.random.Generator, options: tuple[str, ...] | list[str]) -> str:
    return options[int(rng.integers(len(options)))]


def sample_task(rng: np.random.Generator) -> CalculatorTask:
    """Draw one word problem; the same generator state always gives the same task.

    >>> import numpy as np
    >>> a, b = sample_task(np.random.default_rng(7)), sample_task(np.random.default_rng(7))
    >>> a == b
    True
    """
    table = _TWO_STEP if rng.random() < _TWO_STEP_FRACTION else _ONE_STEP
    pattern = _pick(rng, list(table))
    template = _pick(rng, table[pattern])
    numbers = _operands(pattern, rng)
    # Distinct operands, so that a swapped or wrongly copied number is a visible mistake.
    while len(set(numbers.values())) < len(numbers):
        numbers = _operands(pattern, rng)
    name, item, container = _pick(rng, _NAMES), _pick(rng, _ITEMS), _pick(rng, _CONTAINERS)
    question = template.format(name=name, item=item, container=container, **numbers)

    if rng.random() < _DISTRACTOR_FRACTION:
        used = set(numbers.values())
        d = _int(rng, 2, 60)
        while d in used:
            d = _int(rng, 2, 60)
        other_item = _pick(rng, [x for x in _ITEMS if x != item])
        sentence = _pick(rng, _DISTRACTORS).format(name=name, d=d, other_item=other_item)
        question = f"{sentence} {question}" if rng.random() < 0.5 else _insert_before_question(question, sentence)

    expression = pattern
    for key, value in numbers.items():
        expression = expression.replace(key, str(value))
    return CalculatorTask(question=question, expression=expression, answer=format_number(evaluate_expression(expression)))


def _insert_before_question(question: str, sentence: str) -> str:
    """Put ``sentence`` just before the final "How many ..." sentence."""
    head, sep, tail = question.rpartition(" How many")
    return f"{head} {sentence}{sep}{tail}" if sep else f"{question} {sentence}"
