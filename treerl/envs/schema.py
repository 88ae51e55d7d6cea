"""JSON Schema from type annotations, and conversion between JSON values and those types.

:func:`type_spec` gives, for one annotated type, the JSON Schema (Draft 2020-12) a tool
parameter of that type accepts and a converter that turns a value valid for that schema
into the annotated type (an ``int`` for ``3.0``, the enum member for its value, the
dataclass or pydantic model for its object). :func:`result_text` goes the other way, from a tool's result
to the text the model reads, and :func:`explain_error` phrases a validation error for the
model, naming the field.

Invariants: every schema built here is valid Draft 2020-12 and accepts exactly what its
converter can convert, except for the checks a dataclass's ``__post_init__`` or a pydantic
model's validators make, which raise ``ValueError``; an unsupported type raises
``TypeError`` when the schema is built (when the tool is defined), never when it is called.
pydantic is optional: it is used only for annotations that are pydantic models, and never
imported here.

>>> spec = type_spec(list[int] | None, "numbers")
>>> spec.schema
{'anyOf': [{'type': 'array', 'items': {'type': 'integer'}}, {'type': 'null'}]}
>>> spec.convert([1, 2.0])
[1, 2]
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import inspect
import json
import math
import pathlib
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

__all__ = [
    "TypeSpec",
    "type_spec",
    "unwrap_annotation",
    "with_default",
    "result_text",
    "describe_value",
    "json_problem",
    "schema_name",
    "explain_error",
]


@dataclass(frozen=True)
class TypeSpec:
    """The JSON Schema of one annotated type and how to convert a valid JSON value to it."""

    schema: dict[str, Any]
    """What a JSON value of this type looks like (Draft 2020-12)."""
    convert: Callable[[Any], Any]
    """Turns a value that is valid for ``schema`` into the annotated type."""


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


def unwrap_annotation(tp: Any) -> tuple[Any, str | None]:
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


def type_spec(tp: Any, where: str, seen: tuple[type, ...] = ()) -> TypeSpec:
    """The schema and converter of type ``tp``; ``where`` names the parameter for errors.

    ``seen`` holds the dataclasses and TypedDicts that enclose ``tp``, so that a recursive
    type is refused instead of recursed into forever.
    """
    tp, _ = unwrap_annotation(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return TypeSpec({}, _identity)
    if tp is type(None) or tp is None:
        return TypeSpec({"type": "null"}, _identity)
    if tp is bool:
        return TypeSpec({"type": "boolean"}, _identity)
    if tp is int:
        return TypeSpec({"type": "integer"}, _to_int)
    if tp is float:
        return TypeSpec({"type": "number"}, float)
    if tp is str:
        return TypeSpec({"type": "string"}, _identity)
    if origin is Literal:
        return _literal_spec(args, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_spec(tp, where)
    if origin in (typing.Union, types.UnionType):
        return _union_spec(args, where, seen)
    if tp in (list, Sequence) or origin in (list, Sequence):
        item = type_spec(args[0], where, seen) if args else TypeSpec({}, _identity)
        return TypeSpec({"type": "array", "items": item.schema}, lambda v: [item.convert(x) for x in v])
    if tp is tuple or origin is tuple:
        return _tuple_spec(args, where, seen)
    if tp in (dict, Mapping) or origin in (dict, Mapping):
        if args and args[0] is not str:
            raise TypeError(f"{where}: dict keys must be str (JSON object keys are strings), got {args[0]!r}")
        value = type_spec(args[1], where, seen) if args else TypeSpec({}, _identity)
        schema = {"type": "object", **({"additionalProperties": value.schema} if args else {})}
        return TypeSpec(schema, lambda v: {k: value.convert(x) for k, x in v.items()})
    if isinstance(tp, type) and (dataclasses.is_dataclass(tp) or typing.is_typeddict(tp)):
        if tp in seen:
            raise TypeError(f"{where}: {tp.__name__} refers to itself; recursive types cannot be tool parameters")
        return _record_spec(tp, where, (*seen, tp))
    pydantic = _pydantic_of(tp)
    if pydantic is not None:
        return _pydantic_spec(pydantic, tp, where)
    raise TypeError(
        f"{where}: type {tp!r} is not supported in tool parameters; use str, int, float, bool, "
        "Literal, Enum, list, tuple, dict[str, ...], Optional, TypedDict, a dataclass, a pydantic model or Any"
    )


def _literal_spec(values: tuple[Any, ...], where: str) -> TypeSpec:
    json_values = [_json_value(v) for v in values]
    if any(_json_type(v) is None for v in json_values):
        raise TypeError(f"{where}: Literal values must be str, int, float, bool or None, got {values!r}")

    def convert(value: Any) -> Any:
        # Validation matched the JSON value; hand back the literal itself (e.g. the enum member).
        for literal, json_value in zip(values, json_values):
            if type(json_value) is type(value) and json_value == value:
                return literal
        return next(lit for lit, jv in zip(values, json_values) if jv == value)

    return TypeSpec({**_enum_type(json_values), "enum": json_values}, convert)


def _enum_spec(cls: type[enum.Enum], where: str) -> TypeSpec:
    values = [member.value for member in cls]
    if any(_json_type(v) is None for v in values):
        raise TypeError(f"{where}: the values of enum {cls.__name__} must be str, int, float, bool or None")
    return TypeSpec({**_enum_type(values), "enum": values}, cls)


def _union_spec(members: tuple[Any, ...], where: str, seen: tuple[type, ...]) -> TypeSpec:
    specs = [type_spec(m, where, seen) for m in members]
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

    return TypeSpec(schema, convert)


def _tuple_spec(args: tuple[Any, ...], where: str, seen: tuple[type, ...]) -> TypeSpec:
    if not args or (len(args) == 2 and args[1] is Ellipsis):
        item = type_spec(args[0], where, seen) if args else TypeSpec({}, _identity)
        return TypeSpec({"type": "array", "items": item.schema}, lambda v: tuple(item.convert(x) for x in v))
    if args == ((),):  # tuple[()]
        args = ()
    items = [type_spec(a, where, seen) for a in args]
    schema = {
        "type": "array",
        "prefixItems": [s.schema for s in items],
        "items": False,
        "minItems": len(items),
        "maxItems": len(items),
    }
    return TypeSpec(schema, lambda v: tuple(s.convert(x) for s, x in zip(items, v)))


def _record_spec(cls: type, where: str, seen: tuple[type, ...]) -> TypeSpec:
    """A dataclass or TypedDict: an object with fixed properties, converted back to ``cls``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    properties: dict[str, dict] = {}
    required: list[str] = []
    converters: dict[str, Callable[[Any], Any]] = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            spec = type_spec(hints[f.name], f"{where}.{f.name}", seen)
            properties[f.name] = with_default(spec.schema, f.default)
            converters[f.name] = spec.convert
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.append(f.name)
        build: Callable[[dict], Any] = lambda kwargs: cls(**kwargs)  # noqa: E731
    else:
        for key, hint in hints.items():
            spec = type_spec(hint, f"{where}.{key}", seen)
            properties[key] = spec.schema
            converters[key] = spec.convert
        required = [k for k in hints if k in cls.__required_keys__]
        build = dict
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return TypeSpec(schema, lambda v: build({k: converters[k](x) for k, x in v.items()}))


def _pydantic_of(tp: Any) -> types.ModuleType | None:
    """The pydantic module when ``tp`` is a pydantic model class, else ``None``.

    pydantic is an optional dependency and is never imported here: a class that is a
    pydantic model was defined with pydantic, which is therefore already loaded.
    """
    pydantic = sys.modules.get("pydantic")
    if pydantic is None or not isinstance(tp, type):
        return None
    base = getattr(pydantic, "BaseModel", None)
    return pydantic if isinstance(base, type) and issubclass(tp, base) else None


def _pydantic_spec(pydantic: types.ModuleType, model: type, where: str) -> TypeSpec:
    """A pydantic model: the model's own JSON Schema, converted with ``model.model_validate``.

    The model's checks (validators, constraints the schema cannot state) can still refuse a
    value the schema accepts: the converter then raises ``ValueError`` naming each failing
    field, which a tool reports as invalid arguments.
    """
    if not hasattr(model, "model_json_schema"):
        raise TypeError(f"{where}: {model.__name__} is a pydantic v1 model; tool parameters need pydantic>=2")
    try:
        schema = model.model_json_schema()
    except pydantic.errors.PydanticUserError as exc:
        raise TypeError(f"{where}: pydantic cannot give the JSON Schema of {model.__name__} ({exc})") from None
    defs = schema.get("$defs", {})
    schema = _inline_refs({k: v for k, v in schema.items() if k != "$defs"}, defs, where, ())

    def convert(value: Any) -> Any:
        try:
            return model.model_validate(value)
        except pydantic.ValidationError as exc:
            raise ValueError("; ".join(_pydantic_problem(e) for e in exc.errors())) from None

    return TypeSpec(schema, convert)


def _pydantic_problem(error: Mapping[str, Any]) -> str:
    """One pydantic error as ``"field 'a.b[0]': message"``."""
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.get("loc", ())).lstrip(".")
    return f"field {path!r}: {error['msg']}" if path else str(error["msg"])


# The keywords whose value is a schema, a list of schemas, or a mapping of names to schemas.
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames",
              "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")


def _inline_refs(schema: Any, defs: Mapping[str, Any], where: str, expanding: tuple[str, ...]) -> Any:
    """``schema`` with each ``{"$ref": "#/$defs/X"}`` replaced by ``X`` itself, and without titles.

    A parameter's schema sits inside the tool's ``parameters`` object, where ``#/$defs``
    would not resolve, so definitions are copied in; a recursive model has no finite copy
    and is refused, as a recursive dataclass is. Titles only repeat the field names.
    """
    if not isinstance(schema, Mapping):
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str):
        name = ref.removeprefix("#/$defs/")
        if name == ref or name not in defs:
            raise TypeError(f"{where}: its pydantic model's JSON Schema refers to {ref!r}, which cannot be inlined")
        if name in expanding:
            raise TypeError(f"{where}: {name} refers to itself; recursive types cannot be tool parameters")
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        # Keywords next to the reference (a field's description, default) win over the definition's.
        return _inline_refs({**defs[name], **siblings}, defs, where, (*expanding, name))
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _SUBSCHEMA:
            value = _inline_refs(value, defs, where, expanding)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            value = [_inline_refs(v, defs, where, expanding) for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, Mapping):
            value = {k: _inline_refs(v, defs, where, expanding) for k, v in value.items()}
        out[key] = value
    return out


def with_default(schema: dict, default: Any) -> dict:
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


# -- results as text ----------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if callable(getattr(value, "model_dump", None)) and not isinstance(value, type):  # pydantic models
        return value.model_dump(mode="json")
    if callable(getattr(value, "tolist", None)):  # numpy scalars and arrays, torch tensors
        return value.tolist()
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, pathlib.PurePath)):
        return str(value)
    raise TypeError(f"a {type(value).__name__} is not JSON-serializable")


def result_text(value: Any, name: str) -> str:
    """A tool's result as the model reads it: a ``str`` as is, anything else as JSON.

    Dataclasses, pydantic models, enums, tuples, sets, numpy and torch values, dates,
    decimals and paths become JSON too; ``TypeError`` (naming tool
    ``name``) for anything else, which is a bug in the tool, not the model's fault.

    >>> result_text({"total": 3, "items": (1, 2)}, "count")
    '{"total": 3, "items": [1, 2]}'
    """
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"tool {name!r} returned {type(value).__name__} data that cannot become text ({exc}); "
            "return a str or JSON-compatible data"
        ) from None


# -- error messages ----------------------------------------------------------------------


# Integers whose decimal form Python refuses to print (``sys.get_int_max_str_digits``).
_MAX_INT_BITS = int((getattr(sys, "get_int_max_str_digits", lambda: 4300)() or 4300) * 3.3219)


def json_problem(value: Any, *, max_depth: int = 64) -> str | None:
    """Why ``value`` is not strict JSON that the rest of treerl can handle, or ``None``.

    Refused: ``NaN`` and infinities (JSON has no such numbers, though Python's JSON reader
    accepts them), integers with more digits than Python prints, and nesting deeper than
    ``max_depth`` (validation would exhaust the recursion limit). The walk is iterative.

    >>> json_problem({"x": [1, 2.5, "a"]}) is None
    True
    >>> json_problem({"x": [1, float("nan")]})
    'x[1] is NaN, which is not a JSON number; give a finite number'
    """
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        where = path.lstrip(".") or "the value"
        if depth > max_depth:
            return f"{where} is nested more than {max_depth} levels deep"
        if isinstance(item, float) and not math.isfinite(item):
            spelled = "NaN" if math.isnan(item) else "Infinity" if item > 0 else "-Infinity"
            return f"{where} is {spelled}, which is not a JSON number; give a finite number"
        if isinstance(item, int) and not isinstance(item, bool) and item.bit_length() > _MAX_INT_BITS:
            return f"{where} is an integer with too many digits (more than {_MAX_INT_BITS * 0.30103:.0f})"
        if isinstance(item, Mapping):
            stack.extend((v, f"{path}.{k}", depth + 1) for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(item))
    return None


def describe_value(value: Any) -> str:
    """A model's value in JSON words, cut short: ``[1, 2] (array)``."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    text = text if len(text) <= 60 else text[:57] + "..."
    kind = "array" if isinstance(value, list) else "object" if isinstance(value, dict) else _json_type(value)
    return f"{text} ({kind or type(value).__name__})"


def schema_name(schema: Mapping[str, Any]) -> str:
    """A short human name for a schema: ``integer``, ``array of string``, ``one of ["c", "f"]``."""
    if "enum" in schema:
        return "one of " + json.dumps(schema["enum"])
    if "anyOf" in schema:
        return " or ".join(schema_name(s) for s in schema["anyOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array" and isinstance(schema.get("items"), Mapping) and schema["items"]:
        return f"array of {schema_name(schema['items'])}"
    if kind == "array" and "prefixItems" in schema:
        return "[" + ", ".join(schema_name(s) for s in schema["prefixItems"]) + "]"
    return kind or "any value"


def explain_error(error: jsonschema.ValidationError) -> str:
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
        return f"{field_name} must be {schema_name(error.schema)}, got {describe_value(error.instance)}"
    return f"{field_name}: {error.message}"
