"""Google-style docstrings: the description and the per-parameter texts a tool schema shows.

:func:`parse_docstring` reads the text before the first section as the description and
the entries of the ``Args:`` section (also ``Arguments``, ``Parameters``, ``Params``) as
parameter descriptions; other sections are skipped. A section header must start at the
docstring's own indentation; an entry's continuation lines are indented deeper than the
entry and are joined to it with single spaces. Anything it cannot read is left out, never
an error: a docstring is documentation, not a contract.
"""

from __future__ import annotations

import inspect
import re

__all__ = ["parse_docstring"]

_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Returns|Return|Yields|Raises|Examples?|Notes?|"
    r"Attributes|Todo|Warnings?|See Also|References)\s*:\s*$"
)
_ARG = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """``(description, {parameter: description})`` from a Google-style docstring.

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
