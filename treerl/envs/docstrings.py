"""Docstrings: the description and the per-parameter texts a tool schema shows.

:func:`parse_docstring` reads the three common styles, even mixed in one docstring:

- **Google**: an ``Args:`` section (also ``Arguments``, ``Parameters``, ``Params``,
  ``Keyword Args``, ``Keyword Arguments``, ``Other Parameters``) of ``name (type): text``
  entries.
- **reST / Sphinx**: ``:param name: text`` fields (also ``:param type name:``, and
  ``parameter``, ``arg``, ``argument``, ``key``, ``keyword``); ``:type:``, ``:returns:``,
  ``:rtype:``, ``:raises:`` and other fields are skipped.
- **numpydoc**: a ``Parameters`` (or ``Other Parameters``) heading underlined with dashes,
  then ``name : type`` entries (``x, y : int`` documents both) with their text indented
  below.

The description is the text before the first section or field. A section header or a field
must start at the docstring's own indentation; an entry's continuation lines are indented
deeper than the entry and are joined to it with single spaces. Anything it cannot read is
left out, never an error: a docstring is documentation, not a contract. A parameter
documented without text maps to ``""``, so that a caller can still tell which names the
docstring documents.
"""

from __future__ import annotations

import inspect
import re

__all__ = ["parse_docstring"]

_PARAMETER_SECTIONS = frozenset(
    {"Args", "Arguments", "Parameters", "Params", "Keyword Args", "Keyword Arguments", "Other Parameters"}
)
_GOOGLE_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters|Returns|Return|"
    r"Yields|Raises|Examples?|Notes?|Attributes|Todo|Warnings?|See Also|References)\s*:\s*$"
)
_GOOGLE_ARG = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
# numpydoc: any heading underlined with dashes ends the description; only the parameter
# sections are read.
_NUMPY_UNDERLINE = re.compile(r"^-{3,}\s*$")
_NUMPY_ARG = re.compile(r"^(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?::.*)?$")
# ``:param x: text`` and ``:param int x: text``; a role such as ``:class:`Foo``` is no field.
_REST_FIELD = re.compile(r"^:(\w+)((?:\s+[^:`]+)?):(?:\s+(.*))?$")
_REST_PARAMETER_FIELDS = frozenset({"param", "parameter", "arg", "argument", "key", "keyword"})


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """``(description, {parameter: description})`` from a Google, reST or numpydoc docstring.

    >>> parse_docstring('''Look up the weather.
    ...
    ...     Args:
    ...         city (str): The city,
    ...             in English.
    ...         days: How many days.
    ...     Returns:
    ...         A forecast.
    ...     ''')
    ('Look up the weather.', {'city': 'The city, in English.', 'days': 'How many days.'})
    >>> parse_docstring('''Look up the weather.
    ...
    ...     :param city: The city.
    ...     :type city: str
    ...     :returns: A forecast.
    ...     ''')
    ('Look up the weather.', {'city': 'The city.'})
    >>> parse_docstring('''Look up the weather.
    ...
    ...     Parameters
    ...     ----------
    ...     city : str
    ...         The city.
    ...     ''')
    ('Look up the weather.', {'city': 'The city.'})
    """
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    # What the lines belong to: None (the description), or a section and its style.
    section: str | None = None
    style = "google"  # "google", "numpy" or "rest"
    entry_indent: int | None = None
    current: list[str] = []  # the parameters the continuation lines describe
    skip_next = False  # a numpydoc heading's underline
    for i, line in enumerate(lines):
        if skip_next:
            skip_next = False
            continue
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if indent == 0 and stripped:
            following = lines[i + 1] if i + 1 < len(lines) else ""
            google = _GOOGLE_SECTION.match(stripped)
            field = _REST_FIELD.match(stripped)
            if _NUMPY_UNDERLINE.match(following) and not _NUMPY_UNDERLINE.match(stripped):
                section, style, entry_indent, current, skip_next = stripped, "numpy", None, [], True
                continue
            if google is not None:
                section, style, entry_indent, current = google.group(1), "google", None, []
                continue
            if field is not None:
                section, style, current = "field", "rest", []
                kind, names, text = field.group(1), field.group(2).split(), field.group(3) or ""
                if kind in _REST_PARAMETER_FIELDS and names:
                    current = [names[-1].lstrip("*")]  # ``:param int x:``: the name comes last
                    args[current[0]] = text.strip()
                continue
        if section is None:
            description.append(line)
            continue
        if not stripped:
            continue
        if style == "rest":
            if indent > 0:
                _extend(args, current, stripped)
            continue
        if section not in _PARAMETER_SECTIONS:
            continue
        if entry_indent is None:
            entry_indent = indent
        if indent > entry_indent:
            _extend(args, current, stripped)
            continue
        if style == "google":
            match = _GOOGLE_ARG.match(stripped)
            current = [match.group(1)] if match is not None else []
            if match is not None:
                args[match.group(1)] = match.group(2).strip()
        else:
            match = _NUMPY_ARG.match(stripped)
            current = [n.strip().lstrip("*") for n in match.group(1).split(",")] if match is not None else []
            for name in current:
                args[name] = ""
    return "\n".join(description).strip(), args


def _extend(args: dict[str, str], names: list[str], text: str) -> None:
    for name in names:
        args[name] = f"{args[name]} {text}".strip()
