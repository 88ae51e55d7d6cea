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
- The work is linear in the text: a reply longer than ``max_chars`` is refused with one
  ``MALFORMED`` error naming the cap, and a parser stops after ``max_calls`` calls and
  errors (one more error names that cap), so no text, however adversarial, makes a parser
  do more than a bounded amount of work per character. Searches for markers go through a
  :class:`Finder`, which never searches the same stretch of text twice for one marker.
- A call inside reasoning is not a call. With ``reasoning=("<think>", "</think>")`` (what
  :func:`~treerl.envs.parsers.get_parser` sets for templates that render reasoning), the
  text up to the first ``</think>`` is reasoning (a leading ``<think>`` is optional: some
  templates open it in the generation prompt), and a ``<think>`` without its ``</think>``
  makes the whole rest reasoning (the model was cut off while thinking), as vLLM's
  reasoning parsers split a reply. Calls are read from the rest only; the reasoning is
  returned as :attr:`ParseResult.reasoning`.

The helpers below (``decode_json``, ``call_from_object``, ...) return the reason as a
``str`` where a value cannot be read, so that a parser turns it into the model's error
message instead of catching exceptions.
"""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from treerl.errors import ToolCallError, ToolErrorKind

__all__ = [
    "ToolCall",
    "ParseResult",
    "ToolCallParser",
    "split_reasoning",
    "Finder",
    "short_snippet",
    "decode_json",
    "DecodeFailure",
    "skip_space",
    "call_from_object",
    "derived_call_id",
    "name_of",
    "dump_json",
    "keeps_text",
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
    reasoning: str | None = None
    """The reasoning split off before calls were read (None when the parser reads no reasoning)."""
    written: list[ToolCall | ToolCallError] | None = field(default=None, repr=False, compare=False)
    """``calls`` and ``errors`` together in the order the reply wrote them (None: not known)."""

    @classmethod
    def of(cls, content: str, found: Sequence[ToolCall | ToolCallError]) -> ParseResult:
        """The result whose calls and errors are ``found``, in the order the reply wrote them."""
        calls = [x for x in found if isinstance(x, ToolCall)]
        errors = [x for x in found if not isinstance(x, ToolCall)]
        return cls(content=content, calls=calls, errors=errors, written=list(found))

    def in_order(self) -> list[ToolCall | ToolCallError]:
        """The calls and errors in the order the reply wrote them, so that results pair with calls by
        position (templates without call ids do); errors first where that order is not known (a
        result built without :meth:`of`, or whose lists were changed since).

        >>> r = ParseResult.of("", [ToolCall("f", {}), ToolCallError(ToolErrorKind.MALFORMED, "bad")])
        >>> [type(x).__name__ for x in r.in_order()]
        ['ToolCall', 'ToolCallError']
        """
        if self.written is not None:
            calls = [x for x in self.written if isinstance(x, ToolCall)]
            errors = [x for x in self.written if not isinstance(x, ToolCall)]
            if _same(calls, self.calls) and _same(errors, self.errors):
                return list(self.written)
        return [*self.errors, *self.calls]


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class ToolCallParser(ABC):
    """Reads and writes the tool-call markup of one model family.

    Subclasses set ``name`` and ``call_format`` (how one good call looks, quoted in the
    error messages sent to the model) and implement ``_parse`` and ``render``; ``parse``
    applies the caps around ``_parse`` (a subclass that overrides ``parse`` itself keeps
    working, without the caps).

    Args:
        max_chars: Longer replies are refused with one ``MALFORMED`` error naming the cap.
        max_calls: Calls and errors read from one reply; one more error names the cap.
        reasoning: ``(start, end)`` markers of the model's reasoning, e.g. ``("<think>",
            "</think>")``: a call written inside reasoning is not read. None: no reasoning.
    """

    name: str
    call_format: str
    max_chars: int = 1_000_000
    """Replies longer than this (in characters) are refused: no model turn needs more."""
    max_calls: int = 64
    """Calls (and malformed calls) read from one reply; reading stops after that many."""

    reasoning: tuple[str, str] | None = None
    """The ``(start, end)`` markers of reasoning, whose calls are not calls; None: no reasoning."""

    def __init__(self, *, max_chars: int | None = None, max_calls: int | None = None,
                 reasoning: tuple[str, str] | None = None):
        for key, value in (("max_chars", max_chars), ("max_calls", max_calls)):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{type(self).__name__}({key}={value!r}): use an int >= 1.")
                setattr(self, key, value)
        if reasoning is not None:
            if (not isinstance(reasoning, (tuple, list)) or len(reasoning) != 2
                    or not all(isinstance(m, str) and m for m in reasoning)):
                raise ValueError(f"{type(self).__name__}(reasoning={reasoning!r}): use a pair of non-empty "
                                 "markers such as ('<think>', '</think>'), or None.")
            self.reasoning = (reasoning[0], reasoning[1])

    def parse(self, text: str, tool_schemas: Mapping[str, dict] | None = None) -> ParseResult:
        """Read the calls in ``text``. Never raises.

        ``tool_schemas`` maps a tool name to its parameters' JSON Schema; formats whose
        arguments are untyped text (qwen3_coder) use it to convert values.
        """
        if len(text) > self.max_chars:
            return ParseResult(content="", errors=[self._error(
                f"the reply has {len(text):,} characters, and tool calls are read only from replies of at most "
                f"{self.max_chars:,} characters (the parser's max_chars); write shorter replies")])
        thought, text = split_reasoning(text, self.reasoning)
        try:
            result = self._parse(text, tool_schemas)
        except RecursionError:  # nesting no model means: data, like any other unreadable call
            result = ParseResult(content="", errors=[self._error("the reply is nested too deeply to read")])
        if thought is not None:
            result.reasoning = thought
        return result

    def _parse(self, text: str, tool_schemas: Mapping[str, dict] | None) -> ParseResult:
        """The format's own reading, under the caps of :meth:`parse`."""
        raise NotImplementedError(f"{type(self).__name__} must implement _parse(text, tool_schemas).")

    @abstractmethod
    def render(self, calls: Sequence[ToolCall]) -> str:
        """The text a model of this family emits to make ``calls``."""

    def call_id(self, text: str, index: int, written: str | None = None) -> str | None:
        """The id that pairs the ``index``-th call of the reply ``text`` with its tool result.

        ``written`` is the id the model wrote (None when it wrote none). Formats whose
        templates need an id on every call and result (Mistral's) override this to give one
        the template accepts; the default keeps what the model wrote.
        """
        return written

    def _error(self, reason: str, tool_name: str | None = None) -> ToolCallError:
        message = f"Could not parse the tool call: {reason}. Write each call as:\n{self.call_format}"
        return ToolCallError(ToolErrorKind.MALFORMED, message, tool_name=tool_name)

    def _object_call(self, name: str, args: str) -> ToolCall | ToolCallError:
        """The call of ``name`` whose arguments are ``args``: one JSON object, or nothing (no arguments)."""
        start = skip_space(args, 0)
        if start == len(args):
            return ToolCall(name=name, arguments={})
        decoded = decode_json(args, start)
        if isinstance(decoded, str):
            return self._error(f"the arguments of {name} are not JSON: {decoded} in {short_snippet(args)}", name)
        value, end = decoded
        if skip_space(args, end) != len(args):
            return self._error(f"text follows the arguments of {name}: {short_snippet(args[end:])}", name)
        if not isinstance(value, dict):
            return self._error(f"the arguments of {name} must be a JSON object, got {type(value).__name__}", name)
        return ToolCall(name=name, arguments=value)

    def _full(self, found: list[ToolCall | ToolCallError]) -> bool:
        """Whether another call would pass ``max_calls``; if so, the error that says so is added to ``found``."""
        if len(found) < self.max_calls:
            return False
        cap = self._error(f"the reply holds more than {self.max_calls} tool calls, and at most {self.max_calls} "
                          "are read from one reply (the parser's max_calls)")
        if not any(isinstance(e, ToolCallError) and e.message == cap.message for e in found):  # said once
            found.append(cap)
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}()" if self.reasoning is None else f"{type(self).__name__}(reasoning={self.reasoning!r})"


def split_reasoning(text: str, markers: tuple[str, str] | None) -> tuple[str | None, str]:
    """``(reasoning, rest)`` of a reply: what comes before the first end marker is reasoning.

    A leading start marker is dropped from the reasoning; a start marker without an end
    marker makes everything after it reasoning (the model stopped while thinking). Without
    ``markers``, or without either marker at the head of the text, there is no reasoning.

    >>> split_reasoning("<think>call add?</think>\\n\\nDone.", ("<think>", "</think>"))
    ('call add?', 'Done.')
    >>> split_reasoning("still thinking</think>ok", ("<think>", "</think>"))
    ('still thinking', 'ok')
    >>> split_reasoning("<think>cut off", ("<think>", "</think>"))
    ('cut off', '')
    >>> split_reasoning("no reasoning", ("<think>", "</think>"))
    (None, 'no reasoning')
    """
    if markers is None:
        return None, text
    start, end = markers
    head = text.lstrip()
    opened = head.startswith(start)
    body = head[len(start):] if opened else text
    cut = body.find(end)
    if cut < 0:
        return (body.strip(), "") if opened else (None, text)
    return body[:cut].strip(), body[cut + len(end):].strip()


class Finder:
    """Finds markers in one text, searching each stretch of text at most once per marker.

    A parser that asks "where is the next ``</tool_call>``?" at every block would scan to
    the end of the text each time when there is none: quadratic. The finder remembers
    where each marker was found (or that it is absent) from where it last looked, so that
    searches moving forward cost linear time in all.

    >>> f = Finder("a<x>b<x>")
    >>> f.find("<x>", 0), f.find("<x>", 2), f.find("<y>", 0), f.first_of(0, "<y>", "<x>")
    (1, 5, 8, 1)
    """

    def __init__(self, text: str):
        self.text = text
        self._found: dict[str, tuple[int, int]] = {}  # marker -> (searched from, found at or len)

    def find(self, needle: str, start: int) -> int:
        """The index of ``needle`` at or after ``start``, or ``len(text)``."""
        cached = self._found.get(needle)
        if cached is not None and cached[0] <= start <= cached[1]:
            return cached[1]
        hit = self.text.find(needle, start)
        hit = len(self.text) if hit < 0 else hit
        self._found[needle] = (start, hit)
        return hit

    def first_of(self, start: int, *needles: str) -> int:
        """The index of the earliest of ``needles`` at or after ``start``, or ``len(text)``."""
        return min(self.find(n, start) for n in needles)


def short_snippet(snippet: str, limit: int = 80) -> str:
    """A snippet of model text for an error message, cut so that messages stay short."""
    snippet = snippet.strip()
    return repr(snippet if len(snippet) <= limit else snippet[:limit] + "...")


_JSON = json.JSONDecoder()


class DecodeFailure(str):
    """Why a JSON value could not be read (a ``str``); ``at_end`` when the text ran out first."""

    at_end: bool = False


def decode_json(text: str, start: int, stop: int | None = None) -> tuple[Any, int] | DecodeFailure:
    """``(value, end)`` for the JSON value starting at ``text[start]``, or the reason it is not one.

    With ``stop``, only ``text[start:stop]`` is read (and a failure's ``at_end`` says
    whether more text might have completed the value). Non-finite numbers (``NaN``,
    ``Infinity``) are read; :meth:`treerl.envs.tools.Tool.validate` refuses them as
    arguments, so that the error names the tool and the argument.
    """
    piece, offset = (text, start) if stop is None else (text[start:stop], 0)
    try:
        value, end = _JSON.raw_decode(piece, offset)
    except json.JSONDecodeError as exc:
        failure = DecodeFailure(f"invalid JSON ({exc.msg} at character {exc.pos - offset})")
        failure.at_end = exc.pos >= len(piece)
        return failure
    except RecursionError:
        return DecodeFailure("invalid JSON (nested too deeply)")
    except ValueError:  # int() refuses numbers of more than sys.get_int_max_str_digits() digits
        return DecodeFailure("invalid JSON (a number has too many digits)")
    return value, end - offset + start


_SPACE = re.compile(r"\s*")


def skip_space(text: str, pos: int) -> int:
    """The index of the first non-space character at or after ``pos`` (``len(text)`` if none)."""
    return _SPACE.match(text, pos).end()


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


_ALPHANUMERIC = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def derived_call_id(text: str, index: int, length: int = 9) -> str:
    """An alphanumeric id for the ``index``-th call of the reply ``text``, a function of both
    (where vLLM draws a random one): a rerun gives the same ids, and the environment and the
    chat renderer, which read the same reply, give the same id to a call and its result.

    >>> derived_call_id("[TOOL_CALLS] [...]", 0) == derived_call_id("[TOOL_CALLS] [...]", 0)
    True
    >>> len(derived_call_id("x", 1)), derived_call_id("x", 1).isalnum(), derived_call_id("x", 0) != derived_call_id("x", 1)
    (9, True, True)
    """
    number = int.from_bytes(hashlib.sha256(f"{index}:{text}".encode()).digest(), "big")
    digits = []
    for _ in range(length):
        number, digit = divmod(number, len(_ALPHANUMERIC))
        digits.append(_ALPHANUMERIC[digit])
    return "".join(digits)


def dump_json(value: Any) -> str:
    """JSON as a model writes it: non-ASCII characters as themselves, not as escapes."""
    return json.dumps(value, ensure_ascii=False)


def name_of(obj: Any) -> str | None:
    """The ``"name"`` of a decoded call object, for the error of a call that failed otherwise."""
    name = obj.get("name") if isinstance(obj, dict) else None
    return name if isinstance(name, str) else None


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (type(None), "null"),
               (list, "array"), (dict, "object"))


def keeps_text(schema: Mapping[str, Any] | None, decoded: Any) -> bool:
    """Whether a text argument whose JSON reading is ``decoded`` should stay text for ``schema``.

    For formats whose values are untyped text (qwen3_coder, glm4_moe): a property whose type
    is a union with ``string`` (``Optional[str]``: ``["string", "null"]``, or ``anyOf``
    members) keeps ``"2024"`` or ``"true"`` as written, since the string is the only
    reading its types admit; where the union also admits the JSON value, that value wins.

    >>> keeps_text({"type": ["string", "null"]}, 2024), keeps_text({"type": ["string", "null"]}, None)
    (True, False)
    >>> keeps_text({"anyOf": [{"type": "integer"}, {"type": "string"}]}, 3), keeps_text({}, 3)
    (False, False)
    """
    if not isinstance(schema, Mapping):
        return False
    named: set[str] = set()
    members = [schema, *(m for key in ("anyOf", "oneOf") for m in schema.get(key) or () if isinstance(m, Mapping))]
    for member in members:
        kind = member.get("type")
        named.update([kind] if isinstance(kind, str) else kind if isinstance(kind, list) else [])
    if "string" not in named:
        return False
    kind = next(name for cls, name in _JSON_TYPES if isinstance(decoded, cls))
    return kind not in named and not (kind == "integer" and "number" in named)
