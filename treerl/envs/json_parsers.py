"""Tool-call formats that write each call as a JSON object: Hermes, Llama 3 JSON and Mistral.

They differ in the markers around the JSON (``<tool_call>`` tags, a ``<|python_tag|>``
or the start of a line, a ``[TOOL_CALLS]`` list) and in the key of the arguments
(``"arguments"`` or ``"parameters"``; each parser accepts both). Arguments given as a
JSON string holding an object, as some models write them, are decoded.

Each decode of a call is linear in what it reads, and ``max_calls`` bounds the number of
calls read; the untagged Llama 3 form, which looks for calls in prose, also bounds its
attempts (``max_attempts``) and reads a candidate one line at a time first, so that
prose full of braces costs linear time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from treerl.envs.parser_base import (
    Finder,
    ParseResult,
    ToolCall,
    ToolCallParser,
    call_from_object,
    decode_json,
    derived_call_id,
    dump_json,
    name_of,
    short_snippet,
    skip_space,
)
from treerl.errors import ToolCallError

__all__ = ["HermesParser", "Llama3JsonParser", "MistralParser"]


class HermesParser(ToolCallParser):
    """Hermes, Qwen2.5 and Qwen3: ``<tool_call>`` JSON ``</tool_call>``, several per turn.

    Tolerates a missing closing tag (generation often stops on the end-of-turn token right
    after the JSON), ``"parameters"`` instead of ``"arguments"`` and arguments given as a
    JSON string.

    >>> HermesParser().parse('<tool_call>\\n{"name": "f", "parameters": "{\\\\"x\\\\": 2}"}').calls
    [ToolCall(name='f', arguments={'x': 2}, id=None)]
    """

    name = "hermes"
    call_format = '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>'
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def _parse(self, text: str, tool_schemas: Mapping[str, dict] | None) -> ParseResult:
        content: list[str] = []
        found: list[ToolCall | ToolCallError] = []  # the calls and the unreadable ones, as written
        finder = Finder(text)
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start >= 0 and self._full(found):
                content.append(text[pos:])  # unread: the cap's error says why
                break
            if start < 0:
                tail = text[pos:]
                if self.close_tag in tail:
                    found.append(self._error(f"found {self.close_tag} without a {self.open_tag} before it"))
                    tail = tail.replace(self.close_tag, "")
                content.append(tail)
                break
            before = text[pos:start]
            if self.close_tag in before:
                found.append(self._error(f"found {self.close_tag} without a {self.open_tag} before it"))
                before = before.replace(self.close_tag, "")
            content.append(before)
            pos, call, error, leftover = self._read_block(text, start + len(self.open_tag), finder)
            if call is not None:
                found.append(call)
            if error is not None:
                found.append(error)
            content.append(leftover)
        return ParseResult.of("".join(content).strip(), found)

    def _read_block(self, text: str, body: int, finder: Finder) -> tuple[int, ToolCall | None, ToolCallError | None, str]:
        """Read one block whose body starts at ``body``: ``(end, call, error, leftover content)``."""
        start = skip_space(text, body)
        decoded = decode_json(text, start) if text.startswith("{", start) else "expected a JSON object"
        if not isinstance(decoded, str):
            obj, end = decoded
            after = skip_space(text, end)
            next_open = finder.find(self.open_tag, after)
            if text.startswith(self.close_tag, after):
                end, leftover = after + len(self.close_tag), ""
            elif finder.find(self.close_tag, after) < next_open:
                return self._skip_block(text, body, "unexpected text after the JSON object", finder)
            else:
                # An unclosed block: the JSON was the call, and any prose after it is content.
                end, leftover = next_open, text[end:next_open]
            call = call_from_object(obj, ("arguments", "parameters"))
            if isinstance(call, str):
                return end, None, self._error(call, name_of(obj)), leftover
            return end, call, None, leftover
        return self._skip_block(text, body, decoded, finder)

    def _skip_block(self, text: str, body: int, reason: str, finder: Finder) -> tuple[int, None, ToolCallError, str]:
        stop = finder.first_of(body, self.close_tag, self.open_tag)
        end = stop + len(self.close_tag) if text.startswith(self.close_tag, stop) else stop
        return end, None, self._error(f"{reason} in {short_snippet(text[body:stop])}"), ""

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(
            f"{self.open_tag}\n{dump_json({'name': c.name, 'arguments': c.arguments})}\n{self.close_tag}" for c in calls
        )


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}``.

    With or without a leading ``<|python_tag|>``; several calls separated by ``;`` or
    newlines. Without the tag, a JSON object counts as a call only when it starts a line
    (or follows the ``;`` after a call) and has a ``"name"``: other JSON in prose is
    content. Looking for calls in prose stops after ``max_attempts`` JSON objects (with an
    error naming the cap), so that text full of braces costs linear time.

    >>> text = '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": 1}}'
    >>> Llama3JsonParser().parse(text).calls
    [ToolCall(name='f', arguments={}, id=None), ToolCall(name='g', arguments={'x': 1}, id=None)]
    """

    name = "llama3_json"
    call_format = '{"name": "<tool name>", "parameters": {<arguments as a JSON object>}}'
    python_tag = "<|python_tag|>"
    # End-of-turn tokens show up in the text when it was decoded with special tokens.
    end_tokens = ("<|eom_id|>", "<|eot_id|>")
    max_attempts: int = 1024
    """JSON objects at line starts tried as calls in one untagged reply."""
    # A call starts a line with an object that has a key (`{}` is never a call).
    _start = re.compile(r'^[ \t]*\{(?=\s*")', re.MULTILINE)
    _looks_like_call = re.compile(r'\{\s*"name"\s*:')

    def _parse(self, text: str, tool_schemas: Mapping[str, dict] | None) -> ParseResult:
        for token in self.end_tokens:
            text = text.replace(token, "")
        tagged = text.find(self.python_tag)
        if tagged >= 0:
            # After the tag the model is in tool mode: everything there must be calls.
            found = self._read_tagged(text[tagged + len(self.python_tag) :].replace(self.python_tag, ""))
            return ParseResult.of(text[:tagged].strip(), found)
        return self._read_untagged(text)

    def _read_tagged(self, region: str) -> list[ToolCall | ToolCallError]:
        found: list[ToolCall | ToolCallError] = []  # the calls and the unreadable ones, as written
        pos = _skip_separators(region, 0)
        while pos < len(region) and not self._full(found):
            decoded = decode_json(region, pos) if region.startswith("{", pos) else "expected a JSON object"
            if isinstance(decoded, str):
                found.append(self._error(f"{decoded} in {short_snippet(region[pos : pos + 100])}"))
                break
            obj, end = decoded
            call = call_from_object(obj, ("parameters", "arguments"))
            if isinstance(call, str):
                found.append(self._error(call, name_of(obj)))
            else:
                found.append(call)
            pos = _skip_separators(region, end)
        return found

    def _read_untagged(self, text: str) -> ParseResult:
        content: list[str] = []
        found: list[ToolCall | ToolCallError] = []  # the calls and the unreadable ones, as written
        finder = Finder(text)
        content_pos = search_pos = 0
        after_call = False
        attempts = long_failures = 0
        while (brace := self._candidate(text, search_pos, after_call)) is not None:
            attempts += 1
            if attempts > self.max_attempts:
                found.append(self._error(f"the reply has more than {self.max_attempts} JSON objects at line starts, "
                                         f"and at most {self.max_attempts} are tried as calls (max_attempts)"))
                break
            if self._full(found):
                break
            decoded, long = self._decode(text, brace, finder)
            if isinstance(decoded, str):
                long_failures += long
                if long_failures > self.max_calls:
                    found.append(self._error(f"more than {self.max_calls} JSON objects spanning several lines "
                                             "could not be read; reading stopped there"))
                    break
                if not self._looks_like_call.match(text, brace):
                    search_pos, after_call = brace + 1, False  # prose that happens to start with a brace
                    continue
                end = finder.find("\n", brace)
                item: ToolCall | ToolCallError = self._error(f"{decoded} in {short_snippet(text[brace : brace + 100])}")
            else:
                obj, end = decoded
                call = call_from_object(obj, ("parameters", "arguments"))
                if isinstance(call, str) and not (isinstance(obj, dict) and "name" in obj):
                    search_pos, after_call = end, False  # JSON without a "name" is an answer, not a call
                    continue
                item = self._error(call, name_of(obj)) if isinstance(call, str) else call
            between = text[content_pos:brace]
            # The `;` or newlines between two calls are separators, not content.
            content.append("" if after_call and not between.strip(" \t\r\n;") else between)
            found.append(item)
            content_pos = search_pos = end
            after_call = True
        content.append(text[content_pos:])
        return ParseResult.of("".join(content).strip(), found)

    def _candidate(self, text: str, pos: int, after_call: bool) -> int | None:
        """Where the next call may start: after a call's ``;`` on the same line, else at a line start."""
        if after_call:
            follow = _SAME_LINE_SEPARATOR.match(text, pos)
            if follow is not None:
                return follow.end() - 1
        match = self._start.search(text, pos)
        return None if match is None else match.end() - 1

    @staticmethod
    def _decode(text: str, brace: int, finder: Finder) -> tuple[tuple[Any, int] | str, bool]:
        """Decode the object at ``brace``: ``(decoded or reason, whether it read past its line)``.

        Its line is read first, so that a failure costs the line, not the rest of the text
        (a JSON string never spans lines). Only an object still open at the line's end is
        read from the whole text, and such failures are capped by the caller.
        """
        line_end = finder.find("\n", brace)
        decoded = decode_json(text, brace, line_end)
        if not isinstance(decoded, str) or line_end == len(text) or not decoded.at_end:
            return decoded, False
        return decode_json(text, brace), True

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(dump_json({"name": c.name, "parameters": c.arguments}) for c in calls)


_SAME_LINE_SEPARATOR = re.compile(r"[ \t]*;[ \t]*\{")


def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
        pos += 1
    return pos


class MistralParser(ToolCallParser):
    """Mistral: ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` objects.

    Also reads the newer ``[TOOL_CALLS]name[ARGS]{...}`` form (with an optional
    ``[CALL_ID]id`` between name and arguments), one marker per call.

    Mistral's templates refuse a call or a tool result without an id of 9 alphanumerics, and
    Mistral-7B-v0.3 writes its calls without one: :meth:`call_id` keeps an id the model wrote
    in that form and derives one from the reply otherwise (:func:`derived_call_id`).

    >>> MistralParser().parse('[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]neg[ARGS]{"x": 2}').calls
    [ToolCall(name='add', arguments={'a': 1}, id=None), ToolCall(name='neg', arguments={'x': 2}, id=None)]
    """

    name = "mistral"
    call_format = '[TOOL_CALLS][{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}]'
    marker = "[TOOL_CALLS]"
    _named = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*(?:\[CALL_ID\]\s*([\w\-]*)\s*)?\[ARGS\]\s*")
    _template_id = re.compile(r"[A-Za-z0-9]{9}")

    def call_id(self, text: str, index: int, written: str | None = None) -> str:
        """The id the model wrote when it is 9 alphanumerics, else one derived from ``text`` and ``index``.

        >>> parser = MistralParser()
        >>> parser.call_id("...", 0, "abcDEF123"), parser.call_id("...", 0, "call_1") == parser.call_id("...", 0)
        ('abcDEF123', True)
        """
        if written is not None and self._template_id.fullmatch(written):
            return written
        return derived_call_id(text, index)

    def _parse(self, text: str, tool_schemas: Mapping[str, dict] | None) -> ParseResult:
        content: list[str] = []
        found: list[ToolCall | ToolCallError] = []  # the calls and the unreadable ones, as written
        pos = 0
        while (start := text.find(self.marker, pos)) >= 0 and not self._full(found):
            content.append(text[pos:start])
            pos = self._read(text, start + len(self.marker), found)
        content.append(text[pos:])
        return ParseResult.of("".join(content).strip(), found)

    def _read(self, text: str, pos: int, found: list[ToolCall | ToolCallError]) -> int:
        start = skip_space(text, pos)
        named = self._named.match(text, pos)
        if named is not None:
            decoded = decode_json(text, named.end())
            if isinstance(decoded, str):
                return self._skip(text, start, decoded, found, tool_name=named.group(1))
            arguments, end = decoded
            call = call_from_object({"name": named.group(1), "arguments": arguments}, ("arguments",))
            if isinstance(call, str):
                found.append(self._error(call, named.group(1)))
            else:
                found.append(ToolCall(call.name, call.arguments, named.group(2) or None))
            return end
        if not text.startswith(("[", "{"), start):
            return self._skip(text, start, "expected a JSON list of calls", found)
        decoded = decode_json(text, start)
        if isinstance(decoded, str):
            return self._skip(text, start, decoded, found)
        value, end = decoded
        for i, obj in enumerate(value if isinstance(value, list) else [value]):
            if i and self._full(found):
                break
            call = call_from_object(obj, ("arguments", "parameters"))
            if isinstance(call, str):
                found.append(self._error(call, name_of(obj)))
            else:
                found.append(call)
        return end

    def _skip(
        self, text: str, start: int, reason: str, found: list[ToolCall | ToolCallError], tool_name: str | None = None
    ) -> int:
        """Record an unreadable call and skip to the next marker (or the end)."""
        stop = text.find(self.marker, start)
        stop = len(text) if stop < 0 else stop
        found.append(self._error(f"{reason} in {short_snippet(text[start:stop])}", tool_name))
        return stop

    def render(self, calls: Sequence[ToolCall]) -> str:
        if not calls:
            return ""
        objects = [
            {"name": c.name, "arguments": c.arguments, **({"id": c.id} if c.id is not None else {})} for c in calls
        ]
        return self.marker + dump_json(objects)
