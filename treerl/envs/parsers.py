"""Tool-call parsers: from a model's text to :class:`ToolCall` objects, and back.

Each model family writes tool calls in its own markup. A :class:`ToolCallParser` reads
one family's markup (``parse``) and writes it (``render``), so that an environment can
turn sampled text into calls and a test can turn calls into the text a model would emit.

``parse`` never raises: a bad rollout is data. Text without any call gives no calls and
no errors; something that clearly tried to be a call (it carries the family's markers)
but cannot be read gives a :class:`~treerl.errors.ToolCallError` of kind
``MALFORMED`` whose message tells the model what a good call looks like, and the other,
valid calls of the same turn are still returned.

The interface and data types live in :mod:`treerl.envs.parser_base`, the formats in
:mod:`treerl.envs.json_parsers` (hermes, llama3_json, mistral),
:mod:`treerl.envs.pythonic_parser` and :mod:`treerl.envs.qwen3_coder_parser`; this module
names them (:data:`PARSERS`) and picks one for a model (:func:`get_parser`).

>>> parser = get_parser("hermes")
>>> result = parser.parse('Let me look.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>')
>>> result.content, result.calls
('Let me look.', [ToolCall(name='add', arguments={'a': 1}, id=None)])
>>> parser.parse(parser.render(result.calls)).calls == result.calls
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from treerl.envs.json_parsers import HermesParser, Llama3JsonParser, MistralParser
from treerl.envs.parser_base import ParseResult, ToolCall, ToolCallParser
from treerl.envs.pythonic_parser import PythonicParser
from treerl.envs.qwen3_coder_parser import Qwen3CoderParser

__all__ = [
    "ToolCall",
    "ParseResult",
    "ToolCallParser",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "PythonicParser",
    "Qwen3CoderParser",
    "PARSERS",
    "get_parser",
]


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
}
"""Parser classes by name, for configs and ``get_parser``."""

# Checked in order: Qwen3-Coder templates contain both `<function=` and `<tool_call>`.
_TEMPLATE_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<function=",), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>", "<|start_header_id|>", "<|end_header_id|>"), "llama3_json"),
)


def get_parser(name: str | None = None, *, chat_template: str | None = None, tokenizer: Any = None) -> ToolCallParser:
    """The tool-call parser for ``name``, or the one the chat template implies.

    An explicit ``name`` wins. Otherwise the template (``chat_template``, else
    ``tokenizer.chat_template``) is searched for each family's markers; ``hermes`` when
    none is found.

    >>> get_parser("mistral")
    MistralParser()
    >>> get_parser(chat_template="{{ '<|start_header_id|>' + message['role'] }}")
    Llama3JsonParser()
    """
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}")
        return PARSERS[name]()
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        # Tokenizers may hold several named templates (e.g. "default" and "tool_use").
        template = "\n".join(str(t) for t in template.values())
    if isinstance(template, str):
        for markers, parser_name in _TEMPLATE_MARKERS:
            if any(marker in template for marker in markers):
                return PARSERS[parser_name]()
    return HermesParser()
