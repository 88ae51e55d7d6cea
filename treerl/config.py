"""Command lines generated from config dataclasses (plus ``--config file.yaml``).

Each entry point has one dataclass whose fields carry a ``help`` string in their metadata
and whose ``__post_init__`` validates values with errors that name the fix. The command
line is built from it, never hand-copied, so flags, defaults and help cannot drift.

Values from the file and the flags are type-checked against the dataclass's type hints in
one place, :func:`check_types`, before the dataclass sees them: ``bool`` from YAML's words
(``"no"`` is false, ``"maybe"`` an error), ``float`` from YAML's ``1e-4`` (which YAML reads
as a string), whole numbers where an ``int`` is needed, finite numbers where a ``float`` is
(``nan`` and ``inf`` are refused), a choice of a ``Literal``. Each error is one line that
names the field, what was wrong, and the fix.

>>> from dataclasses import dataclass, field
>>> @dataclass
... class Demo:
...     steps: int = field(default=10, metadata={"help": "How many steps."})
...     out: str | None = field(default=None, metadata={"help": "Where to write."})
...     env_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "Keyword arguments."})
>>> parser = argparse.ArgumentParser()
>>> add_dataclass_arguments(parser, Demo)
>>> config_from_args(Demo, parser.parse_args(["--steps", "3", "--env-kwargs", '{"data_path": "p.jsonl"}']))
Demo(steps=3, out=None, env_kwargs={'data_path': 'p.jsonl'})
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from treerl.errors import ConfigError

__all__ = ["field_help", "add_dataclass_arguments", "config_from_args", "load_config_file", "check_types",
           "unknown_option_hints", "AcceptsAliases"]

T = TypeVar("T")


def field_help(default: Any = dataclasses.MISSING, help: str = "", **kwargs: Any) -> Any:
    """A dataclass field with help text for the generated command line."""
    metadata = {"help": help, **kwargs.pop("metadata", {})}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _or_none(tp: type) -> Any:
    """argparse type: ``tp(text)``, or None for ``none``/``null``.

    >>> _or_none(float)("2.5"), _or_none(float)("None")
    (2.5, None)
    """
    def parse(text: str) -> Any:
        return None if text.strip().lower() in ("none", "null") else tp(text)

    parse.__name__ = tp.__name__  # argparse names the type in its error message
    return parse


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_mapping(text: str) -> dict[str, Any]:
    """A JSON object (or a YAML flow mapping) given on the command line, e.g. '{"data_path": "p.jsonl"}'."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": 1}}', got {text!r} ({problem})")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": 1}}', got {text!r}")
    return {str(k): v for k, v in value.items()}


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of ``cls`` (defaults are left to the dataclass, so that
    ``--config`` values apply unless a flag is given explicitly)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False:
            continue
        tp, optional = _unwrap_optional(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata.get("help", ""),
                                  **_type_kwargs(tp, optional)}
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is not None:
            kwargs["help"] += f" (default: {default})"
        if optional and tp is not bool:
            kwargs["metavar"] = kwargs.get("metavar") or f.name.upper()
        aliases = [_flag(a) for a, target in _aliases(cls).items() if target == f.name]
        if aliases:
            kwargs["help"] += f" (also {', '.join(aliases)}, as in TRL)"
        parser.add_argument(_flag(f.name), *aliases, **kwargs)
    for name, (tp, help_text) in _translated(cls).items():
        parser.add_argument(_flag(name), dest=name, default=argparse.SUPPRESS, help=help_text,
                            **_type_kwargs(tp, False))
    parser.add_argument("--config", dest="__config__", default=None, metavar="FILE.yaml",
                        help="Read these options from a YAML (or JSON) file; flags override it.")


def _type_kwargs(tp: Any, optional: bool) -> dict[str, Any]:
    """``add_argument``'s ``type`` (and ``nargs``, ``choices``, ``metavar``) for a field of type ``tp``."""
    origin = typing.get_origin(tp)
    if tp is bool:
        return {"type": _parse_bool, "nargs": "?", "const": True, "metavar": "BOOL"}
    if origin is Literal:
        choices = typing.get_args(tp)
        return {"type": type(choices[0]), "choices": choices}
    if origin is dict or tp is dict:
        return {"type": _parse_mapping, "metavar": "JSON"}
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1]
        return {"type": item, "nargs": "+"}
    if tp in (int, float) and optional:
        return {"type": _or_none(tp)}  # unsetting an optional number from the command line: --flag none
    if tp in (int, float, str, Path):
        return {"type": tp}
    return {"type": str}


def _aliases(cls: type) -> dict[str, str]:
    """``cls.ALIASES`` (other names of fields, e.g. TRL's ``num_generations`` for ``group_size``) whose
    target is a field of ``cls`` and whose name is not one."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {a: t for a, t in getattr(cls, "ALIASES", {}).items() if t in names and a not in names}


def _translated(cls: type) -> dict[str, tuple[type, str]]:
    """``cls.TRANSLATED``: other names (TRL's ``per_device_train_batch_size``) that ``cls.translate_options``
    turns into fields or takes with a note, each with its type and help; they are flags and YAML keys too."""
    return dict(getattr(cls, "TRANSLATED", {}))


def _overridden(cls: type, from_file: dict[str, Any], flags: set[str]) -> dict[str, Any]:
    """``from_file`` without the options that a flag of another name sets (``cls.TRANSLATED_INTO``): flags
    override the file, ``--steps`` its TRL ``max_steps`` as ``--max-steps`` its ``steps``."""
    into = getattr(cls, "TRANSLATED_INTO", {})

    def overridden(key: str) -> bool:  # a field against a translated option only: TRL's batch sizes combine
        return any(into.get(f, f) == into.get(key, key) and (f in into) != (key in into) for f in flags)

    return {k: v for k, v in from_file.items() if not overridden(k)}


def _named_twice(aliases: Mapping[str, str], given: Mapping[str, Any]) -> list[str]:
    """``"alias and field"`` for each option ``given`` under both its names (which would win is not for
    a dict's order to say)."""
    return sorted(f"{k} and {aliases[k]}" for k in given if k in aliases and aliases[k] in given)


class AcceptsAliases(type):
    """The metaclass of a config dataclass with ``ALIASES``: its keyword arguments in Python take the
    same other names as its flags and YAML keys (TRL's ``num_generations`` for ``group_size``), and a
    name in its ``UNSUPPORTED`` is refused with what to use instead, unless ``NEUTRAL`` lists its value as
    one that means what the config already does (see :func:`without_neutral`).

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Demo(metaclass=AcceptsAliases):
    ...     ALIASES = {"num_generations": "group_size"}
    ...     UNSUPPORTED = {"per_device_train_batch_size": "a step plays tasks x group_size episodes"}
    ...     group_size: int = 8
    >>> Demo(num_generations=4)
    Demo(group_size=4)
    >>> Demo(num_generations=4, group_size=4)
    Traceback (most recent call last):
    ...
    TypeError: Demo(): num_generations and group_size name the same option; keep one.
    >>> Demo(per_device_train_batch_size=4)
    Traceback (most recent call last):
    ...
    TypeError: Demo() has no option per_device_train_batch_size: a step plays tasks x group_size episodes.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        kwargs = without_neutral(cls, kwargs)
        aliases = _aliases(cls)
        if both := _named_twice(aliases, kwargs):
            raise TypeError(f"{cls.__name__}(): {'; '.join(both)} name the same option; keep one.")
        names = {f.name for f in dataclasses.fields(cls) if f.init} | set(_translated(cls))
        hints = unknown_option_hints(cls)
        for name in kwargs:
            if name not in names and name not in aliases:
                said = _instead(name, names | set(aliases), hints)
                raise TypeError(f"{cls.__name__}() has no option {name}" + (f": {said}" if said else "")
                                + ("" if said and said.endswith("?") else "."))
        kwargs = {aliases.get(k, k): v for k, v in kwargs.items()}
        if _translated(cls):
            kwargs = cls.translate_options(kwargs)
        return super().__call__(*args, **kwargs)


def _instead(name: str, names: Iterable[str], hints: Mapping[str, str]) -> str | None:
    """What to use instead of the unknown option ``name``: its hint, else "did you mean" the closest of
    ``names``, else None; the same words in Python, on the command line and in ``--config`` files.

    >>> _instead("lerning_rate", {"learning_rate", "steps"}, {})
    'did you mean learning_rate?'
    """
    if name in hints:
        return hints[name]
    close = difflib.get_close_matches(name, sorted(names), 1)
    return f"did you mean {close[0]}?" if close else None


def without_neutral(cls: type, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` without the options that ``cls.NEUTRAL`` lists at their value: another toolkit's option at a
    value that means what ``cls`` does anyway (TRL's ``repetition_penalty=1.0``), or ``None`` where that
    toolkit's ``None`` means "off" or "the default" (TRL's ``min_p=None``). A script or a YAML file that
    writes out the other toolkit's defaults runs; any other value is refused or taken as before.

    >>> class Demo:
    ...     NEUTRAL = {"repetition_penalty": (1.0,), "min_p": (None,)}
    >>> without_neutral(Demo, {"repetition_penalty": 1, "min_p": None, "top_p": 0.9})
    {'top_p': 0.9}
    >>> without_neutral(Demo, {"repetition_penalty": 1.1, "min_p": 0.0})
    {'repetition_penalty': 1.1, 'min_p': 0.0}
    """
    neutral = getattr(cls, "NEUTRAL", {})
    return {k: v for k, v in given.items() if not any(_same_value(v, n) for n in neutral.get(k, ()))}


def _same_value(value: Any, neutral: Any) -> bool:
    """``value`` is ``neutral``: identical for ``None`` and booleans (``0`` is not ``False``), equal otherwise."""
    if neutral is None or isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML/JSON mapping of option names (dashes or underscores) to values."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file.")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"--config {path}: not valid YAML ({where}{problem}); fix the file.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}.")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def unknown_option_hints(cls: type, hints: Mapping[str, str] | None = None) -> dict[str, str]:
    """Names that are not options of ``cls`` but that a user may bring (``cls.option_hints()`` where it has
    one, else ``cls.UNSUPPORTED``, e.g. TRL's ``per_device_train_batch_size``; plus ``hints``), each with
    what to do instead."""
    own = cls.option_hints() if hasattr(cls, "option_hints") else getattr(cls, "UNSUPPORTED", {})
    return {**own, **(hints or {})}


def config_from_args(cls: type[T], args: argparse.Namespace, *, extra_keys: Sequence[str] = (),
                     hints: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from a config file (if ``--config``) overridden by explicit flags.

    ``extra_keys`` are keys the file may hold for the command itself (``learner``), not for ``cls``;
    ``hints`` say what to use instead of names that are not options (see :func:`unknown_option_hints`).
    Invalid values raise :class:`~treerl.errors.ConfigError` with the dataclass's own validation message.
    """
    values: dict[str, Any] = {}
    config_path = getattr(args, "__config__", None)
    translated = _translated(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init} | set(translated)
    if config_path:
        aliases = _aliases(cls)
        raw = without_neutral(cls, {k: v for k, v in load_config_file(config_path).items() if k not in extra_keys})
        if both := _named_twice(aliases, raw):
            raise ConfigError(f"--config {config_path}: {'; '.join(both)} name the same option; keep one.")
        # A YAML boolean under another toolkit's name is passed on as its word, for the config to read as
        # that toolkit does (TRL's scale_rewards: false, its older form of "none").
        from_file = {aliases.get(k, k): str(v).lower() if k in aliases and isinstance(v, bool) else v
                     for k, v in raw.items()}
        unknown = sorted(set(from_file) - names)
        if unknown:
            known_hints = unknown_option_hints(cls, hints)
            said = "".join(f" ({k}: {instead})" for k in unknown if (instead := _instead(k, names, known_hints)))
            raise ConfigError(f"--config {config_path}: unknown option(s) {unknown}{said}; valid ones: "
                              f"{sorted(names)}.")
        values.update(_overridden(cls, from_file, {k for k in vars(args) if k in names}))
    values.update({k: v for k, v in vars(args).items() if k in names})
    values = check_types(cls, values)
    for name in set(values) & set(translated):  # typed here as fields are, for translate_options to read
        problem, values[name] = _convert(values[name], translated[name][0])
        if problem is not None:
            raise ConfigError(f"{name}={values[name]!r}: {problem}.")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n")


def check_types(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` converted to the types of ``cls``'s fields; :class:`~treerl.errors.ConfigError` names a bad one.

    Generic over the type hints (``bool``, ``int``, ``float``, ``str``, ``Path``,
    ``Literal``, ``X | None``, ``list[X]``, ``dict``); other types pass unchecked.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Demo:
    ...     lr: float = 2e-4
    ...     resume: bool = False
    ...     steps: int = 10
    >>> check_types(Demo, {"lr": "1e-4", "resume": "no", "steps": 3.0})
    {'lr': 0.0001, 'resume': False, 'steps': 3}
    >>> check_types(Demo, {"steps": 2.5})
    Traceback (most recent call last):
    ...
    treerl.errors.ConfigError: steps=2.5: expected a whole number; give e.g. --steps 10 (steps: 10 in YAML).
    """
    hints = typing.get_type_hints(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    out = dict(values)
    for name, value in values.items():
        if name not in hints:
            continue
        problem, converted = _convert(value, hints[name])
        if problem is not None:
            example = defaults.get(name)
            if example is dataclasses.MISSING or example is None:
                inner = _unwrap_optional(hints[name])[0]
                example = _EXAMPLES.get(typing.get_origin(inner) or inner)
            if isinstance(example, dict) or typing.get_origin(_unwrap_optional(hints[name])[0]) is dict:
                fix = f"; give e.g. {_flag(name)} '{{\"key\": 1}}' (a mapping in YAML)"
            elif example is not None:
                fix = f"; give e.g. {_flag(name)} {_cli_text(example)} ({name}: {_cli_text(example)} in YAML)"
            else:
                fix = ""
            raise ConfigError(f"{name}={value!r}: {problem}{fix}.")
        out[name] = converted
    return out


_EXAMPLES: dict[Any, Any] = {int: 1, float: 1.0, bool: True, str: "text"}


def _cli_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Path):
        return str(value)
    return str(value) if not isinstance(value, str) else (value if value and " " not in value else repr(value))


def _convert(value: Any, tp: Any) -> tuple[str | None, Any]:
    """``(None, converted)``, or ``(what is wrong, value)``."""
    if tp is Any or isinstance(tp, TypeVar):
        return None, value
    if tp is type(None):
        return (None, None) if value is None else ("expected null", value)
    inner, optional = _unwrap_optional(tp)
    if optional:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "~")):
            return None, None
        return _convert(value, inner)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for member in typing.get_args(tp):
            problem, converted = _convert(value, member)
            if problem is None:
                return None, converted
        return f"expected one of {', '.join(getattr(m, '__name__', str(m)) for m in typing.get_args(tp))}", value
    if tp is bool:
        if isinstance(value, bool):
            return None, value
        if isinstance(value, int) and value in (0, 1):
            return None, bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return None, value.strip().lower() in _TRUE
        return "expected true or false", value
    if tp is int:
        if isinstance(value, bool):
            return "expected a whole number, not a boolean", value
        if isinstance(value, int):
            return None, value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return None, int(value)
        if isinstance(value, str):
            try:
                return None, int(value.strip().replace("_", ""))
            except ValueError:
                pass
        return "expected a whole number", value
    if tp is float:
        if isinstance(value, bool):
            return "expected a number, not a boolean", value
        number = value
        if isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
            try:
                number = float(value.strip())
            except ValueError:
                return "expected a number", value
        if not isinstance(number, (int, float)):
            return "expected a number", value
        if not math.isfinite(number):
            return "expected a finite number", value
        return None, float(number)
    if tp is str:
        if isinstance(value, bool):
            return "expected text, got a boolean (YAML reads yes/no/on/off as booleans: quote the word)", value
        if isinstance(value, (int, float)):
            return None, str(value)
        return (None, value) if isinstance(value, str) else (f"expected text, got {type(value).__name__}", value)
    if tp is Path:
        return (None, Path(value)) if isinstance(value, (str, Path)) else ("expected a path", value)
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            problem, converted = _convert(value, type(choice))
            if problem is None and converted == choice:
                return None, choice
        return f"expected one of {', '.join(map(str, choices))}", value
    if origin is dict or tp is dict:
        if isinstance(value, str):  # a JSON object written as a string
            try:
                return None, _parse_mapping(value)
            except argparse.ArgumentTypeError:
                pass
        return (None, dict(value)) if isinstance(value, Mapping) else ("expected a mapping (a JSON object)", value)
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            return "expected a list", value
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        items = []
        for item in value:
            problem, converted = _convert(item, args[0]) if args else (None, item)
            if problem is not None:
                return f"an item {item!r}: {problem}", value
            items.append(converted)
        return None, items if origin is list else tuple(items)
    return None, value
