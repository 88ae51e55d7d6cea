"""Streamed chat completions: each choice's text goes out as the policy samples it (server-sent events).

The recorder's :meth:`~treerl.serve.recorder.Recorder.complete` runs as its own task and
reports into a queue: a :class:`StreamStart` once the request is accepted (its episodes
found, nothing sampled yet), then ``(choice, StreamedToken)`` for every token as the policy's
decode loop samples it (``GenerationRequest.on_token``, through a :class:`TokenRelay`), then :data:`END` when the task is
done. :func:`events` turns that into OpenAI ``chat.completion.chunk`` events.

What a chunk may carry (:class:`ChoiceText`): only text that the finished reply's
``content`` is certain to begin with, so that the deltas joined are exactly the content of
the same request unstreamed. Held back until it is certain: an incomplete UTF-8 character
or a possible stop token (:class:`~treerl.agents.chat.TextStream`), text that may be the
start of a ``stop`` string, and, when the reply is read for tool calls, everything from
the first call marker on (and leading or trailing whitespace, which a reply with calls
loses). At the end the rest of the content, the tool calls (OpenAI ``tool_calls``
deltas), the finish reason with the log-probs (when asked for) and the usage come from the
finished completion, the very objects a non-streamed request returns.

With ``logprobs``, a chunk carries the log-probs of the tokens its content came from, as
OpenAI's do: every token sampled up to the one whose text reaches the end of the content sent
so far (:meth:`ChoiceText.num_sent_tokens`). The tokens of held-back text come with the
finish reason. Joined, the chunks' ``logprobs.content`` are those of the same request
unstreamed.

A client that goes away mid-stream stops only its events: the completion task is not
the response's, so the turn is sampled to its end and recorded whole, as if the client had
read it (the episode stays open for the client's next request or reward, or times out);
``stream/disconnects`` counts them.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from treerl.agents.chat import ChatRenderer
from treerl.agents.policy import StreamedToken
from treerl.serve.openai_format import chunk

__all__ = ["StreamStart", "END", "ChoiceText", "TokenRelay", "started", "events"]

END = ("end",)
"""The queue's last item: the completion task is done (its result or error is the task's)."""


@dataclass
class StreamStart:
    """The queue's first item: the request is accepted and sampling starts."""

    episode_ids: list[str] | None
    """The episode of each choice (None: the request is not recorded)."""
    forced: list[list[int]]
    """Per choice, the tokens that open the reply unsampled (a forced tool call's opening)."""


class TokenRelay:
    """Hands tokens from the policy's decode thread to the streams' queues on the event loop.

    Waking the event loop from another thread costs a system call and a context switch; the
    relay wakes it at most once for all the tokens that arrive before it runs (every row of a
    decode step, of every stream), so the decode thread pays a lock and an append per token.
    Order is kept: a token is in the queue before anything the decode thread hands over after
    it (the generation's result).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, tuple[int, StreamedToken]]] = []

    def sink(self, queue: asyncio.Queue, index: int) -> Callable[[StreamedToken], None]:
        """An ``on_token`` callback for choice ``index`` of the stream ``queue``."""

        def on_token(token: StreamedToken) -> None:
            with self._lock:
                self._pending.append((queue, (index, token)))
                if len(self._pending) > 1:  # a wake-up is on its way already
                    return
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the event loop is closed (the server is stopping): nobody listens
                pass

        return on_token

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, item in pending:
            queue.put_nowait(item)


def _partial_suffix(text: str, needles: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that is the start of a needle, short of all of it.

    >>> _partial_suffix("see <tool", ["<tool_call>"]), _partial_suffix("done", ["<tool_call>"])
    (5, 0)
    """
    for k in range(min(max((len(n) for n in needles), default=1) - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(len(n) > k and n.startswith(tail) for n in needles):
            return k
    return 0


class ChoiceText:
    """The content of one streamed choice that can be sent now (see the module docstring).

    ``markers`` (:func:`~treerl.serve.openai_format.call_markers`): None when the reply is not
    read for tool calls; else the strings a call contains (``()``: any text may be a call).

    >>> from types import SimpleNamespace
    >>> tok = SimpleNamespace(decode=lambda ids, **kw: "".join(map(chr, ids)), added_tokens_decoder={},
    ...                       all_special_ids=[], chat_template="{{ x }}")
    >>> text = ChoiceText(ChatRenderer(tok), [], stops=["!!"], markers=("<tool_call>",))
    >>> [text.push(ord(c)) for c in "Hi <t"], [text.push(ord(c)) for c in "ool_call>..."]
    (['H', 'i', '', '', ''], ['', '', '', '', '', '', '', '', '', '', '', ''])
    >>> text.sent
    'Hi'
    """

    def __init__(self, renderer: ChatRenderer, forced: Sequence[int], *, stops: Sequence[str],
                 markers: tuple[str, ...] | None):
        self._stream = renderer.text_stream()
        self.stops, self.markers = list(stops), markers
        self.text = "".join(self._stream.push(t) for t in forced)
        """The stable text of the reply so far (the forced opening included)."""
        self.sent = ""
        """The content sent so far."""
        self._opening = len(self.text)
        self._ends: list[int] = []
        """Per sampled token pushed: the length of ``text`` after it."""

    def push(self, token_id: int) -> str:
        """The content ``token_id`` lets go out now ("" when none)."""
        self.text += self._stream.push(token_id)
        self._ends.append(len(self.text))
        end = self._sendable()
        if end <= len(self.sent):
            return ""
        delta = self.text[len(self.sent):end]
        self.sent += delta
        return delta

    def num_sent_tokens(self) -> int:
        """How many sampled tokens the content sent so far came from: up to the first whose text
        reaches its end (a token whose text is only partly sent counts; one that added no text
        yet, such as the first half of a UTF-8 character, waits for the text it makes).

        >>> from types import SimpleNamespace
        >>> tok = SimpleNamespace(decode=lambda ids, **kw: "".join(map(chr, ids)), added_tokens_decoder={},
        ...                       all_special_ids=[], chat_template="{{ x }}")
        >>> text = ChoiceText(ChatRenderer(tok), [], stops=["!!"], markers=None)
        >>> [text.push(ord(c)) for c in "ab!"], text.num_sent_tokens()
        (['a', 'b', ''], 2)
        """
        if len(self.sent) <= self._opening:
            return 0
        return min(bisect.bisect_left(self._ends, len(self.sent)) + 1, len(self._ends))

    def rest(self, content: str | None) -> str:
        """The rest of the finished reply's ``content`` after what was sent."""
        content = content or ""
        if not content.startswith(self.sent):  # the rules above prevent it; a bug if seen
            raise RuntimeError(f"streamed {self.sent!r}, but the reply's content is {content!r}")
        return content[len(self.sent):]

    def _sendable(self) -> int:
        """How much of ``text`` the finished content is certain to begin with."""
        text = self.text
        end = len(text)
        found = [text.find(s) for s in self.stops if s in text]
        end = min(found) if found else end - _partial_suffix(text, self.stops)
        if self.markers is not None:  # read for calls: prose before the first marker, trimmed
            if not self.markers:
                return 0
            found = [text.find(m) for m in self.markers if m in text]
            end = min([end, *found]) if found else min(end, len(text) - _partial_suffix(text, self.markers))
            head = text[:end]
            if head[:1].isspace():  # a reply with calls has its content stripped: nothing is certain
                return 0
            end = len(head.rstrip())
        return end


async def started(queue: asyncio.Queue, task: asyncio.Task) -> StreamStart:
    """The :class:`StreamStart` of ``task``; raises what the task raised if it failed before
    (a refused request, answered with its 4xx as unstreamed)."""
    get = asyncio.ensure_future(queue.get())
    await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
    if not get.done():
        get.cancel()
    elif get.result() is not END:  # END first: the task failed, and its done callback said so
        return get.result()
    task.result()
    raise RuntimeError("the completion ended without starting its stream; this is a bug")


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def events(queue: asyncio.Queue, task: asyncio.Task, texts: list[ChoiceText], head: dict[str, Any],
                 extras: list[dict[str, Any]], finish: Callable[[Any], dict[str, Any]], include_usage: bool,
                 metrics: Any, logprob: Callable[[StreamedToken], dict[str, Any]] | None = None
                 ) -> AsyncIterator[str]:
    """The server-sent events of a streamed completion.

    ``finish(task.result())`` is the completion body an unstreamed request would get; its
    choices give the rest of each content, the tool calls and the finish reason, its usage the
    last chunk's. ``extras[i]`` are fields every chunk of choice ``i`` carries (its episode id).
    ``logprob(token)`` is a token's entry of ``logprobs.content`` (None: log-probs were not asked for).
    """
    waiting: list[list[dict[str, Any]]] = [[] for _ in texts]  # per choice: entries of tokens not sent yet
    sent: list[list[dict[str, Any]]] = [[] for _ in texts]
    done = False
    try:
        for i, extra in enumerate(extras):
            yield sse(chunk(head, i, {"role": "assistant", "content": ""}, extra=extra))
        while True:
            items = [await queue.get()]
            while not queue.empty():  # a slow reader gets the tokens sampled meanwhile in one chunk
                items.append(queue.get_nowait())
            deltas: dict[int, str] = {}
            for item in items:
                if item is not END:
                    index, token = item
                    deltas[index] = deltas.get(index, "") + texts[index].push(token.token_id)
                    if logprob is not None:
                        waiting[index].append(logprob(token))
            for index, delta in sorted(deltas.items()):
                if not delta:
                    continue
                extra = extras[index]
                if logprob is not None:
                    n = texts[index].num_sent_tokens() - len(sent[index])
                    entries, waiting[index] = waiting[index][:n], waiting[index][n:]
                    sent[index] += entries
                    extra = {**extra, "logprobs": {"content": entries}}
                yield sse(chunk(head, index, {"content": delta}, extra=extra))
            if items[-1] is END:
                break
        failure = "cancelled (the server is stopping)" if task.cancelled() else task.exception()
        if failure is not None:  # not the client's doing (a refused request never starts a stream)
            metrics["stream/errors"] += 1
            yield sse({"error": {"message": f"generation failed: {failure}", "type": "server_error",
                                 "param": None, "code": None}})
            yield "data: [DONE]\n\n"
            done = True
            return
        body = finish(task.result())
        for c in body["choices"]:
            index, message, extra = c["index"], c["message"], extras[c["index"]]
            rest = texts[index].rest(message.get("content"))
            if rest:
                yield sse(chunk(head, index, {"content": rest}, extra=extra))
            for j, call in enumerate(message.get("tool_calls") or []):
                yield sse(chunk(head, index, {"tool_calls": [{"index": j, **call}]}, extra=extra))
            logprobs = {}
            if c["logprobs"] is not None:  # the tokens not sent yet come with the finish reason
                content = c["logprobs"]["content"]
                if content[:len(sent[index])] != sent[index]:  # the rules above prevent it; a bug if seen
                    raise RuntimeError(f"streamed the log-probs of {len(sent[index])} tokens that do not begin "
                                       "the reply's")
                logprobs = {"logprobs": {"content": content[len(sent[index]):]}}
            yield sse(chunk(head, index, {}, c["finish_reason"], extra={**extra, **logprobs}))
        if include_usage:
            yield sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": body["usage"]})
        yield "data: [DONE]\n\n"
        done = True
    finally:
        if not done:  # the client went away: its completion goes on and is recorded whole
            metrics["stream/disconnects"] += 1
