"""The environment contract: Gymnasium's ``Env`` for multi-turn, tool-using chat.

* ``reset(*, seed=None, options=None) -> (obs, info)`` where ``obs`` is the opening list of
  chat messages (system prompt, user turn);
* ``step(action) -> (obs, reward, terminated, truncated, info)`` where ``action`` is the
  assistant's completion text and ``obs`` the new messages it caused (tool results, user
  feedback), empty when the episode ends.

Environments whose steps wait on I/O implement ``async def astep``; ``step`` then runs it on
a private event loop. Environments that only implement ``step`` are run in a worker thread
by ``astep``, so the rollout engine can always ``await env.astep(...)``; likewise ``areset``
runs a synchronous ``reset`` in a worker thread.

:class:`ToolEnv` is the class most environments subclass: it parses tool calls out of the
completion, validates and runs them, and turns every failure into an observation and a
metric (a bad rollout is data, not a crash). Override ``sample_task`` (or pass a dataset)
and ``score``; ``gold_actions`` makes ``validate()`` prove that gold answers earn full reward.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gymnasium
import numpy as np

from treerl.errors import EnvError, ToolCallError, ToolErrorKind
from treerl.envs.loops import run_until_done
from treerl.envs.offload import run_in_thread
from treerl.envs.parsers import PARSERS, ParseResult, ToolCall, ToolCallParser, get_parser
from treerl.envs.spaces import ChatMessages, Completion
from treerl.envs.tools import Tool, ToolResult, run_tool_call

__all__ = ["Message", "Task", "Env", "ToolEnv", "ValidationReport", "run_sync"]

Message = dict[str, Any]

_INLINE_CHARS = 2_000
"""Replies this short are read on the event loop by treerl's own (linear) parsers."""


@dataclass
class Task:
    """One problem an environment poses.

    Attributes:
        prompt: The user's request, or the full opening messages; when these start with a system
            message, it replaces the environment's system prompt.
        answer: The gold answer the verifier compares against.
        info: Anything else the environment needs (hidden tests, a secret, metadata).
        id: A stable identifier (recorded with trajectories; resumable rollouts key on it).
    """

    prompt: str | list[Message]
    answer: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    id: str | None = None


@dataclass
class ValidationReport:
    """What ``Env.validate()`` found: gold answers must earn the full reward."""

    num_tasks: int
    num_passed: int
    failures: list[str]

    @property
    def ok(self) -> bool:
        return self.num_passed == self.num_tasks


def run_sync(coro):
    """Run a coroutine to completion from synchronous code, even under a running loop.

    :func:`~treerl.envs.loops.run_until_done`: a fresh event loop, on which tasks the coroutine
    left behind (a timed-out tool that swallows its cancellation) get a short grace and are then
    abandoned, not waited for; if the calling thread already runs one (a notebook), the
    coroutine runs on a helper thread instead of failing.
    """
    return run_until_done(coro)


class Env(gymnasium.Env[list[Message], str]):
    """Base class of treerl environments: Gymnasium's contract with chat observations.

    Subclasses implement ``reset`` and either ``step`` or ``astep``. ``fork()`` returns an
    independent copy in the same state (branching rollouts fork after turn k).
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 4}  # Gymnasium text envs declare 4
    fork_shares: ClassVar[tuple[str, ...]] = ("dataset",)
    """Members that :meth:`fork` shares with the copies instead of copying them: read-only data."""
    description: ClassVar[str] = ""
    """One line shown by ``treerl envs``."""

    def __init__(self, *, render_mode: str | None = None):
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"render_mode={render_mode!r} is not supported: use one of {self.metadata['render_modes']} or None."
            )
        self.render_mode = render_mode
        self.observation_space = ChatMessages()
        self.action_space = Completion()
        self.messages: list[Message] = []

    # -- tools ---------------------------------------------------------------------------
    @property
    def tools(self) -> Sequence[Tool]:
        """The tools the model may call (none by default)."""
        return ()

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI-style schemas of :attr:`tools`, for ``apply_chat_template(..., tools=...)``."""
        return [copy.deepcopy(t.schema) for t in self.tools]

    # -- sync / async bridging ----------------------------------------------------------
    def step(self, action: str):
        if type(self).astep is Env.astep:
            raise NotImplementedError(f"{type(self).__name__} must implement step() or astep().")
        return run_sync(self.astep(action))

    async def astep(self, action: str):
        """Async step. By default runs the synchronous ``step`` in a thread of its own.

        Not asyncio's default executor: its few workers (CPU count + 4) would make the steps
        of a large group queue behind each other, and a step that hangs past the engine's
        ``max_episode_seconds`` would keep the executor's shutdown waiting until it ends.
        """
        if type(self).step is Env.step:
            raise NotImplementedError(f"{type(self).__name__} must implement step() or astep().")
        return await run_in_thread(self.step, action, name="treerl-env-step")

    async def areset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Async reset. By default runs the synchronous ``reset`` in a thread of its own, as ``astep`` does.

        A reset may wait (a database query, a container start): run on the event loop, it would
        stall every other episode of the run. A ``reset`` that must run on the event loop (it
        makes an object bound to it) belongs in an override of ``areset``.
        """
        return await run_in_thread(functools.partial(self.reset, seed=seed, options=options), name="treerl-env-reset")

    def fork(self) -> Env:
        """An independent environment in the same state, random generator included.

        A deep copy, except for the members named in ``fork_shares`` (the dataset), which the
        copies share: read-only, and copying a large dataset for every generation of every group
        cost more than the episodes. Members that cannot be deep-copied (a lock, a client with an
        open connection, a socket) are shared by the copies too, with a warning naming them,
        rather than failing the group; override ``fork`` where sharing one is wrong.
        """
        cls = type(self)
        shares = {id(v): v for name in self.fork_shares if (v := self.__dict__.get(name)) is not None}
        if cls not in _SHARES_MEMBERS:  # else the whole copy failed before: not tried (and half done) again
            try:
                return copy.deepcopy(self, dict(shares))
            except Exception:  # noqa: BLE001 - deepcopy fails with TypeError, PicklingError, copy.Error, ...
                pass
        clone = copy.copy(self)
        memo: dict[int, Any] = {**shares, id(self): clone}
        shared = []
        for name, value in vars(self).items():
            try:
                clone.__dict__[name] = copy.deepcopy(value, memo)
            except Exception:  # noqa: BLE001
                clone.__dict__[name] = value
                shared.append(f"{name} ({type(value).__name__})")
        if shared and cls not in _SHARES_MEMBERS:
            _SHARES_MEMBERS.add(cls)
            warnings.warn(f"{cls.__name__}.fork(): {', '.join(shared)} cannot be deep-copied, so the generations of a "
                          "group share it; override fork() if each needs its own.", stacklevel=2)
        return clone

    def validate(self, num_tasks: int = 8, seed: int = 0) -> ValidationReport:
        """Check that gold answers earn the full reward. Environments with gold answers override this."""
        raise NotImplementedError(f"{type(self).__name__} has no gold answers to validate.")

    def feedback(self) -> str | None:
        """What went wrong in the episode so far, in words a model can read; None when nothing did.

        The rollout engine asks when an episode ends and records the text as the episode's
        ``metrics["feedback"]``; SDPO's teacher reads it (a failed attempt's tool errors,
        failed tests, wrong answer). Override it to give your environment's verdict.
        """
        return None

    def episode_metrics(self) -> Mapping[str, Any]:
        """Numbers that describe the episode so far, by name (SkyRL-Gym's ``get_metrics()``); none by default.

        The rollout engine asks when an episode ends (after its last step, before ``close()``)
        and records each number as the episode's ``metrics["env/NAME"]``; ``treerl learn``
        logs each one per step as its mean over the step's episodes that reported it
        (``env/NAME``), and ``treerl rollout`` and ``treerl eval`` summarize them the same way.
        Numbers are ints, floats and bools (as 0/1); other values, NaN and infinities are
        left out. An episode that does not report a name is left out of that name's mean:
        report 0 where absence means 0.

        >>> class Graded(Env):
        ...     def episode_metrics(self):
        ...         return {"format_ok": True, "answer_chars": 12}
        """
        return {}

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n".join(f"[{m['role']}] {m['content']}" for m in self.messages)


_SHARES_MEMBERS: set[type] = set()
"""Environment classes with members fork() cannot deep-copy: it copies them member by member, and
has warned once about the members it shares."""


class ToolEnv(Env):
    """A multi-turn environment in which the model calls tools and then answers.

    Each step parses the completion for tool calls (format chosen by ``parser``). With calls,
    each is validated against its tool's JSON Schema and run (with its timeout); results come
    back as ``tool`` messages. A completion without calls is the final answer: the episode
    terminates and ``score`` gives the reward. Failures never raise: they come back to the
    model as messages that say what was wrong, and are counted in ``info["metrics"]``.

    Subclasses set ``system_prompt`` and override :meth:`sample_task` (or pass ``dataset``),
    :meth:`score`, and optionally :meth:`is_final`, :meth:`gold_actions`,
    :meth:`answer_feedback` (what :meth:`feedback` says about a final answer), and
    :meth:`episode_metrics` (numbers about the episode, averaged in the run's metrics).

    Args:
        tools: Tools available to the model (default: the class attribute ``tool_list``):
            :class:`Tool` objects or typed functions, which become ``Tool(fn)``.
        dataset: Tasks to draw from instead of ``sample_task`` (a sequence of :class:`Task`
            or of dicts with ``prompt``/``answer``/``info``/``id``, e.g. a ``datasets.Dataset``; a
            dict's other columns, ``info`` included, are kept in ``info["row"]`` and reach reward functions).
        max_turns: Assistant turns before the episode is truncated.
        parser: Tool-call format name (see ``treerl.envs.parsers.PARSERS``) or parser object.
            ``None`` (the default) means "the policy's": the rollout engine and ``treerl eval``
            pick it from the tokenizer's chat template (:meth:`use_parser_of`); alone, the
            environment parses Hermes ``<tool_call>`` JSON.
        system_prompt: Overrides the class's system prompt.
        parse_timeout_s: Seconds that reading one reply's tool calls (``parser.parse`` and
            :meth:`is_final`) may take; past it the turn is one ``malformed`` call.
        score_timeout_s: Seconds that :meth:`score` may take; past it the reward is 0.0
            and ``info["metrics"]["score/timeout"]`` is 1. ``None``: no limit here, for a
            score that bounds itself (CodeSandbox's hidden tests run under the sandbox's
            limit, which does not count the wait for a sandbox slot; this one would).
        malformed_ends_episode: A reply with a ``malformed`` tool call (one that cannot be
            parsed) ends the episode at reward 0, its other calls unrun (termination
            ``malformed_call``, ``info["metrics"]["episode/malformed_call"]`` is 1), as TRL's
            multi-turn tool loop does. Off (the default), the model reads an error message and
            may try again, which costs it only a turn: in training, a group's malformed calls
            then earn the same advantage as clean ones and can grow unchecked.
        malformed_penalty: Subtracted from a step's reward once per ``malformed`` call in the
            reply (the episode's reward is the sum of its steps; success, read from the final
            step, is unchanged). A reply that breaks the format then costs its episode even
            when the model recovers after the error message, and a reply of many broken calls
            costs more than one; with ``malformed_ends_episode`` the ending step's reward is
            ``-malformed_penalty`` times its malformed calls, below a wrong answer's 0.

    Parsing, validating and running sync tools, and scoring run in their own threads
    (:mod:`treerl.envs.offload`), not on the event loop that plays the other episodes;
    only work bounded to about a millisecond stays on the loop (treerl's own parsers on
    replies of at most 2,000 characters, validating small arguments).
    """

    system_prompt: ClassVar[str] = ""
    tool_list: ClassVar[Sequence[Tool]] = ()
    max_reward: ClassVar[float] = 1.0
    """The reward a gold answer earns; ``validate()`` checks it."""

    def __init__(
        self,
        *,
        tools: Sequence[Tool] | None = None,
        dataset: Sequence[Task | Mapping[str, Any]] | None = None,
        max_turns: int = 4,
        parser: str | ToolCallParser | None = None,
        system_prompt: str | None = None,
        render_mode: str | None = None,
        parse_timeout_s: float = 10.0,
        score_timeout_s: float | None = 60.0,
        malformed_ends_episode: bool = False,
        malformed_penalty: float = 0.0,
    ):
        super().__init__(render_mode=render_mode)
        if not (isinstance(malformed_penalty, (int, float)) and not isinstance(malformed_penalty, bool)
                and 0 <= malformed_penalty < float("inf")):
            raise ValueError(f"malformed_penalty={malformed_penalty!r} must be a finite number >= 0 (the reward a "
                             "malformed call costs), e.g. --env-kwargs '{\"malformed_penalty\": 0.1}'.")
        self.malformed_penalty = float(malformed_penalty)
        if not isinstance(malformed_ends_episode, bool):
            raise ValueError(f"malformed_ends_episode={malformed_ends_episode!r} must be true or false, e.g. "
                             "--env-kwargs '{\"malformed_ends_episode\": true}'.")
        self.malformed_ends_episode = malformed_ends_episode
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns} must be >= 1: the model needs at least one turn to answer.")
        for key, value in (("parse_timeout_s", parse_timeout_s), ("score_timeout_s", score_timeout_s)):
            if key == "score_timeout_s" and value is None:
                continue
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{key}={value!r} must be a finite number of seconds > 0, e.g. {key}=10.0.")
        self.parse_timeout_s = float(parse_timeout_s)
        self.score_timeout_s = None if score_timeout_s is None else float(score_timeout_s)
        # A plain function is made a tool here, as TRL's and verifiers' tools=[fn] take it.
        self._tools = [t if isinstance(t, Tool) else Tool(t) for t in (self.tool_list if tools is None else tools)]
        names = [t.name for t in self._tools]
        if len(set(names)) != len(names):
            raise ValueError(f"Tool names must be unique, got {names}: rename one with @tool(name=...).")
        self._tool_map = {t.name: t for t in self._tools}
        self.dataset = dataset
        if dataset is not None and len(dataset) == 0:
            raise ValueError("dataset is empty: pass at least one task, or None to use sample_task().")
        self.max_turns = max_turns
        self.parser_from_policy = parser is None
        self.parser = get_parser(parser) if isinstance(parser, str) or parser is None else parser
        if system_prompt is not None:
            self.system_prompt = system_prompt
        self.task: Task | None = None
        self.turn = 0
        self.done = True
        self.metrics: Counter[str] = Counter()
        self.tool_records: list[dict[str, Any]] = []
        """The episode's tool-call records so far (what :meth:`feedback` reports)."""
        self.final_answer: str | None = None
        self.final_reward = 0.0

    @property
    def tools(self) -> Sequence[Tool]:
        return tuple(self._tools)

    def use_parser_of(self, tokenizer: Any) -> None:
        """Parse tool calls in the format of ``tokenizer``'s chat template, unless a parser was given."""
        if self.parser_from_policy:
            self.parser = get_parser(tokenizer=tokenizer)

    # -- hooks ---------------------------------------------------------------------------
    def sample_task(self, rng: np.random.Generator) -> Task:
        """Draw a task. Override this, or pass ``dataset=``."""
        raise NotImplementedError(
            f"{type(self).__name__} has no tasks: override sample_task(rng) or pass dataset=[...]."
        )

    def score(self, task: Task, completion: str) -> float:
        """The reward of the final answer ``completion`` for ``task``. Override this."""
        raise NotImplementedError(f"{type(self).__name__} must override score(task, completion).")

    def is_final(self, parsed: ParseResult) -> bool:
        """Whether a turn without valid tool calls is a final answer (default: always).

        Environments that expect a particular answer form (e.g. ``\\boxed{}``) override this;
        a turn that is neither a call nor a final answer is then a ``no_call`` failure.
        """
        return True

    def gold_actions(self, task: Task) -> list[str]:
        """Completions that solve ``task`` (used by ``validate()``). Override to enable it."""
        raise NotImplementedError(f"{type(self).__name__} has no gold actions: override gold_actions(task).")

    def answer_feedback(self, task: Task, completion: str, reward: float) -> str | None:
        """The verifier's word on a final answer that earned ``reward`` (part of :meth:`feedback`).

        The default only says that it fell short of ``max_reward``; environments override it
        with what their verifier knows (the gold check, the failed tests).
        """
        if reward >= self.max_reward:
            return None
        return f"The final answer earned a reward of {reward:g} out of {self.max_reward:g}."

    def feedback(self) -> str | None:
        """The failed tool calls of the episode (the last few, with their messages), then
        :meth:`answer_feedback` on the final answer, or that none came within the turns."""
        failed = [r for r in self.tool_records if r.get("error")]
        parts = []
        if failed:
            lines = [f"- {r.get('name') or 'reply'}: {r['error']}: {_clip(r.get('message') or '', 300)}"
                     for r in failed[-_MAX_FEEDBACK_ERRORS:]]
            more = f" (the last {_MAX_FEEDBACK_ERRORS} of {len(failed)})" if len(failed) > _MAX_FEEDBACK_ERRORS else ""
            parts.append(f"Tool calls that failed{more}:\n" + "\n".join(lines))
        if self.final_answer is not None and self.task is not None:
            verdict = self.answer_feedback(self.task, self.final_answer, self.final_reward)
            if verdict:
                parts.append(verdict)
        elif self.metrics.get("episode/malformed_call"):
            parts.append("The episode ended at a malformed tool call, without a final answer.")
        elif self.done:
            parts.append(f"There was no final answer within {self.max_turns} turns.")
        return "\n\n".join(parts) or None

    def no_call_message(self) -> str:
        """What the model is told when a turn has neither a tool call nor a final answer."""
        example = self.parser.render([ToolCall(self._tools[0].name, {})]) if self._tools else ""
        return (
            "Your reply had no tool call and no final answer. "
            + (f"Call a tool, for example:\n{example}\nor give the final answer." if example else "Give the final answer.")
        )

    # -- Gymnasium API --------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        self.task = self._select_task(options)
        if self.task.id is None and seed is not None:
            self.task.id = f"seed-{seed}"  # a generated task is named by the seed that drew it
        self.turn = 0
        self.done = False
        self.metrics = Counter()
        self.tool_records, self.final_answer, self.final_reward = [], None, 0.0
        messages: list[Message] = []
        # A task that opens with its own system message keeps it instead of the environment's, as TRL
        # uses a conversational prompt as it is (a dataset's format instructions are the user's to give).
        own_system = isinstance(self.task.prompt, list) and bool(self.task.prompt) \
            and self.task.prompt[0].get("role") == "system"
        if self.system_prompt and not own_system:
            messages.append({"role": "system", "content": self.system_prompt})
        if isinstance(self.task.prompt, str):
            messages.append({"role": "user", "content": self.task.prompt})
        else:
            messages.extend(copy.deepcopy(self.task.prompt))
        self.messages = copy.deepcopy(messages)
        info = {"task_id": self.task.id, "answer": copy.deepcopy(self.task.answer), "tools": self.tool_schemas}
        if "row" in self.task.info:  # the dataset row's other columns: reward functions get them (as in TRL)
            info["row"] = copy.deepcopy(self.task.info["row"])
        return messages, info

    async def astep(self, action: str):
        if self.done or self.task is None:
            raise EnvError("step() called on a finished or never-reset episode: call reset() first.")
        if not isinstance(action, str):
            raise EnvError(f"The action must be the completion text (str), got {type(action).__name__}.")
        self.turn += 1
        self.messages.append({"role": "assistant", "content": action})
        parsed, final = await self._read_turn(action)
        records: list[dict[str, Any]] = []
        obs: list[Message] = []

        malformed = sum(e.kind is ToolErrorKind.MALFORMED for e in parsed.errors)
        penalty = self.malformed_penalty * malformed
        if self.malformed_ends_episode and malformed:
            records = [_error_record(err) for err in parsed.errors]
            return self._end_on_malformed(records, 0.0 - penalty)  # not -0.0 when there is no penalty
        results = iter(await asyncio.gather(*(run_tool_call(c, self._tool_map) for c in parsed.calls)))
        # The id pairing each result with its call, where the template needs one (Mistral's refuses a
        # result without it): the parser's, which the chat renderer gives the call in the same way (the
        # k-th readable call's index is k; calls the model wrote badly come after them).
        call_id = getattr(self.parser, "call_id", lambda text, index, written=None: written)
        num_calls = num_errors = 0
        # Results in the order the calls were written: templates without call ids pair them by position.
        for item in parsed.in_order():
            if isinstance(item, ToolCall):
                res: ToolResult = next(results)
                records.append({
                    "name": res.call.name,
                    "arguments": copy.deepcopy(res.call.arguments),
                    "error": res.error.value if res.error else None,
                    "message": None if res.ok else res.content,
                })
                message = {"role": "tool", "name": res.call.name, "content": res.content}
                cid = call_id(action, num_calls, res.call.id)  # the model's id, or the template's (Mistral)
                num_calls += 1
            else:  # a call the model attempted but wrote badly
                records.append(_error_record(item))
                message = {"role": "tool", "content": item.message}
                cid = call_id(action, len(parsed.calls) + num_errors)
                num_errors += 1
            if cid is not None:
                message["tool_call_id"] = cid
            obs.append(message)

        reward, terminated, termination = 0.0, False, None
        if not records:
            if final:
                reward, terminated, termination = await self._score_turn(action), True, "final_answer"
                self.final_answer, self.final_reward = action, reward
            else:
                records.append({"name": None, "arguments": None, "error": ToolErrorKind.NO_CALL.value,
                                "message": self.no_call_message()})
                obs.append({"role": "user", "content": self.no_call_message()})
        reward -= penalty  # a reply with calls is not a final answer: its reward was 0
        truncated = not terminated and self.turn >= self.max_turns
        if truncated:
            termination = "max_turns"
        self.done = terminated or truncated

        self._count(records, terminated, truncated)
        self.tool_records.extend(copy.deepcopy(records))
        # Truncated on a turn with calls, the results are still the step's observation (as in Gymnasium,
        # where a truncated step's observation is a real one); a final answer has none.
        self.messages.extend(copy.deepcopy(obs))
        info = {
            "turn": self.turn,
            "tool_calls": records,
            "termination": termination,
            "metrics": dict(self.metrics),
        }
        return obs, reward, terminated, truncated, info

    def _end_on_malformed(self, records: list[dict[str, Any]], reward: float):
        """The step's return when a malformed call ends the episode (``malformed_ends_episode``): ``reward`` (0, or
        less with ``malformed_penalty``)."""
        self.done = True
        self.metrics["episode/malformed_call"] = 1
        self._count(records, terminated=False, truncated=False)  # not a final answer
        self.tool_records.extend(copy.deepcopy(records))
        info = {"turn": self.turn, "tool_calls": records, "termination": "malformed_call",
                "metrics": dict(self.metrics)}
        return [], reward, True, False, info

    async def _read_turn(self, action: str) -> tuple[ParseResult, bool]:
        """The reply's calls and whether, having none, it is a final answer; off the event loop, timed."""
        schemas = {t.name: t.parameters for t in self._tools}

        def read() -> tuple[ParseResult, bool]:
            parsed = self.parser.parse(action, schemas)
            return parsed, not parsed.calls and not parsed.errors and self.is_final(parsed)

        if not self._tools:
            # Nothing to call (the template showed the model no tools): call markup is text of the
            # answer, as in TRL's and verifiers' single-turn tasks, never a malformed call kept from the score.
            parsed = ParseResult(content=action.strip())
            return parsed, self.is_final(parsed)
        if len(action) <= _INLINE_CHARS and type(self.parser) in PARSERS.values():
            # treerl's own parsers are linear (about 1 ms for this much text): a thread would
            # cost more than it saves.
            return read()
        try:
            return await run_in_thread(read, timeout=self.parse_timeout_s, name="treerl-parse")
        except TimeoutError:
            message = (f"Reading the tool calls of this reply took longer than {self.parse_timeout_s:g} s "
                       "(the environment's parse_timeout_s). Write shorter, simpler tool calls.")
            return ParseResult(content="", errors=[ToolCallError(ToolErrorKind.MALFORMED, message)]), False

    async def _score_turn(self, action: str) -> float:
        """:meth:`score` off the event loop, timed: 0.0 when it overruns ``score_timeout_s``."""
        assert self.task is not None
        try:
            return float(await run_in_thread(self.score, self.task, action, timeout=self.score_timeout_s,
                                             name="treerl-score"))
        except TimeoutError:
            self.metrics["score/timeout"] = 1
            return 0.0

    # -- validation ----------------------------------------------------------------------
    def validate(self, num_tasks: int = 8, seed: int = 0) -> ValidationReport:
        """Play :meth:`gold_actions` on ``num_tasks`` tasks and check each earns ``max_reward``."""
        failures = []
        for i in range(num_tasks):
            env = self.fork()
            _, info = env.reset(seed=seed + i)
            total, terminated, truncated = 0.0, False, False
            for action in env.gold_actions(env.task):
                if terminated or truncated:
                    break
                _, reward, terminated, truncated, info = env.step(action)
                total += reward
            if not terminated or not np.isclose(total, self.max_reward):
                failures.append(
                    f"task {info.get('task_id', i)!r}: gold actions earned {total} "
                    f"(terminated={terminated}, truncated={truncated}), expected {self.max_reward}"
                )
        return ValidationReport(num_tasks, num_tasks - len(failures), failures)

    # -- helpers ---------------------------------------------------------------------------
    def _select_task(self, options: Mapping[str, Any]) -> Task:
        if "task" in options:
            return _as_task(options["task"], None)
        if self.dataset is not None:
            index = options.get("task_index")
            if index is None:
                index = int(self.np_random.integers(len(self.dataset)))
            if not 0 <= index < len(self.dataset):
                raise EnvError(f"task_index={index} is out of range: the dataset has {len(self.dataset)} tasks.")
            return _as_task(self.dataset[index], index)
        if "task_index" in options:
            raise EnvError(f"{type(self).__name__} generates tasks; pass seed= instead of task_index.")
        return self.sample_task(self.np_random)

    def _count(self, records: list[dict[str, Any]], terminated: bool, truncated: bool) -> None:
        m = self.metrics
        m["turns"] = self.turn
        for r in records:
            m["tool_calls/total"] += 1
            m[f"tool_calls/{r['error'] or 'ok'}"] += 1
        if terminated:
            m["episode/final_answer"] = 1
        if truncated:
            m["episode/max_turns"] = 1


def _error_record(error: ToolCallError) -> dict[str, Any]:
    """The ``info["tool_calls"]`` record of a call that failed before it could run."""
    return {"name": error.tool_name, "arguments": None, "error": error.kind.value, "message": error.message}


_MAX_FEEDBACK_ERRORS = 3
"""Failed tool calls :meth:`ToolEnv.feedback` lists: the last few say what the attempt ended on."""


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_task(item: Task | Mapping[str, Any], index: int | None) -> Task:
    if isinstance(item, Task):
        task = copy.deepcopy(item)
    elif isinstance(item, Mapping):
        if "prompt" not in item:
            raise EnvError(f"A dataset row needs a 'prompt' field; got keys {sorted(item)}.")
        info = dict(item.get("info") or {})
        # The row's other columns reach reward functions as keyword arguments (TRL passes them so),
        # its `info` column too (verifiers keeps a row's metadata there).
        extra = {k: v for k, v in item.items() if k not in ("prompt", "answer", "id")}
        if extra:
            info["row"] = {**extra, **(info.get("row") or {})}
        task = Task(prompt=item["prompt"], answer=item.get("answer"), info=info, id=item.get("id"))
    else:
        raise EnvError(f"A task must be a Task or a mapping with 'prompt'; got {type(item).__name__}.")
    if task.id is None and index is not None:
        task.id = str(index)
    return task
