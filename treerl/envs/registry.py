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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import gymnasium

from treerl.envs.core import Env
from treerl.envs.group import EnvGroup, member_name
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
        **kwargs: Default keyword arguments for the constructor (``make`` can override them).
    """
    if id in _REGISTRY and not override:
        raise ValueError(f"Environment {id!r} is already registered: pick another id or pass override=True.")
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


def make_group(ids: str, *, weights: Mapping[str, float] | list[float] | None = None, **member_kwargs: Any) -> EnvGroup:
    """The :class:`~treerl.envs.group.EnvGroup` of comma-separated ``ids``, each built by :func:`make`.

    Keyword arguments are keyed by member name, as ``--env-kwargs`` gives them: each member's
    own (a mapping), and ``weights`` for the mix.

    >>> env = make_group("calc=treerl/Calculator-v0,guess=treerl/GuessNumber-v0", weights={"calc": 3, "guess": 1},
    ...                  guess={"high": 8})
    >>> [env.route(k) for k in range(4)], env.envs["guess"].high
    (['calc', 'calc', 'guess', 'calc'], 8)
    """
    pairs = group_members(ids)
    names = [n for n, _ in pairs]
    unknown = sorted(set(member_kwargs) - set(names))
    if unknown:
        raise ValueError(f"{', '.join(map(repr, unknown))} names no environment of the group {names}: key each "
                         "environment's keyword arguments by its name, e.g. "
                         f"{{\"{names[-1]}\": {{...}}, \"weights\": [...]}}.")
    members = {}
    try:
        for name, env_id in pairs:
            kwargs = member_kwargs.get(name) or {}
            if not isinstance(kwargs, Mapping):
                raise ValueError(f"{name}={kwargs!r}: an environment's keyword arguments are a mapping, e.g. "
                                 f"{{\"{name}\": {{\"max_turns\": 4}}}}.")
            members[name] = make(env_id, **kwargs)
        return EnvGroup(members, weights=weights, member_kwargs=member_kwargs)
    except BaseException:
        for env in members.values():
            env.close()
        raise


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
