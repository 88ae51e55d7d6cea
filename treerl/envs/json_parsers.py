"""Tool-call formats that write each call as a JSON object: Hermes, Llama 3 JSON and Mistral.

They differ in the markers around the JSON (``<tool_call>`` tags, a ``<|python_tag|>``
or the start of a line, a ``[TOOL_CALLS]`` list) and in the key of the arguments
(``"arguments"`` or ``"parameters"``; each parser accepts both). Arguments given as a
JSON string holding an object, as some models write them, are decoded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from treerl.envs.parser_base import (
    ParseResult,
    ToolCall,
    ToolCallParser,
    call_from_object,
    decode_json,
    dump_json,
    first_of,
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

    def parse(self, text: str, tool_schemas: Mapping[str, dict] | None = None) -> ParseResult:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                tail = text[pos:]
                if self.close_tag in tail:
                    errors.append(self._error(f"found {self.close_tag} without a {self.open_tag} before it"))
                    tail = tail.replace(self.close_tag, "")
                content.append(tail)
                break
            before = text[pos:start]
            if self.close_tag in before:
                errors.append(self._error(f"found {self.close_tag} without a {self.open_tag} before it"))
                before = before.replace(self.close_tag, "")
            content.append(before)
            pos, call, error, leftover = self._read_block(text, start + len(self.open_tag))
            if call is not None:
                calls.append(call)
            if error is not None:
                errors.append(error)
            content.append(leftover)
        return ParseResult(content="".join(content).strip(), calls=calls, errors=errors)

    def _read_block(self, text: str, body: int) -> tuple[int, ToolCall | None, ToolCallError | None, str]:
        """Read one block whose body starts at ``body``: ``(end, call, error, leftover content)``."""
        start = skip_space(text, body)
        decoded = decode_json(text, start) if text.startswith("{", start) else "expected a JSON object"
        if not isinstance(decoded, str):
            obj, end = decoded
            after = skip_space(text, end)
            next_open = first_of(text, after, self.open_tag)
            if text.startswith(self.close_tag, after):
                end, leftover = after + len(self.close_tag), ""
            elif first_of(text, after, self.close_tag) < next_open:
                return self._skip_block(text, body, "unexpected text after the JSON object")
            else:
                # An unclosed block: the JSON was the call, and any prose after it is content.
                end, leftover = next_open, text[end:next_open]
            call = call_from_object(obj, ("arguments", "parameters"))
            if isinstance(call, str):
                return end, None, self._error(call, name_of(obj)), leftover
            return end, call, None, leftover
        return self._skip_block(text, body, decoded)

    def _skip_block(self, text: str, body: int, reason: str) -> tuple[int, None, ToolCallError, str]:
        stop = first_of(text, body, self.close_tag, self.open_tag)
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
    and has a ``"name"``: other JSON in prose is content.

    >>> text = '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": 1}}'
    >>> Llama3JsonParser().parse(text).calls
    [ToolCall(name='f', arguments={}, id=None), ToolCall(name='g', arguments={'x': 1}, id=None)]
    """

    name = "llama3_json"
    call_format = '{"name": "<tool name>", "parameters": {<arguments as a JSON object>}}'
    python_tag = "<|python_tag|>"
    # End-of-turn tokens show up in the text when it was decoded with special tokens.
    end_tokens = ("<|eom_id|>", "<|eot_id|>")
    # A call starts a line or follows the `;` that ends the previous one.
    _start = re.compile(r"(?:^|;)[ \t]*\{", re.MULTILINE)
    _looks_like_call = re.compile(r'\{\s*"name"\s*:')

    def parse(self, text: str, tool_schemas: Mapping[str, dict] | None = None) -> ParseResult:
        for token in self.end_tokens:
            text = text.replace(token, "")
        tagged = text.find(self.python_tag)
        if tagged >= 0:
            # After the tag the model is in tool mode: everything there must be calls.
            calls, errors = self._read_tagged(text[tagged + len(self.python_tag) :].replace(self.python_tag, ""))
            return ParseResult(content=text[:tagged].strip(), calls=calls, errors=errors)
        return self._read_untagged(text)

    def _read_tagged(self, region: str) -> tuple[list[ToolCall], list[ToolCallError]]:
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        pos = _skip_separators(region, 0)
        while pos < len(region):
            decoded = decode_json(region, pos) if region.startswith("{", pos) else "expected a JSON object"
            if isinstance(decoded, str):
                errors.append(self._error(f"{decoded} in {short_snippet(region[pos:])}"))
                break
            obj, end = decoded
            call = call_from_object(obj, ("parameters", "arguments"))
            if isinstance(call, str):
                errors.append(self._error(call, name_of(obj)))
            else:
                calls.append(call)
            pos = _skip_separators(region, end)
        return calls, errors

    def _read_untagged(self, text: str) -> ParseResult:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        content_pos = search_pos = 0
        after_call = False
        while (match := self._start.search(text, search_pos)) is not None:
            brace = match.end() - 1
            decoded = decode_json(text, brace)
            if isinstance(decoded, str):
                if not self._looks_like_call.match(text, brace):
                    search_pos = brace + 1  # prose that happens to start with a brace
                    continue
                end = first_of(text, brace, "\n")
                found: ToolCall | ToolCallError = self._error(f"{decoded} in {short_snippet(text[brace:end])}")
            else:
                obj, end = decoded
                call = call_from_object(obj, ("parameters", "arguments"))
                if isinstance(call, str) and not (isinstance(obj, dict) and "name" in obj):
                    search_pos = end  # JSON without a "name" is an answer, not a call
                    continue
                found = self._error(call, name_of(obj)) if isinstance(call, str) else call
            between = text[content_pos:brace]
            # The `;` or newlines between two calls are separators, not content.
            content.append("" if after_call and not between.strip(" \t\r\n;") else between)
            if isinstance(found, ToolCallError):
                errors.append(found)
            else:
                calls.append(found)
            content_pos = search_pos = end
            after_call = True
        content.append(text[content_pos:])
        return ParseResult(content="".join(content).strip(), calls=calls, errors=errors)

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(dump_json({"name": c.name, "parameters": c.arguments}) for c in calls)


def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
        pos += 1
    return pos


class MistralParser(ToolCallParser):
    """Mistral: ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` objects.

    Also reads the newer ``[TOOL_CALLS]name[ARGS]{...}`` form (with an optional
    ``[CALL_ID]id`` between name and arguments), one marker per call.

    >>> MistralParser().parse('[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]neg[ARGS]{"x": 2}').calls
    [ToolCall(name='add', arguments={'a': 1}, id=None), ToolCall(name='neg', arguments={'x': 2}, id=None)]
    """

    name = "mistral"
    call_format = '[TOOL_CALLS][{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}]'
    marker = "[TOOL_CALLS]"
    _named = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*(?:\[CALL_ID\]\s*([\w\-]*)\s*)?\[ARGS\]\s*")

    def parse(self, text: str, tool_schemas: Mapping[str, dict] | None = None) -> ParseResult:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        pos = 0
        while (start := text.find(self.marker, pos)) >= 0:
            content.append(text[pos:start])
            pos = self._read(text, start + len(self.marker), calls, errors)
        content.append(text[pos:])
        return ParseResult(content="".join(content).strip(), calls=calls, errors=errors)

    def _read(self, text: str, pos: int, calls: list[ToolCall], errors: list[ToolCallError]) -> int:
        start = skip_space(text, pos)
        named = self._named.match(text, pos)
        if named is not None:
            decoded = decode_json(text, named.end())
            if isinstance(decoded, str):
                return self._skip(text, start, decoded, errors, tool_name=named.group(1))
            arguments, end = decoded
            call = call_from_object({"name": named.group(1), "arguments": arguments}, ("arguments",))
            if isinstance(call, str):
                errors.append(self._error(call, named.group(1)))
            else:
                calls.append(ToolCall(call.name, call.arguments, named.group(2) or None))
            return end
        if not text.startswith(("[", "{"), start):
            return self._skip(text, start, "expected a JSON list of calls", errors)
        decoded = decode_json(text, start)
        if isinstance(decoded, str):
            return self._skip(text, start, decoded, errors)
        value, end = decoded
        for obj in value if isinstance(value, list) else [value]:
            call = call_from_object(obj, ("arguments", "parameters"))
            if isinstance(call, str):
                errors.append(self._error(call, name_of(obj)))
            else:
                calls.append(call)
        return end

    def _skip(
        self, text: str, start: int, reason: str, errors: list[ToolCallError], tool_name: str | None = None
    ) -> int:
        """Record an unreadable call and skip to the next marker (or the end)."""
        stop = text.find(self.marker, start)
        stop = len(text) if stop < 0 else stop
        errors.append(self._error(f"{reason} in {short_snippet(text[start:stop])}", tool_name))
        return stop

    def render(self, calls: Sequence[ToolCall]) -> str:
        if not calls:
            return ""
        objects = [
            {"name": c.name, "arguments": c.arguments, **({"id": c.id} if c.id is not None else {})} for c in calls
        ]
        return self.marker + dump_json(objects)
