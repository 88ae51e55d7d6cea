"""treerl's own errors: the base class, and the typed errors at the environment boundary.

Every floor of the package (kernels and learners too) derives its errors from
:class:`TreerlError`, so this module sits below them all and imports nothing of treerl.

A bad rollout is data, not a crash: every way a model's tool call can fail is one of the
closed set of kinds in :class:`ToolErrorKind`. Tools and parsers raise
:class:`ToolCallError` (or :class:`ToolTimeout`); the environment catches them in one
place, turns them into an observation for the model, and records the kind in ``info``.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ToolErrorKind", "TreerlError", "ConfigError", "MissingExtraError", "EnvError", "ToolCallError", "ToolTimeout"]


class ToolErrorKind(str, Enum):
    """Why a model's turn did not produce a successful tool call."""

    NO_CALL = "no_call"
    """The turn had neither a tool call nor a final answer."""
    MALFORMED = "malformed"
    """Something that looks like a tool call could not be parsed."""
    UNKNOWN_TOOL = "unknown_tool"
    """The call names a tool the environment does not have."""
    INVALID_ARGUMENTS = "invalid_arguments"
    """The arguments fail the tool's JSON Schema or cannot be converted to its types."""
    TOOL_ERROR = "tool_error"
    """The tool raised an exception."""
    TIMEOUT = "timeout"
    """The tool ran past its time limit."""


class TreerlError(Exception):
    """Base class of treerl's own errors."""


class ConfigError(TreerlError, ValueError):
    """A setting, path or file the user gave cannot work; the message names the fix.

    The ``treerl`` command prints it without a traceback and exits with status 2.
    """


class MissingExtraError(ConfigError, ImportError):
    """An optional dependency a setting needs is not installed; the message names the extra.

    Still an ``ImportError`` for code that catches one; the ``treerl`` command prints it in one
    line and exits with status 2, as for any setting that cannot work.
    """


class EnvError(TreerlError):
    """An environment was used wrongly (our bug or the user's), e.g. ``step`` before ``reset``."""


class ToolCallError(TreerlError):
    """A model's tool call failed in one of the ways of :class:`ToolErrorKind`.

    ``message`` is written for the model: it says what was wrong and what a correct call
    looks like, because it is sent back as the tool's observation.
    """

    def __init__(self, kind: ToolErrorKind, message: str, *, tool_name: str | None = None):
        super().__init__(message)
        self.kind = ToolErrorKind(kind)
        self.message = message
        self.tool_name = tool_name

    def __repr__(self) -> str:
        return f"ToolCallError(kind={self.kind.value!r}, tool_name={self.tool_name!r}, message={self.message!r})"


class ToolTimeout(ToolCallError):
    """A tool ran past its time limit."""

    def __init__(self, message: str, *, tool_name: str | None = None):
        super().__init__(ToolErrorKind.TIMEOUT, message, tool_name=tool_name)
