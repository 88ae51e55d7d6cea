"""Tools: Python functions the model can call, with a JSON Schema built from their signature.

``@tool`` turns a typed function into a :class:`Tool`. The parameters' JSON Schema comes
from the type hints, the descriptions from a Google-style docstring. A call from the model
is validated with that schema (jsonschema, Draft 2020-12), converted to the annotated
types, run under a time limit, and its result turned into text for the model.

>>> @tool
... def add(a: int, b: int = 0) -> int:
...     '''Add two integers.
...
...     Args:
...         a: The first term.
...         b: The second term.
...     '''
...     return a + b
>>> add.parameters["properties"]["b"]
{'type': 'integer', 'description': 'The second term.', 'default': 0}
>>> add(2, 3)
5
>>> import asyncio
>>> asyncio.run(add.acall({"a": 2, "b": 3}))
'5'

Every way a model's call can fail becomes a :class:`~treerl.errors.ToolCallError` of a
known kind, and :func:`run_tool_call` turns those into a :class:`ToolResult`, so that a bad
call is an observation for the model, not a crash.

**Time limits.** A sync tool runs in a worker thread (``asyncio.to_thread``). On timeout the
caller gets :class:`~treerl.errors.ToolTimeout` at once, but the thread cannot be
killed: it runs on to its end and holds one of the default executor's workers meanwhile.
An async tool is cancelled on timeout (``asyncio.wait_for``), which only works when it
awaits: an async tool that blocks the event loop cannot be stopped. For code that may
hang or must really be stopped, use ``isolate=True``: each call then runs in a fresh
process (``forkserver`` where available, else ``spawn``), which is killed on timeout. The
function must then be importable by its module and name (a module-level function) or
picklable, and its arguments picklable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import importlib
import inspect
import json
import multiprocessing
import pickle
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from treerl.envs.parsers import ToolCall
from treerl.envs.processes import akill_and_reap
from treerl.errors import ToolCallError, ToolErrorKind, ToolTimeout

__all__ = ["Tool", "tool", "ToolResult", "run_tool_call"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_MP_CONTEXT = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
# The time limit of an isolated call counts from when the function is ready to run in the
# child, so that process start-up (interpreter, imports) does not eat a short limit; start-up
# itself gets this much before the call is given up as timed out.
_ISOLATE_STARTUP_S = 60.0
_MAX_REPORTED_ERRORS = 5


# -- JSON Schema from type hints -------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """The JSON Schema of one annotated type and how to convert a valid JSON value to it."""

    schema: dict[str, Any]
    convert: Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


def _to_int(value: Any) -> int:
    # JSON does not tell 3 from 3.0 and Draft 2020-12 calls 3.0 an integer, so the schema
    # accepts it; the function still gets the int it was annotated with.
    return int(value)


def _json_value(value: Any) -> Any:
    """A literal or enum value as it appears in JSON."""
    return value.value if isinstance(value, enum.Enum) else value


def _enum_type(values: Sequence[Any]) -> dict[str, Any]:
    """``{"type": ...}`` when all enum values share one JSON type, else ``{}``."""
    kinds = {_json_type(v) for v in values}
    return {"type": kinds.pop()} if len(kinds) == 1 and None not in kinds else {}


def _json_type(value: Any) -> str | None:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return None


def _unwrap(tp: Any) -> tuple[Any, str | None]:
    """Strip ``Annotated``, ``Required`` and ``NotRequired``; a string in ``Annotated`` is a description."""
    description = None
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            description = next((m for m in tp.__metadata__ if isinstance(m, str)), description)
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Required, typing.NotRequired):
            tp = typing.get_args(tp)[0]
        else:
            return tp, description


def _spec(tp: Any, where: str, seen: tuple[type, ...] = ()) -> _Spec:
    """The schema and converter of type ``tp``; ``where`` names the parameter for errors."""
    tp, _ = _unwrap(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return _Spec({}, _identity)
    if tp is type(None) or tp is None:
        return _Spec({"type": "null"}, _identity)
    if tp is bool:
        return _Spec({"type": "boolean"}, _identity)
    if tp is int:
        return _Spec({"type": "integer"}, _to_int)
    if tp is float:
        return _Spec({"type": "number"}, float)
    if tp is str:
        return _Spec({"type": "string"}, _identity)
    if origin is Literal:
        return _literal_spec(args, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_spec(tp, where)
    if origin in (typing.Union, types.UnionType):
        return _union_spec(args, where, seen)
    if tp in (list, Sequence) or origin in (list, Sequence):
        item = _spec(args[0], where, seen) if args else _Spec({}, _identity)
        return _Spec({"type": "array", "items": item.schema}, lambda v: [item.convert(x) for x in v])
    if tp is tuple or origin is tuple:
        return _tuple_spec(args, where, seen)
    if tp in (dict, Mapping) or origin in (dict, Mapping):
        if args and args[0] is not str:
            raise TypeError(f"{where}: dict keys must be str (JSON object keys are strings), got {args[0]!r}")
        value = _spec(args[1], where, seen) if args else _Spec({}, _identity)
        schema = {"type": "object", **({"additionalProperties": value.schema} if args else {})}
        return _Spec(schema, lambda v: {k: value.convert(x) for k, x in v.items()})
    if isinstance(tp, type) and (dataclasses.is_dataclass(tp) or typing.is_typeddict(tp)):
        if tp in seen:
            raise TypeError(f"{where}: {tp.__name__} refers to itself; recursive types cannot be tool parameters")
        return _record_spec(tp, where, (*seen, tp))
    raise TypeError(
        f"{where}: type {tp!r} is not supported in tool parameters; use str, int, float, bool, "
        "Literal, Enum, list, tuple, dict[str, ...], Optional, TypedDict, a dataclass or Any"
    )


def _literal_spec(values: tuple[Any, ...], where: str) -> _Spec:
    json_values = [_json_value(v) for v in values]
    if any(_json_type(v) is None for v in json_values):
        raise TypeError(f"{where}: Literal values must be str, int, float, bool or None, got {values!r}")

    def convert(value: Any) -> Any:
        # Validation matched the JSON value; hand back the literal itself (e.g. the enum member).
        for literal, json_value in zip(values, json_values):
            if type(json_value) is type(value) and json_value == value:
                return literal
        return next(lit for lit, jv in zip(values, json_values) if jv == value)

    return _Spec({**_enum_type(json_values), "enum": json_values}, convert)


def _enum_spec(cls: type[enum.Enum], where: str) -> _Spec:
    values = [member.value for member in cls]
    if any(_json_type(v) is None for v in values):
        raise TypeError(f"{where}: the values of enum {cls.__name__} must be str, int, float, bool or None")
    return _Spec({**_enum_type(values), "enum": values}, cls)


def _union_spec(members: tuple[Any, ...], where: str, seen: tuple[type, ...]) -> _Spec:
    specs = [_spec(m, where, seen) for m in members]
    types_only = [s.schema.get("type") for s in specs if set(s.schema) == {"type"}]
    if len(types_only) == len(specs):
        # Optional[int] reads best as {"type": ["integer", "null"]}.
        schema: dict[str, Any] = {"type": types_only}
    else:
        schema = {"anyOf": [s.schema for s in specs]}
    validators = [jsonschema.Draft202012Validator(s.schema) for s in specs]

    def convert(value: Any) -> Any:
        # The first member the value is valid for decides, as in the annotation's order.
        for validator, spec in zip(validators, specs):
            if validator.is_valid(value):
                return spec.convert(value)
        return value

    return _Spec(schema, convert)


def _tuple_spec(args: tuple[Any, ...], where: str, seen: tuple[type, ...]) -> _Spec:
    if not args or (len(args) == 2 and args[1] is Ellipsis):
        item = _spec(args[0], where, seen) if args else _Spec({}, _identity)
        return _Spec({"type": "array", "items": item.schema}, lambda v: tuple(item.convert(x) for x in v))
    if args == ((),):  # tuple[()]
        args = ()
    items = [_spec(a, where, seen) for a in args]
    schema = {
        "type": "array",
        "prefixItems": [s.schema for s in items],
        "items": False,
        "minItems": len(items),
        "maxItems": len(items),
    }
    return _Spec(schema, lambda v: tuple(s.convert(x) for s, x in zip(items, v)))


def _record_spec(cls: type, where: str, seen: tuple[type, ...]) -> _Spec:
    """A dataclass or TypedDict: an object with fixed properties, converted back to ``cls``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    properties: dict[str, dict] = {}
    required: list[str] = []
    converters: dict[str, Callable[[Any], Any]] = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            spec = _spec(hints[f.name], f"{where}.{f.name}", seen)
            properties[f.name] = _with_default(spec.schema, f.default)
            converters[f.name] = spec.convert
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.append(f.name)
        build: Callable[[dict], Any] = lambda kwargs: cls(**kwargs)  # noqa: E731
    else:
        for key, hint in hints.items():
            spec = _spec(hint, f"{where}.{key}", seen)
            properties[key] = spec.schema
            converters[key] = spec.convert
        required = [k for k in hints if k in cls.__required_keys__]
        build = dict
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return _Spec(schema, lambda v: build({k: converters[k](x) for k, x in v.items()}))


def _with_default(schema: dict, default: Any) -> dict:
    """``schema`` plus ``"default"`` when there is one that JSON can show."""
    if default is dataclasses.MISSING or default is inspect.Parameter.empty:
        return schema
    value = _json_value(default)
    if isinstance(value, tuple):
        value = list(value)
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return schema  # still optional, just not shown
    return {**schema, "default": value}


# -- docstrings --------------------------------------------------------------------------

_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Returns|Return|Yields|Raises|Examples?|Notes?|"
    r"Attributes|Todo|Warnings?|See Also|References)\s*:\s*$"
)
_ARG = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """``(description, {parameter: description})`` from a Google-style docstring.

    >>> _parse_docstring('''Look up the weather.
    ...
    ...     Args:
    ...         city (str): The city,
    ...             in English.
    ...         days: How many days.
    ...     Returns:
    ...         A forecast.
    ...     ''')
    ('Look up the weather.', {'city': 'The city, in English.', 'days': 'How many days.'})
    """
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    entry_indent: int | None = None
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        header = _SECTION.match(stripped) if indent == 0 else None
        if header is not None:
            section, entry_indent, current = header.group(1), None, None
            continue
        if section is None:
            description.append(line)
            continue
        if section not in ("Args", "Arguments", "Parameters", "Params") or not stripped:
            continue
        if entry_indent is None:
            entry_indent = indent
        match = _ARG.match(stripped)
        if indent <= entry_indent and match is not None:
            current = match.group(1)
            args[current] = match.group(2).strip()
        elif current is not None and indent > entry_indent:
            args[current] = f"{args[current]} {stripped}".strip()
    return "\n".join(description).strip(), args


# -- tools -------------------------------------------------------------------------------


class Tool:
    """A function the model can call, with the JSON Schema of its parameters.

    Build one with :func:`tool`. Calling the tool object calls the function unchanged;
    :meth:`acall` is the model's way in: validate, convert, run under the time limit,
    return text. Methods become tools once bound (``tool(counter.add)``): in a class body
    ``self`` has no annotation and is refused.

    Attributes:
        name: The name the model calls it by.
        description: What it does, for the model (the docstring's text before its sections).
        parameters: JSON Schema of the arguments object (``properties``, ``required``,
            ``additionalProperties: false``).
        timeout: Seconds a call may run, or ``None`` for no limit.
        is_async: Whether ``fn`` is a coroutine function.
        isolate: Whether each call runs in its own process, killed on timeout.
        fn: The original function.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = 10.0,
        isolate: bool = False,
    ):
        if not callable(fn):
            raise TypeError(f"tool() needs a function, got {fn!r}")
        self.fn = fn
        self.name = name if name is not None else getattr(fn, "__name__", "")
        if not _NAME.match(self.name):
            raise ValueError(
                f"tool name {self.name!r} is not valid: use 1 to 64 letters, digits, '_', '.' or '-'; "
                "pass name=... to tool()"
            )
        if timeout is not None and not timeout > 0:
            raise ValueError(
                f"timeout of tool {self.name!r} must be a positive number of seconds or None, got {timeout!r}"
            )
        self.timeout = timeout
        self.isolate = isolate
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        doc_description, arg_descriptions = _parse_docstring(inspect.getdoc(fn))
        self.description = description if description is not None else doc_description
        self.parameters, self._converters = self._build_parameters(arg_descriptions)
        self._validator = jsonschema.Draft202012Validator(self.parameters)
        if isolate:
            self._payload = _function_payload(fn, self.name)
        functools.update_wrapper(self, fn)

    def _build_parameters(self, arg_descriptions: Mapping[str, str]) -> tuple[dict, dict[str, Callable]]:
        try:
            signature = inspect.signature(self.fn)
            hints = typing.get_type_hints(self.fn, include_extras=True)
        except (NameError, TypeError, ValueError) as exc:
            raise TypeError(f"tool {self.name!r}: cannot read the type hints of its function ({exc})") from exc
        properties: dict[str, dict] = {}
        required: list[str] = []
        converters: dict[str, Callable] = {}
        for param in signature.parameters.values():
            where = f"tool {self.name!r}, parameter {param.name!r}"
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
                raise TypeError(
                    f"{where}: *args, **kwargs and positional-only parameters cannot be described by a JSON "
                    "Schema; give the tool named, annotated parameters"
                )
            if param.name not in hints:
                raise TypeError(
                    f"{where} has no type annotation; annotate it (e.g. `{param.name}: str`) so that its "
                    "JSON Schema can be built"
                )
            _, annotated_description = _unwrap(hints[param.name])
            spec = _spec(hints[param.name], where)
            schema = dict(spec.schema)
            text = arg_descriptions.get(param.name) or annotated_description
            if text:
                schema["description"] = text
            properties[param.name] = _with_default(schema, param.default)
            converters[param.name] = spec.convert
            if param.default is inspect.Parameter.empty:
                required.append(param.name)
        parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
        return parameters, converters

    @property
    def schema(self) -> dict[str, Any]:
        """OpenAI-style tool schema, as chat templates take it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: Any) -> dict[str, Any]:
        """Check ``arguments`` against the schema and convert them to the annotated types.

        ``arguments`` is the decoded JSON object (a JSON string holding one is accepted too).
        Integral floats are accepted for ``int`` parameters (JSON does not tell ``3`` from
        ``3.0``) and converted; booleans are not integers; ints are accepted for ``float``.

        Raises:
            ToolCallError: kind ``INVALID_ARGUMENTS``, with a message for the model that
                names each bad field and what was expected.
        """
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                raise self._invalid(["the arguments are a string that is not a JSON object"]) from None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            raise self._invalid([f"the arguments must be a JSON object, got {_describe(arguments)}"])
        arguments = dict(arguments)
        problems = sorted(self._validator.iter_errors(arguments), key=lambda e: [str(p) for p in e.absolute_path])
        if problems:
            raise self._invalid([_explain(e, self.parameters) for e in problems[:_MAX_REPORTED_ERRORS]])
        converted = {}
        for key, value in arguments.items():
            try:
                converted[key] = self._converters[key](value)
            except (TypeError, ValueError) as exc:
                # A dataclass's own checks (__post_init__) can still refuse valid JSON.
                raise self._invalid([f"argument {key!r}: {exc}"]) from None
        return converted

    def _invalid(self, problems: list[str]) -> ToolCallError:
        message = (
            f"Invalid arguments for tool {self.name!r}: " + "; ".join(problems) + f". Expected: {self._signature()}."
        )
        return ToolCallError(ToolErrorKind.INVALID_ARGUMENTS, message, tool_name=self.name)

    def _signature(self) -> str:
        """A short, readable signature for error messages: ``add(a: integer, b: integer = 0)``."""
        parts = []
        for key, schema in self.parameters["properties"].items():
            part = f"{key}: {_schema_name(schema)}"
            if "default" in schema:
                part += f" = {json.dumps(schema['default'])}"
            elif key not in self.parameters["required"]:
                part += " (optional)"
            parts.append(part)
        return f"{self.name}({', '.join(parts)})"

    async def acall(self, arguments: Any) -> str:
        """Validate ``arguments``, run the tool under its time limit, return its result as text.

        A ``str`` result is returned as is; anything else as JSON (dataclasses, enums, tuples
        and sets included).

        Raises:
            ToolCallError: ``INVALID_ARGUMENTS`` from :meth:`validate`; ``TOOL_ERROR`` when the
                tool raised (message ``"ValueError: ..."``); a ``ToolCallError`` the tool raised
                itself passes through.
            ToolTimeout: the call ran past ``timeout``.
            TypeError: the tool returned something that is not JSON-serializable (a bug in
                the tool, not the model's fault).
        """
        kwargs = self.validate(arguments)
        if self.isolate:
            outcome = await self._run_isolated(kwargs)
        elif self.is_async:
            outcome = await self._with_timeout(_capture_async(self.fn, kwargs))
        else:
            outcome = await self._with_timeout(asyncio.to_thread(_capture, self.fn, kwargs))
        return self._finish(outcome)

    async def _with_timeout(self, awaitable: Any) -> tuple[str, Any]:
        try:
            return await asyncio.wait_for(awaitable, self.timeout)
        except TimeoutError:
            # _capture wraps the tool's own exceptions, so a TimeoutError here is ours.
            raise self._timeout() from None

    def _timeout(self) -> ToolTimeout:
        return ToolTimeout(f"Tool {self.name!r} timed out after {self.timeout:g} s.", tool_name=self.name)

    def _finish(self, outcome: tuple[str, Any]) -> str:
        status, value = outcome
        if status == "ok":
            return _to_text(value, self.name)
        if status == "text":
            return value
        if status == "raised":
            if isinstance(value, ToolCallError):
                raise value
            raise ToolCallError(ToolErrorKind.TOOL_ERROR, f"{type(value).__name__}: {value}", tool_name=self.name)
        if status == "tool_call_error":
            kind, message = value
            raise ToolCallError(kind, message, tool_name=self.name)
        if status == "error":
            raise ToolCallError(ToolErrorKind.TOOL_ERROR, value, tool_name=self.name)
        raise TypeError(value)  # "bug": the tool or its setup is broken, not the model's call

    async def _run_isolated(self, kwargs: dict[str, Any]) -> tuple[str, Any]:
        """Run one call in a fresh process; kill it on timeout."""
        try:
            request = pickle.dumps((self._payload, kwargs))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"tool {self.name!r} has isolate=True but its arguments cannot be pickled: {exc}") from exc
        ctx = multiprocessing.get_context(_MP_CONTEXT)
        receiver, sender = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_isolated_main, args=(request, sender), daemon=True, name=f"tool-{self.name}")
        try:
            await asyncio.to_thread(process.start)
            sender.close()  # so that the child's exit shows here as end of file
            first = await _receive(receiver, _ISOLATE_STARTUP_S)
            if first is None:
                raise self._timeout()
            if first[0] != "ready":
                return first
            outcome = await _receive(receiver, self.timeout)
            if outcome is None:
                raise self._timeout()
            return outcome
        finally:
            await akill_and_reap(process, timeout_s=None)
            receiver.close()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool(name={self.name!r}, timeout={self.timeout!r}, is_async={self.is_async}, isolate={self.isolate})"


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = 10.0,
    isolate: bool = False,
) -> Any:
    """Make a :class:`Tool` of a typed function; usable as ``@tool`` and ``@tool(...)``.

    Args:
        fn: The function. Every parameter needs a type annotation (see the module doc for
            the supported types); parameters with a default are optional.
        name: The name the model calls it by (default: the function's name).
        description: What it does (default: the docstring's text before its sections).
        timeout: Seconds a call may run, or ``None`` for no limit.
        isolate: Run each call in its own process, killed on timeout (the function must be
            importable or picklable).

    Raises:
        TypeError: a parameter has no annotation or an unsupported type (the message names it).
        ValueError: the name or the timeout is invalid.

    >>> @tool(name="shout", timeout=1.0)
    ... def upper(text: str) -> str:
    ...     return text.upper()
    >>> upper.schema["function"]["name"], upper.parameters["required"]
    ('shout', ['text'])
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(f, name=name, description=description, timeout=timeout, isolate=isolate)

    return wrap if fn is None else wrap(fn)


@dataclass
class ToolResult:
    """The outcome of one tool call: the text for the model and, when it failed, why."""

    call: ToolCall
    content: str
    error: ToolErrorKind | None = None

    @property
    def ok(self) -> bool:
        """Whether the tool ran and returned."""
        return self.error is None


async def run_tool_call(call: ToolCall, tools: Mapping[str, Tool]) -> ToolResult:
    """Run ``call`` with the tool of that name; a model's fault becomes a failed result.

    Unknown tools, invalid arguments, tool exceptions and timeouts give a :class:`ToolResult`
    whose ``content`` explains the problem to the model and whose ``error`` is the kind.
    Only bugs outside the model's control (e.g. a tool returning unserializable data) raise.

    >>> import asyncio
    >>> @tool
    ... def echo(text: str) -> str:
    ...     return text
    >>> asyncio.run(run_tool_call(ToolCall("echo", {"text": "hi"}), {"echo": echo}))
    ToolResult(call=ToolCall(name='echo', arguments={'text': 'hi'}, id=None), content='hi', error=None)
    >>> asyncio.run(run_tool_call(ToolCall("ecko", {}), {"echo": echo})).content
    "Unknown tool 'ecko'. Available tools: echo."
    """
    selected = tools.get(call.name)
    if selected is None:
        available = ", ".join(sorted(tools)) if tools else "none"
        message = f"Unknown tool {call.name!r}. Available tools: {available}."
        return ToolResult(call, message, ToolErrorKind.UNKNOWN_TOOL)
    try:
        return ToolResult(call, await selected.acall(call.arguments))
    except ToolCallError as exc:
        return ToolResult(call, exc.message, exc.kind)


# -- running -----------------------------------------------------------------------------


def _capture(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[str, Any]:
    """Call ``fn``, returning ``("ok", result)`` or ``("raised", exception)``.

    Capturing the tool's exceptions keeps them apart from the timeout's own ``TimeoutError``.
    """
    try:
        return "ok", fn(**kwargs)
    except Exception as exc:  # the tool's failure is the model's observation
        return "raised", exc


async def _capture_async(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[str, Any]:
    try:
        return "ok", await fn(**kwargs)
    except Exception as exc:  # the tool's failure is the model's observation
        return "raised", exc


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    raise TypeError(f"a {type(value).__name__} is not JSON-serializable")


def _to_text(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"tool {name!r} returned {type(value).__name__} data that cannot become text ({exc}); "
            "return a str or JSON-compatible data"
        ) from None


def _function_payload(fn: Callable[..., Any], name: str) -> tuple[str, Any]:
    """How a child process finds ``fn``: by module and name, else the pickled function.

    Under ``@tool`` the module's attribute is the Tool, not the function, so pickle's own
    by-reference lookup would fail; the child resolves the name and unwraps the Tool.
    """
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and qualname and "<" not in qualname:
        return "ref", (module, qualname)
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(
            f"tool {name!r} has isolate=True but its function can be neither imported by name nor pickled "
            f"({exc}); define it at module level"
        ) from exc
    return "pickle", fn


def _resolve(payload: tuple[str, Any]) -> Callable[..., Any]:
    how, what = payload
    if how == "pickle":
        return what
    module, qualname = what
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target.fn if isinstance(target, Tool) else target


def _isolated_main(request: bytes, conn: Any) -> None:
    """Entry point of an isolated call's process: resolve, report ready, run, send the outcome."""
    try:
        payload, kwargs = pickle.loads(request)
        fn = _resolve(payload)
    except Exception as exc:  # reported to the parent, which raises it as a bug
        conn.send(("bug", f"the isolated tool could not be loaded in its process: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    try:
        result = fn(**kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(_await(result))
    except ToolCallError as exc:
        conn.send(("tool_call_error", (exc.kind, exc.message)))
        return
    except Exception as exc:  # the tool's failure is the model's observation
        conn.send(("raised_text", f"{type(exc).__name__}: {exc}"))
        return
    try:
        conn.send(("text", _to_text(result, getattr(fn, "__name__", "tool"))))
    except TypeError as exc:
        conn.send(("bug", str(exc)))


async def _await(awaitable: Any) -> Any:
    return await awaitable


async def _receive(conn: Any, timeout: float | None) -> tuple[str, Any] | None:
    """The next message from a child, ``None`` on timeout; a dead child reads as an error outcome."""
    if not await asyncio.to_thread(conn.poll, timeout):
        return None
    try:
        message = conn.recv()
    except (EOFError, OSError):
        return "error", "The tool crashed: its process exited before returning a result."
    if message[0] == "raised_text":
        return "error", message[1]
    return message


# -- error messages ----------------------------------------------------------------------


def _describe(value: Any) -> str:
    """A model's value in JSON words, cut short: ``[1, 2] (array)``."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    text = text if len(text) <= 60 else text[:57] + "..."
    kind = "array" if isinstance(value, list) else "object" if isinstance(value, dict) else _json_type(value)
    return f"{text} ({kind or type(value).__name__})"


def _schema_name(schema: Mapping[str, Any]) -> str:
    """A short human name for a schema: ``integer``, ``array of string``, ``one of ["c", "f"]``."""
    if "enum" in schema:
        return "one of " + json.dumps(schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_schema_name(s) for s in schema["anyOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array" and isinstance(schema.get("items"), Mapping) and schema["items"]:
        return f"array of {_schema_name(schema['items'])}"
    if kind == "array" and "prefixItems" in schema:
        return "[" + ", ".join(_schema_name(s) for s in schema["prefixItems"]) + "]"
    return kind or "any value"


def _explain(error: jsonschema.ValidationError, root: Mapping[str, Any]) -> str:
    """One validation error, phrased for the model, naming the field."""
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    field_name = f"argument {path!r}" if path else "the arguments"
    if error.validator == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        where = f" of {path!r}" if path else ""
        return "missing required argument" + ("s " if len(missing) > 1 else " ") + ", ".join(map(repr, missing)) + where
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = set(error.schema.get("properties", {}))
        extra = [k for k in error.instance if k not in allowed]
        known = ", ".join(error.schema.get("properties", {})) or "none"
        where = f" in {path!r}" if path else ""
        return f"unexpected argument {', '.join(map(repr, extra))}{where} (known: {known})"
    if error.validator in ("type", "enum", "anyOf", "items", "prefixItems", "minItems", "maxItems"):
        return f"{field_name} must be {_schema_name(error.schema)}, got {_describe(error.instance)}"
    return f"{field_name}: {error.message}"
