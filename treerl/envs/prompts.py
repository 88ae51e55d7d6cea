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

With ``environment_factory`` (TRL's argument of that name) every episode plays an environment
object of the user's own: a fresh one from the factory for each generation, never a copy of
another. Its ``reset(**row)`` is called with the row's columns, and the string it returns (if
any) is appended to the prompt's last message; its public methods (all but ``reset`` and
``get_reward``: :func:`environment_tools`) are the episode's tools, after ``tools``. A dict
``{name: factory}`` plays the factory that each row's ``environment`` column names (that column
is not passed to ``reset``), with only that environment's tools; a row without a prompt (a dataset that only
routes) opens with an empty user message, which ``reset``'s text follows, as in TRL. The generations of a row share
its prompt (GRPO's group), so their ``reset`` calls must return the same string; forking an
episode in play (branching) is refused, as the objects cannot be copied. The objects of a row's
generations are the row's ``environments`` column (:class:`EnvironmentInstances`), from which
``treerl.GRPOTrainer`` gives each reward function the object of each episode (TRL's
``environments`` argument).

>>> class Counter:
...     def reset(self, **row):
...         self.count = 0
...         return " Reach 3."
...     def increment(self, step: int) -> str:
...         '''Add to the counter.
...
...         Args:
...             step: How much to add.
...         '''
...         self.count += step
...         return str(self.count)
>>> env = PromptEnv(dataset=[{"prompt": "Count."}], environment_factory=Counter)
>>> obs, info = env.reset(seed=0)
>>> obs[-1]["content"], [t["function"]["name"] for t in info["tools"]]
('Count. Reach 3.', ['increment'])
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from treerl.envs.builtin.math_verify import RowTasks, check_rows, load_rows
from treerl.envs.core import Message, Task, ToolEnv
from treerl.envs.tools import Tool
from treerl.errors import EnvError

__all__ = ["PromptEnv", "EnvironmentInstances", "environment_tools"]

TOOL_TURNS = 10
"""Turns of an episode with tools unless ``max_turns`` says otherwise (TRL's default has no turn limit;
``max_episode_tokens`` bounds the episode too)."""

EMPTY_PROMPT: tuple[Message, ...] = ({"role": "user", "content": ""},)
"""TRL's prompt where an ``environment_factory``'s ``reset()`` gives it: an empty user message."""

EnvironmentFactory = Callable[[], Any]
"""TRL's: a callable (an environment class) that returns an object with ``reset(**row) -> str | None``."""


class PromptEnv(ToolEnv):
    """Prompts from rows; reward 0 (the learner's reward functions score); optional tools.

    Args:
        dataset: Rows (dicts, or a ``datasets.Dataset``) with a ``prompt`` column.
        data_path: A JSON Lines or Parquet file of such rows instead.
        prompt_key: The column holding the prompt: a string (sent as one user message) or a list of
            ``{"role", "content"}`` messages (a leading system message is the episode's system prompt). With
            an ``environment_factory`` a row may lack it (TRL's): the prompt is then an empty user message
            followed by what ``reset()`` returns.
        tools: Functions (or :class:`~treerl.envs.tools.Tool` objects) the model may call.
        max_turns: Assistant turns of an episode (default: 1 without tools, ``TOOL_TURNS`` with tools or
            an ``environment_factory``).
        environment_factory: TRL's: a callable (an environment class) that returns the object an episode
            plays, or a dict of them by name, picked by each row's ``environment`` column (see the
            module docstring).
        **kwargs: :class:`~treerl.envs.core.ToolEnv`'s (``system_prompt``, ``parser``, ...).
    """

    description = "Prompts from a dataset, scored only by reward functions (TRL's GRPOTrainer task)."
    max_reward = 0.0
    # The user's environment objects are never copied: fork() gives each generation a fresh one.
    fork_shares = ("dataset", "environment_factory", "environment", "_spare", "_instances")

    def __init__(self, *, dataset: Sequence[Mapping[str, Any]] | None = None,
                 data_path: str | os.PathLike | None = None, prompt_key: str = "prompt",
                 tools: Sequence[Callable[..., Any]] = (), max_turns: int | None = None,
                 environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory] | None = None,
                 **kwargs: Any):
        if dataset is None and data_path is None:
            raise ValueError("PromptEnv needs rows: pass dataset=[{'prompt': ...}, ...] or data_path='rows.jsonl'.")
        names = _factory_names(environment_factory)
        rows = load_rows(data_path, dataset, "")
        has_factory = environment_factory is not None
        check_rows(rows, functools.partial(_check_row, prompt_key=prompt_key, environments=names,
                                           has_factory=has_factory),
                   key=(PromptEnv, prompt_key, names, has_factory))
        tools = list(tools or ())
        multi_turn = bool(tools) or has_factory
        tasks = RowTasks(rows, functools.partial(_row_task, prompt_key=prompt_key, keep_row=has_factory))
        super().__init__(dataset=tasks, tools=tools,
                         max_turns=max_turns if max_turns is not None else (TOOL_TURNS if multi_turn else 1),
                         **kwargs)
        self.environment_factory = environment_factory
        self.environment: Any = None
        """The object this episode plays (with ``environment_factory``, once reset)."""
        self._standalone_tools = list(self._tools)
        self._spare: Any = None  # the object reset() made, until the first generation takes it
        self._instances: EnvironmentInstances | None = None
        self._reset_kwargs: dict[str, Any] = {}
        self._instruction: str | None = None

    def score(self, task: Task, completion: str) -> float:
        return 0.0  # no verifier: the reward functions score the episode

    def answer_feedback(self, task: Task, completion: str, reward: float) -> str | None:
        return None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        messages, info = super().reset(seed=seed, options=options)
        if self.environment_factory is None:
            return messages, info
        assert self.task is not None
        self._reset_kwargs = dict(self.task.info["columns"])
        if isinstance(self.environment_factory, Mapping):
            self._reset_kwargs.pop("environment")  # it picks the environment; TRL does not pass it to reset()
        instance = self._factory()()
        self._instruction = _reset(instance, self._reset_kwargs)
        # This object plays the first generation (TRL resets one object per rollout; a spare one per row
        # would start, say, a sandbox for nothing); fork() makes the others.
        self._spare = instance
        self._instances = EnvironmentInstances(type(instance).__name__)
        self._play(instance)
        if self._instruction is not None:
            messages[-1] = _appended(messages[-1], self._instruction)
            self.messages[-1] = _appended(self.messages[-1], self._instruction)
        info["tools"] = self.tool_schemas
        info["row"] = {**info.get("row", {}), "environments": self._instances}
        return messages, info

    def fork(self) -> PromptEnv:
        """Another generation of the row: with ``environment_factory``, on its own object from the factory,
        reset with the same row (the first takes the object :meth:`reset` made)."""
        if self.environment is None:
            return super().fork()  # type: ignore[return-value]
        if self.turn:
            raise EnvError("PromptEnv(environment_factory=...) cannot fork an episode in play: an environment object "
                           "cannot be copied (TRL has no branching); set branch_factor=1.")
        instance, self._spare = self._spare, None
        if instance is None:
            instance = self._factory()()
            instruction = _reset(instance, self._reset_kwargs)
            if instruction != self._instruction:
                raise EnvError(
                    f"{type(instance).__name__}.reset() returned {_shown(instruction)} for a generation of a row "
                    f"whose first generation it gave {_shown(self._instruction)}: the generations of a row share its "
                    "prompt here (GRPO's group; TRL prompts each rollout apart), so reset() must return the same "
                    "text for the same row. Draw the task from the row's columns (e.g. a seed column), not at "
                    "random in reset().")
        assert self._instances is not None
        self._instances.instances.append(instance)
        clone = super().fork()
        assert isinstance(clone, PromptEnv)
        clone._play(instance)
        return clone

    def _factory(self) -> EnvironmentFactory:
        """The factory of this row's environment."""
        factory = self.environment_factory
        if isinstance(factory, Mapping):
            assert self.task is not None
            return factory[self.task.info["columns"]["environment"]]
        assert factory is not None
        return factory

    def _play(self, instance: Any) -> None:
        """Play ``instance``: its methods become the episode's tools, after the ``tools`` given."""
        self.environment = instance
        self._tools = [*self._standalone_tools, *environment_tools(instance)]
        names = [t.name for t in self._tools]
        if len(set(names)) != len(names):
            raise ValueError(f"Tool names must be unique, got {names}: a method of {type(instance).__name__} has the "
                             "name of a function in tools=; rename one.")
        self._tool_map = {t.name: t for t in self._tools}


class EnvironmentInstances(str):
    """The environment objects of a row's generations, in generation order (``instances``): the row's
    ``environments`` column when :class:`PromptEnv` plays an ``environment_factory``.

    A string (the environment's class name) wherever the row is written, copied or pickled; the objects
    travel only with the row itself, to the reward functions.
    """

    instances: list[Any]

    def __new__(cls, name: str) -> EnvironmentInstances:
        self = super().__new__(cls, name)
        self.instances = []
        return self

    def __copy__(self) -> EnvironmentInstances:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> EnvironmentInstances:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return str, (str(self),)


def environment_tools(environment: Any) -> list[Tool]:
    """The tools of a TRL environment object: the public functions of its class but ``reset`` and
    ``get_reward``, bound to it (TRL's rule: properties and class methods are not tools)."""
    return [Tool(getattr(environment, name)) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def _factory_names(factory: Any) -> tuple[str, ...] | None:
    """The names a dict ``environment_factory`` routes rows by (None for one factory); a bad one is refused."""
    if not isinstance(factory, Mapping):
        if factory is not None and not callable(factory):
            raise ValueError(f"environment_factory={factory!r} is not callable: give a class (or a function) that "
                             "returns an environment object, or a dict of them by name.")
        return None
    if not factory:
        raise ValueError("environment_factory is an empty dict: map at least one name to a factory.")
    for name, value in factory.items():
        if not isinstance(name, str) or not callable(value):
            raise ValueError(f"environment_factory[{name!r}] = {value!r}: map names (str) to factories (classes or "
                             "functions that return an environment object).")
    return tuple(factory)


def _reset(environment: Any, row: Mapping[str, Any]) -> str | None:
    """``environment.reset(**row)``, TRL's call: the text to append to the prompt, or None."""
    text = environment.reset(**row)
    if text is not None and not isinstance(text, str):
        raise EnvError(f"{type(environment).__name__}.reset() returned {type(text).__name__}: return a string "
                       "(appended to the prompt's last message) or None.")
    return text


def _appended(message: Message, text: str) -> Message:
    """``message`` with ``text`` after its content, as TRL appends reset's text (no separator)."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: one more text part
        return {**message, "content": [*content, {"type": "text", "text": text}]}
    return {**message, "content": (content or "") + text}


def _shown(text: str | None) -> str:
    return "None" if text is None else repr(text if len(text) <= 60 else text[:57] + "...")


def _check_row(row: Mapping[str, Any], index: int, *, prompt_key: str,
               environments: Collection[str] | None = None, has_factory: bool = False) -> None:
    if environments is not None and row.get("environment") not in environments:
        found = f"environment={row['environment']!r}" if "environment" in row else "no 'environment' column"
        raise ValueError(f"Row {index} has {found}: with a dict environment_factory every row names its environment, "
                         f"one of {list(environments)}.")
    if prompt_key not in row and has_factory:  # TRL's: the environment's reset() gives the prompt
        return
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


def _row_task(row: Mapping[str, Any], index: int, *, prompt_key: str, keep_row: bool = False) -> Task:
    _check_row(row, index, prompt_key=prompt_key, has_factory=keep_row)
    # With an environment_factory a row may have no prompt (a dataset that only routes, by its 'environment'
    # column): TRL's placeholder, an empty user message, which reset()'s text then follows (and which is not
    # one of the columns passed to reset()).
    prompt = row[prompt_key] if prompt_key in row else [dict(m) for m in EMPTY_PROMPT]
    prompt = [dict(m) for m in prompt] if isinstance(prompt, list) else prompt
    # Every other column reaches reward functions, as TRL passes them (answer as ``answer``).
    extra = {k: v for k, v in row.items() if k not in (prompt_key, "answer")}
    info: dict[str, Any] = {"row": extra} if extra else {}
    if keep_row:  # the whole row, prompt included, is what TRL passes to an environment's reset()
        info["columns"] = dict(row)
    return Task(prompt=prompt, answer=row.get("answer"), id=str(index), info=info)
