"""SkyRL-Gym environments played by treerl: ``SkyRLEnv`` wraps one SkyRL-Gym text environment and
a dataset in SkyRL's row format.

A SkyRL-Gym environment (``skyrl_gym.envs.base_text_env.BaseTextEnv``) is built per episode from
one dataset row, as SkyRL's generator builds it: ``make(env_class, env_config=..., extras=row)``,
where ``extras`` is the row without its ``prompt`` and ``env_class`` columns (``reward_spec``,
``extra_info``, ``data_source``, ...); ``init(prompt)`` gives the opening messages, and each
``step(completion)`` returns ``observations`` (new chat messages), ``reward``, ``done`` and
``metadata``. Here:

* ``reset`` draws the row (``options["task_index"]``, ``options["task"]``, else by the seed), builds
  the environment and returns ``init``'s messages; ``info`` holds the row's extras (``row``), the
  gold answer (``reward_spec["ground_truth"]``) and ``init``'s metadata;
* ``step`` returns the observations, the reward, ``terminated=done``, and ``truncated`` when
  ``max_turns`` (if set) steps passed without ``done``; ``info["metadata"]`` is the step's
  metadata;
* ``episode_metrics()`` is the numbers of the steps' metadata (a later step's value of a key
  replacing an earlier one's) with those of ``get_metrics()``: the engine records them as the
  episode's ``metrics["env/<key>"]`` and ``treerl learn`` logs their means (SkyRL's default
  aggregation: numbers averaged over the episodes that have them, the rest dropped);
* the environment parses the completion itself (SkyRL's ``<search>``, ``<sql>``, ``####``):
  treerl offers no tools and parses no tool calls;
* ``fork()`` deep-copies the SkyRL environment with the rest (the rows are shared).

``skyrl_gym`` is imported only when an environment is named by its SkyRL-Gym id (``pip install
'treerl[skyrl]'``); a class (or any function taking ``env_config`` and ``extras``) needs nothing.

>>> class Echo:  # BaseTextEnv's interface, without the package
...     def __init__(self, env_config=None, extras={}):
...         self.gold = extras["reward_spec"]["ground_truth"]
...     def init(self, prompt):
...         return prompt, {}
...     def step(self, action):
...         return {"observations": [], "reward": float(action == self.gold), "done": True, "metadata": {}}
>>> rows = [{"prompt": [{"role": "user", "content": "Say hi."}], "env_class": "echo",
...          "reward_spec": {"method": "rule", "ground_truth": "hi"}}]
>>> env = SkyRLEnv(Echo, dataset=rows)
>>> env.reset(seed=0)[0]
[{'role': 'user', 'content': 'Say hi.'}]
>>> env.step("hi")[1:3]
(1.0, True)

From the command line, ``--env skyrl/<id>`` plays SkyRL-Gym's environment ``<id>`` (its built-ins,
or one a module given with ``--import`` registers with ``skyrl_gym.register``)::

    treerl learn --env skyrl/gsm8k --env-kwargs '{"data_path": "train.parquet"}' --output-dir runs/gsm8k
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import Any

from treerl.envs.core import Env, Message
from treerl.errors import ConfigError, EnvError, MissingExtraError

__all__ = ["SkyRLEnv", "NAMESPACE", "import_skyrl_gym"]

NAMESPACE = "skyrl/"
"""``treerl.make("skyrl/<id>")`` (and ``--env skyrl/<id>``) is SkyRL-Gym's environment ``<id>``."""


def import_skyrl_gym():
    """The ``skyrl_gym`` module, or an ImportError that says which extra to install."""
    try:
        import skyrl_gym
    except ImportError as error:
        raise MissingExtraError(
            "SkyRL-Gym environments named by id need the skyrl-gym package, an optional dependency: "
            "pip install 'treerl[skyrl]' (or pass SkyRLEnv the environment's class)."
        ) from error
    return skyrl_gym


class SkyRLEnv(Env):
    """A SkyRL-Gym text environment and its dataset, as a treerl environment (see the module docstring).

    Args:
        env_class: The SkyRL-Gym environment: its registered id (``"gsm8k"``, built with
            ``skyrl_gym.make``), or its class or a function taking ``env_config`` and ``extras``.
        data_path: The dataset, JSON Lines or Parquet, in SkyRL's row format (``prompt`` messages,
            ``env_class``, ``reward_spec``, ``extra_info``, ...).
        dataset: The rows themselves instead (dicts, or a ``datasets.Dataset``).
        env_config: The environment's configuration (SkyRL's ``environment.skyrl_gym.<env_class>``,
            e.g. ``{"search_url": ..., "topk": 3}``), given as an OmegaConf ``DictConfig`` where
            omegaconf is installed (it comes with skyrl-gym), else as a dict.
        max_turns: Put into every row's extras as ``max_turns`` (SkyRL's generator does so with
            ``generator.max_turns``; multi-turn environments read it), and the episode is truncated
            after that many steps without ``done``. ``None``: the environment's own limit.
        prompt_key: The column of the opening messages (a list of chat messages, or a string: one
            user message).
        env_class_key: The column naming each row's environment: a row naming another than
            ``env_class`` is refused (mix environments with ``--env skyrl/a,skyrl/b``, an EnvGroup).
    """

    description = "A SkyRL-Gym text environment (skyrl/<id>) on a dataset in SkyRL's format."

    def __init__(self, env_class: str | Callable[..., Any], *, data_path: str | os.PathLike | None = None,
                 dataset: Sequence[Mapping[str, Any]] | None = None, env_config: Mapping[str, Any] | None = None,
                 max_turns: int | None = None, prompt_key: str = "prompt", env_class_key: str = "env_class",
                 render_mode: str | None = None):
        from treerl.envs.builtin.math_verify import check_rows, read_rows

        super().__init__(render_mode=render_mode)
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"max_turns={max_turns!r} must be a whole number >= 1 (or None: the environment's own "
                             "limit), e.g. --env-kwargs '{\"max_turns\": 5}'.")
        if (data_path is None) == (dataset is None):
            raise ConfigError("SkyRLEnv needs its tasks: pass data_path (a JSON Lines or Parquet file of SkyRL-format "
                             "rows) or dataset (the rows), not both, e.g. --env-kwargs '{\"data_path\": "
                             "\"train.parquet\"}'.")
        if isinstance(env_class, str):
            skyrl_gym = import_skyrl_gym()
            if env_class not in skyrl_gym.registry:
                import difflib

                close = difflib.get_close_matches(env_class, list(skyrl_gym.registry), n=3, cutoff=0.5)
                hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise LookupError(f"SkyRL-Gym has no environment {env_class!r}.{hint} Its environments: "
                                  f"{sorted(skyrl_gym.registry)}; register yours with skyrl_gym.register in a "
                                  "module given with --import.")
            self.name = env_class
        elif callable(env_class):
            self.name = getattr(env_class, "__name__", type(env_class).__name__)
        else:
            raise ValueError(f"env_class={env_class!r} must be a SkyRL-Gym id (e.g. 'gsm8k') or an environment class.")
        self.env_class = env_class
        self.dataset = read_rows(data_path) if data_path is not None else dataset
        """The rows, read-only (each reset copies its row's extras)."""
        self.where = os.fspath(data_path) if data_path is not None else "dataset"
        if len(self.dataset) == 0:
            raise ValueError(f"{self.where} has no rows: SkyRLEnv needs at least one task.")
        self.prompt_key, self.env_class_key = prompt_key, env_class_key
        check_rows(self.dataset, self._check_row)
        self.env_config = _as_config(env_config)
        self.max_turns = max_turns
        self.env: Any = None
        """The SkyRL-Gym environment of the current episode (None before the first reset)."""
        self.turn, self.done = 0, False
        self.metadata_numbers: dict[str, float] = {}
        """The numbers of the episode's step metadata so far, by key (a later step's replacing an earlier one's)."""

    def _check_row(self, row: Mapping[str, Any], index: int) -> None:
        if not isinstance(row, Mapping) or self.prompt_key not in row:
            found = f"keys {sorted(row)}" if isinstance(row, Mapping) else type(row).__name__
            raise ValueError(f"{self.where}: row {index} has no {self.prompt_key!r} column ({found}): SkyRL's rows "
                             "hold the opening chat messages there (prompt_key= names another column).")
        named = row.get(self.env_class_key)
        if isinstance(self.env_class, str) and named is not None and named != self.env_class:
            raise ValueError(f"{self.where}: row {index} has {self.env_class_key}={named!r}, but this environment "
                             f"plays {self.env_class!r}: train a mixed dataset on a group, e.g. --env "
                             f"{NAMESPACE}{self.env_class},{NAMESPACE}{named} --env-kwargs "
                             "'{\"data_path\": ...}' (each row plays the environment it names).")

    # -- Gymnasium API ---------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        self.close()
        row, index = self._row(options)
        extras = copy.deepcopy({k: v for k, v in row.items() if k not in (self.prompt_key, self.env_class_key)})
        if self.max_turns is not None:
            extras["max_turns"] = self.max_turns
        self.env = self._build(extras, index)
        prompt = row[self.prompt_key]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else copy.deepcopy(list(prompt))
        opening, metadata = self.env.init(prompt)
        messages = self._messages(opening, "init()")
        if not messages:
            raise EnvError(f"{self.name}.init() returned no messages for {self._where(index)}: the opening "
                           "messages are the model's prompt.")
        self.messages = copy.deepcopy(messages)
        self.turn, self.done = 0, False
        self.metadata_numbers = {}
        reward_spec = extras.get("reward_spec")
        info = {
            "task_id": None if index is None else str(index),
            "answer": copy.deepcopy(reward_spec.get("ground_truth")) if isinstance(reward_spec, Mapping) else None,
            "row": copy.deepcopy(extras),
            "metadata": dict(metadata or {}),
        }
        return messages, info

    def step(self, action: str):
        if self.env is None or self.done:
            raise EnvError("step() called on a finished or never-reset episode: call reset() first.")
        out = self.env.step(action)
        if not isinstance(out, Mapping) or not {"observations", "reward", "done"} <= set(out):
            raise EnvError(f"{self.name}.step() returned {repr(out)[:80]}: a SkyRL-Gym step returns "
                           "BaseTextEnvStepOutput(observations=[...], reward=..., done=..., metadata={...}).")
        reward = out["reward"]
        if isinstance(reward, Real) and not isinstance(reward, bool):  # gsm8k scores a missing answer as int 0
            reward = float(reward)
        obs = self._messages(out["observations"] or [], "step()")
        self.turn += 1
        terminated = bool(out["done"])
        truncated = not terminated and self.max_turns is not None and self.turn >= self.max_turns
        self.done = terminated or truncated
        # The sampled tokens stay what the model wrote (a tree records them); a rewrite is only noted.
        written = out.get("postprocessed_action")
        self.messages += [{"role": "assistant", "content": action if written is None else written}, *obs]
        metadata = dict(out.get("metadata") or {})
        self.metadata_numbers.update(_numbers(metadata))
        info = {"turn": self.turn, "metadata": metadata, "metrics": {"turns": self.turn},
                "termination": "max_turns" if truncated else None}
        if written is not None:
            info["postprocessed_action"] = written
        return [dict(m) for m in obs], reward, terminated, truncated, info

    def episode_metrics(self) -> dict[str, float]:
        """The numbers of the steps' metadata and of the SkyRL environment's ``get_metrics()`` (SkyRL's generator
        asks it when the trajectory ends, however it ended)."""
        get_metrics = getattr(self.env, "get_metrics", None)
        return {**self.metadata_numbers, **_numbers(get_metrics() if callable(get_metrics) else {})}

    def close(self) -> None:
        if self.env is not None:
            env, self.env = self.env, None
            close = getattr(env, "close", None)
            if callable(close):
                close()

    # -- helpers ---------------------------------------------------------------------------
    def _row(self, options: Mapping[str, Any]) -> tuple[Mapping[str, Any], int | None]:
        if "task" in options:
            row = options["task"]
            self._check_row(row, 0)
            return row, None
        index = options.get("task_index")
        if index is None:
            index = int(self.np_random.integers(len(self.dataset)))
        if not 0 <= index < len(self.dataset):
            raise EnvError(f"task_index={index} is out of range: {self.where} has {len(self.dataset)} rows.")
        return self.dataset[index], index

    def _build(self, extras: dict[str, Any], index: int | None) -> Any:
        """The SkyRL-Gym environment of one row, built as SkyRL's generator builds it."""
        try:
            if isinstance(self.env_class, str):
                return import_skyrl_gym().make(self.env_class, env_config=self.env_config, extras=extras)
            return self.env_class(env_config=self.env_config, extras=extras)
        except Exception as exc:  # noqa: BLE001 - SkyRL's envs check their extras with assert
            raise EnvError(f"{self.name} cannot be built from {self._where(index)}: {type(exc).__name__}: {exc} "
                           f"(its extras: {sorted(extras)}; env_config: {dict(self.env_config or {})})") from exc

    def _where(self, index: int | None) -> str:
        return "the task in reset(options)" if index is None else f"{self.where} row {index}"

    def _messages(self, messages: Any, where: str) -> list[Message]:
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
            raise EnvError(f"{self.name}.{where} returned {repr(messages)[:80]}: SkyRL-Gym environments return "
                           "chat messages, [{'role': ..., 'content': ...}].")
        return [dict(m) for m in messages]


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of SkyRL metadata or metrics (bools as 0/1), as SkyRL's default aggregation keeps the
    numbers and drops the rest."""
    return {str(k): float(v) for k, v in values.items() if isinstance(v, Real)}


def _as_config(env_config: Mapping[str, Any] | None) -> Any:
    """``env_config`` as SkyRL's environments read it: a ``DictConfig`` (attribute access) where omegaconf is
    installed, else a dict."""
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return dict(env_config or {})
    return OmegaConf.create(dict(env_config or {}))
