"""Tool-call formats with their own tags around each call: GLM-4 MoE and DeepSeek.

GLM-4.5 writes one block per call, the arguments as key/value tags (values are text; JSON
when the argument is not a string)::

    <tool_call>multiply
    <arg_key>a</arg_key>
    <arg_value>17</arg_value>
    </tool_call>

DeepSeek-V3 and R1 write the calls between special tokens, the arguments as fenced JSON
(V3.1 drops the type and the fence: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply
    ```json
    {"a": 17}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Both read blocks with a :class:`~treerl.envs.parser_base.Finder` (linear in the text) and
stop after ``max_calls``.

>>> GlmParser().parse("<tool_call>f\\n<arg_key>a</arg_key>\\n<arg_value>17</arg_value>\\n</tool_call>").calls
[ToolCall(name='f', arguments={'a': 17}, id=None)]
>>> DeepSeekParser().parse(DeepSeekParser().render([ToolCall("f", {"a": 1})])).calls
[ToolCall(name='f', arguments={'a': 1}, id=None)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from treerl.envs.parser_base import (
    Finder,
    ParseResult,
    ToolCall,
    ToolCallParser,
    decode_json,
    dump_json,
    keeps_text,
    short_snippet,
    skip_space,
)
from treerl.errors import ToolCallError

__all__ = ["GlmParser", "DeepSeekParser"]


class _BlockParser(ToolCallParser):
    """Calls between ``open_tag`` and ``close_tag``; text around them is the content."""

    open_tag: str
    close_tag: str
    outer: tuple[str, ...] = ()
    """Markers around the list of calls, dropped from the content."""

    def _parse(self, text: str, tool_schemas: Mapping[str, dict] | None) -> ParseResult:
        content: list[str] = []
        found: list[ToolCall | ToolCallError] = []  # the calls and the unreadable ones, as written
        finder = Finder(text)
        pos = 0
        while True:
            start = finder.find(self.open_tag, pos)
            content.append(text[pos:start])
            if start == len(text) or self._full(found):
                if start < len(text):
                    content.append(text[start:])  # unread: the cap's error says why
                break
            body_start = start + len(self.open_tag)
            end = finder.find(self.close_tag, body_start)
            nested = finder.find(self.open_tag, body_start)
            end = min(end, nested)  # a block without its close tag ends where the next begins
            call = self._call(text[body_start:end], tool_schemas or {})
            found.append(call)
            pos = end + len(self.close_tag) if text.startswith(self.close_tag, end) else end
        joined = "".join(content)
        for marker in self.outer:
            joined = joined.replace(marker, "")
        return ParseResult.of(joined.strip(), found)

    def _call(self, body: str, schemas: Mapping[str, dict]) -> ToolCall | ToolCallError:
        raise NotImplementedError


class GlmParser(_BlockParser):
    """GLM-4.5 / GLM-4 MoE: ``<tool_call>NAME`` then ``<arg_key>``/``<arg_value>`` pairs."""

    name = "glm4_moe"
    call_format = ("<tool_call><tool name>\n<arg_key><argument name></arg_key>\n<arg_value><value></arg_value>\n"
                   "</tool_call>")
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def _call(self, body: str, schemas: Mapping[str, dict]) -> ToolCall | ToolCallError:
        head = body.find("<arg_key>")
        name = (body if head < 0 else body[:head]).strip()
        if not name or "\n" in name or "<" in name:
            return self._error(f"a call must start with the tool's name, got {short_snippet(body)}")
        properties = (schemas.get(name) or {}).get("properties") or {}
        arguments: dict[str, Any] = {}
        pos = 0 if head < 0 else head
        while head >= 0:
            key_end = body.find("</arg_key>", pos)
            value_start = body.find("<arg_value>", pos)
            value_end = body.find("</arg_value>", pos)
            if not (pos < key_end < value_start < value_end):
                return self._error(f"an argument of {name} is not <arg_key>...</arg_key><arg_value>...</arg_value>: "
                                   f"{short_snippet(body[pos:])}", name)
            key = body[pos + len("<arg_key>"):key_end].strip()
            raw = body[value_start + len("<arg_value>"):value_end]
            arguments[key] = _typed(raw, properties.get(key))
            pos = value_end + len("</arg_value>")
            head = body.find("<arg_key>", pos)
            if head < 0 and body[pos:].strip():
                return self._error(f"text follows the arguments of {name}: {short_snippet(body[pos:])}", name)
            pos = head
        return ToolCall(name=name, arguments=arguments)

    def render(self, calls: Sequence[ToolCall]) -> str:
        """Calls as GLM-4.5's template renders them."""
        return "\n".join(
            f"<tool_call>{c.name}\n" + "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else dump_json(v)}</arg_value>\n"
                for k, v in c.arguments.items())
            + "</tool_call>"
            for c in calls
        )


def _typed(raw: str, schema: Any) -> Any:
    """An argument's text as its value: text for strings, else JSON when it reads as JSON and the schema admits it."""
    if isinstance(schema, Mapping) and schema.get("type") == "string":
        return raw
    decoded = decode_json(raw, skip_space(raw, 0))
    if isinstance(decoded, str) or skip_space(raw, decoded[1]) != len(raw):
        return raw  # not JSON: the tool's validation says what was expected
    return raw if keeps_text(schema, decoded[0]) else decoded[0]


class DeepSeekParser(_BlockParser):
    """DeepSeek-V3/R1 (``function<｜tool▁sep｜>NAME`` and fenced JSON) and V3.1 (``NAME<｜tool▁sep｜>{...}``)."""

    name = "deepseek"
    call_format = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><tool name>\n```json\n"
                   "{<arguments as a JSON object>}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    open_tag, close_tag = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    outer = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")

    def _call(self, body: str, schemas: Mapping[str, dict]) -> ToolCall | ToolCallError:
        sep = body.find("<｜tool▁sep｜>")
        if sep < 0:
            return self._error(f"a call has no <｜tool▁sep｜>: {short_snippet(body)}")
        kind, rest = body[:sep].strip(), body[sep + len("<｜tool▁sep｜>"):]
        if kind == "function" and "\n" in rest:  # V3 / R1: the name, then fenced JSON
            name, _, args = rest.partition("\n")
            args = args.strip()
            if args.startswith("```"):
                args = args[args.find("\n") + 1:] if "\n" in args else ""
                args = args[:args.rfind("```")] if "```" in args else args
        else:  # V3.1: the name before the separator
            name, args = kind, rest
        name = name.strip()
        if not name:
            return self._error(f"a call names no tool: {short_snippet(body)}")
        return self._object_call(name, args)

    def render(self, calls: Sequence[ToolCall]) -> str:
        """Calls as DeepSeek-V3/R1's template renders them."""
        if not calls:
            return ""
        return ("<｜tool▁calls▁begin｜>" + "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{c.name}\n```json\n{dump_json(c.arguments)}\n```<｜tool▁call▁end｜>"
            for c in calls) + "<｜tool▁calls▁end｜>")
