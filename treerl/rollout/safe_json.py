"""JSON for data that came from a model: encoding that never fails, and says what it could not encode.

Episode records carry what the model and the environment produced: tool arguments such as
``NaN`` or ``Infinity`` (which Python's JSON reader accepts), integers of more digits than
Python prints, nesting a thousand levels deep, objects an environment put into its
metrics. Strict JSON has no spelling for these, and one of them must not cost a file
write. :func:`dumps_record` tries the fast strict encoding first; only when that fails
does it walk the record, put ``null`` where a value cannot be encoded, and list each
such place with what was there.

>>> text, dropped = dumps_record({"arguments": {"x": float("nan"), "y": 1}})
>>> text
'{"arguments":{"x":null,"y":1}}'
>>> dropped
[{'path': 'arguments.x', 'value': 'float nan'}]
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["dumps_record", "MAX_DEPTH"]

MAX_DEPTH = 100
"""Deeper values are cut (``null``): the C encoder would exhaust the recursion limit."""
_MAX_REPORTED = 20
# Integers whose decimal form Python refuses to print (``sys.get_int_max_str_digits``).
_MAX_INT_BITS = int((getattr(sys, "get_int_max_str_digits", lambda: 4300)() or 4300) * 3.3219)


def dumps_record(obj: Any, *, default: Callable[[Any], Any] | None = None) -> tuple[str, list[dict[str, str]]]:
    """``(compact JSON, what was dropped)``; never raises for anything inside ``obj``.

    ``default`` converts objects JSON does not know (as ``json.dumps``'s); what it cannot
    convert is dropped. The list names at most 20 dropped places (``path``, ``value``).
    """
    try:  # the common case, encoded once: a group's tokens are most of a write
        return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=default), []
    except (ValueError, TypeError, RecursionError, OverflowError):
        pass
    dropped: list[dict[str, str]] = []
    clean = _narrow(obj, "", 0, default, dropped)
    return json.dumps(clean, separators=(",", ":"), allow_nan=False, default=default), dropped[:_MAX_REPORTED]


def _encodes(value: Any, default: Callable[[Any], Any] | None) -> bool:
    try:
        json.dumps(value, allow_nan=False, default=default)
    except (ValueError, TypeError, RecursionError, OverflowError):
        return False
    return True


def _narrow(value: Any, path: str, depth: int, default: Callable[[Any], Any] | None,
            dropped: list[dict[str, str]]) -> Any:
    """``value`` itself when strict JSON encodes it; else each child tried alike, the top few
    levels down (a group's episodes, an episode's fields), so that only the parts that fail are
    walked in Python (:func:`_clean`)."""
    if _encodes(value, default):
        return value
    if depth >= 3 or not isinstance(value, (Mapping, list, tuple)):
        return _clean(value, path, depth, default, dropped)
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _narrow(v, f"{path}.{k}", depth + 1, default, dropped) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_narrow(v, f"{path}[{i}]", depth + 1, default, dropped) for i, v in enumerate(value)]
    return _clean(value, path, depth, default, dropped)


def _clean(value: Any, path: str, depth: int, default: Callable[[Any], Any] | None,
           dropped: list[dict[str, str]]) -> Any:
    """A copy of ``value`` that strict JSON can encode; ``None`` (recorded) for what it cannot."""
    def drop(what: str) -> None:
        dropped.append({"path": path.lstrip(".") or "(root)", "value": what})

    if depth > MAX_DEPTH:
        drop(f"nested more than {MAX_DEPTH} levels deep")
        return None
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if value.bit_length() > _MAX_INT_BITS:
            drop(f"int of about {value.bit_length() * 0.30103:.0f} digits")
            return None
        return int(value)  # an int subclass (IntEnum) as a plain int
    if isinstance(value, float):
        if not math.isfinite(value):
            drop(f"float {value!r}")
            return None
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not (key is None or isinstance(key, (str, int, float))):
                drop(f"key of type {type(key).__name__}")
                continue
            try:
                name = key if isinstance(key, str) else repr(key)
            except ValueError:  # an int key of too many digits to print
                drop("int key of too many digits")
                continue
            out[name] = _clean(item, f"{path}.{name}", depth + 1, default, dropped)
        return out
    if isinstance(value, (list, tuple)):
        return [_clean(item, f"{path}[{i}]", depth + 1, default, dropped) for i, item in enumerate(value)]
    if default is not None:
        try:
            converted = default(value)
        except Exception:  # noqa: BLE001 - whatever the converter does not know is dropped, and named
            converted = value
        if converted is not value:
            return _clean(converted, path, depth + 1, default, dropped)
    drop(f"object of type {type(value).__name__}")
    return None
