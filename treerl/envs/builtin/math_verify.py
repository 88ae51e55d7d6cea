"""``treerl/MathVerify-v0``: single-turn math, graded by math-verify.

Tasks come from a local JSONL file (``data_path``), an in-memory dataset (``dataset``: a
``datasets.Dataset`` or a list of dicts), or the small sample that ships with treerl.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from treerl.envs.core import Task, ToolEnv
from treerl.envs.verifiers import math_verify_reward

__all__ = ["MathVerifyEnv", "load_jsonl", "load_rows", "read_rows"]


def load_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a JSON Lines file into a list of dicts; the error names the bad line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({exc.msg}): fix or remove that line.") from None
    return rows


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSON Lines file, or of a Parquet file (``.parquet``, read with pyarrow)."""
    if os.fspath(path).endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"{path}: reading a Parquet file needs pyarrow (pip install pyarrow), or convert it "
                              "to JSON Lines.") from None
        return pq.read_table(path).to_pylist()
    return load_jsonl(path)


def load_rows(
    data_path: str | os.PathLike | None, dataset: Sequence[Mapping[str, Any]] | None, default_file: str
) -> Sequence[Mapping[str, Any]]:
    """Task rows from ``dataset``, else the file ``data_path`` (JSON Lines or Parquet), else the shipped
    ``default_file``."""
    if data_path is not None and dataset is not None:
        raise ValueError("Pass data_path or dataset, not both.")
    if dataset is not None:
        return dataset
    if data_path is None:
        data_path = resources.files("treerl.envs") / "data" / default_file
    return read_rows(data_path)


class MathVerifyEnv(ToolEnv):
    """Single-turn math: answer in \\boxed{}, checked by math-verify against the gold answer.

    Args:
        data_path: A JSONL file with one problem per line (or a Parquet file, one per row).
        dataset: Rows (dicts or a ``datasets.Dataset``) instead of a file.
        prompt_key: The column holding the problem text (``prompt``, TRL's name, when there is no
            ``question`` column); a list of messages (TRL's conversational format) is used as such, and
            a system message at its start replaces the environment's system prompt.
            The row's other columns reach reward functions as keyword arguments.
        answer_key: The column holding the gold answer.
    """

    description = "Single-turn math answered in \\boxed{}, graded by math-verify (local JSONL or in-memory dataset)."
    system_prompt = "Solve the problem. Put the final answer in \\boxed{}."

    def __init__(
        self,
        *,
        data_path: str | os.PathLike | None = None,
        dataset: Sequence[Mapping[str, Any]] | None = None,
        prompt_key: str = "question",
        answer_key: str = "answer",
        **kwargs: Any,
    ):
        dataset = load_rows(data_path, dataset, "math_sample.jsonl")
        rows = [self._row(r, prompt_key, answer_key, i) for i, r in enumerate(dataset)]
        kwargs.setdefault("max_turns", 1)
        super().__init__(dataset=rows, **kwargs)

    @staticmethod
    def _row(row: Mapping[str, Any], prompt_key: str, answer_key: str, index: int) -> Task:
        if prompt_key == "question" and "question" not in row and "prompt" in row:
            prompt_key = "prompt"  # TRL's column name
        missing = [k for k in (prompt_key, answer_key) if k not in row]
        if missing:
            raise ValueError(
                f"Row {index} has no {missing} column (columns: {sorted(row)}): pass prompt_key=/answer_key= to match."
            )
        prompt = row[prompt_key]
        if isinstance(prompt, list):  # TRL's conversational format: the messages themselves
            if not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt):
                raise ValueError(f"Row {index}: {prompt_key!r} is a list but not of messages ({{'role', 'content'}} "
                                 "dicts); give a string or a list of messages.")
            prompt = [dict(m) for m in prompt]  # a leading system message replaces the environment's
        else:
            prompt = str(prompt)
        extra = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        return Task(prompt=prompt, answer=str(row[answer_key]), id=str(row.get("id", index)),
                    info={"row": extra} if extra else {})

    def score(self, task: Task, completion: str) -> float:
        return math_verify_reward(completion, task.answer)

    def gold_actions(self, task: Task) -> list[str]:
        return [f"The answer is \\boxed{{{task.answer}}}."]
