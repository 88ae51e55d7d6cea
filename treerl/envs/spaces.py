"""Gymnasium spaces for text environments: chat messages in, completion text out.

An observation is the list of *new* chat messages since the last step (OpenAI/transformers
message dicts); an action is the assistant's completion text. Both spaces implement
``contains`` and ``sample`` so that Gymnasium's ``check_env`` can exercise an environment.

>>> space = ChatMessages()
>>> [{"role": "user", "content": "2 + 2?"}] in space
True
>>> [{"role": "narrator", "content": "hi"}] in space
False
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

import numpy as np
from gymnasium import spaces

__all__ = ["ROLES", "ChatMessages", "Completion"]

ROLES = ("system", "user", "assistant", "tool")

# Characters used when sampling random text: letters, digits, whitespace and the markup
# characters tool-call formats use, so random actions also probe the parsers.
_SAMPLE_CHARSET = string.ascii_letters + string.digits + " \n{}[]()<>\"':,=/\\_-+*."
_OPTIONAL_STR_KEYS = ("name", "tool_call_id", "reasoning_content")


class ChatMessages(spaces.Space[list]):
    """The space of lists of chat messages.

    A member is a list of at most ``max_messages`` dicts, each with a ``role`` in
    :data:`ROLES`, a ``content`` string of at most ``max_length`` characters, and optionally
    ``name``/``tool_call_id`` strings and a ``tool_calls`` list of dicts.
    """

    def __init__(self, max_messages: int = 64, max_length: int = 1_000_000, seed: int | np.random.Generator | None = None):
        if max_messages < 1:
            raise ValueError(f"max_messages={max_messages} must be >= 1: a step may return at least one message.")
        self.max_messages = max_messages
        self.max_length = max_length
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        if not isinstance(x, list) or len(x) > self.max_messages:
            return False
        return all(self._is_message(m) for m in x)

    def _is_message(self, m: Any) -> bool:
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            return False
        content = m.get("content")
        if not isinstance(content, str) or len(content) > self.max_length:
            return False
        if any(k in m and not isinstance(m[k], str) for k in _OPTIONAL_STR_KEYS):
            return False
        calls = m.get("tool_calls")
        return calls is None or (isinstance(calls, list) and all(isinstance(c, Mapping) for c in calls))

    def sample(self, mask: Any | None = None, probability: Any | None = None) -> list[dict[str, str]]:
        if mask is not None or probability is not None:
            raise NotImplementedError("ChatMessages.sample takes no mask or probability: sample() with no arguments.")
        num = int(self.np_random.integers(1, min(3, self.max_messages) + 1))
        return [
            {
                "role": str(self.np_random.choice(ROLES)),
                "content": _random_text(self.np_random, min(64, self.max_length)),
            }
            for _ in range(num)
        ]

    def __repr__(self) -> str:
        return f"ChatMessages(max_messages={self.max_messages})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatMessages) and (other.max_messages, other.max_length) == (self.max_messages, self.max_length)


class Completion(spaces.Text):
    """The space of assistant completions: any string of at most ``max_length`` characters.

    Unlike :class:`gymnasium.spaces.Text`, membership does not restrict the character set
    (a model may emit anything); ``sample`` draws from letters, digits and tool-call markup.
    """

    def __init__(self, max_length: int = 100_000, seed: int | np.random.Generator | None = None):
        super().__init__(max_length=max_length, min_length=0, charset=_SAMPLE_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any | None = None, probability: Any | None = None) -> str:
        if mask is not None or probability is not None:
            raise NotImplementedError("Completion.sample takes no mask or probability: sample() with no arguments.")
        return _random_text(self.np_random, min(64, self.max_length))

    def __repr__(self) -> str:
        return f"Completion(max_length={self.max_length})"


def _random_text(rng: np.random.Generator, max_length: int) -> str:
    length = int(rng.integers(0, max_length + 1))
    return "".join(rng.choice(list(_SAMPLE_CHARSET), size=length).tolist())
