"""Text environments played as chats: a Gymnasium environment whose observations are plain
strings (GEM's and TextArena's games, a user's own ``gymnasium.Env``) becomes a treerl
environment whose observations are chat messages. GEM's environments (``gem.Env``, not a
``gymnasium.Env``: its ``reset`` takes a seed and no options) play as they are; a TextArena game
(``reset(num_players, seed)``, ``get_observation()``, ``step -> (done, info)``, the rewards from
``close()``) plays as its single player: each observation is the game's new messages since the
model's last action, and the reward comes at the end, from the game's rewards.

The first observation is the user's opening message (after ``system_prompt``, if given); every
later one is the next user message; the model's completion is the action. Rewards, ends and
``info`` pass through unchanged, and so do seeds and ``reset`` options.

>>> import gymnasium
>>> class Echo(gymnasium.Env):
...     def reset(self, *, seed=None, options=None):
...         super().reset(seed=seed)
...         return "Say hi.", {}
...     def step(self, action):
...         return "Well done." if action == "hi" else "Say hi.", float(action == "hi"), action == "hi", False, {}
>>> env = TextEnv(Echo())
>>> env.reset(seed=0)[0]
[{'role': 'user', 'content': 'Say hi.'}]
>>> env.step("hi")[:3]
([{'role': 'user', 'content': 'Well done.'}], 1.0, True)
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gymnasium
import numpy as np

from treerl.envs.core import Env, Message
from treerl.errors import EnvError

__all__ = ["TextEnv"]

_GLOBAL_GENERATORS = threading.RLock()
"""Held while a game runs with its TextEnv's own states in the process's ``random`` and numpy
generators: the steps of concurrent episodes (each in its own thread) must not interleave there.
Re-entrant, so a game that builds or plays another TextEnv does not wait on itself. Held only
around the game's own synchronous call: the rollout engine's event loop (which builds
environments) at most waits for the one call in progress, which never waits for the loop."""


class TextEnv(Env):
    """A Gymnasium environment with string observations and string actions, as a chat.

    Args:
        env: The environment, or a function that builds it (``lambda: gem.make("game:GuessTheNumber-v0-easy")``).
        system_prompt: A system message before the first observation.
        role: The role of the observations' messages (``user``; ``tool`` for a tool-like game
            needs a template that renders tool messages without a call id).
        own_random: Give the game a generator state of its own (see below). ``False``: the game
            draws from the process's generators, and its calls run concurrently: for a game
            whose steps wait (run code, call a server) and draw nothing at random.

    GEM's and TextArena's games draw from Python's global ``random`` (GEM's also from numpy's),
    and their seeded ``reset`` reseeds it. So each TextEnv keeps its own state of both: swapped
    into the process's generators around each call into the game (building it, ``reset``,
    ``step``), saved after it, and the caller's state put back, so the game's draws, its forks'
    and the rest of the process's never mix. ``reset(seed=...)`` seeds that state (as GEM does)
    before the game resets, and ``fork()`` copies it: a fork steps a game that draws during
    ``step`` (GEM's 2048) exactly as the original would from the same point. The calls into the
    games of all TextEnvs run one at a time, under one lock (the swap takes well under a
    millisecond); code outside a TextEnv that draws from the global generators in another
    thread meanwhile draws from the game's state.

    Register it as any environment, e.g. ``treerl.register("gem/GuessTheNumber-v0",
    lambda **kw: TextEnv(lambda: gem.make("game:GuessTheNumber-v0-easy", **kw)))``; then
    ``treerl learn --import my_envs.py --env gem/GuessTheNumber-v0``. ``fork()`` copies the
    wrapped environment with the rest (members it cannot copy are shared: see
    :meth:`treerl.envs.Env.fork`).
    """

    def __init__(self, env: gymnasium.Env | Callable[[], gymnasium.Env], *, system_prompt: str | None = None,
                 role: str = "user", own_random: bool = True, render_mode: str | None = None):
        super().__init__(render_mode=render_mode)
        # Fresh states from the OS's entropy, as an unseeded generator starts: two unseeded games differ.
        self._generators = (random.Random().getstate(), np.random.RandomState().get_state()) if own_random else None
        if not isinstance(env, gymnasium.Env) and callable(env):
            with self._own_generators():  # a game may draw, or reseed, as it is built
                env = env()
        self.env = env
        if not isinstance(self.env, gymnasium.Env) and hasattr(self.env, "get_observation"):
            self.env = _TextArenaGame(self.env)
        self.system_prompt, self.role = system_prompt, role

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        with self._own_generators(seed):
            # GEM's reset takes no options (``reset(seed=None)``): pass them only when there are some.
            obs, info = self.env.reset(seed=seed, **({"options": options} if options else {}))
        opening = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.messages = [*opening, self._message(obs, "reset()")]
        return [dict(m) for m in self.messages], dict(info)

    def step(self, action: str):
        with self._own_generators():
            obs, reward, terminated, truncated, info = self.env.step(action)
        new = [self._message(obs, "step()")] if obs not in (None, "") else []
        self.messages += [{"role": "assistant", "content": action}, *new]
        return [dict(m) for m in new], reward, terminated, truncated, dict(info)

    def close(self) -> None:
        close = getattr(self.env, "close", None)  # gem.Env has no close()
        if close is not None:
            close()

    @contextlib.contextmanager
    def _own_generators(self, seed: int | None = None) -> Iterator[None]:
        """This environment's states in the process's ``random`` and numpy generators (seeded
        with ``seed`` if given) for the duration; the caller's states are put back after."""
        if self._generators is None:  # own_random=False
            yield
            return
        with _GLOBAL_GENERATORS:
            caller = random.getstate(), np.random.get_state()
            random.setstate(self._generators[0])
            np.random.set_state(self._generators[1])
            try:
                if seed is not None:
                    random.seed(seed)
                    np.random.seed(seed % 2**32)  # numpy's global generator takes 32-bit seeds
                yield
            finally:
                self._generators = random.getstate(), np.random.get_state()
                random.setstate(caller[0])
                np.random.set_state(caller[1])

    def _message(self, obs: Any, where: str) -> Message:
        if isinstance(obs, str):
            return {"role": self.role, "content": obs}
        if isinstance(obs, Mapping) and "role" in obs and "content" in obs:  # already a message
            return dict(obs)
        raise EnvError(f"{type(self.env.unwrapped).__name__}.{where} returned the observation {str(obs)[:80]!r}: "
                       "TextEnv plays environments whose observations are text (a str).")


class _TextArenaGame:
    """A single-player TextArena game (``textarena.Env``) with Gymnasium's ``reset`` and ``step``.

    TextArena's ``reset(num_players, seed)`` returns nothing, ``get_observation()`` returns the
    player and the messages since it last looked (``(from_id, text, type)`` tuples; a string
    with the observation wrappers ``ta.make`` applies by default, which are read under),
    ``step(action)`` returns ``(done, info)`` and ``close()`` the rewards by player and each
    player's game info.
    """

    def __init__(self, env: Any):
        self.env = env
        # Observations come from the game itself, under the wrappers (TextArena's ``Wrapper.env``):
        # the observation wrappers ``ta.make`` adds by default resend the whole game every turn, which
        # the chat already holds, and keep the last game's messages after ``reset``. Actions still go
        # through every wrapper (the action formatting ones included).
        self.game = env
        while hasattr(self.game, "env"):
            self.game = self.game.env

    @property
    def unwrapped(self) -> Any:
        return self.env

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if options:
            raise ValueError(f"TextEnv plays a TextArena game as its single player: reset options {options!r} "
                             "have no TextArena counterpart.")
        self.env.reset(num_players=1, seed=seed)
        return self._observe(), {}

    def step(self, action: str):
        done, info = self.env.step(action)
        obs = self._observe()
        if not done:
            return obs, 0.0, False, False, dict(info)
        rewards, game_info = self.env.close()
        player = game_info.get(self.player, {})
        # The game's verdict (a win, the turn limit, an invalid move) is not among its messages.
        reason = player.get("reason")
        return "\n".join(filter(None, [obs, reason])), float(rewards[self.player]), True, False, {**info, **player}

    def close(self) -> None:
        pass  # TextArena's close() ends the game for its rewards; step() called it at the end

    def _observe(self) -> str:
        self.player, obs = self.game.get_observation()
        if isinstance(obs, str):
            return obs
        # The model's own action comes back first: the chat already holds it.
        return "\n".join(text for sender, text, *_ in obs if sender != self.player)
