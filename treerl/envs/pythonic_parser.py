"""The "pythonic" tool-call format of Llama 3.2 and 4 (and of Gemma 3's tool-use templates): a Python list
of calls, ``[f(a=1), g()]``.

The list is read with :mod:`ast` and never evaluated: only keyword arguments with literal
values make a call. Brackets are matched by a scanner that knows Python's strings and
comments, so brackets inside string arguments do not count.

The work is linear in the text: a list ends before the next line that starts another list
of calls, the scanner stops at ``max_depth`` levels of brackets, and one reply is read up
to ``max_values`` brackets and commas in all (so :func:`ast.parse` never sees more), each
cap giving a ``MALFORMED`` error that names it.
"""

from __future__ import annotations

import ast
import keyword
import re
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from treerl.envs.parser_base import ParseResult, ToolCall, ToolCallParser, short_snippet
from treerl.envs.python_source import parse as parse_python
from treerl.errors import ToolCallError

__all__ = ["PythonicParser"]

# What `ast.parse` raises on bad input (deep nesting included).
_READ_ERRORS = (ValueError, SyntaxError, RecursionError, MemoryError)
# Brackets, commas, comments and string openers: what the bracket scanner stops at.
_EVENT = re.compile("[][(){},#]|'''|\"\"\"|'|\"")
# The rest of a string literal after its opening quote(s); a backslash always takes the
# next character with it (also in raw strings, where it keeps a quote from ending them).
_STRING_END = {
    "'": re.compile(r"(?:[^'\\\n]|\\.)*'", re.DOTALL),
    '"': re.compile(r'(?:[^"\\\n]|\\.)*"', re.DOTALL),
    "'''": re.compile(r"(?:[^'\\]|\\.|'(?!''))*'''", re.DOTALL),
    '"""': re.compile(r'(?:[^"\\]|\\.|"(?!""))*"""', re.DOTALL),
}
# Model text is compiled under this file name, so that the warnings the compiler gives for
# it ("invalid decimal literal", "invalid escape sequence") are dropped and only those.
_SOURCE_NAME = "<treerl tool call>"
for _category in (SyntaxWarning, DeprecationWarning):
    warnings.filterwarnings("ignore", category=_category, module=re.escape(_SOURCE_NAME))
# Integers whose decimal form Python refuses to print (``sys.get_int_max_str_digits``).
_MAX_INT_BITS = int((getattr(sys, "get_int_max_str_digits", lambda: 4300)() or 4300) * 3.3219)


class PythonicParser(ToolCallParser):
    """Llama 3.2/4 (and Gemma 3) "pythonic" calls: a Python list of calls, ``[fn(a=1, b="x"), g()]``.

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
    max_depth: int = 64
    """Brackets nested deeper than this are not a call a model means to make."""
    max_values: int = 4096
    """Brackets and commas read from one reply, which bounds the work of :func:`ast.parse`."""
    _start = re.compile(r"^[ \t]*(\[)\s*[A-Za-z_][\w.]*\s*\(", re.MULTILINE)
    _json_names = {"true": True, "false": False, "null": None}

    def _parse(self, text: str, tool_schemas: Mapping[str, dict] | None) -> ParseResult:
        for marker in self.markers:
            # The markers stand on their own line for the purpose of finding the list.
            text = text.replace(marker, "\n")
        content: list[str] = []
        found: list[ToolCall | ToolCallError] = []  # the calls and the unreadable ones, as written
        budget = [self.max_values]
        pos = 0
        match = self._start.search(text)
        while match is not None and not self._full(found):
            start = match.start(1)
            content.append(text[pos:start])
            # A list ends before the next line that starts one: every character is scanned once.
            following = self._start.search(text, match.end())
            stop = len(text) if following is None else following.start(1)
            end = self._closing_bracket(text, start, stop, budget)
            if isinstance(end, str):
                found.append(self._error(end))
                pos = start
                break
            if end is None:
                line_end = text.find("\n", start, stop)
                pos = stop if line_end < 0 else line_end
                found.append(self._error(f"unbalanced brackets or quotes in {short_snippet(text[start:pos])}"))
            else:
                self._read_list(text[start:end], found)
                pos = end
            match = following
        content.append(text[pos:])
        return ParseResult.of("".join(content).strip(), found)

    def _closing_bracket(self, text: str, start: int, stop: int, budget: list[int]) -> int | str | None:
        """The index just past the bracket that closes ``text[start] == "["``, looking before ``stop``.

        ``None`` when the brackets or quotes do not close before ``stop``; the reason as a
        ``str`` when a cap is reached. ``budget`` holds the brackets and commas the reply
        may still spend.
        """
        depth, pos = 0, start
        while (event := _EVENT.search(text, pos, stop)) is not None:
            token, pos = event.group(), event.end()
            if token in _STRING_END:
                rest = _STRING_END[token].match(text, pos, stop)
                if rest is None:
                    return None
                pos = rest.end()
                continue
            if token == "#":
                line_end = text.find("\n", pos, stop)
                if line_end < 0:
                    return None
                pos = line_end
                continue
            budget[0] -= 1
            if budget[0] < 0:
                return (f"the reply has more than {self.max_values} brackets and commas in calls, and at most "
                        f"{self.max_values} are read from one reply (the parser's max_values)")
            if token in "([{":
                depth += 1
                if depth > self.max_depth:
                    return f"brackets are nested more than {self.max_depth} deep (the parser's max_depth)"
            elif token in ")]}":
                depth -= 1
                if depth == 0:
                    return pos
        return None

    def _read_list(self, source: str, found: list[ToolCall | ToolCallError]) -> None:
        try:
            tree = parse_python(source, filename=_SOURCE_NAME, mode="eval")
        except _READ_ERRORS as exc:
            found.append(self._error(f"invalid Python ({_reason(exc)}) in {short_snippet(source)}"))
            return
        if not isinstance(tree.body, ast.List):
            found.append(self._error(f"expected a list of calls, got {short_snippet(source)}"))
            return
        for node in tree.body.elts:
            if self._full(found):
                return
            call = self._read_call(node, source)
            found.append(call)

    def _read_call(self, node: ast.expr, source: str) -> ToolCall | ToolCallError:
        if not isinstance(node, ast.Call):
            return self._error(f"expected a call like tool_name(param=value), got {_snippet(source, node)}")
        name = _dotted_name(node.func)
        if name is None:
            return self._error(f"the called thing must be a tool name, got {_snippet(source, node.func)}")
        if node.args:
            return self._error(f"{name}() was given positional arguments; name every argument (param=value)", name)
        arguments: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return self._error(f"{name}() uses **; name every argument (param=value)", name)
            try:
                arguments[kw.arg] = self._literal(kw.value, source)
            except ValueError as exc:
                return self._error(f"argument {kw.arg!r} of {name}() {exc}", name)
        return ToolCall(name=name, arguments=arguments)

    def _literal(self, node: ast.expr, source: str, depth: int = 0) -> Any:
        """The JSON-compatible value of a literal node; ``ValueError`` for anything else."""
        if depth > self.max_depth:
            raise ValueError(f"is nested more than {self.max_depth} deep")
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
            if isinstance(node.value, int) and node.value.bit_length() > _MAX_INT_BITS:
                raise ValueError("is a number with too many digits")
            return node.value
        if isinstance(node, ast.Name) and node.id in self._json_names:
            return self._json_names[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self._literal(node.operand, source, depth + 1)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self._literal(elt, source, depth + 1) for elt in node.elts]
        if isinstance(node, ast.Dict):
            result = {}
            for key, value in zip(node.keys, node.values):
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    raise ValueError("has a dict whose keys are not all strings")
                result[key.value] = self._literal(value, source, depth + 1)
            return result
        raise ValueError(f"is not a literal value: {_snippet(source, node)}")

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


def _snippet(source: str, node: ast.AST) -> str:
    """The source of ``node`` for an error message (read from positions: ``ast.unparse`` recurses)."""
    return short_snippet(ast.get_source_segment(source, node) or type(node).__name__)
