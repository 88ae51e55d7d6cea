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

from collections.abc import Callable, Mapping
from typing import Any

import gymnasium

from treerl.envs.core import Env, Message
from treerl.errors import EnvError

__all__ = ["TextEnv"]


class TextEnv(Env):
    """A Gymnasium environment with string observations and string actions, as a chat.

    Args:
        env: The environment, or a function that builds it (``lambda: gem.make("game:GuessTheNumber-v0-easy")``).
        system_prompt: A system message before the first observation.
        role: The role of the observations' messages (``user``; ``tool`` for a tool-like game
            needs a template that renders tool messages without a call id).

    Register it as any environment, e.g. ``treerl.register("gem/GuessTheNumber-v0",
    lambda **kw: TextEnv(lambda: gem.make("game:GuessTheNumber-v0-easy", **kw)))``; then
    ``treerl learn --import my_envs.py --env gem/GuessTheNumber-v0``. ``fork()`` copies the
    wrapped environment with the rest (members it cannot copy are shared: see
    :meth:`treerl.envs.Env.fork`).
    """

    def __init__(self, env: gymnasium.Env | Callable[[], gymnasium.Env], *, system_prompt: str | None = None,
                 role: str = "user", render_mode: str | None = None):
        super().__init__(render_mode=render_mode)
        self.env = env if isinstance(env, gymnasium.Env) or not callable(env) else env()
        if not isinstance(self.env, gymnasium.Env) and hasattr(self.env, "get_observation"):
            self.env = _TextArenaGame(self.env)
        self.system_prompt, self.role = system_prompt, role

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        # GEM's reset takes no options (``reset(seed=None)``): pass them only when there are some.
        obs, info = self.env.reset(seed=seed, **({"options": options} if options else {}))
        opening = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.messages = [*opening, self._message(obs, "reset()")]
        return [dict(m) for m in self.messages], dict(info)

    def step(self, action: str):
        obs, reward, terminated, truncated, info = self.env.step(action)
        new = [self._message(obs, "step()")] if obs not in (None, "") else []
        self.messages += [{"role": "assistant", "content": action}, *new]
        return [dict(m) for m in new], reward, terminated, truncated, dict(info)

    def close(self) -> None:
        close = getattr(self.env, "close", None)  # gem.Env has no close()
        if close is not None:
            close()

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
    with the observation wrappers ``ta.make`` applies by default), ``step(action)`` returns
    ``(done, info)`` and ``close()`` the rewards by player and each player's game info.
    """

    def __init__(self, env: Any):
        self.env = env

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
        self.player, obs = self.env.get_observation()
        if isinstance(obs, str):
            return obs
        # The model's own action comes back first: the chat already holds it.
        return "\n".join(text for sender, text, *_ in obs if sender != self.player)
