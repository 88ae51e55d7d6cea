"""One episode's steps, shared by every driver of episodes: the engine's loop and ``treerl serve``.

An episode is recorded into its group's tree by four steps, always in this order per turn:

1. :func:`sample_turn`: the policy samples the next assistant turn from the episode's context
   (its exact ids, log-probs, candidate sets and version become a ``sampled`` segment);
2. :func:`observe`: what came back (tool results, a user turn) gives the bridge tokens of
   :class:`~treerl.agents.chat.ChatRenderer`; :func:`next_context_len` says whether the next
   turn still fits;
3. :func:`apply_bridge`: the bridge becomes an ``env`` segment, or, when the chat template is
   not append-only, the episode continues on a new branch (:func:`restart`);
4. :func:`finish_episode`: the leaf and what was said about it become the group's episode.

The engine (:class:`~treerl.rollout.engine.RolloutEngine`) calls them in a loop with an
environment; the server calls them as a client's requests arrive, and uses :func:`restart`
when a client rewrites its history. Either way the root-to-leaf path is exactly the token
sequence the model saw.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from typing import Any

from treerl.agents.chat import Bridge, ChatRenderer, assistant_message
from treerl.agents.policy import Generation, GenerationRequest, Policy, SamplingParams
from treerl.rollout.trajectory import Group

__all__ = ["EpisodeState", "Turn", "turn_params", "sample_turn", "observe", "next_context_len", "apply_bridge",
           "restart", "finish_episode"]


@dataclass
class EpisodeState:
    """What one in-flight episode carries between turns (copied when it branches)."""

    env: Any
    """The environment (None when a client outside plays the environment's part)."""
    messages: list[dict[str, Any]]
    """The conversation the context renders, assistant turns as their raw sampled text."""
    context_ids: list[int]
    parent: int
    """The segment the next sampled turn hangs from."""
    path: tuple[int, ...]
    """Generation index, then the branch index at each fork: names the episode and seeds it."""
    turn: int = 0
    rewards: list[float] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra_leaves: list[int] = field(default_factory=list)
    branched: bool = False
    started: float = field(default_factory=time.monotonic)
    max_context: int | None = None
    """The most tokens this episode's context may reach (the engine's limits for it); None: the caller's."""
    rendered: tuple[list[dict[str, Any]], str] | None = field(default=None, repr=False)
    """``(messages, text)``: the renderer's text of that very list (with the generation prompt),
    valid while ``messages`` is still that list, so a turn renders the conversation once."""

    @property
    def name(self) -> str:
        return ".".join(map(str, self.path))

    def fork(self, branch: int) -> EpisodeState:
        child = copy.copy(self)
        child.env = self.env.fork() if self.env is not None else None
        child.path = (*self.path, branch)
        for name in ("messages", "context_ids", "rewards", "tool_calls", "metrics", "extra_leaves"):
            setattr(child, name, copy.deepcopy(getattr(self, name)))
        if self.rendered is not None and self.rendered[0] is self.messages:
            child.rendered = (child.messages, self.rendered[1])
        return child


@dataclass
class Turn:
    """One sampled assistant turn: its segment, what the policy returned, and its text."""

    leaf: int
    generation: Generation
    text: str
    """The sampled text without a final special stop token (:meth:`ChatRenderer.completion_text`)."""
    before: list[dict[str, Any]]
    """The conversation the turn's context was rendered from."""
    before_text: str | None = None
    """Its rendering with the generation prompt, when the episode kept it (else rendered again)."""
    forced: list[int] = field(default_factory=list)
    """Tokens put at the start of the turn rather than sampled (a server forcing a tool call's
    opening): recorded as an ``env`` segment before the sampled one, never trained on."""

    @property
    def token_ids(self) -> list[int]:
        """The whole turn as the context holds it: forced tokens, then sampled ones."""
        return [*self.forced, *self.generation.token_ids]


def turn_params(params: SamplingParams, state: EpisodeState, max_episode_tokens: int) -> SamplingParams | None:
    """``params`` with ``max_new_tokens`` cut to what the episode's token budget leaves; None when nothing is left."""
    budget = max_episode_tokens - len(state.context_ids)
    if budget <= 0:
        return None
    return params if budget >= params.max_new_tokens else replace(params, max_new_tokens=budget)


async def sample_turn(policy: Policy, state: EpisodeState, group: Group, renderer: ChatRenderer,
                      params: SamplingParams, *, seed: int | None, shared: str | None, session: str | None,
                      forced: list[int] | None = None) -> Turn:
    """Sample the next assistant turn from the episode's context and record it as a ``sampled`` segment.

    ``forced`` tokens open the turn without being sampled (an ``env`` segment before the sampled one)."""
    forced = list(forced or [])
    parent = group.add_segment("env", forced, parent=state.parent) if forced else state.parent
    request = GenerationRequest(prompt_ids=[*state.context_ids, *forced], params=params, seed=seed, group=shared,
                                session=session)
    gen = await policy.agenerate(request)
    leaf = group.add_segment(
        "sampled", gen.token_ids, parent=parent, logprobs=gen.logprobs, candidates=gen.candidates,
        policy_version=gen.policy_version, finish_reason=gen.finish_reason,
        top_ids=gen.top_ids, top_logprobs=gen.top_logprobs,
    )
    text = renderer.completion_text([*forced, *gen.token_ids])
    before = state.messages
    before_text = state.rendered[1] if state.rendered is not None and state.rendered[0] is before else None
    state.messages = [*before, assistant_message(text)]
    return Turn(leaf=leaf, generation=gen, text=text, before=before, before_text=before_text, forced=forced)


def observe(state: EpisodeState, renderer: ChatRenderer, turn: Turn, obs: list[dict[str, Any]]) -> Bridge:
    """The bridge after ``turn`` given the new messages ``obs``; the conversation takes them in.

    The turn stays in the conversation in the form the bridge rendered it (raw, or
    structured when the template needs the parsed calls), so later renderings agree.
    """
    bridge = renderer.bridge(turn.before, turn.token_ids, turn.text, obs, prev_text=turn.before_text)
    turn_message = bridge.message if bridge.message is not None else assistant_message(turn.text)
    state.messages = [*turn.before, turn_message, *copy.deepcopy(obs)]
    state.rendered = None if bridge.text is None else (state.messages, bridge.text)
    return bridge


def next_context_len(state: EpisodeState, turn: Turn, bridge: Bridge) -> int:
    """The length of the context the next turn would start from."""
    if bridge.branch:
        return len(bridge.context_ids or [])
    return len(state.context_ids) + len(turn.token_ids) + len(bridge.ids)


def apply_bridge(state: EpisodeState, group: Group, turn: Turn, bridge: Bridge) -> bool:
    """Extend the context with the bridge (an ``env`` segment), or branch; returns whether it branched."""
    if bridge.branch:
        restart(state, group, list(bridge.context_ids or []), old_leaf=turn.leaf, reason=bridge.reason)
        return True
    state.parent = group.add_segment("env", bridge.ids, parent=turn.leaf)
    state.context_ids = [*state.context_ids, *turn.token_ids, *bridge.ids]
    return False


def restart(state: EpisodeState, group: Group, context_ids: list[int], *, old_leaf: int, reason: str | None) -> None:
    """Continue from ``context_ids`` (a re-rendered conversation) as a new root of the group.

    The path the model really saw ends at ``old_leaf``; it stays an extra leaf of the episode,
    trained on with the episode's reward. Callers drop the policy's session cache.
    """
    state.extra_leaves.append(old_leaf)
    state.context_ids = list(context_ids)
    state.parent = group.add_segment("env", state.context_ids, parent=None)
    state.metrics["template/branch_reason"] = reason


def finish_episode(state: EpisodeState, group: Group, leaf: int, termination: str) -> None:
    """Record the episode ending at ``leaf`` in ``group``."""
    metrics = dict(state.metrics)
    metrics.update({"generation": list(state.path), "turns": state.turn,
                    "wall_s": round(time.monotonic() - state.started, 3)})
    group.add_episode(
        leaf=leaf, reward=sum(state.rewards), rewards=list(state.rewards), messages=state.messages,
        tool_calls=state.tool_calls, termination=termination, metrics=metrics,
        extra_leaves=list(state.extra_leaves),
    )
