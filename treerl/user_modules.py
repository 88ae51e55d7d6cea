"""The user's modules (``--import``): imported once in the command's process, and again in each
process it spawns (AsyncGRPO's generators), since what they register (an environment, a SkyRL-Gym
environment, a loss) lives in the importing process only."""

from __future__ import annotations

import importlib
import runpy
from collections.abc import Sequence
from pathlib import Path

from treerl.errors import ConfigError

__all__ = ["import_user_modules", "imported_user_modules"]

_IMPORTED: list[str] = []
"""What :func:`import_user_modules` imported in this process, in order: a spawned process imports them too."""


def import_user_modules(specs: Sequence[str]) -> None:
    """Import modules (``pkg.mod``) or run Python files (``path/to/file.py``) that register environments;
    each once per process (a file run again would register its environments again)."""
    for spec in specs:
        if spec in _IMPORTED or (spec.endswith(".py") and str(Path(spec).resolve()) in _IMPORTED):
            continue
        if spec.endswith(".py"):
            if not Path(spec).is_file():
                raise ConfigError(f"--import {spec}: no such file. Pass a Python file or an importable module name.")
            # One module name per file, so what it defines is the same definition when it runs again.
            runpy.run_path(spec, run_name=f"treerl_user_module:{Path(spec).resolve()}")
            spec = str(Path(spec).resolve())  # a spawned process may start elsewhere
        else:
            try:
                importlib.import_module(spec)
            except ImportError as exc:
                raise ConfigError(f"--import {spec}: {exc}. Is the module installed or on PYTHONPATH?") from None
        if spec not in _IMPORTED:
            _IMPORTED.append(spec)


def imported_user_modules() -> tuple[str, ...]:
    """The modules and files :func:`import_user_modules` imported in this process."""
    return tuple(_IMPORTED)
