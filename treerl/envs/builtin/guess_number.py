"""``treerl/GuessNumber-v0``: a multi-turn game with per-turn feedback and a shaped reward.

The environment thinks of a number in ``[1, high]``; after each guess it says "Higher." or
"Lower.". Each wrong guess earns a small shaped reward for the part of the remaining range
it ruled out; the right guess ends the episode with reward 1. A reply without a usable
number earns nothing and is told how to answer.
"""

from __future__ import annotations

import re
from typing import Any

from treerl.envs.core import Env, ValidationReport
from treerl.errors import EnvError

__all__ = ["GuessNumberEnv"]

_NUMBER = re.compile(r"-?\d+")
_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
_MAX_DIGITS = 30


class GuessNumberEnv(Env):
    """Guess the secret number; feedback after every turn.

    Args:
        high: The secret is drawn uniformly from ``1..high``.
        max_turns: Guesses before the episode is truncated.
        shaping_coef: Scale of the per-turn shaped reward (0 disables shaping).
    """

    description = "Multi-turn guess-the-number game: higher/lower feedback each turn, shaped per-turn reward."

    def __init__(self, *, high: int = 64, max_turns: int = 8, shaping_coef: float = 0.1, render_mode: str | None = None):
        super().__init__(render_mode=render_mode)
        if high < 2:
            raise ValueError(f"high={high} must be >= 2 so that there is something to guess.")
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns} must be >= 1.")
        self.high, self.max_turns, self.shaping_coef = high, max_turns, shaping_coef
        self.secret: int | None = None
        self.low_bound, self.high_bound, self.turn, self.done = 1, high, 0, True
        self.history: list[tuple[int | None, str]] = []
        """(guess, outcome) per turn: what :meth:`feedback` retells."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        self.secret = int(options["secret"]) if "secret" in options else int(self.np_random.integers(1, self.high + 1))
        self.low_bound, self.high_bound, self.turn, self.done = 1, self.high, 0, False
        self.history = []
        prompt = (
            f"I am thinking of a whole number between 1 and {self.high}. Guess it. After each guess I will say "
            "'Higher.' or 'Lower.'. Reply with your guess as \\boxed{n}."
        )
        self.messages = [{"role": "user", "content": prompt}]
        return [dict(m) for m in self.messages], {"task_id": f"secret-{self.secret}" if seed is None else f"seed-{seed}"}

    def step(self, action: str):
        if self.done or self.secret is None:
            raise EnvError("step() called on a finished or never-reset episode: call reset() first.")
        self.turn += 1
        self.messages.append({"role": "assistant", "content": action})
        guess = self._parse_guess(action)
        reward, terminated, feedback = 0.0, False, None
        if guess is None or not self.low_bound <= guess <= self.high_bound:
            feedback = f"Reply with one whole number between {self.low_bound} and {self.high_bound}, as \\boxed{{n}}."
            outcome = "invalid"
        elif guess == self.secret:
            reward, terminated, outcome = 1.0, True, "correct"
        else:
            before = self.high_bound - self.low_bound + 1
            if guess < self.secret:
                self.low_bound, feedback, outcome = guess + 1, "Higher.", "higher"
            else:
                self.high_bound, feedback, outcome = guess - 1, "Lower.", "lower"
            after = self.high_bound - self.low_bound + 1
            reward = self.shaping_coef * (before - after) / self.high
        truncated = not terminated and self.turn >= self.max_turns
        self.done = terminated or truncated
        self.history.append((guess, outcome))
        obs = [] if self.done else [{"role": "user", "content": feedback}]
        self.messages.extend(dict(m) for m in obs)
        info = {
            "turn": self.turn,
            "outcome": outcome,
            "termination": "correct" if terminated else ("max_turns" if truncated else None),
            "metrics": {"turns": self.turn, "episode/solved": int(terminated)},
        }
        if guess is not None:  # absent rather than None: Gymnasium's vector envs stack it as an int array
            info["guess"] = guess
        return obs, float(reward), terminated, truncated, info

    def feedback(self) -> str | None:
        """The higher/lower history of an unsolved game and the range it leaves; None once solved."""
        if not self.history or self.history[-1][1] == "correct":
            return None
        said = {"higher": "higher", "lower": "lower", "invalid": "not a valid guess"}
        guesses = ", ".join(f"{'no number' if g is None else g} ({said[o]})" for g, o in self.history)
        return (f"Your guesses and the answers: {guesses}. The number is between {self.low_bound} and "
                f"{self.high_bound}.")

    @staticmethod
    def _parse_guess(text: str) -> int | None:
        boxed = _BOXED.findall(text)
        numbers = boxed or _NUMBER.findall(text)
        if not numbers:
            return None
        # A number of more digits than any range here is out of range; int() would refuse
        # thousands of digits (sys.get_int_max_str_digits) rather than say so.
        digits = numbers[-1].lstrip("-").lstrip("0")
        return None if len(digits) > _MAX_DIGITS else int(numbers[-1])

    def validate(self, num_tasks: int = 8, seed: int = 0) -> ValidationReport:
        """Guessing the secret at once earns the full reward of 1."""
        failures = []
        for i in range(num_tasks):
            env = self.fork()
            env.reset(seed=seed + i)
            _, reward, terminated, _, _ = env.step(f"\\boxed{{{env.secret}}}")
            if not (terminated and reward == 1.0):
                failures.append(f"seed {seed + i}: the secret earned {reward} (terminated={terminated})")
        return ValidationReport(num_tasks, num_tasks - len(failures), failures)
