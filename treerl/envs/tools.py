"""Tools: Python functions the model can call, with a JSON Schema built from their signature.

``@tool`` turns a typed function into a :class:`Tool`. The parameters' JSON Schema comes
from the type hints (dataclasses, TypedDicts and pydantic models included), the
descriptions from a Google, reST or numpydoc docstring; a docstring that documents a
parameter the function does not have gives a warning when the tool is made. A call from
the model is validated with that schema (jsonschema, Draft 2020-12), converted to the
annotated types, run under a time limit, and its result turned into text for the model.

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

**Time limits.** A sync tool runs in a fresh thread (:func:`~treerl.envs.offload.run_in_thread`),
and its limit is measured on its own execution: from when the thread starts the tool, so
that neither a busy event loop nor a busy machine turns a call that finished in time into
a timeout. On timeout the caller gets :class:`~treerl.errors.ToolTimeout` at once, but the
thread cannot be killed: it runs on to its end (it holds no shared worker meanwhile).
An async tool is cancelled on timeout and the caller gets :class:`~treerl.errors.ToolTimeout`
at once, whether or not the tool stops: one that swallows the cancellation runs on,
abandoned, until it returns (its result is dropped; closing the event loop,
:func:`~treerl.envs.loops.run_until_done` gives it a short grace, then leaves it), and one that blocks the event loop cannot be stopped at all. For code
that may hang or must really be stopped, use ``isolate=True``: each call then runs in a fresh
process (``forkserver`` where available, else ``spawn``), which is killed on timeout. The
function must then be importable by its module and name (a module-level function) or
picklable, and its arguments picklable (:mod:`treerl.envs.isolation`).

The parameters' schema and the conversion of arguments come from :mod:`treerl.envs.schema`,
their descriptions from :mod:`treerl.envs.docstrings`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import re
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema

from treerl.envs.docstrings import parse_docstring
from treerl.envs.isolation import function_payload, run_isolated
from treerl.envs.loops import run_with_limit
from treerl.envs.offload import run_in_thread
from treerl.envs.parsers import ToolCall
from treerl.envs.schema import (
    describe_value,
    explain_error,
    json_problem,
    result_text,
    schema_name,
    type_spec,
    unwrap_annotation,
    with_default,
)
from treerl.errors import ToolCallError, ToolErrorKind, ToolTimeout

__all__ = ["Tool", "tool", "ToolResult", "run_tool_call"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_MAX_REPORTED_ERRORS = 5


class Tool:
    """A function the model can call, with the JSON Schema of its parameters.

    Build one with :func:`tool`. Calling the tool object calls the function unchanged;
    :meth:`acall` is the model's way in: validate, convert, run under the time limit,
    return text. Methods become tools once bound (``tool(counter.add)``): in a class body
    ``self`` has no annotation and is refused. A callable object is described by its
    ``__call__`` (and its class docstring), a ``functools.partial`` by its function less the
    keywords it binds; both need ``name=``.

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
        adapter = _adapter_for(fn)
        if adapter is not None:
            raise TypeError(f"{type(fn).__name__} {getattr(fn, 'name', '')!r} is a tool of another library; "
                            f"make it a treerl tool with Tool.{adapter}(...), which keeps its schema")
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
        self.is_async = _is_async(fn)
        doc_description, arg_descriptions = _docs(fn)
        self.description = description if description is not None else doc_description
        self.parameters, self._converters = self._build_parameters(arg_descriptions)
        self._validator = jsonschema.Draft202012Validator(self.parameters)
        if isolate:
            self._payload = function_payload(fn, self.name)
        # Name, docstring and __wrapped__, not the function's __dict__: a callable object's own
        # attributes (its name, timeout, ...) would overwrite the tool's.
        functools.update_wrapper(self, fn, updated=())

    def _build_parameters(self, arg_descriptions: Mapping[str, str]) -> tuple[dict, dict[str, Callable]]:
        try:
            signature = inspect.signature(self.fn)
            hints = typing.get_type_hints(_annotated(self.fn), include_extras=True)
        except (NameError, TypeError, ValueError) as exc:
            raise TypeError(f"tool {self.name!r}: cannot read the type hints of its function ({exc})") from exc
        properties: dict[str, dict] = {}
        required: list[str] = []
        converters: dict[str, Callable] = {}
        # What a functools.partial binds stays bound: not offered to the model (nor its value shown).
        bound = _bound_keywords(self.fn)
        for param in signature.parameters.values():
            if param.name in bound:
                continue
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
            _, annotated_description = unwrap_annotation(hints[param.name])
            spec = type_spec(hints[param.name], where)
            schema = dict(spec.schema)
            text = arg_descriptions.get(param.name) or annotated_description
            if text:
                schema["description"] = text
            properties[param.name] = with_default(schema, param.default)
            converters[param.name] = spec.convert
            if param.default is inspect.Parameter.empty:
                required.append(param.name)
        unknown = [name for name in arg_descriptions if name not in signature.parameters]
        if unknown:
            _warn_at(self.fn, (
                f"tool {self.name!r}: its docstring documents {', '.join(map(repr, unknown))}, which the function "
                f"does not take (its parameters: {', '.join(signature.parameters) or 'none'}); "
                "fix the name in the docstring or in the signature"
            ))
        parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
        return parameters, converters

    @classmethod
    def from_schema(cls, name: str, parameters: Mapping[str, Any] | None, fn: Callable[..., Any] | None = None, *,
                    description: str = "", timeout: float | None = 10.0) -> Tool:
        """A tool whose parameters' JSON Schema is given rather than read from a signature.

        For tools described elsewhere: an MCP server's, or the ``tools`` of an OpenAI request.
        Calls are validated against ``parameters`` exactly as for ``@tool`` functions (same
        errors), and ``fn`` receives the arguments as keyword arguments, unconverted.

        >>> t = Tool.from_schema("lookup", {"type": "object", "properties": {"key": {"type": "string"}},
        ...                                 "required": ["key"]}, lambda key: key.upper())
        >>> t.validate({"key": "a"}), t(key="b")
        ({'key': 'a'}, 'B')
        >>> t.validate({})
        Traceback (most recent call last):
        ...
        treerl.errors.ToolCallError: Invalid arguments for tool 'lookup': ...
        """
        if not _NAME.match(name or ""):
            raise ValueError(f"tool name {name!r} is not valid: use 1 to 64 letters, digits, '_', '.' or '-'.")
        parameters = dict(parameters) if parameters else {"type": "object", "properties": {}}
        try:
            jsonschema.Draft202012Validator.check_schema(parameters)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"tool {name!r}: its parameters are not a valid JSON Schema ({exc.message}).") from None
        if parameters.get("type", "object") != "object":
            raise ValueError(f"tool {name!r}: its parameters schema must describe an object, got type "
                             f"{parameters.get('type')!r}.")
        self = cls.__new__(cls)
        self.fn = fn if fn is not None else _not_callable(name)
        self.name, self.description, self.timeout, self.isolate = name, description, timeout, False
        self.is_async = _is_async(self.fn)
        self.parameters, self._converters = parameters, {}
        self._validator = jsonschema.Draft202012Validator(_nullable_as_null_type(parameters))
        return self

    @classmethod
    def from_langchain(cls, lc_tool: Any, *, timeout: float | None = 10.0) -> Tool:
        """A LangChain tool (``@tool`` function, ``StructuredTool``, ``BaseTool`` subclass) as a treerl tool.

        The model sees the schema LangChain gives an OpenAI model (``convert_to_openai_tool``);
        a call runs ``ainvoke`` for a tool with a coroutine, else ``invoke`` in a thread.
        """
        from langchain_core.utils.function_calling import convert_to_openai_tool

        spec = convert_to_openai_tool(lc_tool)["function"]
        if getattr(lc_tool, "coroutine", None) is not None:
            async def call(**arguments: Any) -> Any:
                return await lc_tool.ainvoke(arguments)
        else:
            def call(**arguments: Any) -> Any:
                return lc_tool.invoke(arguments)
        return cls.from_schema(spec["name"], spec.get("parameters"), call, description=spec.get("description", ""),
                               timeout=timeout)

    @classmethod
    def from_smolagents(cls, sm_tool: Any, *, timeout: float | None = 10.0) -> Tool:
        """A smolagents tool (``@tool`` function or ``Tool`` subclass) as a treerl tool.

        The model sees the schema smolagents gives a tool-calling model (``get_tool_json_schema``:
        its ``inputs``, a ``nullable`` input optional); a call runs the tool in a thread.
        """
        from smolagents.models import get_tool_json_schema

        spec = get_tool_json_schema(sm_tool)["function"]

        def call(**arguments: Any) -> Any:
            return sm_tool(**arguments)

        return cls.from_schema(spec["name"], spec.get("parameters"), call, description=spec.get("description", ""),
                               timeout=timeout)

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
        The arguments must be strict JSON: ``NaN``, infinities, integers of more than
        Python's 4,300 printable digits and nesting deeper than 64 levels are refused.

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
            raise self._invalid([f"the arguments must be a JSON object, got {describe_value(arguments)}"])
        arguments = dict(arguments)
        problem = json_problem(arguments)
        if problem is not None:  # NaN, huge integers and deep nesting: before jsonschema, which chokes on them
            raise self._invalid([problem.replace("the value", "the arguments", 1)])
        problems = sorted(self._validator.iter_errors(arguments), key=lambda e: [str(p) for p in e.absolute_path])
        if problems:
            raise self._invalid([explain_error(e) for e in problems[:_MAX_REPORTED_ERRORS]])
        converted = {}
        for key, value in arguments.items():
            try:
                converted[key] = self._converters.get(key, _unchanged)(value)
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
        for key, schema in self.parameters.get("properties", {}).items():
            part = f"{key}: {schema_name(schema)}"
            if "default" in schema:
                part += f" = {json.dumps(schema['default'])}"
            elif key not in self.parameters.get("required", ()):
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
        # Validation reads model-sized data: small arguments are validated on the event loop
        # (well under a millisecond), others in a thread; a sync tool then runs in a thread
        # whose clock starts when the tool does.
        small = _is_small(arguments)
        if not (self.isolate or self.is_async):
            kwargs = self.validate(arguments) if small else None
            try:
                outcome = await run_in_thread(_capture, self.fn, timeout=self.timeout, name=f"treerl-tool-{self.name}",
                                              prepare=(lambda: kwargs) if small else (lambda: self.validate(arguments)))
            except TimeoutError:
                raise self._timeout() from None
            return self._finish(outcome)
        kwargs = self.validate(arguments) if small else await run_in_thread(
            self.validate, arguments, name=f"treerl-validate-{self.name}")
        if self.isolate:
            try:
                outcome = await run_isolated(self._payload, kwargs, name=self.name, timeout=self.timeout)
            except TimeoutError:
                raise self._timeout() from None
        else:
            outcome = await self._with_timeout(_capture_async(self.fn, kwargs))
        return self._finish(outcome)

    async def _with_timeout(self, awaitable: Any) -> tuple[str, Any]:
        # Not asyncio.wait_for: after its cancel it waits for the tool to end, so a tool that
        # swallows CancelledError (a retry loop catching it) held the call, and the rollout,
        # for as long as it ran. Here the call returns at the limit; the tool, asked to stop,
        # runs on abandoned until it does.
        try:
            return await run_with_limit(awaitable, self.timeout, name=f"tool {self.name!r}")
        except TimeoutError:
            raise self._timeout() from None

    def _timeout(self) -> ToolTimeout:
        return ToolTimeout(f"Tool {self.name!r} timed out after {self.timeout:g} s.", tool_name=self.name)

    def _finish(self, outcome: tuple[str, Any]) -> str:
        status, value = outcome
        if status == "ok":
            return result_text(value, self.name)
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

    _SHARED_BY_COPIES = ("parameters", "_converters", "_validator")

    def __deepcopy__(self, memo: dict[int, Any]) -> Tool:
        """A copy that shares the schema, its converters and its validator (built once, never
        changed; copying the validator was most of an environment's fork, once per generation)
        and deep-copies the rest: a method of an environment stays bound to the copy's."""
        clone = copy.copy(self)
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            if name not in self._SHARED_BY_COPIES:
                clone.__dict__[name] = copy.deepcopy(value, memo)
        return clone

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


def _annotated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function whose annotations and docstring describe ``fn``'s parameters.

    ``fn`` itself, the function inside a ``functools.partial``, or a callable object's ``__call__``.
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.isroutine(fn) or inspect.isclass(fn) or not callable(fn):
        return fn
    return fn.__call__


def _adapter_for(fn: Any) -> str | None:
    """The ``Tool`` constructor for a LangChain or smolagents tool object, else ``None``."""
    packages = {cls.__module__.split(".")[0] for cls in type(fn).__mro__}
    if "langchain_core" in packages:
        return "from_langchain"
    if "smolagents" in packages and hasattr(fn, "inputs"):
        return "from_smolagents"
    return None


def _bound_keywords(fn: Callable[..., Any]) -> set[str]:
    bound: set[str] = set()
    while isinstance(fn, functools.partial):
        bound.update(fn.keywords)
        fn = fn.func
    return bound


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(_annotated(fn))


def _docs(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The description and parameter descriptions of ``fn``'s docstring.

    A callable object's class docstring gives the description, else its ``__call__``'s; the
    parameters may be documented in either.
    """
    described = _annotated(fn)
    own_description, own_args = parse_docstring(inspect.getdoc(described))
    if described is fn or isinstance(fn, functools.partial):
        return own_description, own_args
    class_description, class_args = parse_docstring(inspect.getdoc(type(fn)))
    return class_description or own_description, {**class_args, **own_args}


def _unchanged(value: Any) -> Any:
    return value


def _warn_at(fn: Callable[..., Any], message: str) -> None:
    """A ``UserWarning`` that points at the definition of ``fn``, wherever the tool was made."""
    code = getattr(inspect.unwrap(getattr(fn, "__func__", fn)), "__code__", None)
    if code is None:
        warnings.warn(message, UserWarning, stacklevel=4)  # _warn_at, _build_parameters, Tool(), its caller
        return
    warnings.warn_explicit(message, UserWarning, code.co_filename, code.co_firstlineno)


def _nullable_as_null_type(schema: Any) -> Any:
    """``schema`` with OpenAPI's ``"nullable": true`` (how smolagents marks an optional input) read as a type that
    also admits null, as the tool's own library reads it: JSON Schema validators ignore the keyword, so a call
    passing null there, valid for the tool, was refused as invalid arguments.

    >>> _nullable_as_null_type({"type": "object", "properties": {"n": {"type": "integer", "nullable": True}}})
    {'type': 'object', 'properties': {'n': {'type': ['integer', 'null'], 'nullable': True}}}
    """
    if isinstance(schema, list):
        return [_nullable_as_null_type(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _nullable_as_null_type(v) for k, v in schema.items()}
    if schema.get("nullable") is True:
        if isinstance(out.get("type"), (str, list)):
            types = [out["type"]] if isinstance(out["type"], str) else list(out["type"])
            out["type"] = types if "null" in types else [*types, "null"]
        if isinstance(out.get("enum"), list) and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
    return out


def _not_callable(name: str) -> Callable[..., Any]:
    def refuse(**kwargs: Any) -> Any:
        raise ToolCallError(ToolErrorKind.TOOL_ERROR, f"Tool {name!r} has a schema but no function to run here.",
                            tool_name=name)

    return refuse


def _is_small(arguments: Any, limit: int = 64) -> bool:
    """Whether ``arguments`` hold at most ``limit`` values and short strings (cheap to validate)."""
    stack, seen = [arguments], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > limit or (isinstance(item, str) and len(item) > 4096):
            return False
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return True


def _capture(kwargs: dict[str, Any], fn: Callable[..., Any]) -> tuple[str, Any]:
    """Call ``fn(**kwargs)``, returning ``("ok", result)`` or ``("raised", exception)``.

    Capturing the tool's exceptions keeps them apart from the timeout's own ``TimeoutError``.
    """
    try:
        return "ok", fn(**kwargs)
    except (Exception, SystemExit) as exc:  # the tool's failure (sys.exit too) is the model's observation
        return "raised", exc


async def _capture_async(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[str, Any]:
    try:
        return "ok", await fn(**kwargs)
    except (Exception, SystemExit) as exc:  # the tool's failure (sys.exit too) is the model's observation
        return "raised", exc
