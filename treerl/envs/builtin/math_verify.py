"""``treerl/MathVerify-v0``: single-turn math, graded by math-verify.

Tasks come from a local JSONL file (``data_path``), an in-memory dataset (``dataset``: a
``datasets.Dataset`` or a list of dicts), or the small sample that ships with treerl.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from typing import Any, overload

from treerl.envs.cache import Recent
from treerl.envs.core import Task, ToolEnv
from treerl.envs.verifiers import math_verify_reward

__all__ = ["MathVerifyEnv", "RowTasks", "check_rows", "file_version", "load_jsonl", "load_rows", "read_rows"]


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


_READ = Recent(4)  # the rows of the files read last


def file_version(path: str | os.PathLike) -> tuple[str, int, int]:
    """What names one version of a file: its real path, size and modification time."""
    stat = os.stat(path)
    return os.path.realpath(path), stat.st_size, stat.st_mtime_ns


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSON Lines file, or of a Parquet file (``.parquet``, read with pyarrow).

    Read once per version of the file (:func:`file_version`) and shared by every caller after: a
    training run builds an environment per task, and a dataset of 100,000 rows takes seconds to
    parse. The rows are read-only (environments copy a task as they draw it).
    """
    return _READ.get_or_put(file_version(path), lambda: _read_rows(path))


def _read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
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
    ``default_file``. A ``dataset`` without ``len`` and indexing (a generator, a streamed
    ``datasets.IterableDataset``) is read into a list once."""
    if data_path is not None and dataset is not None:
        raise ValueError("Pass data_path or dataset, not both.")
    if dataset is not None:
        return dataset if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__") else list(dataset)
    if data_path is None:
        data_path = resources.files("treerl.envs") / "data" / default_file
    return read_rows(data_path)


class RowTasks(Sequence[Task]):
    """The tasks of a dataset's rows, each made (``convert(row, index)``) when it is drawn.

    An environment is built for every task of a run; converting every row of a large dataset
    each time cost as much as the episode. Check the rows when building (cheaply), then wrap them.

    >>> tasks = RowTasks([{"q": "1+1"}, {"q": "2+2"}], lambda row, i: Task(prompt=row["q"], id=str(i)))
    >>> len(tasks), tasks[1].prompt, tasks[-1].id, [t.id for t in tasks[:1]]
    (2, '2+2', '1', ['0'])
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]], convert: Callable[[Mapping[str, Any], int], Task]):
        self.rows, self.convert = rows, convert

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, index: int) -> Task: ...
    @overload
    def __getitem__(self, index: slice) -> list[Task]: ...
    def __getitem__(self, index: int | slice) -> Task | list[Task]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"task {index} of {len(self)}")
        index %= len(self)
        return self.convert(self.rows[index], index)


_CHECKED = Recent(16)  # (id of rows, what was checked) -> the rows (held: their id stays theirs)


def check_rows(rows: Sequence[Mapping[str, Any]], check: Callable[[Mapping[str, Any], int], Any],
               key: Any = None) -> None:
    """``check(row, index)`` on every row (it raises for a bad one), or on the first row of a
    ``datasets.Dataset``, whose rows all have its columns. With ``key`` (what ``check`` checks, e.g.
    the columns), the same rows are checked once for it: the rows of a file, read once, are
    checked again for every environment built on them otherwise. A task is still checked as it
    is made (``RowTasks``), so rows changed after their check fail when drawn."""
    if key is not None and _CHECKED.get((id(rows), key)) is rows:
        return
    for index in range(min(len(rows), 1)) if hasattr(rows, "column_names") else range(len(rows)):
        check(rows[index], index)
    if key is not None:
        _CHECKED.put((id(rows), key), rows)


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
        check_rows(dataset, functools.partial(self._prompt_key, prompt_key=prompt_key, answer_key=answer_key),
                   key=(type(self), prompt_key, answer_key))
        rows = RowTasks(dataset, functools.partial(self._row, prompt_key=prompt_key, answer_key=answer_key))
        kwargs.setdefault("max_turns", 1)
        super().__init__(dataset=rows, **kwargs)

    @staticmethod
    def _prompt_key(row: Mapping[str, Any], index: int, *, prompt_key: str, answer_key: str) -> str:
        """The column holding ``row``'s prompt; raises when a column is missing or the prompt is not usable."""
        if prompt_key == "question" and "question" not in row and "prompt" in row:
            prompt_key = "prompt"  # TRL's column name
        missing = [k for k in (prompt_key, answer_key) if k not in row]
        if missing:
            raise ValueError(
                f"Row {index} has no {missing} column (columns: {sorted(row)}): pass prompt_key=/answer_key= to match."
            )
        prompt = row[prompt_key]
        if isinstance(prompt, list) and not all(isinstance(m, Mapping) and "role" in m and "content" in m
                                                for m in prompt):
            raise ValueError(f"Row {index}: {prompt_key!r} is a list but not of messages ({{'role', 'content'}} "
                             "dicts); give a string or a list of messages.")
        return prompt_key

    @classmethod
    def _row(cls, row: Mapping[str, Any], index: int, *, prompt_key: str, answer_key: str) -> Task:
        prompt_key = cls._prompt_key(row, index, prompt_key=prompt_key, answer_key=answer_key)
        prompt = row[prompt_key]
        if isinstance(prompt, list):  # TRL's conversational format: the messages themselves
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
