"""The environment registry: ``treerl.register`` / ``treerl.make``, mirrored into Gymnasium.

Every id registered here is also registered with Gymnasium, so after ``import treerl``
``gymnasium.make("treerl/Calculator-v0")`` works too (Gymnasium wraps the environment in
its usual checkers; ``treerl.make`` returns the bare environment with ``astep``/``fork``).
The other way, as in ``gymnasium.make``, an id registered with ``gymnasium.register`` is
found too, and ``"module:Name-v0"`` imports ``module`` (which registers it) first. Several ids,
comma-separated, make one :class:`~treerl.envs.group.EnvGroup` (:func:`make_group`).

>>> import treerl
>>> env = treerl.make("treerl/Calculator-v0")
>>> type(env).__name__
'CalculatorEnv'
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import gymnasium

from treerl.envs.cache import Recent
from treerl.envs.core import Env
from treerl.envs.group import EnvGroup, member_name
from treerl.envs.reasoning_gym import NAMESPACE as RG_NAMESPACE
from treerl.envs.skyrl import NAMESPACE as SKYRL_NAMESPACE
from treerl.errors import ConfigError

__all__ = ["EnvSpec", "register", "make", "make_group", "registry", "spec", "env_id_of", "factory_env_id"]


@dataclass(frozen=True)
class EnvSpec:
    """How to build a registered environment."""

    id: str
    entry_point: str | Callable[..., Any]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    description: str | None = None

    def load(self) -> Callable[..., Any]:
        """The class or factory behind ``entry_point`` (``"module:attr"`` strings are imported)."""
        if callable(self.entry_point):
            return self.entry_point
        module_name, _, attr = self.entry_point.partition(":")
        if not attr:
            raise ValueError(f"entry_point {self.entry_point!r} of {self.id!r} must look like 'package.module:ClassName'.")
        return getattr(importlib.import_module(module_name), attr)

    def make(self, **kwargs: Any):
        return self.load()(**{**self.kwargs, **kwargs})


_REGISTRY: dict[str, EnvSpec] = {}
registry: Mapping[str, EnvSpec] = MappingProxyType(_REGISTRY)
"""Read-only view of the registered environments, by id."""


_GYMNASIUM_ONLY = frozenset({"reward_threshold", "nondeterministic", "max_episode_steps", "order_enforce", "autoreset",
                              "disable_env_checker", "apply_api_compatibility", "additional_wrappers",
                              "vector_entry_point"})
"""Options of ``gymnasium.register`` that are not constructor arguments."""


def register(
    id: str,
    entry_point: str | Callable[..., Any],
    *,
    description: str | None = None,
    override: bool = False,
    **kwargs: Any,
) -> EnvSpec:
    """Register an environment under ``id`` (``"namespace/Name-vN"``) here and with Gymnasium.

    Args:
        id: The environment id, e.g. ``"myproject/Shop-v0"``.
        entry_point: A class/factory, or ``"package.module:ClassName"`` (imported lazily).
        description: One line for ``treerl envs``; defaults to the class's ``description``.
        override: Replace an existing registration instead of refusing.
        **kwargs: Default keyword arguments for the constructor (``make`` can override them);
            Gymnasium's form, ``kwargs={...}``, is taken too.
    """
    if id in _REGISTRY and not override:
        raise ValueError(f"Environment {id!r} is already registered: pick another id or pass override=True.")
    if isinstance(kwargs.get("kwargs"), Mapping):  # gymnasium.register(id, entry_point, kwargs={...})
        given = dict(kwargs.pop("kwargs"))
        both = sorted(set(given) & set(kwargs))
        if both:
            raise ValueError(f"register({id!r}): {both} given both in kwargs= and as keyword arguments; keep one.")
        kwargs = {**given, **kwargs}
    gymnasium_only = sorted(set(kwargs) & _GYMNASIUM_ONLY)
    if gymnasium_only:
        raise ValueError(f"register({id!r}): {gymnasium_only} are gymnasium.register options treerl does not take "
                         "(its episodes end by max_turns, the environment's own limit, and the engine's token and "
                         "time limits); the other keyword arguments are the constructor's defaults.")
    spec_ = EnvSpec(id=id, entry_point=entry_point, kwargs=dict(kwargs), description=description)
    _REGISTRY[id] = spec_
    if id in gymnasium.registry:
        del gymnasium.registry[id]
    gymnasium.register(id=id, entry_point=entry_point, kwargs=dict(kwargs))
    return spec_


def spec(id: str) -> EnvSpec:
    """The registration of ``id``; the error lists close matches.

    ``id`` may name a module to import first, ``"mypackage.envs:Shop-v0"``, and may be
    registered with ``gymnasium.register`` instead of :func:`register`, as ``gymnasium.make``
    allows. Several ids, comma-separated, are a group (:func:`make_group`); each must exist.
    ``skyrl/<id>`` is SkyRL-Gym's environment ``<id>`` (:class:`~treerl.envs.skyrl.SkyRLEnv`), registered
    here on first use; whether SkyRL-Gym has it is checked when it is built. Likewise ``rg/<name>`` is
    reasoning-gym's dataset ``<name>`` (:class:`~treerl.envs.reasoning_gym.ReasoningGymEnv`).
    """
    if "," in id:
        for _, member_id in group_members(id):
            spec(member_id)
        return EnvSpec(id=id, entry_point=functools.partial(make_group, id),
                       description="A group: each task plays one of " + ", ".join(n for n, _ in group_members(id)))
    if ":" in id and id not in _REGISTRY:
        module_name, _, id = id.partition(":")
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"{module_name}:{id}: importing {module_name!r} failed ({exc}). Is the module "
                              "that registers the environment installed or on PYTHONPATH?") from None
    if id not in _REGISTRY and id in gymnasium.registry:
        return _from_gymnasium(gymnasium.registry[id])
    if id not in _REGISTRY and id.startswith(SKYRL_NAMESPACE) and len(id) > len(SKYRL_NAMESPACE):
        env_class = id[len(SKYRL_NAMESPACE):]
        return register(id, "treerl.envs.skyrl:SkyRLEnv", env_class=env_class,
                        description=f"SkyRL-Gym's {env_class} environment (skyrl_gym.make({env_class!r})).")
    if id not in _REGISTRY and id.startswith(RG_NAMESPACE) and len(id) > len(RG_NAMESPACE):
        name = id[len(RG_NAMESPACE):]
        return register(id, "treerl.envs.reasoning_gym:ReasoningGymEnv", dataset_name=name,
                        description=f"reasoning-gym's {name} dataset (reasoning_gym.create_dataset({name!r})).")
    try:
        return _REGISTRY[id]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(id, list(_REGISTRY), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise KeyError(
            f"No environment registered as {id!r}.{hint} Run `treerl envs` to list them, "
            "or register yours with treerl.register(id, entry_point)."
        ) from None


def _from_gymnasium(gym_spec: gymnasium.envs.registration.EnvSpec) -> EnvSpec:
    """The registration of an id that only ``gymnasium.register`` knows, if treerl can play it as registered."""
    spec_ = EnvSpec(id=gym_spec.id, entry_point=gym_spec.entry_point, kwargs=dict(gym_spec.kwargs))
    target = spec_.load()
    if isinstance(target, type) and not issubclass(target, Env):
        raise ConfigError(
            f"{gym_spec.id} is a Gymnasium environment ({target.__name__}) but not a treerl one: treerl plays "
            "environments whose observations are chat messages and actions completion text, subclasses of "
            "treerl.envs.Env or ToolEnv."
        )
    if gym_spec.max_episode_steps is not None:
        raise ConfigError(
            f"{gym_spec.id} is registered with gymnasium.register(max_episode_steps={gym_spec.max_episode_steps}), "
            "but treerl plays the bare environment, without Gymnasium's TimeLimit wrapper: limit the turns in the "
            "environment itself (ToolEnv's max_turns) and register it without max_episode_steps, or with "
            "treerl.register(id, entry_point, max_turns=...)."
        )
    return spec_


def make(id: str, **kwargs: Any):
    """Build the registered environment ``id`` (bare, without Gymnasium's wrappers).

    As ``gymnasium.make`` does, the environment's ``spec`` is its registration with the
    keyword arguments it was built with.
    """
    spec_ = spec(id)
    env = spec_.make(**kwargs)
    if isinstance(env, gymnasium.Env) and env.spec is None and spec_.id in gymnasium.registry:
        env.spec = dataclasses.replace(gymnasium.spec(spec_.id), kwargs={**spec_.kwargs, **kwargs})
    return env


def group_members(ids: str) -> list[tuple[str, str]]:
    """The (name, id) pairs of a comma-separated group id: ``name=id`` names one, else :func:`member_name`.

    >>> group_members("treerl/Calculator-v0,guess=treerl/GuessNumber-v0")
    [('Calculator-v0', 'treerl/Calculator-v0'), ('guess', 'treerl/GuessNumber-v0')]
    """
    pairs = []
    for entry in ids.split(","):
        name, _, env_id = entry.strip().rpartition("=")
        env_id = env_id.strip()
        if not env_id:
            raise ConfigError(f"env={ids!r} has an empty entry: separate environment ids by single commas, e.g. "
                              "treerl/Calculator-v0,treerl/GuessNumber-v0.")
        pairs.append((name.strip() or member_name(env_id), env_id))
    names = [n for n, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"env={ids!r} has two environments called {twice[0]!r}: name them, e.g. "
                          f"a={pairs[0][1]},b={pairs[0][1]}.")
    return pairs


def make_group(ids: str, *, weights: Mapping[str, float] | list[float] | None = None,
               data_path: str | os.PathLike | None = None, dataset: Sequence[Mapping[str, Any]] | None = None,
               env_key: str | None = None, **member_kwargs: Any) -> EnvGroup:
    """The :class:`~treerl.envs.group.EnvGroup` of comma-separated ``ids``, each built by :func:`make`.

    Keyword arguments are keyed by member name, as ``--env-kwargs`` gives them: each member's
    own (a mapping), and ``weights`` for the mix.

    One mixed dataset (SkyRL-Gym's form) instead of each member's own: ``data_path`` (JSON Lines
    or Parquet) or ``dataset`` (rows), each row naming its environment in the column ``env_key``
    (default ``env``, else SkyRL-Gym's ``env_class``). Each member is built with its rows as its
    ``dataset``, in the file's order, and reads them as its own (``prompt_key`` and the like
    among its keyword arguments); task ``k`` plays row ``k mod N``, so the rows set the mix.

    >>> env = make_group("calc=treerl/Calculator-v0,guess=treerl/GuessNumber-v0", weights={"calc": 3, "guess": 1},
    ...                  guess={"high": 8})
    >>> [env.route(k) for k in range(4)], env.envs["guess"].high
    (['calc', 'calc', 'guess', 'calc'], 8)
    >>> rows = [{"env": "math", "question": "1 + 1 = ?", "answer": "2"},
    ...         {"env": "calc", "prompt": "2*3?", "answer": "6"}]
    >>> env = make_group("calc=treerl/Calculator-v0,math=treerl/MathVerify-v0", dataset=rows)
    >>> [env.task_options(k) for k in range(3)]
    [{'env': 'math', 'task_index': 0}, {'env': 'calc', 'task_index': 0}, {'env': 'math', 'task_index': 0}]
    """
    pairs = group_members(ids)
    names = [n for n, _ in pairs]
    unknown = sorted(set(member_kwargs) - set(names))
    if unknown:
        raise ValueError(f"{', '.join(map(repr, unknown))} names no environment of the group {names}: key each "
                         "environment's keyword arguments by its name, e.g. "
                         f"{{\"{names[-1]}\": {{...}}, \"weights\": [...]}}.")
    for name in names:
        if not isinstance(member_kwargs.get(name) or {}, Mapping):
            raise ValueError(f"{name}={member_kwargs[name]!r}: an environment's keyword arguments are a mapping, e.g. "
                             f"{{\"{name}\": {{\"max_turns\": 4}}}}.")
    order, member_rows = None, {}
    if data_path is not None or dataset is not None:
        if weights is not None:
            raise ValueError("weights and the group's data_path (or dataset) both set the mix: each row is one task "
                             "of the environment it names, so the rows set it; drop weights, or repeat rows to "
                             "weigh them.")
        order, member_rows = _split_rows(data_path, dataset, env_key, pairs, member_kwargs)
    elif env_key is not None:
        raise ValueError(f"env_key={env_key!r} names the column of a mixed dataset, but the group has none: pass "
                         "data_path (or dataset) with it.")
    members = {}
    try:
        for name, env_id in pairs:
            kwargs = dict(member_kwargs.get(name) or {})
            if order is not None:
                kwargs["dataset"] = member_rows[name]
            try:
                members[name] = make(env_id, **kwargs)
            except TypeError as exc:
                if order is None or "dataset" not in str(exc):
                    raise
                raise ValueError(f"{name} ({env_id}) takes no dataset (it generates its tasks), so rows of the "
                                 f"group's dataset cannot name it ({exc}): drop its rows, or train it in a group "
                                 "without data_path, mixed by weights.") from None
        return EnvGroup(members, weights=weights, member_kwargs=member_kwargs, order=order)
    except BaseException:
        for env in members.values():
            env.close()
        raise


_SPLITS = Recent(4)  # (file version, env_key, members) -> the file's rows split by member


def _split_rows(data_path: str | os.PathLike | None, dataset: Sequence[Mapping[str, Any]] | None,
                env_key: str | None, pairs: list[tuple[str, str]],
                member_kwargs: Mapping[str, Any]) -> tuple[list[str], dict[str, list[Mapping[str, Any]]]]:
    """Each row's member (in order) and each member's rows, of a mixed dataset."""
    from treerl.envs.builtin.math_verify import file_version, read_rows

    names = [n for n, _ in pairs]
    if data_path is not None and dataset is not None:
        raise ValueError("Pass the group's data_path or its dataset, not both.")
    own = [n for n in names if {"data_path", "dataset"} & set(member_kwargs.get(n) or {})]
    if own:
        raise ValueError(f"{own[0]} has its own data_path/dataset, but the group's data_path gives every environment "
                         f"its rows: drop {own[0]}'s, or the group's (and give each environment its own).")
    if dataset is None:  # a file's split is made once per version of it, not for every environment built
        return _SPLITS.get_or_put((file_version(data_path), env_key, tuple(names)),
                                  lambda: _route_rows(read_rows(data_path), data_path, env_key, names))
    return _route_rows(dataset, "dataset", env_key, names)


def _route_rows(rows: Sequence[Mapping[str, Any]], where: Any, env_key: str | None,
                names: list[str]) -> tuple[list[str], dict[str, list[Mapping[str, Any]]]]:
    if len(rows) == 0:
        raise ValueError(f"{where} has no rows: an environment group's dataset needs at least one.")
    chosen = "" if env_key is not None else " (the column the first row has: 'env', else SkyRL-Gym's 'env_class')"
    if env_key is None:  # verifiers' and treerl's `env`, else SkyRL-Gym's `env_class`
        first = rows[0]
        env_key = "env" if "env" in first or "env_class" not in first else "env_class"
    order: list[str] = []
    member_rows: dict[str, list[Mapping[str, Any]]] = {n: [] for n in names}
    for i, row in enumerate(rows):
        name = row.get(env_key) if isinstance(row, Mapping) else None
        if name not in member_rows:
            found = f"{env_key}={name!r}" if isinstance(row, Mapping) and env_key in row else f"no {env_key!r} column"
            raise ValueError(f"{where}: row {i} has {found}; each row names one environment of the group {names} in "
                             f"its {env_key!r} column{chosen}; env_key= names another column.")
        order.append(name)
        member_rows[name].append(row)
    empty = [n for n in names if not member_rows[n]]
    if empty:
        raise ValueError(f"{where}: no row names {empty[0]!r} in its {env_key!r} column, so it would never play: "
                         f"drop it from the group, or add its rows.")
    return order, member_rows


def env_id_of(env: Any) -> str:
    """What to call ``env`` in trajectories and reports: its registered id, else its class's import path."""
    env_spec = getattr(env, "spec", None)
    unwrapped = getattr(env, "unwrapped", env)
    return getattr(env_spec, "id", None) or f"{type(unwrapped).__module__}.{type(unwrapped).__qualname__}"


def factory_env_id(env_factory: Callable[[], Any]) -> str | None:
    """:func:`env_id_of` the environment ``env_factory`` builds (one is built and closed), or ``None`` when
    it does not build: where it is played, the failure is reported as the run reports environment errors."""
    try:
        env = env_factory()
    except Exception:  # noqa: BLE001 - a label only; the run meets the same error where it plays
        return None
    try:
        return env_id_of(env)
    finally:
        env.close()


def description_of(spec_: EnvSpec) -> str:
    """The one-line description: the registration's, else the class's, else its docstring's first line."""
    if spec_.description:
        return spec_.description
    target = spec_.load()
    text = getattr(target, "description", "") or (target.__doc__ or "").strip().splitlines()[0:1]
    return text if isinstance(text, str) else (text[0] if text else "")
