"""Agent traffic recorded as trajectory trees: episodes, their turns, groups by task, rewards, the file.

Every chat request is one turn of an **episode**, recorded with the rollout engine's own
steps (:mod:`treerl.rollout.episode`): the policy samples from the episode's exact token
context (a ``sampled`` segment), and the client's next request plays the environment's
part. When its messages extend what the episode holds (the server's reply, echoed, plus new
tool results or user turns), the :class:`~treerl.agents.chat.ChatRenderer` bridge appends
them as an ``env`` segment; when the client rewrote its history (or the template is not
append-only), the episode continues on a new branch rendered from the client's messages,
and the old path stays an extra leaf, trained on with the episode's reward. Nothing the
model sampled is re-tokenized: the server's own assistant turns are rendered from their raw
text, whatever copy the client sends back.

Requests find their episode by id (``X-Episode-Id``, ``metadata.episode_id`` or ``user``),
else by content: the open episode whose conversation the messages extend, else a new one.
``n > 1`` forks the episode into ``n`` episodes ``E.0 ... E.{n-1}`` (siblings in the tree).

Episodes of one ``task_id`` form a **group**; it is complete once ``group_size`` of them
finished (a reward was posted, or they timed out) and none is open, or when the client
closes the task. Complete groups are appended to the trajectory file (the format
:func:`~treerl.rollout.trajectory.read_groups` reads; a restarted server resumes it) and
handed to learners by position (:meth:`Recorder.groups`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from jinja2 import TemplateError

from treerl.agents.chat import ChatRenderer
from treerl.agents.policy import Generation, GenerationRequest, Policy, SamplingParams, StreamedToken
from treerl.envs.parsers import get_parser
from treerl.rollout.engine import request_seed
from treerl.rollout.episode import (
    EpisodeState,
    Turn,
    apply_bridge,
    finish_episode,
    next_context_len,
    observe,
    restart,
    sample_turn,
    turn_params,
)
from treerl.rollout.record import recorded_model, tokenizer_info
from treerl.rollout.trajectory import Group, GroupWriter, make_header, read_all_groups
from treerl.serve.config import ServeConfig
from treerl.serve.openai_format import (ChatRequest, RequestError, call_end, call_opening, first_call_end, message_key,
                                        template_messages, tool_reply)
from treerl.serve.streaming import StreamStart, TokenRelay

__all__ = ["Recorder", "Choice", "serve_header"]

ENV_ID = "treerl-serve"


@dataclass
class Choice:
    """One sampled reply to a request."""

    episode_id: str
    message: dict[str, Any]
    finish_reason: str
    generation: Generation
    text: str
    prompt_tokens: int


@dataclass
class _Task:
    """An open group: one task's episodes sharing a tree."""

    key: str
    """The group's task key (``task_id``, then ``task_id#1``... for later groups of the same task)."""
    slot: str
    """Its key among the open tasks: the task id, or the episode id of an episode without one."""
    task_id: str | None
    group: Group
    size: int
    roots: dict[tuple[int, ...], int] = field(default_factory=dict)
    open: set[str] = field(default_factory=set)
    num_started: int = 0


@dataclass
class _Episode:
    id: str
    task: _Task
    state: EpisodeState
    renderer: ChatRenderer
    tools: list[dict[str, Any]] | None
    view: list[str] = field(default_factory=list)
    """The client's view of the conversation (:func:`message_key` of each message)."""
    client_messages: list[dict[str, Any]] = field(default_factory=list)
    raw_texts: dict[str, str] = field(default_factory=dict)
    """The client's view of each reply this episode got -> its raw sampled text."""
    turn: Turn | None = None
    last_active: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def session(self) -> str:
        return f"{self.task.key}/{self.id}"


def _digest(keys: Sequence[str]) -> str:
    return hashlib.sha1("\n".join(keys).encode()).hexdigest()


class _Cut:
    """A policy view that ends a generation where ``end_of(text)`` says: the end of the first ``stop``
    string the client asked to stop at, or of the first tool call (``parallel_tool_calls: false``).

    Tokens after the one whose text reaches that end are dropped before they are recorded:
    a prefix of a sample is itself an exact sample, so the recorded log-probs stay exact, and the
    turn ends there as if the model had stopped (the next request's bridge closes it).
    """

    def __init__(self, policy: Policy, renderer: ChatRenderer, end_of: Callable[[str], int | None]):
        self.policy, self.renderer, self.end_of = policy, renderer, end_of

    def end_session(self, session: str) -> None:
        self.policy.end_session(session)

    async def agenerate(self, request: GenerationRequest) -> Generation:
        gen = await self.policy.agenerate(request)
        end = self.end_of(self.renderer.completion_text(gen.token_ids))
        if end is None:
            return gen
        lo, hi = 1, len(gen.token_ids)  # the fewest tokens whose text reaches the end
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.renderer.completion_text(gen.token_ids[:mid])) >= end:
                hi = mid
            else:
                lo = mid + 1
        cut = {name: getattr(gen, name)[:lo] for name in ("candidates", "top_ids", "top_logprobs")
               if getattr(gen, name) is not None}
        return replace(gen, token_ids=gen.token_ids[:lo], logprobs=gen.logprobs[:lo], finish_reason="stop", **cut)


class _Streamed:
    """A policy view that reports each sampled token of its requests to ``on_token`` (a streamed choice)."""

    def __init__(self, policy: Policy, on_token: Callable[[StreamedToken], None]):
        self.policy, self.on_token = policy, on_token

    def end_session(self, session: str) -> None:
        self.policy.end_session(session)

    async def agenerate(self, request: GenerationRequest) -> Generation:
        return await self.policy.agenerate(replace(request, on_token=self.on_token))


class Recorder:
    """Serves chat requests through ``policy`` and records them as trees (see the module docstring)."""

    def __init__(self, policy: Policy, tokenizer: Any, cfg: ServeConfig):
        self.policy, self.tokenizer, self.cfg = policy, tokenizer, cfg
        self.parser = get_parser(tokenizer=tokenizer)
        # The most tokens a context may reach: past max_position_embeddings the model's positions are untrained.
        self.max_context = context_limit(policy, cfg.max_episode_tokens)
        self.episodes: dict[str, _Episode] = {}
        self.forks: dict[str, list[str]] = {}
        self.by_view: dict[str, str] = {}
        self.tasks: dict[str, _Task] = {}
        self.task_counts: Counter[str] = Counter()
        self.metrics: Counter[str] = Counter()
        self.finished: list[Group] = []
        self.writer: GroupWriter | None = None
        if cfg.out:
            # Cuts a torn last line, so a restarted server resumes the file; its header must match this server's.
            self.writer = GroupWriter(cfg.out, header=serve_header(cfg, tokenizer))
            self.finished = read_all_groups(cfg.out)
            for g in self.finished:
                self.task_counts[str(g.info.get("task_id") or g.task_key)] += 1
        self.running = asyncio.Event()
        self.running.set()
        self._new_groups: asyncio.Condition | None = None
        self._relay: TokenRelay | None = None  # streamed tokens: from the decode thread to the event loop

    # -- requests ---------------------------------------------------------------------------------

    async def complete(self, request: ChatRequest, *, episode_id: str | None, task_id: str | None,
                       record: bool = True, stream: asyncio.Queue | None = None) -> list[Choice]:
        """Sample ``request.n`` replies for ``request`` in its episode; records them unless ``record`` is False.

        With a ``stream`` queue, a :class:`~treerl.serve.streaming.StreamStart` is put there once the
        request is accepted, then ``(choice, StreamedToken)`` for each token as it is sampled; the replies
        and the records are the same as without.
        """
        await self.running.wait()  # paused while weights change
        params = self._params(request)  # bad sampling options are refused before the episode changes
        opening = call_opening(self.parser, request)  # tool_choice required or named: the call's opening, forced
        if not record:
            return await self._unrecorded(request, params, opening, stream)
        episode = self._find(request, episode_id, task_id)
        async with episode.lock:
            if episode.id not in self.episodes:  # it finished (a reward came) while this request waited
                raise RequestError("episode_id", f"episode {episode.id!r} has finished.", status=409)
            self._take_messages(episode, request)
            children = self._fork(episode, request.n) if request.n > 1 else [episode]
            shared = f"{episode.task.key}/{episode.state.name}/turn{episode.state.turn}" if len(children) > 1 else None
            forced = episode.renderer.encode(opening) if opening else None
            # The forced opening is context the sampled tokens come after: it takes from their budget.
            limited = [turn_params(params, c.state, self.max_context - len(forced or ())) for c in children]
            if any(p is None for p in limited):
                raise self._too_long(len(episode.state.context_ids) + len(forced or ()))
            if stream is not None:
                stream.put_nowait(StreamStart([c.id for c in children], [forced or []] * len(children)))
            turns = await asyncio.gather(*(
                sample_turn(self._policy(request, c.renderer, stream, i), c.state, c.task.group, c.renderer, p,
                            shared=shared, session=c.session,
                            seed=None if request.seed is None else request_seed(request.seed, i), forced=forced)
                for i, (c, p) in enumerate(zip(children, limited))))
            choices = [self._reply(c, t, request) for c, t in zip(children, turns)]
            if params.top_k != 1:  # what a learner recomputes the log-probs at (greedy turns are the same at any)
                temperatures = episode.task.group.info.setdefault("temperatures", [])
                if params.temperature not in temperatures:
                    temperatures.append(params.temperature)
            for child in children:  # a later request without an id finds its episode by these messages
                self.by_view[_digest(child.view)] = child.id
            return choices

    def _policy(self, request: ChatRequest, renderer: ChatRenderer, stream: asyncio.Queue | None, index: int) -> Any:
        """The policy as choice ``index`` of ``request`` sees it: streamed, cut at stop strings and, with
        ``parallel_tool_calls: false``, where the first tool call closes."""
        if stream is None:
            policy: Any = self.policy
        else:
            loop = asyncio.get_running_loop()
            if self._relay is None or self._relay.loop is not loop:
                self._relay = TokenRelay(loop)
            policy = _Streamed(self.policy, self._relay.sink(stream, index))
        marker = call_end(self.parser, request)
        if not request.stop and marker is None:
            return policy
        reasoning = self.parser.reasoning

        def end_of(text: str) -> int | None:
            ends = [text.find(s) + len(s) for s in request.stop if s in text]
            if marker is not None and (end := first_call_end(text, marker, reasoning)) is not None:
                ends.append(end)
            return min(ends, default=None)

        return _Cut(policy, renderer, end_of)

    def _find(self, request: ChatRequest, episode_id: str | None, task_id: str | None) -> _Episode:
        keys = [message_key(m) for m in request.messages]
        if episode_id is not None and episode_id in self.forks:
            # The client continues one of the forks: the one whose conversation its messages extend.
            for child in self.forks[episode_id]:
                e = self.episodes.get(child)
                if e is not None and keys[:len(e.view)] == e.view:
                    return e
            episode_id = next((c for c in self.forks[episode_id] if c in self.episodes), None)
            if episode_id is None:
                raise RequestError("episode_id", "every fork of this episode has finished.", status=409)
        if episode_id is not None and episode_id in self.episodes:
            return self.episodes[episode_id]
        if episode_id is None:
            for k in range(len(keys) - 1, 0, -1):  # the longest open conversation these messages extend
                found = self.by_view.get(_digest(keys[:k]))
                if found in self.episodes:
                    return self.episodes[found]
        return self._open(request, episode_id or f"ep-{uuid.uuid4().hex[:16]}", task_id)

    def _open(self, request: ChatRequest, episode_id: str, task_id: str | None) -> _Episode:
        if not _valid_id(episode_id):
            raise RequestError("episode_id", f"{episode_id!r} must be 1-128 letters, digits, '-', '_', ':' or '.'.")
        # Rendered first: a conversation the template refuses, or too long, leaves nothing behind.
        renderer = self._renderer(request.tools)
        messages = template_messages(request.messages, {})
        prompt_ids = _render(renderer, messages)
        if len(prompt_ids) >= self.max_context:
            raise self._too_long(len(prompt_ids))
        key = task_id if task_id is not None else episode_id
        task = self.tasks.get(key)
        if task is None:
            n = self.task_counts[key]
            self.task_counts[key] += 1
            group_key = key if n == 0 else f"{key}#{n}"
            size = self.cfg.group_size if task_id is not None else 1  # an episode without a task: a group of one
            task = _Task(key=group_key, slot=key, task_id=task_id, size=size,
                         group=Group(task_key=group_key, env_id=ENV_ID,
                                     info={"task_id": task_id, "num_prompt_messages": len(request.messages),
                                           "source": "serve"}))
            self.tasks[key] = task
        root = task.roots.get(tuple(prompt_ids))
        if root is None:  # episodes of a task with the same opening messages share their prompt segment
            root = task.roots[tuple(prompt_ids)] = task.group.add_segment("prompt", prompt_ids)
        state = EpisodeState(env=None, messages=messages, context_ids=list(prompt_ids), parent=root,
                             path=(task.num_started,))
        task.num_started += 1
        episode = _Episode(id=episode_id, task=task, state=state, renderer=renderer, tools=request.tools)
        task.open.add(episode_id)
        self.episodes[episode_id] = episode
        self.metrics["episodes/started"] += 1
        return episode

    def _renderer(self, tools: list[dict[str, Any]] | None) -> ChatRenderer:
        return ChatRenderer(self.tokenizer, tools=tools)

    def _take_messages(self, episode: _Episode, request: ChatRequest) -> None:
        """Bring the episode's context up to the request's messages: a bridge, or a new branch."""
        turn = episode.turn
        if turn is None:  # the episode's first request: its prompt is the context already
            episode.client_messages = list(request.messages)
            return
        keys = [message_key(m) for m in request.messages]
        extends = (len(keys) > len(episode.view) and keys[:len(episode.view)] == episode.view
                   and request.tools == episode.tools)
        state, group = episode.state, episode.task.group
        if extends:
            new = request.messages[len(episode.view):]
            obs = template_messages(new, episode.raw_texts, earlier=episode.client_messages)
            before = state.messages
            bridge = observe(state, episode.renderer, turn, obs)
            if (needed := next_context_len(state, turn, bridge)) >= self.max_context:
                state.messages = before  # refused: the episode stays as it was, at its last reply
                raise self._too_long(needed)
            if apply_bridge(state, group, turn, bridge):
                self.metrics["episodes/template_branches"] += 1
                self.policy.end_session(episode.session)
        else:
            # The client rewrote its history (or changed its tools): go on from what it sent now,
            # with this server's own replies still rendered from their raw text.
            if request.tools != episode.tools:
                episode.renderer, episode.tools = self._renderer(request.tools), request.tools
            messages = template_messages(request.messages, episode.raw_texts)
            ids = _render(episode.renderer, messages)
            if len(ids) >= self.max_context:
                raise self._too_long(len(ids))
            restart(state, group, ids, old_leaf=turn.leaf, reason="history_rewritten")
            state.messages = messages
            self.metrics["episodes/history_rewrites"] += 1
            self.policy.end_session(episode.session)
        self._unindex(episode)
        episode.client_messages = list(request.messages)
        episode.turn = None

    def _fork(self, episode: _Episode, n: int) -> list[_Episode]:
        """``n`` episodes continuing ``episode``'s context (``n > 1``): ids ``E.0 ... E.{n-1}``."""
        task = episode.task
        children = []
        for b in range(n):
            child_id = f"{episode.id}.{b}"
            child = _Episode(id=child_id, task=task, state=episode.state.fork(b), renderer=episode.renderer,
                             tools=episode.tools, client_messages=list(episode.client_messages),
                             raw_texts=dict(episode.raw_texts))
            self.episodes[child_id] = child
            task.open.add(child_id)
            children.append(child)
        self._close_open(episode)
        self.forks[episode.id] = [c.id for c in children]
        self.policy.end_session(episode.session)
        return children

    def _too_long(self, num_tokens: int) -> RequestError:
        """OpenAI's refusal of a context the model cannot take (a reply needs at least one token after it)."""
        why = f"max_episode_tokens={self.cfg.max_episode_tokens}"
        if self.max_context < self.cfg.max_episode_tokens:
            why = f"the model's max_position_embeddings, below {why}"
        return RequestError("messages", f"this model's maximum context length is {self.max_context} tokens ({why}), "
                                        f"but the conversation needs {num_tokens} tokens before the reply. Shorten "
                                        "the messages.", code="context_length_exceeded")

    def _params(self, request: ChatRequest) -> SamplingParams:
        cfg = self.cfg
        if request.n > cfg.max_n:
            raise RequestError("n", f"{request.n} exceeds max_n={cfg.max_n}.")
        max_tokens = request.max_tokens or cfg.max_new_tokens
        if max_tokens > cfg.max_tokens_cap:
            raise RequestError("max_tokens", f"{max_tokens} exceeds max_tokens_cap={cfg.max_tokens_cap}.")
        top_k = request.top_k if request.top_k is not None else cfg.top_k
        top_p = request.top_p if request.top_p is not None else cfg.top_p
        min_p = request.min_p if request.min_p is not None else cfg.min_p
        temperature = request.temperature if request.temperature is not None else cfg.temperature
        penalty = request.repetition_penalty if request.repetition_penalty is not None else cfg.repetition_penalty
        if temperature == 0:  # greedy, as OpenAI reads temperature 0: the most likely token, log-prob 0
            temperature, top_k = 1.0, 1
        if top_k is None and (top_p < 1 or min_p > 0):
            top_k = 64  # the candidate set is recorded exactly, so nucleus sampling needs a bound
        stops = list(request.stop)
        marker = call_end(self.parser, request)  # parallel_tool_calls false: the sample ends at the first call's end
        if marker is not None and self.parser.reasoning is None:  # (with reasoning, only after it: cut afterwards)
            stops.append(marker)
        stop_ids = []
        for s in stops:  # single-token stops end decoding early; the others are cut afterwards
            ids = self.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                stop_ids.append(ids[0])
        try:
            return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repetition_penalty=penalty, max_new_tokens=max_tokens, stop_token_ids=tuple(stop_ids),
                                  top_logprobs=request.top_logprobs)
        except ValueError as exc:
            raise RequestError("sampling", str(exc)) from None

    def _reply(self, episode: _Episode, turn: Turn, request: ChatRequest) -> Choice:
        state = episode.state
        state.turn += 1
        text = turn.text
        for s in request.stop:  # OpenAI leaves the stop string out of the reply
            if s in text:
                text = text[:text.find(s)]
        parsed = None
        if request.tools and request.tool_choice != "none":
            parsed = self.parser.parse(text, {t["function"]["name"]: t["function"].get("parameters")
                                              for t in request.tools})
        message, records = tool_reply(text, parsed, request.tools)
        # Each call record names the sampled segment that made it, as the engine's do (the viewer places it there).
        state.tool_calls.extend({**r, "segment": turn.leaf} for r in records)
        for r in records:
            name = f"tool_calls/{r['error'] or 'ok'}"
            self.metrics[name] += 1
            state.metrics[name] = state.metrics.get(name, 0) + 1
        finish = "tool_calls" if message.get("tool_calls") else turn.generation.finish_reason
        if turn.generation.finish_reason == "length" and not message.get("tool_calls"):
            finish = "length"
        checked_reply = {"role": "assistant", "content": message.get("content"),
                         "tool_calls": [{"id": c["id"], "name": c["function"]["name"],
                                         "arguments": c["function"]["arguments"]}
                                        for c in message.get("tool_calls") or []]}
        reply_key = message_key(checked_reply)
        episode.raw_texts[reply_key] = turn.text
        episode.view = [message_key(m) for m in episode.client_messages] + [reply_key]
        episode.client_messages = [*episode.client_messages, checked_reply]
        episode.turn = turn
        episode.last_active = time.monotonic()
        self.metrics["requests/sampled_tokens"] += len(turn.generation.token_ids)
        # Prompt tokens the model ran: shared prefills and session caches make it less than the contexts.
        self.metrics["requests/prompt_tokens_processed"] += turn.generation.num_prompt_tokens_processed
        self.metrics["requests/context_tokens"] += len(state.context_ids)
        return Choice(episode.id, message, finish, turn.generation, turn.text, len(state.context_ids))

    async def _unrecorded(self, request: ChatRequest, params: SamplingParams, opening: str | None,
                          stream: asyncio.Queue | None) -> list[Choice]:
        """Replies to a request that is not to be recorded (an evaluation): the same policy and renderer."""
        renderer = self._renderer(request.tools)
        messages = template_messages(request.messages, {})
        state = EpisodeState(env=None, messages=messages, context_ids=_render(renderer, messages), parent=0,
                             path=(0,))
        forced = renderer.encode(opening) if opening else None
        params = turn_params(params, state, self.max_context - len(forced or ()))
        if params is None:
            raise self._too_long(len(state.context_ids) + len(forced or ()))
        scratch = Group(task_key="unrecorded", env_id=ENV_ID)
        scratch.add_segment("prompt", state.context_ids)
        if stream is not None:
            stream.put_nowait(StreamStart(None, [forced or []] * request.n))
        choices = []
        for i in range(request.n):
            s = state.fork(i)
            turn = await sample_turn(self._policy(request, renderer, stream, i), s, scratch, renderer, params,
                                     shared=None, session=None,
                                     seed=None if request.seed is None else request_seed(request.seed, i),
                                     forced=forced)
            episode = _Episode(id="", task=_Task("", "", None, scratch, 1), state=s, renderer=renderer,
                               tools=request.tools, client_messages=list(request.messages))
            choices.append(self._reply(episode, turn, request))
        return choices

    # -- rewards and groups -------------------------------------------------------------------------

    async def reward(self, episode_id: str, reward: float | None = None, rewards: Sequence[float] | None = None,
                     metrics: dict[str, Any] | None = None, termination: str = "completed",
                     feedback: str | None = None) -> None:
        """Finish an episode with its reward (or per-turn ``rewards``, summed), once its request in flight is done.

        ``feedback`` (what went wrong, in words) is kept as the episode's ``metrics["feedback"]``,
        where the engine keeps an environment's :meth:`~treerl.envs.Env.feedback` (SDPO's teacher reads it).
        """
        if episode_id in self.forks:
            raise RequestError("episode_id", f"episode {episode_id!r} forked into {self.forks[episode_id]} (n > 1); "
                                             "post a reward to each of them.", status=409)
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise RequestError("episode_id", f"no open episode {episode_id!r} (unknown, or finished already).",
                               status=404)
        async with episode.lock:
            if episode.id not in self.episodes:
                raise RequestError("episode_id", f"episode {episode_id!r} has finished already.", status=409)
            if episode.turn is None:
                raise RequestError("episode_id", f"episode {episode_id!r} has no reply to reward yet.", status=409)
            episode.state.rewards = [float(r) for r in rewards] if rewards is not None else [float(reward)]
            episode.state.metrics.update(metrics or {})
            if feedback:
                episode.state.metrics["feedback"] = feedback
            self._finish(episode, termination)

    def _finish(self, episode: _Episode, termination: str) -> None:
        episode.state.metrics["episode_id"] = episode.id
        finish_episode(episode.state, episode.task.group, episode.turn.leaf, termination)
        self.metrics[f"episodes/{termination}"] += 1
        self._close_open(episode)
        self.policy.end_session(episode.session)
        task = episode.task
        if not task.open and len(task.group.episodes) >= task.size:
            self._complete(task)

    def _close_open(self, episode: _Episode) -> None:
        self.episodes.pop(episode.id, None)
        episode.task.open.discard(episode.id)
        self._unindex(episode)

    def _unindex(self, episode: _Episode) -> None:
        if episode.view and self.by_view.get(_digest(episode.view)) == episode.id:
            del self.by_view[_digest(episode.view)]

    def finish_task(self, task_id: str) -> int:
        """Close a task's group now: its open episodes are dropped; returns the episodes it keeps."""
        task = self.tasks.get(task_id)
        if task is None:
            raise RequestError("task_id", f"no open task {task_id!r}.", status=404)
        for episode_id in list(task.open):
            episode = self.episodes.get(episode_id)
            if episode is not None:
                self.metrics["episodes/dropped"] += 1
                self._close_open(episode)
                self.policy.end_session(episode.session)
        kept = len(task.group.episodes)
        if kept:
            self._complete(task)
        else:
            del self.tasks[task.slot]
        return kept

    def _complete(self, task: _Task) -> None:
        group = task.group
        self.tasks.pop(task.slot, None)
        group.episodes.sort(key=lambda e: e.metrics["generation"])
        if self.writer is not None:
            self.writer.write(group)
        self.finished.append(group)
        self.metrics["groups/finished"] += 1
        if self._new_groups is not None:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._condition():
            self._condition().notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._new_groups is None:
            self._new_groups = asyncio.Condition()
        return self._new_groups

    async def groups(self, start: int, count: int, wait_s: float) -> list[Group]:
        """Finished groups ``start .. start + count - 1`` (as many as exist after waiting up to ``wait_s``)."""
        cond = self._condition()
        deadline = time.monotonic() + wait_s
        async with cond:
            while len(self.finished) < start + count and (left := deadline - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(cond.wait(), timeout=left)
                except asyncio.TimeoutError:
                    break
        return self.finished[start:start + count]

    def expire(self, now: float | None = None) -> int:
        """End episodes idle for longer than ``episode_timeout_s`` (termination ``timeout``); returns how many."""
        now = time.monotonic() if now is None else now
        stale = [e for e in self.episodes.values()
                 if now - e.last_active > self.cfg.episode_timeout_s and not e.lock.locked()]
        for episode in stale:
            if episode.turn is None:  # never answered: nothing sampled to keep
                self._close_open(episode)
                continue
            self._finish(episode, "timeout")
        return len(stale)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def serve_header(cfg: ServeConfig, tokenizer: Any) -> dict[str, Any]:
    """The trajectory file's header: what a restarted server must share to append to it (sampling is per request)."""
    return make_header({
        "env_id": ENV_ID,
        "model": recorded_model(cfg.model),
        "tokenizer": tokenizer_info(tokenizer),
        "group_size": cfg.group_size,
        "max_episode_tokens": cfg.max_episode_tokens,
    })


def context_limit(policy: Any, max_episode_tokens: int) -> int:
    """``max_episode_tokens``, or the policy's model's ``max_position_embeddings`` when it declares a smaller one.

    >>> from types import SimpleNamespace
    >>> model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1024))
    >>> context_limit(SimpleNamespace(model=model), 2048)
    1024
    >>> context_limit(None, 2048)
    2048
    """
    config = getattr(getattr(policy, "model", None), "config", None)
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0:
        return min(max_episode_tokens, positions)
    return max_episode_tokens


def _render(renderer: ChatRenderer, messages: list[dict[str, Any]]) -> list[int]:
    try:
        return renderer.prompt_ids(messages)
    except (TemplateError, ValueError, TypeError) as exc:  # the template refuses the conversation: the client's fault
        raise RequestError("messages", f"the chat template cannot render this conversation: {exc}") from None


def _valid_id(text: str) -> bool:
    return 0 < len(text) <= 128 and all(ch.isalnum() or ch in "-_:." for ch in text)
