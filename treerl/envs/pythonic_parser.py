"""The "pythonic" tool-call format of Llama 3.2 and 4: a Python list of calls, ``[f(a=1), g()]``.

The list is read with :mod:`ast` and never evaluated: only keyword arguments with literal
values make a call. Brackets are matched with Python's own tokenizer, so brackets inside
string arguments do not count.
"""

from __future__ import annotations

import ast
import io
import keyword
import re
import tokenize
from collections.abc import Mapping, Sequence
from typing import Any

from treerl.envs.parser_base import ParseResult, ToolCall, ToolCallParser, short_snippet
from treerl.errors import ToolCallError

__all__ = ["PythonicParser"]

# Nesting deep enough to exhaust the recursion limit of `ast` is not a call a model meant
# to make; these are the exceptions `ast` and `tokenize` raise on bad input.
_READ_ERRORS = (ValueError, SyntaxError, RecursionError, MemoryError, tokenize.TokenError)


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
                errors.append(self._error(f"unbalanced brackets or quotes in {short_snippet(text[start:stop])}"))
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
            errors.append(self._error(f"invalid Python ({_reason(exc)}) in {short_snippet(source)}"))
            return
        if not isinstance(tree.body, ast.List):
            errors.append(self._error(f"expected a list of calls, got {short_snippet(source)}"))
            return
        for node in tree.body.elts:
            call = self._read_call(node)
            if isinstance(call, ToolCallError):
                errors.append(call)
            else:
                calls.append(call)

    def _read_call(self, node: ast.expr) -> ToolCall | ToolCallError:
        if not isinstance(node, ast.Call):
            return self._error(f"expected a call like tool_name(param=value), got {short_snippet(ast.unparse(node))}")
        name = _dotted_name(node.func)
        if name is None:
            return self._error(f"the called thing must be a tool name, got {short_snippet(ast.unparse(node.func))}")
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
        raise ValueError(f"is not a literal value: {short_snippet(ast.unparse(node))}")

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
