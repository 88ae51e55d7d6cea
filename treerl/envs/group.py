"""``EnvGroup``: one environment made of several, so that one policy trains on a mix of them.

Each ``reset`` picks one member and the whole episode is that member's: its prompt, tools,
parser, steps, reward and feedback. The engine resets once per task and forks the reset
environment for each generation, so every generation of a GRPO group plays the same member
on the same task. Which member a reset picks:

* ``options={"env": name}``, or ``options={"task": {..., "env": name}}``: that one (verifiers'
  task column, SkyRL-Gym's ``env_class``);
* else by the seed, along a fixed schedule that follows the weights in every stretch of seeds
  (equal weights: round-robin, seed ``k`` plays member ``k mod n``); a reset without a seed draws
  from ``self.np_random``. A group built on one mixed dataset (``order``: each row's member, in
  the file's order; :func:`treerl.envs.registry.make_group`'s ``data_path``) follows its rows
  instead: task ``k`` plays row ``k mod N``, on the member the row names.

The rollout engine asks :meth:`EnvGroup.task_options` which member plays task ``i`` (and which
row, for a dataset-backed member), so the members' datasets are played row after row. The
reset's ``info["env"]`` names the member; the engine records it with the group, and rollout,
eval and learn report each member's mean reward as ``reward/<name>``.

From the command line, ``--env`` takes several ids, comma-separated, each optionally named
(``calc=treerl/Calculator-v0``; default name: the id after its last ``/``); ``--env-kwargs``
then maps each name to its environment's keyword arguments, and ``weights`` to the mix
(:func:`treerl.envs.registry.make_group`).

>>> import treerl
>>> env = treerl.make("calc=treerl/Calculator-v0,guess=treerl/GuessNumber-v0")
>>> [env.route(k) for k in range(4)]
['calc', 'guess', 'calc', 'guess']
>>> _, info = env.reset(seed=1)
>>> info["env"], env.tool_schemas
('guess', [])
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from treerl.envs.core import Env, ValidationReport
from treerl.envs.task_order import shuffled_index, task_options
from treerl.envs.tools import Tool
from treerl.errors import EnvError

__all__ = ["EnvGroup", "member_name", "RESERVED_NAMES", "GROUP_KEYWORDS"]

GROUP_KEYWORDS = frozenset({"weights", "data_path", "dataset", "env_key"})
"""The keyword arguments of :func:`~treerl.envs.registry.make_group` that are the group's, not a member's."""

RESERVED_NAMES = GROUP_KEYWORDS | {"mean", "std", "success_rate", "zero_std_frac", "num_zero_std_groups",
                                   "env_mean", "env_std"}
"""Names a member cannot take: the group's own keywords, and ``reward/*`` metrics."""

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_MAX_PERIOD = 1000
"""Longest schedule of seeds: weights are followed to within 1/1000 of the tasks."""


def member_name(env_id: str) -> str:
    """The default name of an environment in a group: its id after the last ``/`` (and ``module:``).

    >>> member_name("treerl/Calculator-v0"), member_name("mypkg.envs:shop/Shop-v1")
    ('Calculator-v0', 'Shop-v1')
    """
    return env_id.rsplit(":", 1)[-1].rsplit("/", 1)[-1]


class EnvGroup(Env):
    """Several environments behind one: each reset routes to one member (see the module docstring).

    Args:
        envs: The members: a mapping from name to environment, or a sequence of environments
            (named by their registered id, :func:`member_name`, else their class).
        weights: How often each member is played: one number per member (in order) or a mapping
            from name to number; zero leaves a member to tasks that name it. Default: equal.
        member_kwargs: The keyword arguments each member was built with (by name), where the
            group built them (:func:`~treerl.envs.registry.make_group`): training's defaults
            for ToolEnv settings apply to a member only where these do not set them.
        order: The member of each task, in order, repeating: a mixed dataset's column of
            environment names, whose rows each member was given as its dataset, in the same order
            (:func:`~treerl.envs.registry.make_group`'s ``data_path``). Task ``k`` then plays row
            ``k mod len(order)``; the weights are the rows' shares. Not with ``weights``.
    """

    description = "Several environments behind one: each task plays one of them (by name, or by seed and weights)."

    def __init__(self, envs: Mapping[str, Env] | Sequence[Env], *,
                 weights: Mapping[str, float] | Sequence[float] | None = None,
                 member_kwargs: Mapping[str, Mapping[str, Any]] | None = None, order: Sequence[str] | None = None,
                 render_mode: str | None = None):
        super().__init__(render_mode=render_mode)
        if isinstance(envs, Mapping):
            members = dict(envs)
        else:
            members = {}
            for env in envs:
                spec = getattr(env, "spec", None)
                name = member_name(spec.id) if spec is not None else type(env).__name__
                if name in members:
                    raise ValueError(f"Two environments of the group are called {name!r}: pass a mapping "
                                     "{name: env} to name them.")
                members[name] = env
        if not members:
            raise ValueError("An EnvGroup needs at least one environment, e.g. EnvGroup({'calc': make(...)}).")
        for name, env in members.items():
            _check_name(name)
            if not isinstance(env, Env):
                raise ValueError(f"The group's {name!r} is a {type(env).__name__}, not a treerl Env: build it with "
                                 "treerl.make(id) or wrap a text game in treerl.envs.TextEnv.")
        self.envs: dict[str, Env] = members
        """The members, by name."""
        self.member_kwargs = {name: dict((member_kwargs or {}).get(name) or {}) for name in members}
        self._mixed = order is not None
        if order is None:
            self.weights = _weights(weights, list(members))
            self._schedule, self._counts = _schedule(list(self.weights.values()))
        else:
            self._schedule, self._counts = _given_schedule(order, list(members), weights)
            self.weights = {name: n / len(self._schedule) for name, n in zip(members, self._counts)}
        """Each member's share of the tasks (summing to 1)."""
        self._ordinal = _ordinals(self._schedule)
        self.current: str | None = None
        """The member the last reset picked (None before the first)."""
        self._borrowed: set[str] = set()
        """Members a fork still shares with its original, forked when first used (see :meth:`fork`)."""

    # -- routing -------------------------------------------------------------------------------
    def route(self, k: int) -> str:
        """The member that task (or seed) ``k`` plays, along the weighted schedule."""
        return list(self.envs)[self._schedule[k % len(self._schedule)]]

    def task_options(self, index: int, shuffle_seed: int | None = None, batch_size: int = 1) -> dict[str, Any]:
        """Reset options of task ``index``: its member, and for a dataset-backed member the next of its rows
        (the member's own ``task_options`` where it has one). With ``shuffle_seed`` (see
        :mod:`~treerl.envs.task_order`) a mixed dataset's rows (``order``) play in a new order each pass over
        them, whole batches of ``batch_size`` (a step's tasks) as TRL's sampler, and each member's own rows
        likewise over the member's passes."""
        period = len(self._schedule)
        mixed = self._mixed and shuffle_seed is not None
        if mixed:  # the rows set the mix: shuffle the tasks, each a row
            index = shuffled_index(index, period, shuffle_seed, batch_size)
        name = self.route(index)
        member = self.envs[name]
        j = list(self.envs).index(name)
        local = (index // period) * self._counts[j] + self._ordinal[index % period]  # how many earlier tasks it had
        # The member's task ``local``: a mixed dataset's rows are shuffled above, a member's own over its passes.
        own = task_options(member, local, None if mixed else shuffle_seed) or {}
        return {"env": name, **own}

    def num_rows(self) -> int | None:
        """The rows of the group's mixed dataset (``order``), which one pass plays each once; None for a group
        mixed by weights, whose members' rows make no one dataset to pass over."""
        return len(self._schedule) if self._mixed else None

    def num_distinct_tasks(self) -> int | None:
        """How many tasks :meth:`task_options` gives before a dataset-backed member plays one of its rows a
        second time (a mixed dataset's number of rows); None when no member plays a dataset.

        >>> import treerl
        >>> rows = [{"question": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(3)]
        >>> env = EnvGroup({"calc": treerl.make("treerl/Calculator-v0"),
        ...                 "math": treerl.make("treerl/MathVerify-v0", dataset=rows)})
        >>> env.num_distinct_tasks()  # tasks 1, 3, 5 play math's rows; task 7 would play its row 0 again
        7
        """
        period = len(self._schedule)
        first_repeat = []
        for j, (name, member) in enumerate(self.envs.items()):
            nested = getattr(member, "num_distinct_tasks", None)
            rows = nested() if callable(nested) else (None if getattr(member, "dataset", None) is None
                                                     else len(member.dataset))
            if rows is None or self._counts[j] == 0:
                continue
            cycles, nth = divmod(rows, self._counts[j])  # the member's task number `rows` is its first repeat
            places = [p for p in range(period) if self._schedule[p] == j]
            first_repeat.append(cycles * period + places[nth])
        return min(first_repeat, default=None)

    def _pick(self, seed: int | None, options: Mapping[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
        """The member a reset plays and the options it passes on (without ``env``)."""
        options = dict(options or {})
        name = options.pop("env", None)
        task = options.get("task")
        if name is None and isinstance(task, Mapping):
            name = task.get("env")
        if name is None:
            if seed is not None:
                name = self.route(seed)
            else:
                shares = list(self.weights.values())
                name = list(self.envs)[int(self.np_random.choice(len(shares), p=shares))]
        if name not in self.envs:
            raise EnvError(f"reset(options={{'env': {name!r}}}): the group has no environment {name!r}; "
                           f"its environments are {sorted(self.envs)}.")
        return name, options or None

    # -- Gymnasium API ---------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        name, member_options = self._pick(seed, options)
        obs, info = self._own(name).reset(seed=seed, options=member_options)
        return obs, self._entered(name, info)

    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        name, member_options = self._pick(seed, options)
        obs, info = await self._own(name).areset(seed=seed, options=member_options)
        return obs, self._entered(name, info)

    def _entered(self, name: str, info: Mapping[str, Any]) -> dict[str, Any]:
        self.current = name
        self.messages = self.current_env.messages  # the member's own list: render() and check_env read it
        return {**info, "env": name}

    def step(self, action: str):
        result = self.current_env.step(action)
        self.messages = self.current_env.messages
        return result

    async def astep(self, action: str):
        result = await self.current_env.astep(action)
        self.messages = self.current_env.messages
        return result

    @property
    def current_env(self) -> Env:
        """The member the last reset picked."""
        if self.current is None:
            raise EnvError("step() called on a never-reset EnvGroup: call reset() first.")
        return self.envs[self.current]

    # -- what the engine reads from the member in play -------------------------------------------
    @property
    def tools(self) -> Sequence[Tool]:
        """The member's tools; before the first reset, every member's (one per name)."""
        if self.current is not None:
            return self.current_env.tools
        unique: dict[str, Tool] = {}
        for env in self.envs.values():
            for t in env.tools:
                unique.setdefault(t.name, t)
        return tuple(unique.values())

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        if self.current is not None:
            return self.current_env.tool_schemas
        unique: dict[str, dict[str, Any]] = {}
        for env in self.envs.values():
            for schema in env.tool_schemas:
                unique.setdefault(schema.get("function", {}).get("name"), schema)
        return list(unique.values())

    @property
    def parser(self) -> Any:
        """The member's tool-call parser (None before the first reset, or for a member without one)."""
        return None if self.current is None else getattr(self.current_env, "parser", None)

    def use_parser_of(self, tokenizer: Any) -> None:
        """Every member parses tool calls in ``tokenizer``'s format, unless it was given a parser."""
        for name, env in self.envs.items():
            if hasattr(env, "use_parser_of"):
                self._own(name).use_parser_of(tokenizer)

    def feedback(self) -> str | None:
        return None if self.current is None else self.current_env.feedback()

    def episode_metrics(self) -> Mapping[str, Any]:
        hook = None if self.current is None else getattr(self.current_env, "episode_metrics", None)
        return hook() if hook is not None else {}

    def render(self) -> str | None:
        return None if self.current is None else self.current_env.render()

    def fork(self) -> EnvGroup:
        """The member in play forked by its own ``fork()`` (a member that overrides it keeps its way); the
        others only when the fork first uses them, because the engine forks a group for every generation
        and a fork plays on the member in play (an idle member's dataset would be copied for nothing)."""
        clone = copy.copy(self)
        clone.envs = dict(self.envs)
        clone._borrowed = set(self.envs) - {self.current}
        if self.current is not None:
            clone.envs[self.current] = self.envs[self.current].fork()
        clone._np_random = copy.deepcopy(self._np_random)
        clone.messages = clone.envs[self.current].messages if self.current is not None else []
        return clone

    def validate(self, num_tasks: int = 8, seed: int = 0) -> ValidationReport:
        """Each of tasks ``seed..seed+num_tasks-1`` validated by the member it routes to; members without
        gold answers are left out."""
        passed, checked, failures = 0, 0, []
        for k in range(seed, seed + num_tasks):
            name = self.route(k)
            try:
                report = self.envs[name].fork().validate(num_tasks=1, seed=k)
            except NotImplementedError:
                continue
            checked += report.num_tasks
            passed += report.num_passed
            failures += [f"{name}: {f}" for f in report.failures]
        return ValidationReport(checked, passed, failures)

    def _own(self, name: str) -> Env:
        """Member ``name``, forked first where it is still the original's (:meth:`fork`)."""
        if name in self._borrowed:
            self.envs[name] = self.envs[name].fork()
            self._borrowed.discard(name)
        return self.envs[name]

    def close(self) -> None:
        """Closes the members this group owns (not those a fork still shares with its original)."""
        for name, env in self.envs.items():
            if name not in self._borrowed:
                env.close()


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} cannot name an environment of a group: use letters, digits, '_', '-' and '.' "
                         "(it becomes the metric reward/<name>), e.g. calc=treerl/Calculator-v0.")
    if name in RESERVED_NAMES:
        why = (f"{name} is the group's own keyword argument" if name in GROUP_KEYWORDS
               else f"reward/{name} is another metric")
        raise ValueError(f"{name!r} cannot name an environment of a group: {why}; name it otherwise, e.g. my_env=...")


def _weights(weights: Mapping[str, float] | Sequence[float] | None, names: list[str]) -> dict[str, float]:
    """Each member's share, from a sequence (in order) or a mapping by name; default equal."""
    if weights is None:
        values = [1.0] * len(names)
    elif isinstance(weights, Mapping):
        unknown = sorted(set(weights) - set(names))
        if unknown:
            raise ValueError(f"weights name {unknown}, which are not environments of the group {names}.")
        values = [weights.get(name, 0.0) for name in names]
    elif isinstance(weights, Sequence) and not isinstance(weights, str):
        if len(weights) != len(names):
            raise ValueError(f"weights={list(weights)} has {len(weights)} numbers for {len(names)} environments "
                             f"{names}: give one per environment, in order, or a mapping by name.")
        values = list(weights)
    else:
        raise ValueError(f"weights={weights!r} must be a list of numbers (one per environment) or a mapping by name, "
                         "e.g. {\"calc\": 3, \"guess\": 1}.")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"weights={weights!r}: each weight must be a finite number >= 0.")
    total = float(sum(values))
    if total <= 0:
        raise ValueError(f"weights={weights!r}: at least one weight must be > 0, or no task has an environment.")
    return {name: value / total for name, value in zip(names, values)}


def _given_schedule(order: Sequence[str], names: list[str],
                    weights: Mapping[str, float] | Sequence[float] | None) -> tuple[list[int], list[int]]:
    """The schedule of ``order`` (a member name per task) and how many places each member has."""
    if weights is not None:
        raise ValueError("weights and order both set the mix: the rows' environments set it (each row is one task); "
                         "drop weights, or repeat rows to weigh them.")
    if isinstance(order, str) or not order:
        raise ValueError(f"order={order!r} must be a non-empty list of environment names, one per task.")
    unknown = sorted({str(n) for n in order} - set(names))
    if unknown:
        raise ValueError(f"order names {unknown}, which are not environments of the group {names}.")
    schedule = [names.index(n) for n in order]
    return schedule, [schedule.count(j) for j in range(len(names))]


def _schedule(shares: list[float]) -> tuple[list[int], list[int]]:
    """A period of member indices that follows ``shares`` in every stretch (smooth weighted round-robin),
    and how many places of the period each member has."""
    period = next((p for p in range(1, _MAX_PERIOD + 1)
                   if all(abs(s * p - round(s * p)) < 1e-9 for s in shares)), _MAX_PERIOD)
    counts = [math.floor(s * period + 1e-9) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda j: -(shares[j] * period - counts[j]))
    for j in by_remainder[: period - sum(counts)]:  # largest remainders: the counts sum to the period
        counts[j] += 1
    current = [0] * len(shares)
    schedule = []
    for _ in range(period):
        current = [c + n for c, n in zip(current, counts)]
        j = max(range(len(shares)), key=lambda i: current[i])  # the first of equals: round-robin in order
        current[j] -= period
        schedule.append(j)
    return schedule, counts


def _ordinals(schedule: list[int]) -> list[int]:
    """For each place of the schedule, how many earlier places belong to the same member."""
    seen: dict[int, int] = {}
    out = []
    for j in schedule:
        out.append(seen.get(j, 0))
        seen[j] = out[-1] + 1
    return out

