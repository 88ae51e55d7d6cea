"""Chat rendering with token fidelity: prompt tokens once, then exact bridge tokens.

A multi-turn episode is played token by token. The prompt is rendered and tokenized once;
the policy samples an assistant turn (ending with the template's end-of-turn token, such
as ``<|im_end|>``); the environment answers with chat messages (tool results, user turns);
and the engine appends **bridge** tokens: the end of the assistant turn's glue, the new
messages, and the next generation prompt. The recorded path (prompt, completion, bridge,
completion, bridge, ...) is then exactly the token sequence the model saw, and the learner
trains on it. Nothing that was sampled is ever re-tokenized.

How a bridge is found (:meth:`ChatRenderer.bridge`):

1. Render, as text, the conversation the context came from (``messages`` with the
   generation prompt) followed by the sampled text: this is the context the model saw.
2. Render the whole conversation, ``messages + [assistant(completion_text)] +
   new_messages``, with the generation prompt. If it does not start with the text of step 1,
   the template is not append-only here (it dropped earlier ``<think>`` reasoning, trimmed
   the sampled text, moved a tools block...): the bridge is a **branch** whose
   ``context_ids`` are the full re-rendered conversation, never a spliced context the model
   did not see.
3. The rest of the rendering must begin with an added token (the end-of-turn token, e.g.
   ``<|im_end|>``, ``<|eot_id|>``, ``</s>``). Tokenizers split added tokens out before any
   BPE merge, so tokenizing the text *from that token on* gives exactly the ids that the
   full rendering has there: that is the bridge (without the end-of-turn token when the
   completion already ends with it). A template that closes assistant turns with plain text
   cannot be cut exactly at the token level, and gives a branch instead.

Conventions (the engine must follow them for the texts to line up):

* ``completion_text`` is the sampled text **without** the final stop token, as
  :meth:`ChatRenderer.completion_text` decodes it. Tool-call markup stays in it, raw.
* The assistant turn is re-rendered as ``{"role": "assistant", "content": completion_text}``
  (:func:`assistant_message`), not with parsed ``tool_calls``: templates render
  ``tool_calls`` themselves, so passing both would show the call twice and the rendering
  would not be the text the model produced. Some templates need the structured form
  (gpt-oss's renders tool results only after an assistant message with ``tool_calls``;
  Mistral's puts a space before plain content): when the renderer has a ``parser`` and the
  raw message does not reproduce the sampled text (or does not render at all), the turn is
  re-rendered from what the parser read (:func:`structured_message`: content, reasoning,
  ``tool_calls``), and when neither reproduces it the bridge is a branch. The message
  that was used is :attr:`Bridge.message`: the conversation keeps it, so later turns
  render the same way.
* A family's end-of-message token that the template writes as another token is accepted
  in place of it (``turn_end_aliases``; by default Llama 3.x's ``<|eom_id|>``, which ends a
  turn that waits for a tool result, for ``<|eot_id|>``, which the Hugging Face template
  writes there). The sampled token stays in the path, as Meta's own prompt format keeps it
  in the history; the rest of the bridge is the template's.
* A completion that did not end with a special stop token (it stopped at
  ``max_new_tokens``, or at a non-special stop id such as ``</tool_call>``) is closed by the
  environment: the bridge then *starts* with the template's end-of-turn token, which is an
  ``env`` token (forced, not sampled), so the path still equals the rendered conversation.
* A completion that ended with a different special token than the one the template puts
  after assistant turns (Qwen stopping on ``<|endoftext|>`` instead of ``<|im_end|>``,
  gpt-oss on ``<|return|>`` where history has ``<|end|>``), and that is not an alias of it,
  gives a branch: the context it continued from is not what the template renders.

>>> from tokenizers import Tokenizer, models, pre_tokenizers, decoders
>>> from transformers import PreTrainedTokenizerFast
>>> alphabet = pre_tokenizers.ByteLevel.alphabet()
>>> base = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
>>> base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
>>> base.decoder = decoders.ByteLevel()
>>> tok = PreTrainedTokenizerFast(tokenizer_object=base, eos_token="<|im_end|>",
...                               extra_special_tokens=["<|im_start|>"])
>>> template = ("{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>\\n"
...             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")
>>> renderer = ChatRenderer(tok, chat_template=template)
>>> messages = [{"role": "user", "content": "2+2?"}]
>>> prompt = renderer.prompt_ids(messages)
>>> completion = tok.encode("4", add_special_tokens=False) + [tok.eos_token_id]
>>> bridge = renderer.bridge(messages, completion, "4", [{"role": "user", "content": "and 3+3?"}])
>>> bridge.branch, tok.decode(bridge.ids)
(False, '\\n<|im_start|>user\\nand 3+3?<|im_end|>\\n<|im_start|>assistant\\n')
>>> full = messages + [assistant_message("4"), {"role": "user", "content": "and 3+3?"}]
>>> prompt + completion + bridge.ids == renderer.prompt_ids(full)
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from jinja2 import TemplateError

__all__ = ["ChatRenderer", "Bridge", "BranchReason", "RenderError", "TextStream", "assistant_message", "structured_message",
           "DEFAULT_TURN_END_ALIASES"]

DEFAULT_TURN_END_ALIASES: dict[str, str] = {"<|eom_id|>": "<|eot_id|>"}
"""Sampled end-of-message token -> the template's end-of-turn token it stands for (when both exist)."""


class RenderError(TemplateError):
    """The chat template refuses every form of the conversation after a turn (its
    ``raise_exception``, or values it cannot render): the episode cannot go on. The engine
    ends the episode there (termination ``render_error``), as data."""


class BranchReason(str, Enum):
    """Why a bridge could not extend the context and started a new branch (a metric key)."""

    NOT_APPEND_ONLY = "not_append_only"
    """The re-rendered conversation does not start with the context the model saw: the
    template rewrote an earlier turn or the sampled text (dropped reasoning, trimmed
    whitespace, moved a tools block, a date that changed...)."""
    TURN_END_NOT_SPECIAL = "turn_end_not_special"
    """The template does not close the assistant turn with an added (special) token, so the
    token stream cannot be cut exactly after the sampled text."""
    STOP_TOKEN_MISMATCH = "stop_token_mismatch"
    """The completion ended with a special token other than the template's end-of-turn token."""


@dataclass(frozen=True)
class Bridge:
    """What the engine appends after a completion, or the new branch it must start instead.

    When ``branch`` is False, ``prompt/bridges + completion_ids + ids`` is the next context.
    When ``branch`` is True, ``ids`` is empty and the next context is ``context_ids`` (a
    fresh tokenization of the whole re-rendered conversation, with the generation prompt);
    the tokens sampled so far stay on the old branch, where the model really saw them.
    """

    ids: list[int]
    """Tokens to append after ``completion_ids``: turn glue, new messages, generation prompt."""
    branch: bool = False
    """True when the template is not append-only here and the engine must start a new branch."""
    context_ids: list[int] | None = None
    """When ``branch`` is True: the full re-rendered context to continue from."""
    reason: str | None = None
    """When ``branch`` is True: a :class:`BranchReason` value, stable enough for metrics."""
    detail: str | None = None
    """When ``branch`` is True: one sentence for logs, saying where the texts differ."""
    message: dict[str, Any] | None = field(default=None, compare=False)
    """The assistant message the turn was re-rendered from (raw or structured); the
    conversation keeps it in place of the raw one. None for a bridge built by hand."""
    text: str | None = field(default=None, compare=False, repr=False)
    """The rendering of the whole conversation after the turn, with the generation prompt: the
    text of the next context, which the next turn's :meth:`ChatRenderer.bridge` takes as
    ``prev_text``. None for a bridge built by hand."""

    def __post_init__(self) -> None:
        if self.branch and (self.context_ids is None or self.reason is None or self.ids):
            raise ValueError(
                "Bridge(branch=True) needs context_ids (the re-rendered context) and a reason, and "
                f"no ids (got {len(self.ids)}); build it with ChatRenderer.bridge."
            )
        if not self.branch and (self.context_ids is not None or self.reason is not None):
            raise ValueError(
                "Bridge(branch=False) extends the context with ids: context_ids and reason must be "
                "None; set branch=True to start a new branch instead."
            )


def assistant_message(completion_text: str) -> dict[str, str]:
    """The message an assistant turn is re-rendered from: the raw sampled text.

    Tool-call markup stays in ``content`` and no ``tool_calls`` key is set: templates render
    ``tool_calls`` themselves, so passing both would put the call in the text twice.

    >>> assistant_message('<tool_call>\\n{"name": "add"}\\n</tool_call>')["role"]
    'assistant'
    """
    return {"role": "assistant", "content": completion_text}


def structured_message(parsed: Any) -> dict[str, Any]:
    """The assistant message of a parsed turn (a :class:`~treerl.envs.parsers.ParseResult`):
    content, reasoning (as ``reasoning_content`` and ``thinking``, the keys templates read)
    and ``tool_calls`` in the OpenAI shape, arguments as objects.

    >>> from treerl.envs.parsers import ParseResult, ToolCall
    >>> structured_message(ParseResult(content="", calls=[ToolCall("add", {"a": 1})]))["tool_calls"]
    [{'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1}}}]
    """
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = message["thinking"] = parsed.reasoning
    if parsed.calls:
        message["tool_calls"] = [
            {"type": "function", **({"id": c.id} if c.id is not None else {}),
             "function": {"name": c.name, "arguments": dict(c.arguments)}}
            for c in parsed.calls
        ]
    return message


# apply_chat_template's own arguments: a template variable with one of these names would
# be swallowed by it (or collide with what the renderer sets itself).
_RESERVED_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class ChatRenderer:
    """Renders chat prompts and computes exact bridge tokens for one tokenizer and template.

    Args:
        tokenizer: a ``transformers`` tokenizer (fast or slow) with the model's added tokens.
        tools: JSON-schema tool specs passed to the template on every rendering.
        chat_template: a Jinja template (or a template name) overriding the tokenizer's own.
        template_kwargs: extra template variables, e.g. ``{"enable_thinking": False}`` or
            a fixed ``{"date_string": "26 Jul 2024"}`` (a template that reads today's date
            is not append-only across midnight).
        parser: the tool-call parser of the model's format (anything with
            ``parse(text) -> ParseResult``); with it, a turn the raw text cannot reproduce is
            re-rendered from the parsed calls (see the module docstring). None: raw only.
        turn_end_aliases: sampled end-of-message token -> the template's end-of-turn token
            it stands for; default :data:`DEFAULT_TURN_END_ALIASES` (pairs that are not both
            added tokens of the tokenizer are ignored).

    The renderer is stateless between calls: the engine passes the conversation each time.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        template_kwargs: dict | None = None,
        parser: Any = None,
        turn_end_aliases: Mapping[str, str] | None = None,
    ) -> None:
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "ChatRenderer: the tokenizer has no chat_template and chat_template=None: nothing "
                "to render the conversation with. Pass chat_template=<a Jinja string>, or set "
                "tokenizer.chat_template."
            )
        if tools is not None and (not isinstance(tools, list)
                                  or not all(isinstance(t, Mapping) for t in tools)):
            raise ValueError(
                f"ChatRenderer.tools must be a list of JSON-schema dicts or None, got {type(tools).__name__}; "
                "pass e.g. [{'type': 'function', 'function': {...}}]."
            )
        template_kwargs = dict(template_kwargs or {})
        clash = sorted(_RESERVED_KWARGS & template_kwargs.keys())
        if clash:
            raise ValueError(
                f"ChatRenderer.template_kwargs has {clash}: these are apply_chat_template's own "
                "arguments, not template variables. Pass tools=... and chat_template=... to "
                "ChatRenderer itself; the renderer sets add_generation_prompt and tokenize."
            )
        self.tokenizer = tokenizer
        self.tools = tools
        self.chat_template = chat_template
        self.template_kwargs = template_kwargs
        self.parser = parser
        # Added tokens (special or not) are split out before BPE runs, which is what makes
        # cutting the token stream at one of them exact.
        added = tokenizer.added_tokens_decoder  # {id: AddedToken}
        self._added_ids = frozenset(added)
        self._special_ids = frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        # Decoding after an anchor keeps decoders that drop a sequence's leading space
        # (SentencePiece-style) from changing a completion's first character.
        self._anchor_id = min(self._added_ids) if self._added_ids else None
        # End-of-turn tokens are added tokens: look them up there, not in the whole vocabulary.
        added_ids = {t.content: i for i, t in added.items()}
        aliases = DEFAULT_TURN_END_ALIASES if turn_end_aliases is None else turn_end_aliases
        self._turn_end_aliases = {added_ids[a]: added_ids[b] for a, b in aliases.items()
                                  if a in added_ids and b in added_ids}

    # -- text and ids -------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The template's text for ``messages`` (with the tools and template variables)."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text; no BOS/EOS added (the template writes its own).

        Text longer than the model's length is tokenized without transformers' warning
        ("Token indices sequence length is longer than ..."): a turn's observations can be
        that long (a reply with many malformed calls gets one long error message each), and
        the rollout engine, which counts the ids, ends the episode at ``max_episode_tokens``
        before the model would see them.
        """
        return list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt tokens: ``messages`` rendered with the generation prompt, tokenized once."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def completion_text(self, completion_ids: Sequence[int]) -> str:
        """The text of sampled ids without a final special stop token: what :meth:`bridge` expects.

        A non-special last id (length stop, or a stop on ``</tool_call>``) is kept: it is
        part of what the model wrote.
        """
        ids = list(completion_ids)
        if ids and ids[-1] in self._special_ids:
            ids = ids[:-1]
        if self._anchor_id is None:
            return self._decode(ids)
        anchor = self._decode([self._anchor_id])
        text = self._decode([self._anchor_id, *ids])
        return text[len(anchor):] if text.startswith(anchor) else self._decode(ids)

    def text_stream(self) -> TextStream:
        """An incremental :meth:`completion_text`: feed it sampled ids one by one (streaming)."""
        return TextStream(self)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # -- bridges ------------------------------------------------------------------------

    def bridge(
        self,
        messages: Sequence[Mapping[str, Any]],
        completion_ids: Sequence[int],
        completion_text: str,
        new_messages: Sequence[Mapping[str, Any]],
        *,
        prev_text: str | None = None,
    ) -> Bridge:
        """Tokens to append after a completion so the path equals the rendered conversation.

        Args:
            messages: the conversation the current context was rendered from (before the
                assistant turn); the context is ``render(messages)`` + ``completion_ids``.
            completion_ids: the sampled ids, ending with the stop token when it stopped on one.
            completion_text: the sampled text without that final stop token
                (:meth:`completion_text`).
            new_messages: what the environment answered (tool results, a user turn).
            prev_text: ``render(messages)`` with the generation prompt when the caller has it
                (the previous bridge's :attr:`Bridge.text`); None renders it here. Passing it
                makes a turn one rendering of the conversation instead of two.

        Returns a :class:`Bridge`; see the module docstring for when it branches.
        Raises ``ValueError`` when ``completion_text`` still ends with the stop token, and
        :class:`RenderError` (from the template's error) when no form of the turn renders.
        """
        completion_ids = list(completion_ids)
        last = completion_ids[-1] if completion_ids else None
        if last in self._special_ids:
            stop_text = self._decode([last])
            if stop_text and completion_text.endswith(stop_text):
                raise ValueError(
                    f"ChatRenderer.bridge: completion_text ends with the stop token {stop_text!r}, "
                    "which the template adds itself after the assistant turn. Pass the text "
                    "without it: renderer.completion_text(completion_ids)."
                )

        # What the model saw, as text: by induction every context the engine holds is the
        # rendering of `messages` (an append-only bridge keeps it so; a branch resets to it).
        if prev_text is None:
            prev_text = self.render(messages, add_generation_prompt=True)
        seen_text = prev_text + completion_text
        message, full_text = self._rerender(messages, completion_text, new_messages, seen_text)

        if not full_text.startswith(seen_text):
            at = _first_difference(seen_text, full_text)
            where = "an earlier turn" if at < len(prev_text) else "the assistant turn just sampled"
            lo = max(0, at - 20)  # a little shared text before the difference, to find it
            return self._branch(
                full_text, message, BranchReason.NOT_APPEND_ONLY,
                f"the re-rendered conversation differs from the context the model saw at character "
                f"{at}, in {where}: saw {seen_text[lo:at + 40]!r}, now {full_text[lo:at + 40]!r}",
            )

        rest = full_text[len(seen_text):]
        rest_ids = self.encode(rest)
        if not rest_ids or rest_ids[0] not in self._added_ids:
            return self._branch(
                full_text, message, BranchReason.TURN_END_NOT_SPECIAL,
                f"the template follows the assistant text with {rest[:40]!r}, which does not start "
                "with an added (special) token, so the tokens cannot be cut exactly there",
            )
        end_of_turn = rest_ids[0]
        if last == end_of_turn or (last is not None and self._turn_end_aliases.get(last) == end_of_turn):
            return Bridge(ids=rest_ids[1:], message=message, text=full_text)
        if last in self._special_ids:
            return self._branch(
                full_text, message, BranchReason.STOP_TOKEN_MISMATCH,
                f"the completion ended with {self._decode([last])!r} but the template closes "
                f"assistant turns with {self._decode([end_of_turn])!r}",
            )
        # No stop token (length stop, or a non-special stop id): the environment closes the
        # turn, so the end-of-turn token is a forced env token at the head of the bridge.
        return Bridge(ids=rest_ids, message=message, text=full_text)

    def _rerender(self, messages: Sequence[Mapping[str, Any]], completion_text: str,
                  new_messages: Sequence[Mapping[str, Any]], seen_text: str) -> tuple[dict[str, Any], str]:
        """The assistant message and the full rendering: the first form that reproduces
        ``seen_text`` (raw, then structured), else the form whose rendering agrees with it
        longest."""
        forms = [assistant_message(completion_text)]
        if self.parser is not None:
            parsed = self.parser.parse(completion_text)
            call_id = getattr(self.parser, "call_id", None)
            if call_id is not None:  # the ids the environment gave the results (Mistral's template needs them)
                parsed.calls = [replace(c, id=call_id(completion_text, k, c.id)) for k, c in enumerate(parsed.calls)]
            structured = structured_message(parsed)
            if structured != forms[0]:
                forms.append(structured)
        rendered: list[tuple[dict[str, Any], str]] = []
        failures: list[Exception] = []
        for message in forms:
            try:
                full_text = self.render([*messages, message, *new_messages], add_generation_prompt=True)
            except (TemplateError, TypeError) as exc:  # the template refuses this form of the turn
                failures.append(exc)
                continue
            if full_text.startswith(seen_text):
                return message, full_text
            rendered.append((message, full_text))
        if not rendered:
            raise RenderError(f"the chat template cannot render the conversation after this turn: "
                              f"{type(failures[0]).__name__}: {failures[0]}") from failures[0]
        # A branch either way: continue from the form closest to what the model saw; on a tie
        # (the difference is in an earlier turn), from the parsed calls, the form templates
        # are written for (Mistral's counts a raw call turn as a reply and then refuses the
        # next one).
        return max(rendered, key=lambda form: (_first_difference(seen_text, form[1]), "tool_calls" in form[0]))

    def _branch(self, full_text: str, message: dict[str, Any], reason: BranchReason, detail: str) -> Bridge:
        return Bridge(ids=[], branch=True, context_ids=self.encode(full_text), reason=reason.value,
                      detail=detail, message=message, text=full_text)


def _first_difference(a: str, b: str) -> int:
    """Index of the first character where ``a`` and ``b`` differ (or the shorter length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


class TextStream:
    """:meth:`ChatRenderer.completion_text` of a completion that is still being sampled, piece by piece.

    :meth:`push` takes the next sampled id and returns the text it makes stable: the pieces
    joined are always a prefix of ``completion_text`` of the ids pushed so far. Held back:
    an incomplete UTF-8 character (a token ending inside a multi-byte character decodes to
    U+FFFD until the rest arrives) and a special token (it is dropped when it turns out to
    be the last, the stop token). Each call decodes a short window, the ids since the last
    stable point plus the ones before it (merges and leading spaces depend on the previous
    token), so a completion of n tokens costs O(n) decoding, not O(n^2).

    >>> from types import SimpleNamespace
    >>> vocab = {1: b"caf", 2: b"\\xc3", 3: b"\\xa9", 4: b"!", 9: b"<end>"}
    >>> decode = lambda ids, **kw: b"".join(vocab[i] for i in ids).decode(errors="replace")
    >>> tok = SimpleNamespace(decode=decode, added_tokens_decoder={}, all_special_ids=[9], chat_template="{{ x }}")
    >>> stream = ChatRenderer(tok).text_stream()
    >>> [stream.push(i) for i in (1, 2, 3, 4, 9)]
    ['caf', '', 'é', '!', '']
    """

    def __init__(self, renderer: ChatRenderer):
        self._decode = renderer._decode
        self._special_ids = renderer._special_ids
        # The anchor first, as completion_text decodes: a SentencePiece-style leading space survives.
        self._ids: list[int] = [] if renderer._anchor_id is None else [renderer._anchor_id]
        self._prefix = 0  # window start: the id before the last stable point (its merges reach into the next)
        self._read = len(self._ids)  # the last stable point: text of ids[:_read] has been handed out
        self._held: int | None = None  # a special id that is the stop token if nothing follows it

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` (the next sampled id) makes stable; "" when nothing is yet."""
        if self._held is not None:
            self._ids.append(self._held)
            self._held = None
        if token_id in self._special_ids:
            self._held = token_id
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]
