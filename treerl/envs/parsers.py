"""Tool-call parsers: from a model's text to :class:`ToolCall` objects, and back.

Each model family writes tool calls in its own markup. A :class:`ToolCallParser` reads
one family's markup (``parse``) and writes it (``render``), so that an environment can
turn sampled text into calls and a test can turn calls into the text a model would emit.

``parse`` never raises: a bad rollout is data. Text without any call gives no calls and
no errors; something that clearly tried to be a call (it carries the family's markers)
but cannot be read gives a :class:`~treerl.errors.ToolCallError` of kind
``MALFORMED`` whose message tells the model what a good call looks like, and the other,
valid calls of the same turn are still returned.

>>> parser = get_parser("hermes")
>>> result = parser.parse('Let me look.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>')
>>> result.content, result.calls
('Let me look.', [ToolCall(name='add', arguments={'a': 1}, id=None)])
>>> parser.parse(parser.render(result.calls)).calls == result.calls
True
"""

from __future__ import annotations

import ast
import io
import json
import keyword
import re
import tokenize
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from treerl.errors import ToolCallError, ToolErrorKind

__all__ = [
    "ToolCall",
    "ParseResult",
    "ToolCallParser",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "PythonicParser",
    "Qwen3CoderParser",
    "PARSERS",
    "get_parser",
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


# Nesting deep enough to exhaust the recursion limit of `json` or `ast` is not a call a
# model meant to make; these are the exceptions the standard readers raise on bad input.
_READ_ERRORS = (ValueError, SyntaxError, RecursionError, MemoryError, tokenize.TokenError)
_JSON = json.JSONDecoder()


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


def _short(snippet: str, limit: int = 80) -> str:
    """A snippet of model text for an error message, cut so that messages stay short."""
    snippet = snippet.strip()
    return repr(snippet if len(snippet) <= limit else snippet[:limit] + "...")


def _decode_json(text: str, start: int) -> tuple[Any, int] | str:
    """``(value, end)`` for the JSON value starting at ``text[start]``, or the reason it is not one."""
    try:
        return _JSON.raw_decode(text, start)
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg} at character {exc.pos - start})"
    except (RecursionError, ValueError):
        return "invalid JSON (nested too deeply)"


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _call_from_object(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | str:
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


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


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
        start = _skip_space(text, body)
        decoded = _decode_json(text, start) if text.startswith("{", start) else "expected a JSON object"
        if not isinstance(decoded, str):
            obj, end = decoded
            after = _skip_space(text, end)
            next_open = _first_of(text, after, self.open_tag)
            if text.startswith(self.close_tag, after):
                end, leftover = after + len(self.close_tag), ""
            elif _first_of(text, after, self.close_tag) < next_open:
                return self._skip_block(text, body, "unexpected text after the JSON object")
            else:
                # An unclosed block: the JSON was the call, and any prose after it is content.
                end, leftover = next_open, text[end:next_open]
            call = _call_from_object(obj, ("arguments", "parameters"))
            if isinstance(call, str):
                return end, None, self._error(call, _name_of(obj)), leftover
            return end, call, None, leftover
        return self._skip_block(text, body, decoded)

    def _skip_block(self, text: str, body: int, reason: str) -> tuple[int, None, ToolCallError, str]:
        stop = _first_of(text, body, self.close_tag, self.open_tag)
        end = stop + len(self.close_tag) if text.startswith(self.close_tag, stop) else stop
        return end, None, self._error(f"{reason} in {_short(text[body:stop])}"), ""

    def render(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(
            f"{self.open_tag}\n{_dumps({'name': c.name, 'arguments': c.arguments})}\n{self.close_tag}" for c in calls
        )


def _name_of(obj: Any) -> str | None:
    name = obj.get("name") if isinstance(obj, dict) else None
    return name if isinstance(name, str) else None


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
            decoded = _decode_json(region, pos) if region.startswith("{", pos) else "expected a JSON object"
            if isinstance(decoded, str):
                errors.append(self._error(f"{decoded} in {_short(region[pos:])}"))
                break
            obj, end = decoded
            call = _call_from_object(obj, ("parameters", "arguments"))
            if isinstance(call, str):
                errors.append(self._error(call, _name_of(obj)))
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
            decoded = _decode_json(text, brace)
            if isinstance(decoded, str):
                if not self._looks_like_call.match(text, brace):
                    search_pos = brace + 1  # prose that happens to start with a brace
                    continue
                end = _first_of(text, brace, "\n")
                found: ToolCall | ToolCallError = self._error(f"{decoded} in {_short(text[brace:end])}")
            else:
                obj, end = decoded
                call = _call_from_object(obj, ("parameters", "arguments"))
                if isinstance(call, str) and not (isinstance(obj, dict) and "name" in obj):
                    search_pos = end  # JSON without a "name" is an answer, not a call
                    continue
                found = self._error(call, _name_of(obj)) if isinstance(call, str) else call
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
        return "; ".join(_dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


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
        start = _skip_space(text, pos)
        named = self._named.match(text, pos)
        if named is not None:
            decoded = _decode_json(text, named.end())
            if isinstance(decoded, str):
                return self._skip(text, start, decoded, errors, tool_name=named.group(1))
            arguments, end = decoded
            call = _call_from_object({"name": named.group(1), "arguments": arguments}, ("arguments",))
            if isinstance(call, str):
                errors.append(self._error(call, named.group(1)))
            else:
                calls.append(ToolCall(call.name, call.arguments, named.group(2) or None))
            return end
        if not text.startswith(("[", "{"), start):
            return self._skip(text, start, "expected a JSON list of calls", errors)
        decoded = _decode_json(text, start)
        if isinstance(decoded, str):
            return self._skip(text, start, decoded, errors)
        value, end = decoded
        for obj in value if isinstance(value, list) else [value]:
            call = _call_from_object(obj, ("arguments", "parameters"))
            if isinstance(call, str):
                errors.append(self._error(call, _name_of(obj)))
            else:
                calls.append(call)
        return end

    def _skip(
        self, text: str, start: int, reason: str, errors: list[ToolCallError], tool_name: str | None = None
    ) -> int:
        """Record an unreadable call and skip to the next marker (or the end)."""
        stop = text.find(self.marker, start)
        stop = len(text) if stop < 0 else stop
        errors.append(self._error(f"{reason} in {_short(text[start:stop])}", tool_name))
        return stop

    def render(self, calls: Sequence[ToolCall]) -> str:
        if not calls:
            return ""
        objects = [
            {"name": c.name, "arguments": c.arguments, **({"id": c.id} if c.id is not None else {})} for c in calls
        ]
        return self.marker + _dumps(objects)


class PythonicParser(ToolCallParser):
    """Llama 3.2/4 "pythonic" calls: a Python list of calls, ``[fn(a=1, b="x"), g()]``.

    Read with :mod:`ast`, never evaluated: arguments must be keyword arguments whose values
    are literals (strings, numbers, ``True``/``False``/``None``, lists, tuples, dicts with
    string keys; JSON's ``true``/``false``/``null`` are accepted too). The list must start a
    line (or follow ``<|python_start|>``), so that prose in brackets stays prose.

    >>> [(c.name, c.arguments) for c in PythonicParser().parse('[get_weather(city="Paris", days=2), now()]').calls]
    [('get_weather', {'city': 'Paris', 'days': 2}), ('now', {})]
    """

    name = "pythonic"
    call_format = '[tool_name(param="value", other=1), other_tool()]'
    markers = ("<|python_start|>", "<|python_end|>")
    _start = re.compile(r"^[ \t]*(\[)\s*[A-Za-z_][\w.]*\s*\(", re.MULTILINE)
    _json_names = {"true": True, "false": False, "null": None}

    def parse(self, text: str, tool_schemas: Mapping[str, dict] | None = None) -> ParseResult:
        for marker in self.markers:
            # The markers stand on their own line for the purpose of finding the list.
            text = text.replace(marker, "\n")
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        pos = 0
        while (match := self._start.search(text, pos)) is not None:
            start = match.start(1)
            content.append(text[pos:start])
            end = _closing_bracket(text, start)
            if end is None:
                stop = text.find("\n", start)
                stop = len(text) if stop < 0 else stop
                errors.append(self._error(f"unbalanced brackets or quotes in {_short(text[start:stop])}"))
                pos = stop
                continue
            self._read_list(text[start:end], calls, errors)
            pos = end
        content.append(text[pos:])
        return ParseResult(content="".join(content).strip(), calls=calls, errors=errors)

    def _read_list(self, source: str, calls: list[ToolCall], errors: list[ToolCallError]) -> None:
        try:
            tree = ast.parse(source, mode="eval")
        except _READ_ERRORS as exc:
            errors.append(self._error(f"invalid Python ({_reason(exc)}) in {_short(source)}"))
            return
        if not isinstance(tree.body, ast.List):
            errors.append(self._error(f"expected a list of calls, got {_short(source)}"))
            return
        for node in tree.body.elts:
            call = self._read_call(node)
            if isinstance(call, ToolCallError):
                errors.append(call)
            else:
                calls.append(call)

    def _read_call(self, node: ast.expr) -> ToolCall | ToolCallError:
        if not isinstance(node, ast.Call):
            return self._error(f"expected a call like tool_name(param=value), got {_short(ast.unparse(node))}")
        name = _dotted_name(node.func)
        if name is None:
            return self._error(f"the called thing must be a tool name, got {_short(ast.unparse(node.func))}")
        if node.args:
            return self._error(f"{name}() was given positional arguments; name every argument (param=value)", name)
        arguments: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return self._error(f"{name}() uses **; name every argument (param=value)", name)
            try:
                arguments[kw.arg] = self._literal(kw.value)
            except ValueError as exc:
                return self._error(f"argument {kw.arg!r} of {name}() {exc}", name)
        return ToolCall(name=name, arguments=arguments)

    def _literal(self, node: ast.expr) -> Any:
        """The JSON-compatible value of a literal node; ``ValueError`` for anything else."""
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
            return node.value
        if isinstance(node, ast.Name) and node.id in self._json_names:
            return self._json_names[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self._literal(node.operand)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self._literal(elt) for elt in node.elts]
        if isinstance(node, ast.Dict):
            result = {}
            for key, value in zip(node.keys, node.values):
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    raise ValueError("has a dict whose keys are not all strings")
                result[key.value] = self._literal(value)
            return result
        raise ValueError(f"is not a literal value: {_short(ast.unparse(node))}")

    def render(self, calls: Sequence[ToolCall]) -> str:
        rendered = []
        for call in calls:
            for name in (call.name, *call.arguments):
                if not all(part.isidentifier() and not keyword.iskeyword(part) for part in name.split(".")):
                    raise ValueError(f"cannot render {name!r} in pythonic calls: it is not a Python identifier")
            args = ", ".join(f"{k}={_python_literal(v)}" for k, v in call.arguments.items())
            rendered.append(f"{call.name}({args})")
        return f"[{', '.join(rendered)}]"


def _python_literal(value: Any) -> str:
    """Python source for a JSON-compatible value (``repr`` spells every such value as a literal)."""
    return repr(value)


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return exc.msg or "syntax error"
    if isinstance(exc, (RecursionError, MemoryError)):
        return "nested too deeply"
    return str(exc) or type(exc).__name__


def _closing_bracket(text: str, start: int) -> int | None:
    """The index just past the bracket that closes ``text[start] == "["``, using Python's tokenizer.

    The tokenizer knows Python's strings, so brackets inside string arguments do not count.
    ``None`` when the brackets never balance or the tokenizer gives up.
    """
    # Line/column positions of the tokens are turned back into an index into `text`.
    line_starts = [start]
    for line in io.StringIO(text[start:]):
        line_starts.append(line_starts[-1] + len(line))
    depth = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text[start:]).readline):
            if tok.type == tokenize.OP and tok.string in "([{":
                depth += 1
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth -= 1
                if depth == 0:
                    row, col = tok.end
                    return line_starts[row - 1] + col
            elif tok.type in (tokenize.ENDMARKER, tokenize.ERRORTOKEN):
                return None  # text that is not Python, or the end before the list closed
    except _READ_ERRORS:
        return None
    return None


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
    ``string`` kept as written. A value that does not convert is kept as text, so that
    schema validation reports it against the right parameter. Without a schema a value is
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
    _function = re.compile(r"<function=([^>\n]*)>")
    _parameter = re.compile(r"<parameter=([^>\n]*)>")

    def parse(self, text: str, tool_schemas: Mapping[str, dict] | None = None) -> ParseResult:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        pos = 0
        while (match := self._block.search(text, pos)) is not None:
            content.append(text[pos : match.start()])
            if match.group() == "<tool_call>":
                end = _first_of(text, match.end(), "</tool_call>", "<tool_call>")
                body = text[match.end() : end]
                pos = end + len("</tool_call>") if text.startswith("</tool_call>", end) else end
            else:
                # A bare <function=...> block without the <tool_call> wrapper.
                end = _first_of(text, match.end(), "</function>", "<tool_call>", "<function=")
                body = text[match.start() : end]
                pos = end + len("</function>") if text.startswith("</function>", end) else end
            call = self._read_block(body, tool_schemas)
            if isinstance(call, ToolCallError):
                errors.append(call)
            else:
                calls.append(call)
        content.append(text[pos:])
        stray = "".join(content)
        for tag in ("</tool_call>", "</function>"):
            if tag in stray:
                errors.append(self._error(f"found {tag} without an opening tag before it"))
                stray = stray.replace(tag, "")
        return ParseResult(content=stray.strip(), calls=calls, errors=errors)

    def _read_block(self, body: str, tool_schemas: Mapping[str, dict] | None) -> ToolCall | ToolCallError:
        function = self._function.search(body)
        if function is None:
            stripped = body.strip()
            if stripped.startswith("{"):
                # Hermes-style JSON inside <tool_call>: read it rather than punish the model.
                decoded = _decode_json(stripped, 0)
                if not isinstance(decoded, str) and not stripped[decoded[1] :].strip():
                    call = _call_from_object(decoded[0], ("arguments", "parameters"))
                    return self._error(call, _name_of(decoded[0])) if isinstance(call, str) else call
            return self._error(f"expected <function=tool_name> in {_short(body)}")
        name = function.group(1).strip()
        if not name:
            return self._error("the function name is empty")
        end = body.find("</function>", function.end())
        inner = body[function.end() : len(body) if end < 0 else end]
        schema = _parameters_schema(tool_schemas, name)
        arguments: dict[str, Any] = {}
        pos = 0
        while (param := self._parameter.search(inner, pos)) is not None:
            key = param.group(1).strip()
            if not key:
                return self._error(f"a parameter of {name} has an empty name", name)
            stop = _first_of(inner, param.end(), "</parameter>", "<parameter=")
            arguments[key] = _convert_text(_strip_one_newline(inner[param.end() : stop]), _property(schema, key))
            pos = stop + len("</parameter>") if inner.startswith("</parameter>", stop) else stop
        return ToolCall(name=name, arguments=arguments)

    def render(self, calls: Sequence[ToolCall]) -> str:
        blocks = []
        for call in calls:
            params = "".join(
                f"<parameter={k}>\n{v if isinstance(v, str) else _dumps(v)}\n</parameter>\n"
                for k, v in call.arguments.items()
            )
            blocks.append(f"<tool_call>\n<function={call.name}>\n{params}</function>\n</tool_call>")
        return "\n".join(blocks)


def _first_of(text: str, start: int, *needles: str) -> int:
    """The index of the earliest of ``needles`` in ``text[start:]``, or ``len(text)``."""
    found = [i for i in (text.find(n, start) for n in needles) if i >= 0]
    return min(found) if found else len(text)


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
    # Unions, `Any` and untyped properties: JSON when it is JSON.
    decoded = _loads(text)
    return value if decoded is _NOT_JSON else decoded


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
}
"""Parser classes by name, for configs and ``get_parser``."""

# Checked in order: Qwen3-Coder templates contain both `<function=` and `<tool_call>`.
_TEMPLATE_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<function=",), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>", "<|start_header_id|>", "<|end_header_id|>"), "llama3_json"),
)


def get_parser(name: str | None = None, *, chat_template: str | None = None, tokenizer: Any = None) -> ToolCallParser:
    """The tool-call parser for ``name``, or the one the chat template implies.

    An explicit ``name`` wins. Otherwise the template (``chat_template``, else
    ``tokenizer.chat_template``) is searched for each family's markers; ``hermes`` when
    none is found.

    >>> get_parser("mistral")
    MistralParser()
    >>> get_parser(chat_template="{{ '<|start_header_id|>' + message['role'] }}")
    Llama3JsonParser()
    """
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}")
        return PARSERS[name]()
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        # Tokenizers may hold several named templates (e.g. "default" and "tool_use").
        template = "\n".join(str(t) for t in template.values())
    if isinstance(template, str):
        for markers, parser_name in _TEMPLATE_MARKERS:
            if any(marker in template for marker in markers):
                return PARSERS[parser_name]()
    return HermesParser()
