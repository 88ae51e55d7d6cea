"""``treerl/CodeSandbox-v0``: write a Python function; hidden unit tests grade it.

The model may try code with the ``run_python`` tool, which runs it in the sandbox
(:mod:`treerl.envs.sandbox`: separate process, time/memory/process limits, private working
directory, no network). Its final answer is a reply with a fenced ```python block and no
tool call; the reward is the fraction of the task's hidden tests that pass.

A task's tests are assert statements run after its code in one sandboxed process
(``tests: ["assert add(1, 2) == 3"]``), or stdin/stdout cases, the form of competitive
programming datasets (``tests: [{"input": "1 2", "output": "3"}]``, parallel ``inputs`` and
``outputs`` lists, or APPS/TACO's ``input_output``): each case runs the code as a program
with its input on stdin, and the output is judged outside the sandbox, so a program cannot
forge its reward (:func:`~treerl.envs.verifiers.io_test_results`); assert tests run in the
candidate's own process, which could tamper with them.

Tasks come from a JSONL file (the shipped dozen by default) or, with ``tasks="word-problems"``,
are generated from the seed: Calculator's word problems (:mod:`~treerl.envs.builtin.calculator_tasks`)
as "write ``solve()``" tasks whose hidden test compares against the reference expression
(``assert solve() == 12 + 7``), so a failed test's feedback shows what was expected, as
tests written against a reference implementation do. Unlimited held-out tasks for learning
benchmarks, at a difficulty the shipped ``tiny-coder`` model can learn.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from treerl.envs.builtin.calculator_tasks import sample_task
from treerl.envs.builtin.math_verify import RowTasks, check_rows, load_rows
from treerl.envs.core import Task, ToolEnv
from treerl.errors import ToolCallError, ToolErrorKind, ToolTimeout
from treerl.envs.parsers import ParseResult, ToolCall
from treerl.envs.sandbox import SandboxErrorKind, SandboxLimits, run_python
from treerl.envs.tools import Tool, tool
from treerl.envs.verifiers import UnitTestReport, io_case, io_test_results, unit_test_results

__all__ = ["CodeSandboxEnv", "make_run_python_tool", "extract_code", "word_problem_task", "unit_test_feedback",
           "io_test_feedback", "row_tests", "TASK_SOURCES", "REWARDS", "WORD_PROBLEM_PROMPT"]

_MAX_FAILED_TESTS = 3
"""Failed tests the feedback shows: enough to point at the mistake, short enough to read."""

_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


TASK_SOURCES = ("file", "word-problems")
"""Where ``CodeSandboxEnv`` takes its tasks from: a JSONL file of rows, or generated word problems."""

REWARDS = ("fraction", "all")
"""How ``CodeSandboxEnv`` turns test results into a reward: the fraction passed, or 1.0 only when all pass."""

WORD_PROBLEM_PROMPT = "Write a function `solve()` that returns the answer to this problem, computed from its numbers: {question}"


def word_problem_task(rng: np.random.Generator) -> Task:
    """A Calculator word problem as a code task: ``solve()`` must return its value.

    The hidden test compares with the reference expression, so its failure names it.

    >>> task = word_problem_task(np.random.default_rng(0))
    >>> task.info["tests"] == [f"assert solve() == {task.info['expression']}"]
    True
    >>> task.info["solution"] == f"def solve():\\n    return {task.info['expression']}"
    True
    """
    t = sample_task(rng)
    info = {"tests": [f"assert solve() == {t.expression}"], "solution": f"def solve():\n    return {t.expression}",
            "expression": t.expression}
    return Task(prompt=WORD_PROBLEM_PROMPT.format(question=t.question), answer=None, info=info)


def extract_code(text: str) -> str | None:
    """The last fenced code block of ``text``, or None."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def make_run_python_tool(limits: SandboxLimits, *, stdin: bool = False) -> Tool:
    """A ``run_python`` tool bound to ``limits``; with ``stdin``, it also takes the text the program reads.

    Outcomes other than a clean run become typed tool errors: the wall-clock limit is a
    ``timeout``; memory, process-count and network violations and exceptions are ``tool_error``
    with the captured output, so the model reads what went wrong. The tool itself has no time
    limit: the sandbox's own counts from when the run has a slot, and a tool limit would count
    the wait for one as the program's time.
    """

    def run_python_tool(code: str) -> str:
        """Run Python code in a sandbox and return what it printed.

        Args:
            code: A complete Python program; use print() to see values.
        """
        return _run(code, None)

    def run_program_tool(code: str, stdin: str = "") -> str:
        """Run a Python program in a sandbox with the given standard input and return what it printed.

        Args:
            code: A complete Python program; use print() to see values.
            stdin: The text the program reads from standard input.
        """
        return _run(code, stdin)

    def _run(code: str, stdin: str | None) -> str:
        result = run_python(code, stdin=stdin, limits=limits)
        if result.error is None:
            return result.stdout if result.stdout else "(no output)"
        if result.error is SandboxErrorKind.TIMEOUT:
            raise ToolTimeout(f"run_python: the program ran past {limits.timeout_s} s and was stopped.", tool_name="run_python")
        detail = (result.stderr or result.stdout).strip()[-2000:]
        raise ToolCallError(
            ToolErrorKind.TOOL_ERROR,
            f"run_python: {result.error.value}: {detail}" if detail else f"run_python: {result.error.value}",
            tool_name="run_python",
        )

    return tool(run_program_tool if stdin else run_python_tool, name="run_python", timeout=None)


def unit_test_feedback(tests: Sequence[str], report: UnitTestReport) -> str:
    """The feedback on a failed final answer: which tests failed (the first few) and what they raised.

    >>> print(unit_test_feedback(["assert f() == 1", "assert f() == 2"], UnitTestReport([True, False], [None, "AssertionError"])))
    The final code passed 1 of 2 tests. Failed tests:
    - `assert f() == 2` raised AssertionError
    """
    if report.code_error is not None:
        return f"Running the final code raised {report.code_error}, so none of the tests ran."
    return _failed_tests(report, [f"`{test}` raised" for test in tests])


def io_test_feedback(cases: Sequence[Mapping[str, str]], report: UnitTestReport) -> str:
    """The feedback on a failed final answer to input/output cases: the inputs it failed on and how.

    >>> print(io_test_feedback([{"input": "1 2", "output": "3"}], UnitTestReport([False], ["expected '3', got '4'"])))
    The final code passed 0 of 1 tests. Failed tests:
    - on input '1 2': expected '3', got '4'
    """
    if report.code_error is not None:
        return f"The final code could not be run ({report.code_error})."
    shown = [case["input"] if len(case["input"]) <= 100 else case["input"][:97] + "..." for case in cases]
    ran = [i for i, error in enumerate(report.errors) if error != "not run"]
    text = _failed_tests(UnitTestReport([report.passed[i] for i in ran], [report.errors[i] for i in ran]),
                         [f"on input {shown[i]!r}:" for i in ran])
    skipped = len(report.errors) - len(ran)  # the cases after a failure, when judging stops there
    return text.replace(f" of {len(ran)} tests.", f" of {len(report.errors)} tests ({skipped} not run).", 1) if skipped else text


def _failed_tests(report: UnitTestReport, labels: Sequence[str]) -> str:
    """The first failed tests, each as its label followed by what went wrong."""
    failed = [(label, error) for label, ok, error in zip(labels, report.passed, report.errors) if not ok]
    lines = [f"- {label} {error}" for label, error in failed[:_MAX_FAILED_TESTS]]
    more = f" (the first {_MAX_FAILED_TESTS})" if len(failed) > _MAX_FAILED_TESTS else ""
    return f"The final code passed {sum(report.passed)} of {len(report.passed)} tests. Failed tests{more}:\n" + "\n".join(lines)


def _as_list(value: Any) -> Any:
    """A tuple or a numpy array (a pandas row of a Parquet list column) as a list; anything else as it is."""
    return list(value) if isinstance(value, (tuple, np.ndarray)) else value


def _parallel_cases(spec: Mapping[str, Any], name: str) -> list[dict[str, Any]]:
    """``{"inputs": [...], "outputs": [...]}`` (APPS, TACO; CodeContests spells them ``input`` and
    ``output``) as a list of cases; ``name`` says where it came from in an error."""
    if spec.get("fn_name"):
        raise ValueError(
            f"{name} names fn_name={spec['fn_name']!r}: call-based tests are not read; "
            "give them as assert statements in 'tests' (e.g. \"assert f(1) == 2\")."
        )
    inputs, outputs = _as_list(spec.get("inputs", spec.get("input"))), _as_list(spec.get("outputs", spec.get("output")))
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError(f"{name} must hold two lists of the same length, 'inputs' and 'outputs' (or 'input' and "
                         f"'output'), one entry per test case; got {spec!r:.200}.")
    return [{"input": i, "output": o} for i, o in zip(inputs, outputs)]


def _calls_a_function(case: Mapping[str, Any]) -> bool:
    """Whether a case is call-based: LiveCodeBench's testtype 'functional', PrimeIntellect's type
    'function_call' (also in DeepCoder and open-r1), or any case naming a function."""
    return case.get("testtype", "stdin") != "stdin" or case.get("type") == "function_call" or bool(case.get("fn_name"))


def _defined_but_never_run(test: str) -> list[str]:
    """The functions and classes a test snippet defines when nothing at its top level calls or asserts
    anything (HumanEval's ``check(candidate)`` left uncalled, a pytest file): such a test passes
    whatever the code does. Empty for any other snippet, and for one that does not parse."""
    try:
        body = ast.parse(test).body
    except (SyntaxError, ValueError):
        return []
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    runs = any(isinstance(node, (ast.Call, ast.Assert, ast.Raise))
               for statement in body if not isinstance(statement, defs) for node in ast.walk(statement))
    return [] if runs else [statement.name for statement in body if isinstance(statement, defs)]


def row_tests(row: Mapping[str, Any]) -> dict[str, list]:
    """A task row's hidden tests: ``{"tests": [assert statements]}`` or ``{"io_cases": [cases]}``.

    Reads ``tests`` (assert statements, ``{"input", "output"}`` cases, or parallel lists
    ``{"inputs": [...], "outputs": [...]}``, CodeContests' ``{"input": [...], "output": [...]}``;
    any of them as JSON text), parallel ``inputs`` and ``outputs`` columns, or APPS/TACO's
    ``input_output`` (a mapping or its JSON text). Raises ``ValueError`` naming what is wrong
    with the row.

    >>> row_tests({"inputs": ["1 2"], "outputs": ["3"]})
    {'io_cases': [{'input': '1 2', 'output': '3'}]}
    >>> row_tests({"tests": {"input": ["1 2"], "output": ["3"]}})
    {'io_cases': [{'input': '1 2', 'output': '3'}]}
    >>> row_tests({"tests": ["assert f() == 1"]})
    {'tests': ['assert f() == 1']}
    """
    if "input_output" in row and "tests" not in row:
        spec = row["input_output"]
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"'input_output' is not JSON ({exc}).") from None
        if not isinstance(spec, Mapping):
            raise ValueError(f"'input_output' must hold an object with 'inputs' and 'outputs', got {spec!r:.200}.")
        row = {"tests": _parallel_cases(spec, "'input_output'")}
    if "tests" not in row and ("inputs" in row or "outputs" in row):
        row = {"tests": _parallel_cases({"inputs": row.get("inputs"), "outputs": row.get("outputs")}, "the row")}
    tests = _as_list(row.get("tests"))
    if isinstance(tests, str):
        try:  # a Parquet or CSV column may hold the list as JSON text
            tests = json.loads(tests)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"'tests' is text but not JSON ({exc}): {tests!r:.120}. Give a list of assert statements or "
                "of cases (or that list as JSON text); one test snippet goes in a list of one, and one that "
                "only defines a checker must call it too (HumanEval's: [test + '\\ncheck(entry_point)'])."
            ) from None
    if isinstance(tests, Mapping):
        tests = _parallel_cases(tests, "'tests'")
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"'tests' must be a non-empty list, got {tests!r:.200}.")
    if all(isinstance(test, str) for test in tests):
        for index, test in enumerate(tests):
            if names := _defined_but_never_run(test):
                raise ValueError(
                    f"test {index} defines {', '.join(n + '()' for n in names)} but never calls it, so it "
                    "would pass whatever the code does: call it in the test (HumanEval's: test + "
                    "'\\ncheck(entry_point)'), or give assert statements."
                )
        return {"tests": list(tests)}
    if all(isinstance(test, Mapping) for test in tests):
        if any(_calls_a_function(test) for test in tests):
            raise ValueError(
                "a case calls a function (LiveCodeBench's testtype 'functional', PrimeIntellect's type "
                "'function_call', or a case with a fn_name): only stdin/stdout cases are read; give "
                "call-based tests as assert statements."
            )
        return {"io_cases": [io_case(test) for test in tests]}
    raise ValueError("'tests' must be all assert statements (text) or all {'input': ..., 'output': ...} cases, not a mix.")


class CodeSandboxEnv(ToolEnv):
    """Write a function; hidden unit tests decide the reward.

    Args:
        data_path: JSONL of tasks with ``prompt``, tests (assert statements, or stdin/stdout
            cases: see :func:`row_tests`), optional ``solution`` (for ``validate()``) and
            ``id``. Defaults to the shipped tasks.
        dataset: Rows instead of a file.
        limits: Sandbox limits for the tool and the hidden tests.
        tasks: ``"file"`` (the rows of ``data_path``/``dataset``, the shipped tasks by default) or
            ``"word-problems"`` (generated from the seed by :func:`word_problem_task`).
        reward: ``"fraction"`` (of the hidden tests passed, the default) or ``"all"`` (1.0 when
            every test passes, else 0.0: DeepCoder's and open-r1's binary code reward).
        prompt_key: The column holding the problem (``question`` in APPS and TACO, ``description``
            in CodeContests, ``text`` in MBPP); text, or a list of chat messages.
        tests_key: The column holding the tests, read as ``tests`` is (``test_list`` in MBPP,
            ``public_tests`` in CodeContests, ``public_test_cases`` in LiveCodeBench); default:
            ``tests``, else ``inputs`` and ``outputs``, else ``input_output``.
    """

    description = "Write a Python function or program; a sandboxed run_python tool; reward = fraction of hidden tests passed (unit tests or stdin/stdout cases)."
    system_prompt = (
        "Write the requested Python function. You can test code with the run_python tool. "
        "When done, reply with the final code in a ```python block and no tool call."
    )
    program_system_prompt = (
        "Write the requested Python program: it reads its input from standard input and prints the answer. "
        "You can test code with the run_python tool, giving it the input to read. "
        "When done, reply with the final code in a ```python block and no tool call."
    )
    """The system prompt when the tasks' tests are stdin/stdout cases (the tool then takes ``stdin``)."""

    def __init__(
        self,
        *,
        data_path: str | os.PathLike | None = None,
        dataset: Sequence[Mapping[str, Any]] | None = None,
        limits: SandboxLimits | None = None,
        tasks: str = "file",
        reward: str = "fraction",
        prompt_key: str = "prompt",
        tests_key: str | None = None,
        **kwargs: Any,
    ):
        if reward not in REWARDS:
            raise ValueError(f"reward={reward!r} is not one of {REWARDS}: 'fraction' of the tests passed, or 'all' of them.")
        self.reward_mode = reward
        if tasks not in TASK_SOURCES:
            raise ValueError(f"tasks={tasks!r} is not one of {TASK_SOURCES}; use 'word-problems' for generated tasks.")
        if tasks == "word-problems" and (data_path is not None or dataset is not None):
            raise ValueError("tasks='word-problems' generates its tasks; drop data_path/dataset, or use tasks='file'.")
        rows, programs = None, False
        if tasks == "file":
            dataset = load_rows(data_path, dataset, "code_tasks.jsonl")
            keys = {"prompt_key": prompt_key, "tests_key": tests_key}
            check = functools.partial(self._check, **keys)
            check_rows(dataset, check, key=(type(self), prompt_key, tests_key))
            rows = RowTasks(dataset, functools.partial(self._row, **keys))
            # Programs read stdin: the tool takes it, and the prompt says so (from the first row, as a
            # file's rows share one form).
            programs = len(dataset) > 0 and "io_cases" in check(dataset[0], 0)
        self.limits = limits or SandboxLimits()
        if programs:
            kwargs.setdefault("system_prompt", self.program_system_prompt)
        kwargs.setdefault("max_turns", 4)
        # The hidden tests run under the sandbox's limit, which does not count the wait for a slot
        # (see treerl.envs.sandbox.max_concurrent_runs); a score limit would, and score a correct
        # program 0 when many episodes finish at once.
        kwargs.setdefault("score_timeout_s", None)
        super().__init__(tools=[make_run_python_tool(self.limits, stdin=programs)], dataset=rows, **kwargs)

    def sample_task(self, rng: np.random.Generator) -> Task:
        return word_problem_task(rng)

    @staticmethod
    def _check(row: Mapping[str, Any], index: int, *, prompt_key: str = "prompt",
               tests_key: str | None = None) -> dict[str, list]:
        """The row's tests (see :func:`row_tests`); raises naming the row when it has none usable."""
        tests = {"tests", "inputs", "outputs", "input_output"} if tests_key is None else {tests_key}
        if prompt_key not in row or not tests & set(row):
            named = "'tests', or 'inputs' and 'outputs', or 'input_output'" if tests_key is None else repr(tests_key)
            raise ValueError(
                f"Code task {index} needs {prompt_key!r} and its tests ({named}); it has {sorted(row)}: "
                "pass prompt_key=/tests_key= to name the columns."
            )
        prompt = row[prompt_key]
        if not isinstance(prompt, str) and not (
                isinstance(prompt, list) and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt)):
            raise ValueError(f"Code task {index}: {prompt_key!r} must be text or a list of chat messages "
                             f"({{'role', 'content'}} dicts), got {prompt!r:.100}.")
        if tests_key is not None:  # the named column, read as 'tests' are (or as APPS's input_output)
            row = {"input_output" if tests_key == "input_output" else "tests": row[tests_key]}
        try:
            return row_tests(row)
        except ValueError as exc:
            raise ValueError(f"Code task {index}: {exc}") from None

    @classmethod
    def _row(cls, row: Mapping[str, Any], index: int, *, prompt_key: str = "prompt",
             tests_key: str | None = None) -> Task:
        info = {**cls._check(row, index, prompt_key=prompt_key, tests_key=tests_key), "solution": row.get("solution")}
        prompt = row[prompt_key]  # (checked above)
        # TRL's conversational format: the messages themselves (a leading system message replaces the environment's)
        prompt = [dict(m) for m in prompt] if isinstance(prompt, list) else str(prompt)
        return Task(prompt=prompt, answer=None, info=info, id=str(row.get("id", index)))

    def is_final(self, parsed: ParseResult) -> bool:
        return extract_code(parsed.content) is not None

    def no_call_message(self) -> str:
        return "Reply with the final code in a ```python block, or call run_python to test code first."

    def score(self, task: Task, completion: str) -> float:
        code = extract_code(completion)
        if code is None:
            self.test_report = None
        elif "io_cases" in task.info:
            # All or nothing: the reward is 0 from the first failed case, so the rest need not run.
            self.test_report = io_test_results(code, task.info["io_cases"], limits=self.limits,
                                               stop_at_failure=self.reward_mode == "all")
        else:
            self.test_report = unit_test_results(code, task.info["tests"], limits=self.limits)
        if self.test_report is None:
            return 0.0
        if self.reward_mode == "all":
            return float(all(self.test_report.passed))
        return self.test_report.fraction

    def answer_feedback(self, task: Task, completion: str, reward: float) -> str | None:
        """Which hidden tests failed and what they raised or printed (the first few), or what the code raised."""
        report: UnitTestReport | None = getattr(self, "test_report", None)
        if report is None or reward >= self.max_reward:
            return None
        if "io_cases" in task.info:
            return io_test_feedback(task.info["io_cases"], report)
        return unit_test_feedback(task.info["tests"], report)

    def gold_actions(self, task: Task) -> list[str]:
        solution = task.info.get("solution")
        if not solution:
            raise ValueError(f"Task {task.id!r} has no 'solution', so it cannot be validated.")
        if "io_cases" in task.info:  # a program: try it on the first case's input, then answer
            if "stdin" not in self.tools[0].parameters["properties"]:  # (a file whose first row has asserts)
                return [f"```python\n{solution}\n```"]
            probe = self.parser.render([ToolCall("run_python", {"code": solution, "stdin": task.info["io_cases"][0]["input"]})])
            return [probe, f"```python\n{solution}\n```"]
        probe = self.parser.render([ToolCall("run_python", {"code": solution + "\nprint('ok')"})])
        return [probe, f"```python\n{solution}\n```"]
