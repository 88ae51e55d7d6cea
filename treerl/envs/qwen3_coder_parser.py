"""The Qwen3-Coder tool-call format: XML-like ``<function=...>`` blocks whose values are untyped text.

Parameter values are converted with the tool's JSON Schema when the caller passes it
(see :class:`Qwen3CoderParser`); a value that does not convert is kept as text, so that
schema validation reports it against the right parameter.
"""

from __future__ import annotations

import json
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
    dump_json,
    keeps_text,
    name_of,
    short_snippet,
)
from treerl.errors import ToolCallError

__all__ = ["Qwen3CoderParser"]


class Qwen3CoderParser(ToolCallParser):
    """Qwen3-Coder XML calls; parameter values are text, typed with the tool's JSON Schema.

    ::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    With ``tool_schemas`` (tool name -> parameters schema) a value is converted to the type
    its property declares: ``integer``, ``number``, ``boolean`` and ``null`` from their
    spellings (Python's ``True``/``None`` too), ``object`` and ``array`` from JSON,
    ``string`` kept as written; for a union with ``string`` (``Optional[str]``), JSON only
    when the union admits its type (``2024`` stays ``"2024"``). A value that does not
    convert is kept as text, so that schema validation reports it against the right
    parameter. Without a schema a value is
    read as JSON when it is JSON, else kept as text (so ``"3"`` becomes ``3``).
    A missing ``<tool_call>`` wrapper or missing closing tags are tolerated.

    >>> text = "<function=f>\\n<parameter=n>\\n3\\n</parameter>\\n<parameter=s>\\n3\\n</parameter>\\n</function>"
    >>> schemas = {"f": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}}
    >>> Qwen3CoderParser().parse(text, schemas).calls
    [ToolCall(name='f', arguments={'n': 3, 's': '3'}, id=None)]
    """

    name = "qwen3_coder"
    call_format = (
        "<tool_call>\n<function=tool_name>\n<parameter=param_name>\nvalue\n</parameter>\n</function>\n</tool_call>"
    )
    _block = re.compile(r"<tool_call>|<function=")
    # Names stop at "<" too, so that a failed match costs the text up to the next tag only.
    _function = re.compile(r"<function=([^>\n<]*)>")
    _parameter = re.compile(r"<parameter=([^>\n<]*)>")

    def _parse(self, text: str, tool_schemas: Mapping[str, dict] | None) -> ParseResult:
        content: list[str] = []
        found: list[ToolCall | ToolCallError] = []  # the calls and the unreadable ones, as written
        finder = Finder(text)
        pos = 0
        while (match := self._block.search(text, pos)) is not None and not self._full(found):
            content.append(text[pos : match.start()])
            if match.group() == "<tool_call>":
                end = finder.first_of(match.end(), "</tool_call>", "<tool_call>")
                body = text[match.end() : end]
                pos = end + len("</tool_call>") if text.startswith("</tool_call>", end) else end
            else:
                # A bare <function=...> block without the <tool_call> wrapper.
                end = finder.first_of(match.end(), "</function>", "<tool_call>", "<function=")
                body = text[match.start() : end]
                pos = end + len("</function>") if text.startswith("</function>", end) else end
            call = self._read_block(body, tool_schemas)
            found.append(call)
        content.append(text[pos:])
        stray = "".join(content)
        for tag in ("</tool_call>", "</function>"):
            if tag in stray:
                found.append(self._error(f"found {tag} without an opening tag before it"))
                stray = stray.replace(tag, "")
        return ParseResult.of(stray.strip(), found)

    def _read_block(self, body: str, tool_schemas: Mapping[str, dict] | None) -> ToolCall | ToolCallError:
        function = self._function.search(body)
        if function is None:
            stripped = body.strip()
            if stripped.startswith("{"):
                # Hermes-style JSON inside <tool_call>: read it rather than punish the model.
                decoded = decode_json(stripped, 0)
                if not isinstance(decoded, str) and not stripped[decoded[1] :].strip():
                    call = call_from_object(decoded[0], ("arguments", "parameters"))
                    return self._error(call, name_of(decoded[0])) if isinstance(call, str) else call
            return self._error(f"expected <function=tool_name> in {short_snippet(body)}")
        name = function.group(1).strip()
        if not name:
            return self._error("the function name is empty")
        end = body.find("</function>", function.end())
        inner = body[function.end() : len(body) if end < 0 else end]
        schema = _parameters_schema(tool_schemas, name)
        arguments: dict[str, Any] = {}
        finder = Finder(inner)
        pos = 0
        while (param := self._parameter.search(inner, pos)) is not None:
            key = param.group(1).strip()
            if not key:
                return self._error(f"a parameter of {name} has an empty name", name)
            stop = finder.first_of(param.end(), "</parameter>", "<parameter=")
            arguments[key] = _convert_text(_strip_one_newline(inner[param.end() : stop]), _property(schema, key))
            pos = stop + len("</parameter>") if inner.startswith("</parameter>", stop) else stop
        return ToolCall(name=name, arguments=arguments)

    def render(self, calls: Sequence[ToolCall]) -> str:
        blocks = []
        for call in calls:
            params = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else dump_json(v)}\n</parameter>\n"
                for k, v in call.arguments.items()
            )
            blocks.append(f"<tool_call>\n<function={call.name}>\n{params}</function>\n</tool_call>")
        return "\n".join(blocks)


def _strip_one_newline(value: str) -> str:
    # The template writes exactly one newline on each side of a value; the value's own
    # leading or trailing whitespace is kept.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _parameters_schema(tool_schemas: Mapping[str, dict] | None, name: str) -> dict | None:
    """The parameters schema of tool ``name``; also accepts OpenAI-style tool schemas."""
    if not tool_schemas or not isinstance(tool_schemas.get(name), Mapping):
        return None
    schema = tool_schemas[name]
    if isinstance(schema.get("function"), Mapping):
        schema = schema["function"]
    if "parameters" in schema and isinstance(schema["parameters"], Mapping) and "properties" not in schema:
        schema = schema["parameters"]
    return schema


def _property(schema: Mapping | None, key: str) -> Mapping | None:
    properties = schema.get("properties") if schema is not None else None
    prop = properties.get(key) if isinstance(properties, Mapping) else None
    return prop if isinstance(prop, Mapping) else None


def _loads(value: str) -> Any:
    """``json.loads`` or a sentinel ``_NOT_JSON``."""
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return _NOT_JSON


_NOT_JSON = object()


def _convert_text(value: str, prop: Mapping | None) -> Any:
    """Convert a qwen3_coder parameter value to the type of its schema property (see the class doc)."""
    if prop is None:
        decoded = _loads(value)
        return value if decoded is _NOT_JSON else decoded
    enum = prop.get("enum")
    if isinstance(enum, list) and value in enum:
        return value
    kind = prop.get("type")
    text = value.strip()
    if kind == "string":
        return value
    if kind == "integer":
        decoded = _loads(text)
        if isinstance(decoded, float) and decoded.is_integer():
            return int(decoded)
        return decoded if isinstance(decoded, int) and not isinstance(decoded, bool) else value
    if kind == "number":
        decoded = _loads(text)
        return decoded if isinstance(decoded, (int, float)) and not isinstance(decoded, bool) else value
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), value)
    if kind == "null":
        return None if text.lower() in ("null", "none") else value
    if kind in ("object", "array"):
        decoded = _loads(text)
        wanted = dict if kind == "object" else list
        return decoded if isinstance(decoded, wanted) else value
    # Unions, `Any` and untyped properties: JSON when it is JSON and a type of the union admits it.
    decoded = _loads(text)
    return value if decoded is _NOT_JSON or keeps_text(prop, decoded) else decoded
