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
names them (:data:`PARSERS`) and picks one for a model (:func:`get_parser`), with gpt-oss's
harmony format in :mod:`treerl.envs.harmony_parser` and GLM-4 MoE's and DeepSeek's in
:mod:`treerl.envs.tagged_parsers`.

A tool call written inside the model's reasoning is not a call (vLLM's reasoning parsers
split a reply the same way): a parser built with ``reasoning=("<think>", "</think>")`` reads
calls only after the reasoning. :func:`get_parser` turns that on when the chat template
renders ``</think>`` (Qwen3, Qwen3.5, GLM-4 MoE, DeepSeek-R1, Nemotron 3) and off otherwise;
``reasoning=`` overrides it either way.

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

from treerl.envs.harmony_parser import HarmonyParser
from treerl.envs.json_parsers import HermesParser, Llama3JsonParser, MistralParser
from treerl.envs.parser_base import ParseResult, ToolCall, ToolCallParser
from treerl.envs.pythonic_parser import PythonicParser
from treerl.envs.qwen3_coder_parser import Qwen3CoderParser
from treerl.envs.tagged_parsers import DeepSeekParser, GlmParser

__all__ = [
    "ToolCall",
    "ParseResult",
    "ToolCallParser",
    "HermesParser",
    "HarmonyParser",
    "Llama3JsonParser",
    "MistralParser",
    "PythonicParser",
    "Qwen3CoderParser",
    "GlmParser",
    "DeepSeekParser",
    "PARSERS",
    "THINK",
    "get_parser",
]


PARSERS: dict[str, type[ToolCallParser]] = {
    "deepseek": DeepSeekParser,
    "glm4_moe": GlmParser,
    "harmony": HarmonyParser,
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
}
"""Parser classes by name, for configs and ``get_parser``."""

# Checked in order: Qwen3-Coder templates contain both `<function=` and `<tool_call>`.
_TEMPLATE_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<|channel|>",), "harmony"),
    (("<arg_key>",), "glm4_moe"),  # GLM's templates hold <tool_call> too
    (("<｜tool▁calls▁begin｜>",), "deepseek"),
    (("<function=",), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    # Gemma 3 has no call format of its own; its tool-use template (treerl's gemma3_tools, vLLM's
    # pythonic example) asks for a Python list of calls.
    (("<start_of_turn>",), "pythonic"),
    (("<|python_tag|>", "<|start_header_id|>", "<|end_header_id|>"), "llama3_json"),
)


THINK: tuple[str, str] = ("<think>", "</think>")
"""The reasoning markers of the families that think in ``<think>`` blocks."""

_AUTO: Any = object()


def get_parser(name: str | None = None, *, chat_template: str | None = None, tokenizer: Any = None,
               reasoning: tuple[str, str] | None = _AUTO) -> ToolCallParser:
    """The tool-call parser for ``name``, or the one the chat template implies.

    An explicit ``name`` wins. Otherwise the template (``chat_template``, else
    ``tokenizer.chat_template``) is searched for each family's markers (Gemma's
    ``<start_of_turn>`` gives ``pythonic``); ``hermes`` when none is found. ``reasoning``
    (markers whose calls are not calls) defaults to :data:`THINK` when the template renders
    ``</think>``, else None; harmony has its own reasoning channel and takes no markers.

    >>> get_parser("mistral")
    MistralParser()
    >>> get_parser(chat_template="{{ '<|start_header_id|>' + message['role'] }}")
    Llama3JsonParser()
    >>> get_parser(chat_template="{{ '<tool_call>' }}{{ '</think>' }}")
    HermesParser(reasoning=('<think>', '</think>'))
    >>> get_parser("hermes", reasoning=THINK)
    HermesParser(reasoning=('<think>', '</think>'))
    """
    if name is not None and name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}")
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        # Tokenizers may hold several named templates (e.g. "default" and "tool_use").
        template = "\n".join(str(t) for t in template.values())
    if not isinstance(template, str):
        template = ""
    if name is None:
        name = next((parser_name for markers, parser_name in _TEMPLATE_MARKERS
                     if any(marker in template for marker in markers)), "hermes")
    if reasoning is _AUTO:
        reasoning = THINK if THINK[1] in template and name != "harmony" else None
    return PARSERS[name](reasoning=reasoning)
