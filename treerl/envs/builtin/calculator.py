"""``treerl/Calculator-v0``: arithmetic word problems with a calculator tool.

The model calls ``calculator(expression)``, reads the result, and answers in ``\\boxed{}``;
math-verify grades the answer. This is treerl's embedded default: the shipped tiny model was
trained on episodes of this environment.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from treerl.envs.builtin.calculator_tasks import SYSTEM_PROMPT, calculator, sample_task
from treerl.envs.core import Task, ToolEnv
from treerl.envs.parsers import ParseResult, ToolCall
from treerl.envs.tools import tool
from treerl.envs.verifiers import extract_boxed, math_verify_reward

__all__ = ["CalculatorEnv", "calculator_tool"]

calculator_tool = tool(calculator, timeout=5.0)


class CalculatorEnv(ToolEnv):
    """Arithmetic word problems: call the calculator, then answer in \\boxed{}.

    Tasks are generated from the seed (``reset(seed=s)`` always poses the same problem), or
    taken from ``dataset`` rows with ``prompt`` and ``answer``.

    Args:
        feedback_reveals_answer: Whether :meth:`feedback` on a wrong answer names the
            correct one (the gold check), or only says that it is wrong.
    """

    description = "Arithmetic word problems with a calculator(expression) tool; answer in \\boxed{}, graded by math-verify."
    system_prompt = SYSTEM_PROMPT
    tool_list = (calculator_tool,)

    def __init__(self, *, feedback_reveals_answer: bool = True, **kwargs: Any):
        kwargs.setdefault("max_turns", 4)
        super().__init__(**kwargs)
        self.feedback_reveals_answer = feedback_reveals_answer

    def sample_task(self, rng: np.random.Generator) -> Task:
        t = sample_task(rng)
        return Task(prompt=t.question, answer=t.answer, info={"expression": t.expression})

    def is_final(self, parsed: ParseResult) -> bool:
        return extract_boxed(parsed.content) is not None

    def no_call_message(self) -> str:
        return (
            "Call the calculator, e.g.\n"
            + self.parser.render([ToolCall("calculator", {"expression": "(3 + 4) * 2"})])
            + "\nor give the final answer as \\boxed{number}."
        )

    def score(self, task: Task, completion: str) -> float:
        return math_verify_reward(completion, str(task.answer))

    def answer_feedback(self, task: Task, completion: str, reward: float) -> str | None:
        """The gold check: whether the boxed answer is right, and (by default) what is."""
        if reward >= self.max_reward:
            return None
        gold = f" The correct answer is {task.answer}." if self.feedback_reveals_answer else ""
        return f"The final answer \\boxed{{{extract_boxed(completion)}}} is wrong.{gold}"

    def gold_actions(self, task: Task) -> list[str]:
        expression = task.info.get("expression") or str(task.answer)
        return [
            self.parser.render([ToolCall("calculator", {"expression": expression})]),
            f"The answer is \\boxed{{{task.answer}}}.",
        ]
