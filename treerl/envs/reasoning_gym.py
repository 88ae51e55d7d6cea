"""reasoning-gym's procedural tasks played by treerl: ``ReasoningGymEnv`` poses the entries of one
procedural dataset as single-turn questions and grades them with the dataset's own scorer.

A reasoning-gym dataset (``reasoning_gym.create_dataset(name, size=..., seed=..., **config)``) is a
sequence of ``size`` entries, entry ``i`` generated from ``seed`` and ``i`` alone: a dict with the
``question``, the gold ``answer`` and ``metadata``; ``dataset.score_answer(answer, entry)`` grades an
answer in [0, 1] (many tasks have more than one right answer, so the scorer, not a comparison with
``answer``, decides). Here, as reasoning-gym's own TRL and verl examples do:

* ``reset`` draws entry ``i`` (``options["task_index"]``, else by the seed) and poses its question
  under a system prompt asking for the answer in ``<answer>...</answer>`` tags;
* the completion is the final answer: its last ``<answer>`` tag's text (stripped; ``None`` when
  there is none) is scored by ``score_answer``, and that score is the reward;
* ``info["metrics"]["rg/answered"]`` is 1 when the completion had an ``<answer>`` tag, so a run can
  tell a wrong answer from one the scorer never saw; a scorer that raises on the model's answer
  scores 0 and counts ``rg/score_error`` (a bad answer is data, not a crash); both are the
  episode's :meth:`episode_metrics`, so ``treerl learn`` logs them per step as ``env/answered`` and
  ``env/score_error``;
* ``fork()`` shares the generator (entries are made on demand, and read-only).

``reasoning_gym`` is imported only when a dataset is named (``pip install 'treerl[reasoning-gym]'``); a
generator object (anything with ``__len__``, ``__getitem__`` and ``score_answer``) needs nothing.

>>> class Doubles:  # a ProceduralDataset's interface, without the package
...     def __len__(self):
...         return 10
...     def __getitem__(self, i):
...         return {"question": f"What is 2 * {i}?", "answer": str(2 * i), "metadata": {}}
...     def score_answer(self, answer, entry):
...         return float(answer == entry["answer"])
>>> env = ReasoningGymEnv(generator=Doubles())
>>> env.reset(options={"task_index": 3})[0][-1]
{'role': 'user', 'content': 'What is 2 * 3?'}
>>> env.step("2 * 3 is <answer>6</answer>")[1:3]
(1.0, True)

From the command line, ``--env rg/<name>`` plays reasoning-gym's dataset ``<name>``; ``--env-kwargs``
are its configuration (``size``, ``seed``, and the dataset's own fields)::

    treerl learn --env rg/leg_counting --env-kwargs '{"size": 500, "seed": 1}' --output-dir runs/legs
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from treerl.envs.core import Task, ToolEnv
from treerl.errors import MissingExtraError

__all__ = ["ReasoningGymEnv", "NAMESPACE", "SYSTEM_PROMPT", "extract_answer", "import_reasoning_gym"]

NAMESPACE = "rg/"
"""``treerl.make("rg/<name>")`` (and ``--env rg/<name>``) is reasoning-gym's dataset ``<name>``."""

SYSTEM_PROMPT = (
    "Given a problem, your task is to answer the question by thinking step-by-step in a clear and specific manner.\n"
    "Once you have thought about the reasoning process, provide the answer in the following format:\n"
    "<answer>answer here</answer>\n"
    "Do not explain your reasoning inside the answer tags, provide only the final answer. When an example is "
    "provided, you should strictly follow the format of the output/answer in that example.\n"
)
"""reasoning-gym's ``SYSTEM_PROMPTS["default"]``, word for word: its datasets' questions and scorers
are written for answers given this way."""

_ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def extract_answer(completion: str) -> str | None:
    """The text of the last ``<answer>...</answer>`` in ``completion``, stripped, or ``None``:
    what ``reasoning_gym.utils.extract_answer`` reads.

    >>> extract_answer("<answer>1</answer> then <answer> 42 </answer>"), extract_answer("42")
    ('42', None)
    """
    matches = _ANSWER.findall(completion)
    return matches[-1].strip() if matches else None


def import_reasoning_gym():
    """The ``reasoning_gym`` module, or an ImportError that says which extra to install."""
    try:
        import reasoning_gym
    except ImportError as error:
        raise MissingExtraError(
            "reasoning-gym datasets named by id need the reasoning-gym package, an optional dependency: "
            "pip install 'treerl[reasoning-gym]' (or pass ReasoningGymEnv a generator object)."
        ) from error
    return reasoning_gym


class ReasoningGymEnv(ToolEnv):
    """One reasoning-gym procedural dataset, as a single-turn environment (see the module docstring).

    Args:
        dataset_name: The dataset's reasoning-gym name (``"leg_counting"``, ``"basic_arithmetic"``, ...),
            built with ``reasoning_gym.create_dataset(dataset_name, size=size, seed=seed, **config)``.
        generator: A dataset object instead (a ``ProceduralDataset``, or anything with ``__len__``,
            ``__getitem__`` giving ``question``/``answer``/``metadata`` entries, and ``score_answer``).
        size: How many entries the dataset has (reasoning-gym's ``size``).
        seed: The seed the entries are generated from (reasoning-gym's ``seed``). Fixed by default,
            where reasoning-gym draws a new one per process: each process of a run, and a resumed
            run, must pose the same task ``i``.
        max_turns: Turns per episode; the first completion is the answer, so 1 is enough.
        **config: The dataset's other configuration fields (e.g. ``min_animals`` of leg_counting).
    """

    description = "A reasoning-gym procedural dataset (rg/<name>), answered in <answer> tags, scored by its scorer."
    system_prompt = SYSTEM_PROMPT
    fork_shares = ("dataset", "generator")

    def __init__(self, dataset_name: str | None = None, *, generator: Any = None, size: int = 500, seed: int = 0,
                 max_turns: int = 1, parser: Any = None, system_prompt: str | None = None,
                 parse_timeout_s: float = 10.0, score_timeout_s: float | None = 60.0,
                 render_mode: str | None = None, **config: Any):
        if (dataset_name is None) == (generator is None):
            raise ValueError("ReasoningGymEnv needs one dataset: its reasoning-gym name (e.g. 'leg_counting') or a "
                             "generator object, not both.")
        if dataset_name is not None:
            generator = _create(dataset_name, size=size, seed=seed, **config)
        elif config:
            raise ValueError(f"{sorted(config)} configure a dataset built by name: a generator object comes "
                             "configured.")
        self.name = dataset_name or type(generator).__name__
        self.generator = generator
        """The procedural dataset: it makes the entries and scores the answers."""
        if len(generator) == 0:
            raise ValueError(f"{self.name} has no entries (size=0): ReasoningGymEnv needs at least one task.")
        super().__init__(dataset=_Entries(generator), max_turns=max_turns, parser=parser, system_prompt=system_prompt,
                         parse_timeout_s=parse_timeout_s, score_timeout_s=score_timeout_s, render_mode=render_mode)

    def score(self, task: Task, completion: str) -> float:
        answer = extract_answer(completion)
        self.metrics["rg/answered"] = int(answer is not None)
        try:
            return float(self.generator.score_answer(answer, entry=task.info["entry"]))
        except Exception:  # noqa: BLE001 - the model's answer reaches third-party scorers: a bad one is data
            self.metrics["rg/score_error"] = 1
            return 0.0

    def episode_metrics(self) -> dict[str, int]:
        """``answered`` and ``score_error`` (logged as ``env/answered`` and ``env/score_error``)."""
        return {"answered": self.metrics.get("rg/answered", 0), "score_error": self.metrics.get("rg/score_error", 0)}

    def gold_actions(self, task: Task) -> list[str]:
        return [f"<answer>{task.answer}</answer>"]

    def answer_feedback(self, task: Task, completion: str, reward: float) -> str | None:
        if extract_answer(completion) is None:
            return "The reply had no <answer>...</answer> tag, so no answer was scored."
        return super().answer_feedback(task, completion, reward)


class _Entries:
    """The generator's entries as tasks, each made when it is drawn (entry ``i`` depends on the seed and ``i``)."""

    def __init__(self, generator: Any):
        self.generator = generator

    def __len__(self) -> int:
        return len(self.generator)

    def __getitem__(self, index: int) -> Task:
        entry = self.generator[index]
        return Task(prompt=str(entry["question"]), answer=entry.get("answer"), info={"entry": entry}, id=str(index))


def _create(name: str, **config: Any) -> Any:
    """``reasoning_gym.create_dataset(name, **config)``; the errors list the names, or the fields."""
    reasoning_gym = import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        import difflib

        close = difflib.get_close_matches(name, list(DATASETS), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise LookupError(f"reasoning-gym has no dataset {name!r}.{hint} Its datasets: {sorted(DATASETS)}.")
    fields = [f.name for f in dataclasses.fields(DATASETS[name][1])]
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise TypeError(f"{', '.join(map(repr, unknown))} is no field of reasoning-gym's {name} configuration "
                        f"({DATASETS[name][1].__name__}); its fields: {fields}.")
    return reasoning_gym.create_dataset(name, **config)

