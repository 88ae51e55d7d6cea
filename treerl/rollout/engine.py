"""The rollout engine: many multi-turn episodes at once, recorded as prefix trees.

For each task the engine resets one environment, renders the prompt once, and plays
``group_size`` generations from forks of that environment. Every generation is a chain of
``sampled`` segments (the policy's exact ids, log-probs, candidate sets, version) and ``env``
segments (the bridge tokens of :class:`~treerl.agents.chat.ChatRenderer`), all hanging off the
shared ``prompt`` segment; with branching, an episode forks its environment after turn k
and continues ``branch_factor`` times from there, so siblings share that prefix too.

Episodes run as asyncio tasks under one concurrency bound: while some wait on tools,
the policy batches the others' generation requests. Limits per episode: turns (the
environment's), tokens (``max_episode_tokens``) and wall clock (``max_episode_seconds``);
the reason an episode ended is recorded. An environment that raises in ``step`` (or returns
a reward that is not a finite number, or an observation that is not chat messages) is
recorded as an ``env_error`` termination, never a crashed run; so is a chat template that cannot render
what came back (``render_error``). When an episode ends, the environment's
``feedback()`` (what went wrong, in words) is recorded as the episode's ``metrics["feedback"]``,
and the numbers of its ``episode_metrics()`` as ``metrics["env/NAME"]`` (summaries average them).

The steps of one turn (sample, observe, bridge or branch, finish) live in
:mod:`treerl.rollout.episode`, where ``treerl serve`` takes them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from treerl.agents.chat import ChatRenderer, RenderError
from treerl.agents.policy import Policy, SamplingParams
from treerl.envs.loops import run_with_limit
from treerl.envs.task_order import task_options
from treerl.errors import EnvError
from treerl.rollout.episode import (
    EpisodeState,
    apply_bridge,
    finish_episode,
    next_context_len,
    observe,
    sample_turn,
    turn_params,
)
from treerl.rollout.lockstep import Lockstep
from treerl.rollout.summary import ENV_METRIC_PREFIX, RolloutStats, env_metric_numbers
from treerl.rollout.trajectory import Group, GroupWriter

__all__ = ["RolloutEngine", "task_options"]

logger = logging.getLogger(__name__)


def request_seed(*parts: int) -> int:
    """A per-request sampling seed derived from (run seed, task, generation, turn)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


class RolloutEngine:
    """Plays a policy in environments and returns trajectory trees.

    Args:
        policy: Anything with ``agenerate`` (see :class:`~treerl.agents.policy.Policy`).
        tokenizer: The policy's tokenizer, with its chat template.
        params: Sampling parameters (``max_new_tokens`` is per assistant turn).
        max_concurrency: Episodes in flight at once, over all groups.
        max_episode_tokens: An episode whose context reaches this many tokens is truncated.
        max_episode_seconds: Wall-clock limit of one episode.
        branch_at_turn: Fork each episode's environment after this many turns ...
        branch_factor: ... into this many continuations (1: no branching).
        seed: Seeds every request (with the task, generation and turn), so runs repeat.
        chat_template: Overrides the tokenizer's template.
        lockstep: Generation in waves of every episode in play, in a fixed order
            (:class:`~treerl.rollout.lockstep.Lockstep`), so the policy's batches, and with them
            every float, repeat from run to run. Every episode of a call is then in play at once
            (``max_concurrency`` does not apply); the policy's own batch size still bounds a batch.
        shuffle_seed: Play a dataset's rows in a new order each pass, seeded with it (see
            :func:`task_options`); None plays them as written. :attr:`shuffle_batch_size` (1 unless
            set) is the tasks a pass plays whole batches of, as TRL's sampler: a learner's step.
        max_completion_tokens: An episode whose completion (every token after the prompt: turns,
            tool results and the template's tokens between them) reaches this many is truncated
            (TRL's ``max_completion_length``); None: only ``max_episode_tokens`` bounds it.
    """

    def __init__(
        self,
        policy: Policy,
        tokenizer: Any,
        *,
        params: SamplingParams | None = None,
        max_concurrency: int = 32,
        max_episode_tokens: int = 4096,
        max_episode_seconds: float = 300.0,
        branch_at_turn: int | None = None,
        branch_factor: int = 1,
        seed: int = 0,
        chat_template: str | None = None,
        lockstep: bool = False,
        shuffle_seed: int | None = None,
        max_completion_tokens: int | None = None,
    ):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1.")
        if branch_factor < 1:
            raise ValueError(f"branch_factor={branch_factor} must be >= 1 (1 means no branching).")
        if branch_factor > 1 and (branch_at_turn is None or branch_at_turn < 1):
            raise ValueError("branch_factor > 1 needs branch_at_turn >= 1: the turn after which episodes fork.")
        self.policy = policy
        self.tokenizer = tokenizer
        self.params = params or SamplingParams()
        self.max_concurrency = max_concurrency
        self.max_episode_tokens = max_episode_tokens
        self.max_episode_seconds = max_episode_seconds
        self.branch_at_turn = branch_at_turn
        self.branch_factor = branch_factor
        self.seed = seed
        self.chat_template = chat_template
        self.lockstep = lockstep
        self.shuffle_seed = shuffle_seed
        self.shuffle_batch_size = 1
        if max_completion_tokens is not None and max_completion_tokens < 1:
            raise ValueError(f"max_completion_tokens={max_completion_tokens} must be >= 1 (None: no limit of its own).")
        self.max_completion_tokens = max_completion_tokens
        self._slots: asyncio.Semaphore | contextlib.nullcontext | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._gate: Lockstep | None = None
        self._left_out_metrics: set[tuple[str, str]] = set()
        """(environment, name) of episode metrics that were not numbers: warned about once."""

    def _max_context(self, prompt_len: int) -> int:
        """The context limit of an episode whose prompt is ``prompt_len`` tokens: ``max_episode_tokens``, or
        less where ``max_completion_tokens`` after the prompt comes first."""
        if self.max_completion_tokens is None:
            return self.max_episode_tokens
        return min(self.max_episode_tokens, prompt_len + self.max_completion_tokens)

    def _ensure_slots(self) -> None:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots_loop = loop
            # In lockstep no episode waits for a slot: when it would start would depend on time.
            self._slots = contextlib.nullcontext() if self.lockstep else asyncio.Semaphore(self.max_concurrency)
            self._gate = Lockstep(self.policy) if self.lockstep else None

    # -- one group -------------------------------------------------------------------------
    async def run_group(self, env: Any, env_id: str, task_seed: int, group_size: int,
                        options: dict[str, Any] | None = None) -> Group:
        """Reset ``env`` on one task and play ``group_size`` generations of it."""
        self._ensure_slots()
        # Counted before the first await, so that no lockstep wave leaves this group behind.
        self._enter(group_size)
        handed_over = 0  # episodes whose _play counts them out
        try:
            if hasattr(env, "use_parser_of"):
                # Tool calls in the format the template played tells the model to write.
                env.use_parser_of(self.tokenizer if self.chat_template is None
                                  else _WithTemplate(self.tokenizer, self.chat_template))
            obs, info = await env.areset(seed=task_seed, options=options)
            if not isinstance(obs, (list, tuple)) or not obs or not all(isinstance(m, Mapping) for m in obs):
                # Else the chat template fails on it with a message about neither reset() nor the environment.
                raise EnvError(f"{env_id}: reset(seed={task_seed}) returned the observation {str(obs)[:80]!r}: it must "
                               "be the opening chat messages, e.g. [{'role': 'user', 'content': text}].")
            # With the parser, a template that needs structured tool calls (gpt-oss) gets them.
            renderer = ChatRenderer(self.tokenizer, tools=env.tool_schemas or None, chat_template=self.chat_template,
                                    parser=getattr(env, "parser", None))
            messages = list(obs)
            prompt_text = renderer.render(messages)
            prompt_ids = renderer.encode(prompt_text)
            group = Group(task_key=f"seed-{task_seed}", env_id=env_id,
                          info={"task_seed": task_seed, "task_id": info.get("task_id"), "options": options,
                                "answer": info.get("answer"), "num_prompt_messages": len(messages),
                                "sampling": _params_dict(self.params),
                                **({"row": info["row"]} if "row" in info else {}),
                                # an EnvGroup's member, which per-environment figures group by
                                **({"env": info["env"]} if isinstance(info.get("env"), str) else {})})
            root = group.add_segment("prompt", prompt_ids)
            states = []
            for g in range(group_size):
                state = EpisodeState(env=env.fork(), messages=copy.deepcopy(messages), context_ids=list(prompt_ids),
                                     parent=root, path=(g,), max_context=self._max_context(len(prompt_ids)))
                state.rendered = (state.messages, prompt_text)
                states.append(state)
            plays = [self._play(s, group, renderer, task_seed, shared=f"{group.task_key}/prompt") for s in states]
            handed_over = group_size
            await asyncio.gather(*plays)
        finally:
            self._leave(group_size - handed_over)
        # Generations finish in any order; store them in generation order, and number the
        # segments in that order, so that files and the packing of the tree repeat.
        group.episodes.sort(key=lambda e: e.metrics["generation"])
        group.canonicalize()
        return group

    def _enter(self, n: int) -> None:
        if self._gate is not None:
            self._gate.enter(n)

    def _leave(self, n: int) -> None:
        if self._gate is not None and n:
            self._gate.leave(n)

    async def _play(self, state: EpisodeState, group: Group, renderer: ChatRenderer, task_seed: int,
                    shared: str | None) -> None:
        assert self._slots is not None
        session = f"{group.task_key}/{state.name}"
        continuations: list[EpisodeState] = []
        try:
            # The slot is held for the episode's turns only: a branching episode gives it back
            # before its continuations queue for slots, so branching can never deadlock.
            async with self._slots:
                continuations = await self._turns(state, group, renderer, task_seed, shared, session)
        finally:
            self.policy.end_session(session)
            self._enter(len(continuations))  # before this episode leaves: the next wave waits for them
            self._leave(1)
        if continuations:
            # Siblings continue from the same context: the policy prefills it once for all.
            point = f"{session}/turn{state.turn}"
            await asyncio.gather(*(self._play(c, group, renderer, task_seed, shared=point) for c in continuations))

    async def _turns(self, state: EpisodeState, group: Group, renderer: ChatRenderer, task_seed: int,
                     shared: str | None, session: str) -> list[EpisodeState]:
        """Play turns until the episode ends (returns []) or branches (returns the continuations)."""
        while True:
            params = turn_params(self.params, state, state.max_context or self.max_episode_tokens)
            if params is None:
                return self._finish(state, group, state.parent, "max_tokens")
            if time.monotonic() - state.started >= self.max_episode_seconds:
                return self._finish(state, group, state.parent, "timeout")
            turn = await sample_turn(self._gate or self.policy, state, group, renderer, params, shared=shared, session=session,
                                     seed=request_seed(self.seed, task_seed, *state.path, state.turn))
            shared = None  # only a context's first request shares its prefill with siblings
            remaining = self.max_episode_seconds - (time.monotonic() - state.started)
            try:
                # Not asyncio.wait_for: it waits for a cancelled step to end, forever for an astep
                # that swallows CancelledError; this returns at the limit and abandons the step.
                obs, reward, terminated, truncated, info = await run_with_limit(
                    state.env.astep(turn.text), max(remaining, 1e-3), name=f"env {group.env_id!r} step ({session})"
                )
            except TimeoutError:
                return self._finish(state, group, turn.leaf, "timeout")
            except Exception as exc:  # an environment bug: recorded as data, the run goes on
                logger.warning("environment %s raised in step(): %s", group.env_id,
                               "".join(traceback.format_exception_only(exc)).strip())
                state.metrics["env_error"] = f"{type(exc).__name__}: {exc}"
                return self._finish(state, group, turn.leaf, "env_error")
            problem = _step_result_problem(reward, info)
            if problem is not None:  # a broken contract is the environment's error, recorded like a raise
                return self._env_error(state, group, turn.leaf, problem)
            state.turn += 1
            state.rewards.append(float(reward))
            # Each call record names the sampled segment that made it (the viewer places it there).
            state.tool_calls.extend({**r, "segment": turn.leaf} for r in info.get("tool_calls", []))
            state.metrics.update(info.get("metrics", {}))
            if terminated or truncated:
                # Both set (a time limit on the very step that ended it): the episode did end (Gymnasium's reading).
                termination = info.get("termination") or ("terminated" if terminated else "max_turns")
                return self._finish(state, group, turn.leaf, termination)

            if not isinstance(obs, (list, tuple)) or not all(isinstance(m, Mapping) for m in obs):
                # Not the template's fault (a text env's bare string, say): the environment broke the contract.
                return self._env_error(state, group, turn.leaf, f"step() returned an observation of type "
                                       f"{type(obs).__name__}: it must be a list of chat messages, e.g. "
                                       "[{'role': 'user', 'content': text}].")
            try:
                bridge = observe(state, renderer, turn, obs)
            except RenderError as exc:  # the template refuses what came back: the episode ends here, as data
                logger.warning("environment %s, episode %s: %s", group.env_id, state.name, exc)
                state.metrics["render_error"] = str(exc)
                return self._finish(state, group, turn.leaf, "render_error")
            # End here, at the sampled leaf, when the next turn could not start: no dangling bridge.
            if next_context_len(state, turn, bridge) >= (state.max_context or self.max_episode_tokens):
                return self._finish(state, group, turn.leaf, "max_tokens")
            if time.monotonic() - state.started >= self.max_episode_seconds:
                return self._finish(state, group, turn.leaf, "timeout")
            if apply_bridge(state, group, turn, bridge):
                # The template renders an earlier turn differently now: the episode went on from
                # what it renders, as a new root; the old path is an extra leaf.
                self.policy.end_session(session)

            if self.branch_factor > 1 and not state.branched and state.turn == self.branch_at_turn:
                state.branched = True
                children = [state.fork(b) for b in range(self.branch_factor)]
                _close(state.env, group.env_id)
                return children

    def _env_error(self, state: EpisodeState, group: Group, leaf: int, problem: str) -> list[EpisodeState]:
        logger.warning("environment %s: %s", group.env_id, problem)
        state.metrics["env_error"] = problem
        return self._finish(state, group, leaf, "env_error")

    def _finish(self, state: EpisodeState, group: Group, leaf: int, termination: str) -> list[EpisodeState]:
        feedback = _feedback(state.env, group.env_id)
        if feedback:
            state.metrics["feedback"] = feedback  # what a teacher may read about this attempt (SDPO)
        state.metrics.update(self._episode_metrics(state.env, group.env_id))
        finish_episode(state, group, leaf, termination)
        _close(state.env, group.env_id)
        return []

    def _episode_metrics(self, env: Any, env_id: str) -> dict[str, float]:
        """``env.episode_metrics()``'s numbers as ``env/NAME`` (see :meth:`treerl.envs.Env.episode_metrics`);
        an environment bug there is logged, not raised, and what is not a number is left out (said once)."""
        hook = getattr(env, "episode_metrics", None)
        if hook is None:
            return {}
        try:
            values = dict(hook() or {})
        except Exception as exc:
            logger.warning("environment %s raised in episode_metrics(): %s", env_id,
                           "".join(traceback.format_exception_only(exc)).strip())
            return {}
        numbers = env_metric_numbers(values)
        for name in sorted(set(values) - set(numbers)):
            if (env_id, name) not in self._left_out_metrics:
                self._left_out_metrics.add((env_id, name))
                logger.warning("environment %s: episode_metrics()[%r] is %s, not a finite number: left out of the "
                               "episode's metrics (report ints, floats or bools)", env_id, name,
                               repr(values[name])[:60])
        return {f"{ENV_METRIC_PREFIX}{name}": value for name, value in numbers.items()}

    # -- many groups -----------------------------------------------------------------------
    async def run(
        self,
        env_factory: Callable[[], Any],
        env_id: str,
        tasks: Iterable[int],
        group_size: int,
        *,
        writer: GroupWriter | None = None,
        on_group: Callable[[Group], None] | None = None,
        keep: bool = True,
    ) -> tuple[list[Group], RolloutStats]:
        """Play every task in ``tasks`` (indices; task ``i`` is reset with seed ``seed + i``).

        Groups are written (and passed to ``on_group``) as they finish. A group that fails
        (a bug: environment errors are recorded as data) does not stop the others: they
        all finish and are written, then the first failure is raised. With ``keep=False``
        the groups are not returned (the list is empty), so a long run that writes them holds
        none in memory after it is done with it.
        """
        self._ensure_slots()
        # Bound the groups in flight too, so a long task list does not build every
        # environment up front: enough groups to keep all episode slots busy, plus one. In
        # lockstep every group starts at once (when one started would depend on time).
        group_slots = (contextlib.nullcontext() if self.lockstep
                       else asyncio.Semaphore(-(-self.max_concurrency // max(group_size, 1)) + 1))
        stats = RolloutStats()
        groups: list[Group] = []
        start = time.monotonic()

        async def one(index: int) -> None:
            async with group_slots:
                env = env_factory()
                try:
                    group = await self.run_group(env, env_id, self.seed + index, group_size,
                                                 task_options(env, index, self.shuffle_seed, self.shuffle_batch_size))
                finally:
                    _close(env, env_id)
            if writer is not None:
                writer.write(group)
            if keep:
                groups.append(group)
            stats.add(group)
            if on_group is not None:
                on_group(group)

        outcomes = await asyncio.gather(*(one(i) for i in tasks), return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        for failure in failures[1:]:
            logger.error("another group failed too: %s", "".join(traceback.format_exception_only(failure)).strip())
        if failures:
            raise failures[0]
        stats.wall_s = time.monotonic() - start
        groups.sort(key=lambda g: g.info["task_seed"])
        return groups, stats


class _WithTemplate:
    """``tokenizer`` as seen through ``chat_template``: its template is the engine's, the rest
    its own (what an environment's ``use_parser_of`` reads the call format from)."""

    def __init__(self, tokenizer: Any, chat_template: str):
        self._tokenizer = tokenizer
        self.chat_template = chat_template

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _step_result_problem(reward: Any, info: Any) -> str | None:
    """What is wrong with ``step()``'s reward and info, or None: the reward must be a finite number (a NaN
    or inf would poison the group's mean and be written as null), the info a mapping (Gymnasium's contract)."""
    try:
        value = float(reward)
    except (TypeError, ValueError):
        value = None
    if value is None or not math.isfinite(value):
        return f"step() returned reward {reward!r}: rewards must be finite numbers (score a failure as, e.g., 0.0)."
    if not isinstance(info, Mapping):
        return f"step() returned info of type {type(info).__name__}: info must be a dict."
    return None


def _feedback(env: Any, env_id: str) -> str | None:
    """``env.feedback()`` (see :meth:`treerl.envs.Env.feedback`); an environment bug there is logged, not raised."""
    hook = getattr(env, "feedback", None)
    if hook is None:
        return None
    try:
        text = hook()
    except Exception as exc:
        logger.warning("environment %s raised in feedback(): %s", env_id,
                       "".join(traceback.format_exception_only(exc)).strip())
        return None
    return text if isinstance(text, str) and text.strip() else None


def _close(env: Any, env_id: str) -> None:
    """``env.close()``; the episode is over, so an environment bug there is logged, not raised."""
    try:
        env.close()
    except Exception as exc:
        logger.warning("environment %s raised in close(): %s", env_id,
                       "".join(traceback.format_exception_only(exc)).strip())


def _params_dict(params: SamplingParams) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(params).items()}
