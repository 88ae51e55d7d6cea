"""Model text reaches `ast.parse` one thread at a time (CPython 3.11 shares the AST builder's
recursion counter between threads, and parallel parses then fail on valid input)."""

from __future__ import annotations

import ast
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from treerl.envs.builtin.calculator_tasks import evaluate_expression
from treerl.envs.pythonic_parser import PythonicParser


def test_calculator_and_pythonic_parser_never_parse_at_the_same_time(monkeypatch):
    real_parse = ast.parse
    inside = 0
    most_inside = 0
    guard = threading.Lock()

    def slow_parse(*args, **kwargs):
        nonlocal inside, most_inside
        with guard:
            inside += 1
            most_inside = max(most_inside, inside)
        try:
            time.sleep(0.002)  # widen the window in which a second thread could enter
            return real_parse(*args, **kwargs)
        finally:
            with guard:
                inside -= 1

    monkeypatch.setattr(ast, "parse", slow_parse)
    parser = PythonicParser()

    def work(i: int) -> None:
        assert evaluate_expression(f"({i} + 1) * 2") == (i + 1) * 2
        result = parser.parse(f'[calculator(expression="{i} + 1")]')
        assert [c.name for c in result.calls] == ["calculator"], result

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(work, range(64)))
    assert most_inside == 1
