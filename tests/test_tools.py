"""@tool: JSON Schema from signatures, docstrings, validation, conversion, running, time limits."""

import asyncio
import enum
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NotRequired, Optional, TypedDict, Union

import jsonschema
import pytest
import torch

from treerl.errors import ToolCallError, ToolErrorKind, ToolTimeout
from treerl.envs.parsers import ToolCall
from treerl.envs.tools import Tool, ToolResult, run_tool_call, tool


def run(coro):
    return asyncio.run(coro)


def param_schema(annotation: Any) -> dict:
    """The schema of one required parameter annotated with ``annotation``."""

    def f(x):
        return x

    f.__annotations__ = {"x": annotation}
    return tool(f).parameters["properties"]["x"]


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Point(TypedDict):
    x: float
    y: float
    label: NotRequired[str]


@dataclass
class Box:
    corner: Point
    size: int = 1
    tags: list[str] = field(default_factory=list)


# -- schema --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "annotation, schema",
    [
        (str, {"type": "string"}),
        (int, {"type": "integer"}),
        (float, {"type": "number"}),
        (bool, {"type": "boolean"}),
        (Any, {}),
        (Literal["c", "f"], {"type": "string", "enum": ["c", "f"]}),
        (Literal[1, "a"], {"enum": [1, "a"]}),
        (Color, {"type": "string", "enum": ["red", "green"]}),
        (Level, {"type": "integer", "enum": [1, 2]}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (Sequence[str], {"type": "array", "items": {"type": "string"}}),
        (list, {"type": "array", "items": {}}),
        (tuple[float, ...], {"type": "array", "items": {"type": "number"}}),
        (
            tuple[int, str],
            {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"type": "string"}],
                "items": False,
                "minItems": 2,
                "maxItems": 2,
            },
        ),
        (dict[str, int], {"type": "object", "additionalProperties": {"type": "integer"}}),
        (dict, {"type": "object"}),
        (Optional[int], {"type": ["integer", "null"]}),
        (str | None, {"type": ["string", "null"]}),
        (Union[int, list[str]], {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "string"}}]}),
        (Annotated[int, "How many."], {"type": "integer", "description": "How many."}),
        (
            Point,
            {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "label": {"type": "string"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
        ),
    ],
)
def test_schema_of_each_supported_type(annotation, schema):
    assert param_schema(annotation) == schema
    jsonschema.Draft202012Validator.check_schema(schema)


def test_nested_dataclass_schema_with_defaults():
    schema = param_schema(Box)
    assert schema == {
        "type": "object",
        "properties": {
            "corner": param_schema(Point),
            "size": {"type": "integer", "default": 1},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["corner"],
        "additionalProperties": False,
    }


def forecast(city: str, days: int = 3, unit: Literal["c", "f"] = "c", color: Color = Color.RED) -> str:
    """Look up the weather forecast.

    Uses the offline tables.

    Args:
        city (str): The city, in English,
            without the country.
        days: How many days ahead.

    Returns:
        A forecast.
    """
    return f"{city}:{days}:{unit}:{color.name}"


def test_parameters_description_and_openai_schema():
    t = tool(forecast)
    assert t.name == "forecast"
    assert t.description == "Look up the weather forecast.\n\nUses the offline tables."
    assert t.parameters == {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city, in English, without the country."},
            "days": {"type": "integer", "description": "How many days ahead.", "default": 3},
            "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
            "color": {"type": "string", "enum": ["red", "green"], "default": "red"},
        },
        "required": ["city"],
        "additionalProperties": False,
    }
    assert t.schema == {
        "type": "function",
        "function": {"name": "forecast", "description": t.description, "parameters": t.parameters},
    }
    jsonschema.Draft202012Validator.check_schema(t.parameters)


def forecast_rest(city: str, days: int = 3, unit: Literal["c", "f"] = "c", color: Color = Color.RED) -> str:
    """Look up the weather forecast.

    Uses the offline tables.

    :param str city: The city, in English,
        without the country.
    :type city: str
    :param days: How many days ahead.
    :type days: int
    :returns: A forecast.
    :rtype: str
    :raises KeyError: for an unknown city.
    """
    return forecast(city, days, unit, color)


def forecast_numpy(city: str, days: int = 3, unit: Literal["c", "f"] = "c", color: Color = Color.RED) -> str:
    """Look up the weather forecast.

    Uses the offline tables.

    Parameters
    ----------
    city : str
        The city, in English,
        without the country.
    days : int, optional
        How many days ahead.
    unit : {"c", "f"}
    color : Color

    Returns
    -------
    str
        A forecast.
    """
    return forecast(city, days, unit, color)


@pytest.mark.parametrize("fn", [forecast, forecast_rest, forecast_numpy], ids=["google", "rest", "numpy"])
def test_google_rest_and_numpy_docstrings_describe_the_same_tool(fn, recwarn):
    t = tool(fn)
    assert t.description == "Look up the weather forecast.\n\nUses the offline tables."
    assert t.parameters == tool(forecast).parameters
    assert not recwarn.list  # every documented name is a parameter


@pytest.mark.parametrize(
    "docstring",
    [
        "Price.\n\nArgs:\n    item: The item.\n    itme: A typo.\n",
        "Price.\n\n:param item: The item.\n:param itme: A typo.\n",
        "Price.\n\nParameters\n----------\nitem : str\n    The item.\nitme : str\n",
    ],
    ids=["google", "rest", "numpy"],
)
def test_a_documented_parameter_the_function_lacks_warns_once(docstring):
    def price(item: str) -> int:
        return 1

    price.__doc__ = docstring
    with pytest.warns(UserWarning) as record:
        t = tool(price)
    assert [str(w.message) for w in record] == [
        "tool 'price': its docstring documents 'itme', which the function does not take (its parameters: item); "
        "fix the name in the docstring or in the signature"
    ]
    assert record[0].filename == __file__  # points at the function, not at treerl
    assert t.parameters["properties"]["item"]["description"] == "The item."


def test_decorator_forms_and_overrides():
    @tool
    def plain(x: int) -> int:
        return x

    @tool(name="renamed", description="Custom.", timeout=None, isolate=False)
    def other(x: int) -> int:
        """Ignored summary."""
        return -x

    assert isinstance(plain, Tool) and isinstance(other, Tool)
    assert (plain.name, plain.timeout) == ("plain", 10.0)
    assert (other.name, other.description, other.timeout) == ("renamed", "Custom.", None)
    assert plain(4) == 4 and other(x=4) == -4  # calling the tool calls the function unchanged
    assert plain.__doc__ is None and other.__name__ == "other"


def test_bound_methods_are_tools_without_self():
    class Counter:
        def __init__(self):
            self.total = 0

        def add(self, amount: int) -> int:
            """Add to the total."""
            self.total += amount
            return self.total

    counter = Counter()
    t = tool(counter.add)
    assert list(t.parameters["properties"]) == ["amount"]
    assert run(t.acall({"amount": 2})) == "2" and counter.total == 2


def test_callable_objects_and_partials_are_tools():
    class Search:
        """Search the shop's catalogue."""

        def __init__(self):
            self.name, self.timeout = "catalogue search", 1000.0  # the object's own, not the tool's

        def __call__(self, query: str, limit: int = 2) -> list[str]:
            """Args:
                query: What to look for.
                limit: How many results.
            """
            return [query] * limit

    class AsyncSearch:
        async def __call__(self, query: str) -> str:
            """Search asynchronously."""
            return query.upper()

    def lookup(key: str, api_key: str, retries: int = 1) -> str:
        """Look a key up.

        Args:
            key: The key.
            api_key: The service's secret.
            retries: How often to retry.
        """
        return f"{key}:{api_key[:2]}:{retries}"

    search = tool(Search(), name="search", timeout=5.0)
    assert (search.name, search.timeout, search.description) == ("search", 5.0, "Search the shop's catalogue.")
    assert search.parameters["properties"]["query"] == {"type": "string", "description": "What to look for."}
    assert search.parameters["required"] == ["query"]
    assert run(search.acall({"query": "pear"})) == '["pear", "pear"]'

    shout = tool(AsyncSearch(), name="shout")
    assert shout.is_async and run(shout.acall({"query": "hi"})) == "HI"
    assert Tool.from_schema("shout", {"type": "object"}, AsyncSearch()).is_async  # not a coroutine as a result

    # What a partial binds is the user's, not the model's: neither offered nor shown.
    bound = tool(functools.partial(lookup, api_key="sk-secret", retries=3), name="lookup")
    assert list(bound.parameters["properties"]) == ["key"] and "sk-secret" not in json.dumps(bound.schema)
    assert bound.description == "Look a key up."
    assert run(bound.acall({"key": "k"})) == "k:sk:3"
    assert run(run_tool_call(ToolCall("lookup", {"key": "k", "api_key": "x"}), {"lookup": bound})).error == (
        ToolErrorKind.INVALID_ARGUMENTS)


@pytest.mark.parametrize(
    "source, match",
    [
        ("def f(x): pass", "parameter 'x' has no type annotation"),
        ("def f(x: set) -> None: pass", "parameter 'x': type <class 'set'> is not supported"),
        ("def f(x: object): pass", "parameter 'x': type <class 'object'> is not supported"),
        ("def f(x: dict[int, str]): pass", "parameter 'x': dict keys must be str"),
        ("def f(*args: int): pass", "parameter 'args'.*\\*args"),
        ("def f(x: int, /): pass", "parameter 'x'.*positional-only"),
        ("def f(x: 'Missing'): pass", "cannot read the type hints"),
    ],
)
def test_unsupported_parameters_fail_at_decoration(source, match):
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    with pytest.raises(TypeError, match=match):
        tool(namespace["f"])


@dataclass
class Node:
    children: list["Node"]


def test_recursive_dataclasses_are_refused():
    with pytest.raises(TypeError, match="refers to itself"):

        @tool
        def f(root: Node) -> None: ...


@pytest.mark.parametrize(
    "kwargs, match",
    [({"name": "has space"}, "tool name 'has space'"), ({"timeout": 0}, "timeout"), ({"timeout": -1.0}, "timeout")],
)
def test_bad_name_or_timeout(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tool(forecast, **kwargs)
    with pytest.raises(ValueError, match="pass name="):
        tool(lambda x: x)


# -- validation and conversion -------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, needles",
    [
        ({}, ["missing required argument 'city'"]),
        ({"city": 3}, ["argument 'city' must be string, got 3 (integer)"]),
        ({"city": "P", "days": True}, ["argument 'days' must be integer, got true (boolean)"]),
        ({"city": "P", "days": 2.5}, ["argument 'days' must be integer"]),
        ({"city": "P", "unit": "k"}, ["argument 'unit' must be one of [\"c\", \"f\"]"]),
        ({"city": "P", "extra": 1}, ["unexpected argument 'extra'", "known: city, days, unit, color"]),
        ([1, 2], ["must be a JSON object, got [1, 2] (array)"]),
        ("{not json", ["not a JSON object"]),
    ],
)
def test_validation_errors_name_the_field(arguments, needles):
    with pytest.raises(ToolCallError) as info:
        tool(forecast).validate(arguments)
    error = info.value
    assert error.kind is ToolErrorKind.INVALID_ARGUMENTS and error.tool_name == "forecast"
    for needle in needles:
        assert needle in error.message
    # The message shows the model what a valid call takes.
    assert 'Expected: forecast(city: string, days: integer = 3, unit: one of ["c", "f"] = "c"' in error.message


def test_nested_validation_error_paths():
    @tool
    def place(boxes: list[Box]) -> int:
        return len(boxes)

    with pytest.raises(ToolCallError, match=r"argument 'boxes\[1\]\.corner\.x' must be number"):
        place.validate({"boxes": [{"corner": {"x": 1, "y": 2}}, {"corner": {"x": "1", "y": 2}}]})
    with pytest.raises(ToolCallError, match=r"missing required argument 'y' of 'boxes\[0\]\.corner'"):
        place.validate({"boxes": [{"corner": {"x": 1}}]})


def test_conversion_to_annotated_types():
    @tool
    def everything(
        n: int,
        x: float,
        color: Color,
        level: Level,
        mode: Literal["a", "b"],
        pair: tuple[int, str],
        many: tuple[float, ...],
        box: Box,
        boxes: list[Box],
        maybe: Optional[Box],
        mixed: Union[int, Point],
        table: dict[str, Point],
    ) -> None: ...

    converted = everything.validate(
        {
            "n": 3.0,  # JSON does not tell 3 from 3.0: accepted, and converted
            "x": 2,
            "color": "green",
            "level": 2,
            "mode": "b",
            "pair": [1, "a"],
            "many": [1, 2.5],
            "box": {"corner": {"x": 0, "y": 1.5}, "tags": ["t"]},
            "boxes": [{"corner": {"x": 1, "y": 1, "label": "p"}, "size": 2}],
            "maybe": None,
            "mixed": {"x": 1, "y": 2},
            "table": {"k": {"x": 1, "y": 2}},
        }
    )
    assert converted == {
        "n": 3,
        "x": 2.0,
        "color": Color.GREEN,
        "level": Level.HIGH,
        "mode": "b",
        "pair": (1, "a"),
        "many": (1.0, 2.5),
        "box": Box(corner={"x": 0, "y": 1.5}, tags=["t"]),
        "boxes": [Box(corner={"x": 1, "y": 1, "label": "p"}, size=2)],
        "maybe": None,
        "mixed": {"x": 1, "y": 2},
        "table": {"k": {"x": 1, "y": 2}},
    }
    assert type(converted["n"]) is int and type(converted["x"]) is float
    assert isinstance(converted["box"], Box) and isinstance(converted["boxes"][0], Box)


def test_validate_accepts_a_json_string_and_none_means_no_arguments():
    @tool
    def f(a: int = 1) -> int:
        return a

    assert f.validate('{"a": 2}') == {"a": 2}
    assert f.validate(None) == {} and f.validate("") == {}


def test_dataclass_checks_become_invalid_arguments():
    @dataclass
    class Positive:
        value: int

        def __post_init__(self):
            if self.value <= 0:
                raise ValueError("value must be positive")

    @tool
    def f(p: Positive) -> int:
        return p.value

    with pytest.raises(ToolCallError, match="argument 'p': value must be positive") as info:
        f.validate({"p": {"value": -1}})
    assert info.value.kind is ToolErrorKind.INVALID_ARGUMENTS


# -- pydantic models ------------------------------------------------------------------------


def pydantic_models():
    """A small pydantic model tree, or a skip where pydantic is not installed."""
    pydantic = pytest.importorskip("pydantic")

    class Address(pydantic.BaseModel):
        """Where a parcel goes."""

        city: str = pydantic.Field(description="The city.")
        zip_code: Optional[str] = None

    class Parcel(pydantic.BaseModel):
        weight_kg: float = pydantic.Field(gt=0)
        to: Address
        via: list[Address] = []
        back: Optional[Address] = None

        @pydantic.field_validator("to")
        @classmethod
        def not_nowhere(cls, value: Address) -> Address:
            if value.city == "Nowhere":
                raise ValueError("no parcels go to Nowhere")  # a check the JSON Schema cannot state
            return value

    return pydantic, Address, Parcel


def test_pydantic_model_parameters_get_an_inlined_schema():
    _, Address, Parcel = pydantic_models()

    def ship(parcel: Parcel, fallback: Optional[Address] = None) -> str:
        """Ship a parcel.

        Args:
            parcel: What to ship.
        """
        return "ok"

    t = tool(ship)
    jsonschema.Draft202012Validator.check_schema(t.parameters)
    assert "$ref" not in repr(t.parameters) and "$defs" not in repr(t.parameters)
    assert "'title'" not in repr(t.parameters)  # pydantic's titles only repeat the field names
    address = {
        "description": "Where a parcel goes.",
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city."},
            "zip_code": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        },
        "required": ["city"],
    }
    parcel = t.parameters["properties"]["parcel"]
    assert parcel["description"] == "What to ship." and parcel["required"] == ["weight_kg", "to"]
    assert parcel["properties"]["to"] == address
    assert parcel["properties"]["via"] == {"type": "array", "items": address, "default": []}
    assert t.parameters["properties"]["fallback"] == {"anyOf": [address, {"type": "null"}], "default": None}


def test_pydantic_arguments_are_converted_with_model_validate():
    _, Address, Parcel = pydantic_models()

    @tool
    def ship(parcel: Parcel, fallback: Optional[Address] = None, parcels: list[Parcel] = []) -> str:
        return f"{parcel.to.city}:{parcel.weight_kg}:{fallback.city if fallback else None}"

    converted = ship.validate({
        "parcel": {"weight_kg": 2, "to": {"city": "Oslo"}, "via": [{"city": "Bergen", "zip_code": "5003"}]},
        "fallback": {"city": "Rome"},
        "parcels": [{"weight_kg": 1.5, "to": {"city": "Paris"}}],
    })
    parcel = converted["parcel"]
    assert isinstance(parcel, Parcel) and isinstance(parcel.to, Address) and isinstance(parcel.via[0], Address)
    assert parcel == Parcel(weight_kg=2.0, to=Address(city="Oslo"), via=[Address(city="Bergen", zip_code="5003")])
    assert converted["fallback"] == Address(city="Rome") and isinstance(converted["parcels"][0], Parcel)
    assert ship.validate({"parcel": {"weight_kg": 1, "to": {"city": "Oslo"}}, "fallback": None})["fallback"] is None
    assert run(ship.acall({"parcel": {"weight_kg": 2, "to": {"city": "Oslo"}}})) == "Oslo:2.0:None"


@pytest.mark.parametrize(
    "parcel, needle",
    [
        # The model's own check, after the schema passed:
        ({"weight_kg": 1, "to": {"city": "Nowhere"}}, "argument 'parcel': field 'to': Value error, no parcels go to"),
        # The schema's, as for any other parameter:
        ({"weight_kg": 0, "to": {"city": "Oslo"}}, "argument 'parcel.weight_kg': 0 is less than or equal to"),
        ({"weight_kg": 1, "to": {}}, "missing required argument 'city' of 'parcel.to'"),
        ({"weight_kg": 1, "to": {"city": "Oslo"}, "via": [{"city": 3}]}, "argument 'parcel.via[0].city' must be"),
    ],
)
def test_pydantic_validation_errors_are_invalid_arguments(parcel, needle):
    _, _, Parcel = pydantic_models()

    @tool
    def ship(parcel: Parcel) -> str:
        return "ok"

    result = run(run_tool_call(ToolCall("ship", {"parcel": parcel}), {"ship": ship}))
    assert result.error is ToolErrorKind.INVALID_ARGUMENTS
    assert needle in result.content and "errors.pydantic.dev" not in result.content


def test_recursive_pydantic_models_are_refused_and_results_become_json():
    pydantic, Address, _ = pydantic_models()

    class Tree(pydantic.BaseModel):
        children: list["Tree"] = []

    with pytest.raises(TypeError, match="Tree refers to itself"):

        @tool
        def walk(root: Tree) -> None: ...

    @tool
    def where() -> Any:
        return {"to": Address(city="Oslo")}

    assert run(where.acall({})) == '{"to": {"city": "Oslo", "zip_code": null}}'


# -- running ---------------------------------------------------------------------------------


def test_sync_and_async_tools_return_text():
    @tool
    def add(a: int, b: int) -> int:
        return a + b

    @tool
    async def greet(name: str) -> str:
        await asyncio.sleep(0)
        return f"hello {name}"

    @tool
    def summary(box: Box) -> Any:
        return {"box": box, "color": Color.RED, "ids": (1, 2), "ünï": "ç"}

    assert not add.is_async and greet.is_async
    assert run(add.acall({"a": 2, "b": 3})) == "5"
    assert run(greet.acall({"name": "Ada"})) == "hello Ada"
    assert run(summary.acall({"box": {"corner": {"x": 1, "y": 2}}})) == (
        '{"box": {"corner": {"x": 1.0, "y": 2.0}, "size": 1, "tags": []}, "color": "red", "ids": [1, 2], "ünï": "ç"}'
    )


def test_tool_exceptions_become_tool_errors():
    @tool
    def fails(x: int) -> int:
        raise ValueError(f"bad x={x}")

    @tool
    async def fails_async() -> int:
        raise TimeoutError("the upstream service timed out")  # the tool's own, not our time limit

    @tool
    def refuses(x: int) -> int:
        raise ToolCallError(ToolErrorKind.INVALID_ARGUMENTS, "x must be even")

    with pytest.raises(ToolCallError) as info:
        run(fails.acall({"x": 3}))
    assert (info.value.kind, info.value.message, info.value.tool_name) == (
        ToolErrorKind.TOOL_ERROR,
        "ValueError: bad x=3",
        "fails",
    )
    with pytest.raises(ToolCallError) as info:
        run(fails_async.acall({}))
    assert not isinstance(info.value, ToolTimeout)
    assert info.value.message == "TimeoutError: the upstream service timed out"
    with pytest.raises(ToolCallError, match="x must be even") as info:
        run(refuses.acall({"x": 1}))
    assert info.value.kind is ToolErrorKind.INVALID_ARGUMENTS


def test_unserializable_results_are_a_bug_not_a_model_fault():
    @tool
    def leaky() -> Any:
        return object()

    with pytest.raises(TypeError, match="tool 'leaky' returned object"):
        run(leaky.acall({}))


def test_numpy_torch_and_date_results_become_json_and_sys_exit_is_a_tool_error():
    import datetime
    import decimal

    import numpy as np

    @tool
    def stats() -> Any:
        return {"count": np.int64(13), "mean": np.float32(0.5), "rows": np.arange(3), "t": torch.tensor([1, 2]),
                "day": datetime.date(2026, 1, 2), "price": decimal.Decimal("1.10")}

    @tool
    def quits() -> str:
        sys.exit(3)

    assert run(stats.acall({})) == ('{"count": 13, "mean": 0.5, "rows": [0, 1, 2], "t": [1, 2], '
                                    '"day": "2026-01-02", "price": "1.10"}')
    result = run(run_tool_call(ToolCall("quits", {}), {"quits": quits}))
    assert result.error is ToolErrorKind.TOOL_ERROR and "SystemExit" in result.content


def test_sync_timeout_returns_at_the_limit():
    release = threading.Event()

    @tool(timeout=0.2)
    def hangs() -> str:
        release.wait(30)
        return "late"

    async def call() -> float:
        start = time.monotonic()
        with pytest.raises(ToolTimeout) as info:
            await hangs.acall({})
        assert info.value.kind is ToolErrorKind.TIMEOUT and "0.2 s" in info.value.message
        elapsed = time.monotonic() - start
        release.set()  # the thread cannot be killed: let it finish so the loop can close
        return elapsed

    assert run(call()) < 5


def test_async_timeout_cancels_the_tool():
    cancelled = []

    @tool(timeout=0.1)
    async def sleeps() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "late"

    start = time.monotonic()
    with pytest.raises(ToolTimeout):
        run(sleeps.acall({}))
    assert time.monotonic() - start < 5 and cancelled == [True]


def test_async_tool_that_swallows_cancellation_still_times_out():
    # A retry loop catching CancelledError: wait_for waited for it to end after the cancel,
    # so the call overran its limit, as long as the tool ran (forever, hanging the rollout).
    released, cancels = asyncio.Event(), []

    @tool(timeout=0.1)
    async def stubborn() -> str:
        while not released.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                cancels.append(True)
        return "late"

    async def call() -> float:
        async def release_later():
            await asyncio.sleep(3.0)  # the bound of this test's tool: not a hang if the timeout fails
            released.set()

        releaser = asyncio.create_task(release_later())
        start = time.monotonic()
        try:
            with pytest.raises(ToolTimeout):
                await stubborn.acall({})
            return time.monotonic() - start
        finally:
            released.set()
            releaser.cancel()

    assert run(call()) < 1.0
    assert cancels  # it was asked to stop; it runs on abandoned, without holding the call


# Isolated tools run in another process, which finds them by module and name.


@tool(isolate=True, timeout=30)
def isolated_square(x: int, box: Box) -> dict:
    return {"square": x * x, "pid": os.getpid(), "size": box.size}


@tool(isolate=True, timeout=30)
def isolated_fails(message: str) -> str:
    raise ValueError(message)


@tool(isolate=True, timeout=30)
def isolated_crashes() -> str:
    os._exit(3)


@tool(isolate=True, timeout=0.5)
def isolated_hangs(pid_file: str) -> str:
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
    return "late"


def _start_sleeper(pid_file: str) -> None:
    """Fork a child that sleeps a minute (what a tool's subprocess.Popen leaves behind), its pid in ``pid_file``."""
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    with open(pid_file, "w") as f:
        f.write(str(pid))


@tool(isolate=True, timeout=0.5)
def isolated_spawns_and_hangs(pid_file: str) -> str:
    _start_sleeper(pid_file)
    time.sleep(60)
    return "late"


@tool(isolate=True, timeout=30)
def isolated_spawns_and_returns(pid_file: str) -> str:
    _start_sleeper(pid_file)
    return "done"


def _ended(pid: int, within_s: float = 5.0) -> bool:
    """Whether process ``pid`` is gone (or a zombie: killed, waiting for init to reap it) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    os.kill(pid, 9)  # not left behind by the test either
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_isolated_call_takes_the_processes_it_started_with_it(tmp_path):
    # The call's process was killed alone: a child it started (a server, a subprocess.Popen)
    # outlived the call, timed out or not, orphaned in the trainer's process group.
    hung, returned = tmp_path / "hung", tmp_path / "returned"

    async def calls():
        return await asyncio.gather(isolated_spawns_and_hangs.acall({"pid_file": str(hung)}),
                                    isolated_spawns_and_returns.acall({"pid_file": str(returned)}),
                                    return_exceptions=True)

    timed_out, done = run(calls())
    assert isinstance(timed_out, ToolTimeout) and done == "done"
    ended = {"timed out": _ended(int(hung.read_text())), "finished": _ended(int(returned.read_text()))}
    assert ended == {"timed out": True, "finished": True}, "a child of an isolated call outlived it"


def test_isolated_tools_run_in_another_process():
    async def calls():
        return await asyncio.gather(
            isolated_square.acall({"x": 7, "box": {"corner": {"x": 0, "y": 0}, "size": 4}}),
            run_tool_call(ToolCall("isolated_fails", {"message": "nope"}), {"isolated_fails": isolated_fails}),
            run_tool_call(ToolCall("isolated_crashes", {}), {"isolated_crashes": isolated_crashes}),
        )

    square, failed, crashed = run(calls())
    assert '"square": 49' in square and '"size": 4' in square
    assert f'"pid": {os.getpid()}' not in square
    assert (failed.error, failed.content) == (ToolErrorKind.TOOL_ERROR, "ValueError: nope")
    assert crashed.error is ToolErrorKind.TOOL_ERROR and "crashed" in crashed.content


def test_isolated_timeout_kills_the_process(tmp_path):
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(ToolTimeout):
        run(isolated_hangs.acall({"pid_file": str(pid_file)}))
    assert time.monotonic() - start < 30  # the tool sleeps 60 s: it was stopped, not waited for
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped, not left sleeping


def test_isolate_needs_an_importable_or_picklable_function():
    def local(x: int) -> int:
        return x

    with pytest.raises(TypeError, match="define it at module level"):
        tool(local, isolate=True)


# -- run_tool_call -----------------------------------------------------------------------------


def test_run_tool_call_turns_model_faults_into_results():
    @tool(timeout=0.1)
    async def slow() -> str:
        await asyncio.sleep(30)
        return "late"

    tools = {"forecast": tool(forecast), "slow": slow}

    async def calls():
        return await asyncio.gather(
            run_tool_call(ToolCall("forecast", {"city": "Oslo", "unit": "f"}), tools),
            run_tool_call(ToolCall("forcast", {"city": "Oslo"}), tools),
            run_tool_call(ToolCall("forecast", {"city": 1}), tools),
            run_tool_call(ToolCall("slow", {}), tools),
        )

    ok, unknown, invalid, timed_out = run(calls())
    assert ok == ToolResult(ToolCall("forecast", {"city": "Oslo", "unit": "f"}), "Oslo:3:f:RED")
    assert ok.ok and not unknown.ok
    assert unknown.error is ToolErrorKind.UNKNOWN_TOOL
    assert unknown.content == "Unknown tool 'forcast'. Available tools: forecast, slow."
    assert invalid.error is ToolErrorKind.INVALID_ARGUMENTS and "argument 'city'" in invalid.content
    assert timed_out.error is ToolErrorKind.TIMEOUT
    assert run(run_tool_call(ToolCall("x", {}), {})).content == "Unknown tool 'x'. Available tools: none."


def test_langchain_tools_keep_their_schema_and_run():
    pytest.importorskip("langchain_core")
    from langchain_core.tools import BaseTool, StructuredTool
    from langchain_core.tools import tool as lc_tool
    from langchain_core.utils.function_calling import convert_to_openai_tool

    @lc_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        if a == 0:
            raise ValueError("zero is not allowed")
        return a * b

    async def fetch(url: str) -> str:
        return f"<html>{url}</html>"

    class Shout(BaseTool):
        name: str = "shout"
        description: str = "Upper-case a text."

        def _run(self, text: str) -> str:
            return text.upper()

    fetch_tool = StructuredTool.from_function(coroutine=fetch, name="fetch", description="Fetch a page.")
    tools = {t.name: t for t in map(Tool.from_langchain, [multiply, fetch_tool, Shout()])}
    for original in (multiply, fetch_tool, Shout()):
        assert tools[original.name].schema == convert_to_openai_tool(original)
    assert tools["fetch"].is_async and not tools["multiply"].is_async

    def call(name, arguments):
        return run(run_tool_call(ToolCall(name, arguments), tools))

    assert call("multiply", {"a": 2, "b": 3}).content == "6"
    assert call("fetch", {"url": "x"}).content == "<html>x</html>"
    assert call("shout", {"text": "hi"}).content == "HI"
    assert call("multiply", {"a": 0, "b": 3}).error == ToolErrorKind.TOOL_ERROR
    assert call("multiply", {"a": "two", "b": 3}).error == ToolErrorKind.INVALID_ARGUMENTS
    with pytest.raises(TypeError, match=r"Tool\.from_langchain"):
        tool(multiply)


@pytest.mark.filterwarnings("ignore:Function 'weather' has decorators")
def test_smolagents_tools_keep_their_schema_and_run():
    pytest.importorskip("smolagents")
    from smolagents import Tool as SmolTool
    from smolagents import tool as smol_tool
    from smolagents.models import get_tool_json_schema
    from smolagents.tools import validate_tool_arguments

    @smol_tool
    def weather(city: str, celsius: bool = True) -> str:
        """The weather in a city.

        Args:
            city: The city.
            celsius: Whether to answer in Celsius.
        """
        return f"{city}: {20 if celsius else 68}"

    class Reverse(SmolTool):
        name = "reverse"
        description = "Reverse a text."
        inputs = {"text": {"type": "string", "description": "The text."}}
        output_type = "string"

        def forward(self, text: str) -> str:
            return text[::-1]

    tools = {t.name: t for t in map(Tool.from_smolagents, [weather, Reverse()])}
    assert tools["weather"].schema == get_tool_json_schema(weather)
    assert tools["weather"].parameters["required"] == ["city"]
    assert run(tools["weather"].acall({"city": "Oslo", "celsius": False})) == "Oslo: 68"
    # smolagents marks an optional input "nullable" (OpenAPI's keyword, which JSON Schema ignores) and takes
    # a null for it, as models often write one: a valid call, not invalid arguments.
    assert get_tool_json_schema(weather)["function"]["parameters"]["properties"]["celsius"]["nullable"] is True
    validate_tool_arguments(weather, {"city": "Oslo", "celsius": None})  # smolagents' own check passes it
    assert tools["weather"].validate({"city": "Oslo", "celsius": None}) == {"city": "Oslo", "celsius": None}
    with pytest.raises(ToolCallError, match="'celsius' must be boolean or null"):
        tools["weather"].validate({"city": "Oslo", "celsius": "yes"})
    assert run(tools["reverse"].acall({"text": "abc"})) == "cba"
    assert run(run_tool_call(ToolCall("reverse", {}), tools)).error == ToolErrorKind.INVALID_ARGUMENTS
    with pytest.raises(TypeError, match=r"Tool\.from_smolagents"):
        tool(weather)
