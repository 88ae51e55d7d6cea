"""The tool-call data types, the parser interface, and the reading helpers the formats share.

A :class:`ToolCallParser` reads one model family's tool-call markup (``parse``) and writes
it (``render``); :mod:`treerl.envs.parsers` holds the registry and picks one. Invariants
every parser keeps:

- ``parse`` never raises: a bad rollout is data. Text without any call gives no calls
  and no errors; something that clearly tried to be a call (it carries the family's
  markers) but cannot be read gives a ``MALFORMED`` :class:`~treerl.errors.ToolCallError`
  whose message shows the model a good call, and the other calls of the turn still count.
- ``parse(render(calls))`` gives ``calls`` back, and the content around the markup is
  returned with the markup removed.

The helpers below (``decode_json``, ``call_from_object``, ...) return the reason as a
``str`` where a value cannot be read, so that a parser turns it into the model's error
message instead of catching exceptions.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from treerl.errors import ToolCallError, ToolErrorKind

__all__ = [
    "ToolCall",
    "ParseResult",
    "ToolCallParser",
    "short_snippet",
    "decode_json",
    "skip_space",
    "first_of",
    "call_from_object",
    "name_of",
    "dump_json",
]


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool by the model: the tool's name and its (JSON-compatible) arguments.

    ``id`` is the call id when the format carries one (Mistral does), else ``None``.
    """

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass
class ParseResult:
    """What a parser read from one model turn."""

    content: str
    """The text with the tool-call markup removed, stripped."""
    calls: list[ToolCall] = field(default_factory=list)
    """The calls that could be read, in order."""
    errors: list[ToolCallError] = field(default_factory=list)
    """One ``MALFORMED`` error per call that could not be read; messages are written for the model."""


class ToolCallParser(ABC):
    """Reads and writes the tool-call markup of one model family.

    Subclasses set ``name`` and ``call_format`` (how one good call looks, quoted in the
    error messages sent to the model) and implement ``parse`` and ``render``.
    """

    name: str
    call_format: str

    @abstractmethod
    def parse(self, text: str, tool_schemas: Mapping[str, dict] | None = None) -> ParseResult:
        """Read the calls in ``text``. Never raises.

        ``tool_schemas`` maps a tool name to its parameters' JSON Schema; formats whose
        arguments are untyped text (qwen3_coder) use it to convert values.
        """

    @abstractmethod
    def render(self, calls: Sequence[ToolCall]) -> str:
        """The text a model of this family emits to make ``calls``."""

    def _error(self, reason: str, tool_name: str | None = None) -> ToolCallError:
        message = f"Could not parse the tool call: {reason}. Write each call as:\n{self.call_format}"
        return ToolCallError(ToolErrorKind.MALFORMED, message, tool_name=tool_name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def short_snippet(snippet: str, limit: int = 80) -> str:
    """A snippet of model text for an error message, cut so that messages stay short."""
    snippet = snippet.strip()
    return repr(snippet if len(snippet) <= limit else snippet[:limit] + "...")


_JSON = json.JSONDecoder()


def decode_json(text: str, start: int) -> tuple[Any, int] | str:
    """``(value, end)`` for the JSON value starting at ``text[start]``, or the reason it is not one."""
    try:
        return _JSON.raw_decode(text, start)
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg} at character {exc.pos - start})"
    except (RecursionError, ValueError):
        return "invalid JSON (nested too deeply)"


def skip_space(text: str, pos: int) -> int:
    """The index of the first non-space character at or after ``pos`` (``len(text)`` if none)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def call_from_object(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | str:
    """A :class:`ToolCall` from a decoded ``{"name": ..., "arguments": ...}``, or the reason it is not one.

    Arguments may be given under any of ``argument_keys``, as an object or as a JSON string
    holding an object (some models double-encode them); missing arguments mean none.
    """
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'the object has no "name" string'
    key = next((k for k in argument_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if isinstance(arguments, str):
        if not arguments.strip():
            arguments = {}
        else:
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return f'"{key}" is a string that is not a JSON object'
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return f'"{key}" must be a JSON object, got {type(arguments).__name__}'
    call_id = obj.get("id")
    return ToolCall(name=name.strip(), arguments=arguments, id=call_id if isinstance(call_id, str) else None)


def dump_json(value: Any) -> str:
    """JSON as a model writes it: non-ASCII characters as themselves, not as escapes."""
    return json.dumps(value, ensure_ascii=False)


def name_of(obj: Any) -> str | None:
    """The ``"name"`` of a decoded call object, for the error of a call that failed otherwise."""
    name = obj.get("name") if isinstance(obj, dict) else None
    return name if isinstance(name, str) else None


def first_of(text: str, start: int, *needles: str) -> int:
    """The index of the earliest of ``needles`` in ``text[start:]``, or ``len(text)``."""
    found = [i for i in (text.find(n, start) for n in needles) if i >= 0]
    return min(found) if found else len(text)

