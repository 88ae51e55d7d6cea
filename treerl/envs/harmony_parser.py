"""gpt-oss's harmony format: a reply is a run of messages, each on a channel, some addressed to a tool.

After the generation prompt ``<|start|>assistant`` a gpt-oss model writes messages like::

    <|channel|>analysis<|message|>I need the product.<|end|>
    <|start|>assistant to=functions.multiply<|channel|>commentary json<|message|>{"a": 17, "b": 23}<|call|>

Each message has a header (an optional role, an optional ``to=<recipient>``, ``<|channel|>``
and the channel's name, an optional content type such as ``json`` or ``<|constrain|>json``)
up to ``<|message|>``, then a body up to ``<|end|>``, ``<|call|>``, ``<|return|>`` or the end
of the text. A message addressed ``to=functions.NAME`` (in the role or the channel header)
is a call of tool ``NAME`` with the body as its JSON arguments. The ``analysis`` channel is
the model's reasoning (returned as :attr:`ParseResult.reasoning`, never read for calls);
``final`` and ``commentary`` messages without a recipient are the content.

The gpt-oss chat template renders tool results only after an assistant message with
structured ``tool_calls``; :class:`~treerl.agents.chat.ChatRenderer` builds that message from
this parser's result (:meth:`ToolCallParser.assistant_message`).

>>> p = HarmonyParser()
>>> r = p.parse('<|channel|>analysis<|message|>Multiply.<|end|><|start|>assistant to=functions.multiply'
...             '<|channel|>commentary json<|message|>{"a": 17, "b": 23}')
>>> r.reasoning, r.calls
('Multiply.', [ToolCall(name='multiply', arguments={'a': 17, 'b': 23}, id=None)])
>>> p.parse(p.render(r.calls)).calls == r.calls
True
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from treerl.envs.parser_base import (
    Finder,
    ParseResult,
    ToolCall,
    ToolCallParser,
    dump_json,
    skip_space,
)
from treerl.errors import ToolCallError

__all__ = ["HarmonyParser"]

_START, _MESSAGE, _CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
# Bounded patterns applied to one header at a time (headers are cut to _MAX_HEADER first).
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")
_MAX_HEADER = 512


class HarmonyParser(ToolCallParser):
    """gpt-oss (harmony): ``to=functions.NAME`` messages are calls, the analysis channel is reasoning."""

    name = "harmony"
    call_format = ('<|start|>assistant to=functions.<tool name><|channel|>commentary json<|message|>'
                   '{<arguments as a JSON object>}<|call|>')

    def _parse(self, text: str, tool_schemas: Mapping[str, dict] | None) -> ParseResult:
        content: list[str] = []
        reasoning: list[str] = []
        found: list[ToolCall | ToolCallError] = []  # the calls and the unreadable ones, as written
        finder = Finder(text)
        pos = 0
        while pos < len(text):
            head_end = finder.find(_MESSAGE, pos)
            if head_end == len(text):  # no more messages: what is left is plain text
                content.append(_strip_markers(text[pos:]))
                break
            header = text[pos:head_end]
            body_start = head_end + len(_MESSAGE)
            body_end = finder.first_of(body_start, *_ENDS)
            body = text[body_start:body_end]
            pos = body_end + next((len(e) for e in _ENDS if text.startswith(e, body_end)), 0)
            after = skip_space(text, pos)
            if text.startswith(_START, after):  # the next message's role header follows
                pos = after + len(_START)
            recipient = _RECIPIENT.search(header) if len(header) <= _MAX_HEADER else None
            channel = _CHANNEL_NAME.search(header) if len(header) <= _MAX_HEADER else None
            if len(header) > _MAX_HEADER or (recipient is not None and recipient.group(1).startswith("functions.")):
                if self._full(found):
                    break
                if len(header) > _MAX_HEADER:
                    found.append(self._error(f"a message header is longer than {_MAX_HEADER} characters"))
                    continue
                name = recipient.group(1)[len("functions."):]
                call = self._call(name, body)
                found.append(call)
            elif channel is not None and channel.group(1) == "analysis":
                reasoning.append(body.strip())
            else:
                content.append(body)
        result = ParseResult.of("\n".join(c.strip() for c in content if c.strip()), found)
        if reasoning:
            result.reasoning = "\n".join(reasoning)
        return result

    def _call(self, name: str, body: str) -> ToolCall | ToolCallError:
        if not name:
            return self._error("the recipient 'functions.' names no tool")
        return self._object_call(name, body)

    def render(self, calls: Sequence[ToolCall]) -> str:
        """Calls as gpt-oss writes them after ``<|start|>assistant`` (as its template renders them), one message each."""
        return _START.join(
            f"{'' if i == 0 else 'assistant'} to=functions.{c.name}<|channel|>commentary json<|message|>"
            f"{dump_json(c.arguments)}<|call|>"
            for i, c in enumerate(calls)
        )


def _strip_markers(text: str) -> str:
    """Plain text between messages, without stray harmony markers."""
    for marker in (_START, _CHANNEL, *_ENDS):
        text = text.replace(marker, "")
    return text
