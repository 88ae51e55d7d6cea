"""A dataset of prompts scored by reward functions alone: the task of TRL's ``GRPOTrainer``.

Each row's ``prompt`` (text, or a list of messages: TRL's conversational format) opens an
episode. Without tools the model's first reply ends it; with tools (plain typed functions, as
TRL's ``tools=[...]``) the model may call them for up to ``max_turns`` turns. There is no gold
answer and no verifier: the environment's reward is 0, and the reward functions given to the
learner score the episodes. The row's other columns (``answer`` among them) reach those
functions as keyword arguments, as in TRL.

>>> env = PromptEnv(dataset=[{"prompt": "Say hi.", "lang": "en"}])
>>> obs, info = env.reset(seed=0)
>>> obs, info["row"]
([{'role': 'user', 'content': 'Say hi.'}], {'lang': 'en'})
>>> env.step("hi")[1:3]
(0.0, True)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from treerl.envs.builtin.math_verify import RowTasks, check_rows, load_rows
from treerl.envs.core import Task, ToolEnv

__all__ = ["PromptEnv"]

TOOL_TURNS = 10
"""Turns of an episode with tools unless ``max_turns`` says otherwise (TRL's default has no turn limit;
``max_episode_tokens`` bounds the episode too)."""


class PromptEnv(ToolEnv):
    """Prompts from rows; reward 0 (the learner's reward functions score); optional tools.

    Args:
        dataset: Rows (dicts, or a ``datasets.Dataset``) with a ``prompt`` column.
        data_path: A JSON Lines or Parquet file of such rows instead.
        prompt_key: The column holding the prompt: a string (sent as one user message) or a list of
            ``{"role", "content"}`` messages (a leading system message is the episode's system prompt).
        tools: Functions (or :class:`~treerl.envs.tools.Tool` objects) the model may call.
        max_turns: Assistant turns of an episode (default: 1 without tools, ``TOOL_TURNS`` with).
        **kwargs: :class:`~treerl.envs.core.ToolEnv`'s (``system_prompt``, ``parser``, ...).
    """

    description = "Prompts from a dataset, scored only by reward functions (TRL's GRPOTrainer task)."
    max_reward = 0.0

    def __init__(self, *, dataset: Sequence[Mapping[str, Any]] | None = None,
                 data_path: str | os.PathLike | None = None, prompt_key: str = "prompt",
                 tools: Sequence[Callable[..., Any]] = (), max_turns: int | None = None, **kwargs: Any):
        if dataset is None and data_path is None:
            raise ValueError("PromptEnv needs rows: pass dataset=[{'prompt': ...}, ...] or data_path='rows.jsonl'.")
        rows = load_rows(data_path, dataset, "")
        check_rows(rows, functools.partial(_check_row, prompt_key=prompt_key), key=(PromptEnv, prompt_key))
        tools = list(tools or ())
        super().__init__(dataset=RowTasks(rows, functools.partial(_row_task, prompt_key=prompt_key)), tools=tools,
                         max_turns=max_turns if max_turns is not None else (TOOL_TURNS if tools else 1), **kwargs)

    def score(self, task: Task, completion: str) -> float:
        return 0.0  # no verifier: the reward functions score the episode

    def answer_feedback(self, task: Task, completion: str, reward: float) -> str | None:
        return None


def _check_row(row: Mapping[str, Any], index: int, *, prompt_key: str) -> None:
    if prompt_key not in row:
        raise ValueError(f"Row {index} has no {prompt_key!r} column (columns: {sorted(row)}): every row needs its "
                         "prompt there (text or a list of messages), or pass prompt_key= to name another column.")
    prompt = row[prompt_key]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt):
            raise ValueError(f"Row {index}: {prompt_key!r} is a list but not of messages ({{'role', 'content'}} "
                             "dicts); give a string or a non-empty list of messages.")
    elif not isinstance(prompt, str):
        raise ValueError(f"Row {index}: {prompt_key!r} is {type(prompt).__name__}; give a string or a list of "
                         "messages.")


def _row_task(row: Mapping[str, Any], index: int, *, prompt_key: str) -> Task:
    _check_row(row, index, prompt_key=prompt_key)
    prompt = row[prompt_key]
    prompt = [dict(m) for m in prompt] if isinstance(prompt, list) else prompt
    # Every other column reaches reward functions, as TRL passes them (answer as ``answer``).
    extra = {k: v for k, v in row.items() if k not in (prompt_key, "answer")}
    return Task(prompt=prompt, answer=row.get("answer"), id=str(index), info={"row": extra} if extra else {})
