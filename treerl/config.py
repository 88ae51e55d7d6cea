"""Command lines generated from config dataclasses (plus ``--config file.yaml``).

Each entry point has one dataclass whose fields carry a ``help`` string in their metadata
and whose ``__post_init__`` validates values with errors that name the fix. The command
line is built from it, never hand-copied, so flags, defaults and help cannot drift.

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
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from treerl.errors import ConfigError

__all__ = ["field_help", "add_dataclass_arguments", "config_from_args", "load_config_file"]

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
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": 1}}', got {text!r} ({exc})")
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
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata.get("help", "")}
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is not None:
            kwargs["help"] += f" (default: {default})"
        origin = typing.get_origin(tp)
        if tp is bool:
            kwargs.update(type=_parse_bool, nargs="?", const=True, metavar="BOOL")
        elif origin is Literal:
            choices = typing.get_args(tp)
            kwargs.update(type=type(choices[0]), choices=choices)
        elif origin is dict or tp is dict:
            kwargs.update(type=_parse_mapping, metavar="JSON")
        elif origin in (list, tuple):
            (item,) = typing.get_args(tp)[:1]
            kwargs.update(type=item, nargs="+")
        elif tp in (int, float, str):
            kwargs["type"] = tp
        elif tp is Path:
            kwargs["type"] = Path
        else:
            kwargs["type"] = str
        if optional and tp is not bool:
            kwargs["metavar"] = kwargs.get("metavar") or f.name.upper()
        parser.add_argument(_flag(f.name), **kwargs)
    parser.add_argument("--config", dest="__config__", default=None, metavar="FILE.yaml",
                        help="Read these options from a YAML (or JSON) file; flags override it.")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML/JSON mapping of option names (dashes or underscores) to values."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file.")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({exc}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}.")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def config_from_args(cls: type[T], args: argparse.Namespace, *, extra_keys: Sequence[str] = ()) -> T:
    """Build ``cls`` from a config file (if ``--config``) overridden by explicit flags.

    ``extra_keys`` are keys the file may hold for the command itself (``learner``), not for ``cls``.
    Invalid values raise :class:`~treerl.errors.ConfigError` with the dataclass's own validation message.
    """
    values: dict[str, Any] = {}
    config_path = getattr(args, "__config__", None)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    if config_path:
        from_file = {k: v for k, v in load_config_file(config_path).items() if k not in extra_keys}
        unknown = sorted(set(from_file) - names)
        if unknown:
            raise ConfigError(f"--config {config_path}: unknown option(s) {unknown}; valid ones: {sorted(names)}.")
        values.update(from_file)
    values.update({k: v for k, v in vars(args).items() if k in names})
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
