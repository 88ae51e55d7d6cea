"""An AsyncGRPO generator: a policy and the rollout engine playing the tickets a trainer hands out.

A generator holds its own copy of the model in a
:class:`~treerl.agents.transformers_policy.TransformersPolicy` and plays each ticket (one task,
``group_size`` generations) with the :class:`~treerl.rollout.engine.RolloutEngine`, many at
once. It starts a ticket only when its weights are recent enough for it (``version >=
ticket.target - max_staleness``, see :mod:`treerl.learners.async_buffer`); until then the
ticket waits, and so does the generator. New weights are loaded between the policy's
batches: an episode in flight continues with them, and each sampled span records the
version that produced it.

:class:`GeneratorCore` is the part every transport shares. :func:`generator_main` runs it in
a process of its own (``multiprocessing`` with the ``spawn`` start method), talking to the
trainer over one duplex pipe:

============ ===================================== =====================================
direction    message                               meaning
============ ===================================== =====================================
trainer ->   ``("weights", version, path)``        load the safetensors file at ``path``
trainer ->   ``("weights_broadcast", version,      receive ``version`` over the weight
             layout, bucket_bytes)``               group now, load it between batches
trainer ->   ``("tickets", [(task, target), ...])`` play these
trainer ->   ``("stop",)``                         finish and exit
-> trainer   ``("ready", pid)``                    model loaded, waiting for weights
-> trainer   ``("started", task, version)``        a ticket passed the version gate
-> trainer   ``("heartbeat", stats)``              alive; idle and busy seconds so far
-> trainer   ``("group", task, oldest, newest,     a finished group (its JSON line) and
             json)``                               the oldest/newest version of its spans
============ ===================================== =====================================

A message is written whole or, if the process is killed mid-write, read as end-of-file by
the trainer: a group is never torn. When the trainer goes away (its end of the pipe
closes) the generator exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from treerl.envs.registry import factory_env_id
from treerl.learners.async_buffer import Ticket
from treerl.learners.config import LearnerConfig
from treerl.rollout.trajectory import Group
from treerl.user_modules import import_user_modules, imported_user_modules

__all__ = ["GeneratorSpec", "GeneratorCore", "generator_main", "span_versions"]

logger = logging.getLogger(__name__)


@dataclass
class GeneratorSpec:
    """What a generator needs to build itself (picklable: it travels to the generator's process)."""

    cfg: LearnerConfig
    """The run's config: environment, model, sampling, limits, seed, group size."""
    max_staleness: int
    heartbeat_s: float = 1.0
    """Seconds between heartbeats."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Overrides of the config's sampling parameters (e.g. ``top_logprobs`` for score centering)."""
    model: Any = None
    """A model object to copy (the caller's); None loads ``cfg.model``."""
    tokenizer: Any = None
    env_factory: Callable[[], Any] | None = None
    """A picklable factory; None makes ``cfg.env`` with ``cfg.env_kwargs``."""
    policy: str = "transformers"
    """``transformers`` (CPU or GPU) or ``vllm`` (a vLLM engine on ``cfg.model``; the vllm extra)."""
    sandbox_runs: int | None = None
    """Sandboxed runs (``run_python``) this generator lets go at once; None: the sandbox's default
    (every CPU), which with several generators on one machine would run too many at once."""
    imports: tuple[str, ...] = field(default_factory=imported_user_modules)
    """The user's modules (``--import``) the trainer imported: a generator process imports them before
    it builds its environment, which they may register (a spawned process starts without them)."""


def span_versions(group: Group) -> tuple[int, int]:
    """The oldest and newest policy version of the group's sampled spans.

    >>> g = Group(task_key="t", env_id="e")
    >>> root = g.add_segment("prompt", [1])
    >>> _ = g.add_segment("sampled", [2], parent=root, logprobs=[-0.1], policy_version=3)
    >>> _ = g.add_segment("sampled", [4], parent=root, logprobs=[-0.1], policy_version=5)
    >>> span_versions(g)
    (3, 5)
    """
    versions = [s.policy_version for s in group.segments if s.kind == "sampled" and s.policy_version is not None]
    if not versions:  # nothing sampled (every episode ended at reset): as fresh as the weights of its start
        return group.info.get("started_version", 0), group.info.get("started_version", 0)
    return min(versions), max(versions)


class GeneratorCore:
    """A policy, an engine and the version gate; plays tickets on the running event loop."""

    def __init__(self, spec: GeneratorSpec, generator_id: int):
        import torch

        from treerl.agents.transformers_policy import TransformersPolicy
        from treerl.learners.precision import set_tf32

        cfg = spec.cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        set_tf32(cfg.tf32, cfg.device)  # a process of its own: its sampler's matmuls as the trainer's
        if cfg.full_determinism:  # its sampler's kernels too (transformers' function seeds as well)
            from transformers.trainer_utils import enable_full_determinism

            enable_full_determinism(cfg.seed)
        if spec.sandbox_runs is not None:
            from treerl.envs.sandbox import set_max_concurrent_runs

            set_max_concurrent_runs(spec.sandbox_runs)
        self.spec, self.id = spec, generator_id
        # No weights from the trainer yet: version -1 opens no gate.
        if spec.policy == "vllm":
            self.policy, tokenizer = _vllm_policy(spec)
        else:
            model, tokenizer = spec.model, spec.tokenizer
            if model is None:
                model, tokenizer = cfg.load_model(cfg.device)
            # One batch for every episode in flight: a generator runs several steps' episodes at once.
            self.policy = TransformersPolicy(model, tokenizer, device=cfg.device, version=-1,
                                             max_batch_size=cfg.max_concurrency, fp32_head=cfg.cast_lm_head_to_fp32)
        self.tokenizer = tokenizer
        self.engine = cfg.engine(self.policy, tokenizer, seed=cfg.seed, branch_at_turn=cfg.branch_at_turn,
                                 branch_factor=cfg.branch_factor, **spec.sampling)
        self.env_factory = cfg.train_env_factory(spec.env_factory)
        self.env_id = (factory_env_id(spec.env_factory) if spec.env_factory is not None else None) or cfg.env
        self.version = -1
        self._changed: asyncio.Condition | None = None
        self._load_lock: asyncio.Lock | None = None
        self._active = 0
        self.started = time.monotonic()
        self._idle_since: float | None = self.started
        self.idle_s = 0.0
        self.load_s = 0.0
        self.num_loads = 0
        self._starts: list[tuple[int, int]] = []

    # -- weights -----------------------------------------------------------------------------

    async def load_weights(self, version: int, weights: Mapping[str, Any] | str | os.PathLike) -> bool:
        """Load ``weights`` (a state dict or a safetensors path) as ``version`` between batches.

        Returns False when they are not newer than what is loaded (a late message), or when the
        file is already gone (a newer version replaced it; its message follows).
        """
        from treerl.agents.transformers_policy import load_state_dict

        self._ensure_loop_state()
        async with self._load_lock:
            if version <= self.version:
                return False
            start = time.perf_counter()
            loop = asyncio.get_running_loop()
            try:
                state = weights if isinstance(weights, Mapping) else await loop.run_in_executor(
                    None, load_state_dict, weights)
            except FileNotFoundError:
                return False
            # set_weights waits for the batch being decoded, so it lands between batches.
            await loop.run_in_executor(None, self.policy.set_weights, state, version)
            self.load_s += time.perf_counter() - start
            self.num_loads += 1
            async with self._changed:
                self.version = version
                self._changed.notify_all()
            return True

    def _ensure_loop_state(self) -> None:
        if self._changed is None:
            self._changed, self._load_lock = asyncio.Condition(), asyncio.Lock()

    # -- tickets -----------------------------------------------------------------------------

    async def play(self, ticket: Ticket, on_start: Callable[[int], None] | None = None) -> tuple[int, int, str]:
        """Wait until the weights are recent enough for ``ticket``, play it; ``(oldest, newest, json)``.

        ``on_start(version)`` is called as it starts (the trainer counts on groups that are due);
        the start is also kept for :meth:`drain_starts`.
        """
        self._ensure_loop_state()
        async with self._changed:
            # The trainer's weights first (version 0 at the start): the model loaded here carries no
            # version, and with max_staleness >= 1 an early ticket's bound alone would let -1 through.
            await self._changed.wait_for(lambda: self.version >= max(0, ticket.target - self.spec.max_staleness))
            started_version = self.version
        self._starts.append((ticket.task, started_version))
        if on_start is not None:
            on_start(started_version)
        self._busy(+1)
        try:
            groups, _ = await self.engine.run(self.env_factory, self.env_id, [ticket.task],
                                              self.spec.cfg.group_size)
        finally:
            self._busy(-1)
        group = groups[0]
        group.info["started_version"] = started_version
        group.info["generator"] = self.id
        oldest, newest = span_versions(group)
        return oldest, newest, group.to_json()

    def drain_starts(self) -> list[tuple[int, int]]:
        """``(task, version)`` of the tickets started since the last call."""
        starts, self._starts = self._starts, []
        return starts

    def _busy(self, delta: int) -> None:
        now = time.monotonic()
        if self._active == 0 and delta > 0 and self._idle_since is not None:
            self.idle_s += now - self._idle_since
            self._idle_since = None
        self._active += delta
        if self._active == 0:
            self._idle_since = now

    def stats(self) -> dict[str, float]:
        """Seconds alive and idle (no ticket being played) so far, and weight loads."""
        now = time.monotonic()
        idle = self.idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
        return {"alive_s": now - self.started, "idle_s": idle, "load_s": self.load_s, "loads": self.num_loads,
                "version": self.version}

    def close(self) -> None:
        self.policy.close()


def _vllm_policy(spec: GeneratorSpec) -> tuple[Any, Any]:
    """A :class:`~treerl.agents.vllm_policy.VLLMPolicy` on ``cfg.model`` and its tokenizer (no weights yet: -1)."""
    from transformers import AutoTokenizer

    from treerl.agents.vllm_policy import VLLMPolicy
    from treerl.models import default_model_path

    cfg = spec.cfg
    path = str(cfg.model or default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    head = max(cfg.top_k or 0, spec.sampling.get("top_logprobs", 0), 1)  # vLLM's max_logprobs covers both
    return VLLMPolicy(path, version=-1, max_candidates=head, max_batch_size=cfg.max_concurrency), tokenizer


# -- the process --------------------------------------------------------------------------------


def generator_main(spec: GeneratorSpec, generator_id: int, conn: Any, weight_group: Any = None) -> None:
    """A generator process: build the core, then serve the trainer's messages until it stops or goes away.

    ``weight_group`` (a :class:`~treerl.learners.weight_broadcast.GroupAddress`) is where weights
    come by broadcast; None when they come as files.
    """
    # Ctrl-C reaches the whole process group; the trainer owns the run and stops its generators
    # (and a generator dying of it would be restarted, with a traceback each).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING)
    import_user_modules(spec.imports)  # what they register is the trainer's only: this process was spawned
    group = None
    if weight_group is not None:
        from treerl.learners.weight_broadcast import WeightGroup

        # First thing, before the model loads: the trainer waits for the pair to form.
        group = WeightGroup(weight_group, rank=1, device=spec.cfg.device)
    core = GeneratorCore(spec, generator_id)
    try:
        asyncio.run(_serve(core, conn, group))
    finally:
        core.close()


async def _serve(core: GeneratorCore, conn: Any, group: Any = None) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        # Blocking reads in a thread, handed to the event loop; end-of-file means the trainer is gone.
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("stop",)
            if message[0] == "weights_broadcast":
                # Received at once, here (the trainer's broadcast waits for it); loaded between batches.
                _, version, layout, bucket_bytes = message
                try:
                    message = ("weights", version, group.receive(layout, version, bucket_bytes))
                except Exception:  # a broken pair cannot be repaired here: exit, the trainer replaces us
                    logger.exception("generator: weight broadcast failed")
                    os._exit(1)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "stop":
                # If the loop does not wind down (an environment that hangs), leave anyway; a daemon
                # timer, so that a loop that does wind down exits at once.
                timer = threading.Timer(10.0, os._exit, args=(0,))
                timer.daemon = True
                timer.start()
                return

    def send(*message: Any) -> None:
        try:
            conn.send(message)
        except (BrokenPipeError, OSError):
            inbox.put_nowait(("stop",))

    threading.Thread(target=read, name="treerl-generator-inbox", daemon=True).start()
    send("ready", os.getpid())

    async def heartbeat() -> None:
        while True:
            send("heartbeat", core.stats())
            await asyncio.sleep(core.spec.heartbeat_s)

    async def run_ticket(ticket: Ticket) -> None:
        oldest, newest, payload = await core.play(ticket, on_start=lambda v: send("started", ticket.task, v))
        send("group", ticket.task, oldest, newest, payload)

    tasks: set[asyncio.Task] = set()

    def spawn(coro) -> None:
        task = loop.create_task(coro)
        tasks.add(task)
        task.add_done_callback(_reraise_in_loop(tasks))

    beat = loop.create_task(heartbeat())
    while True:
        message = await inbox.get()
        kind = message[0]
        if kind == "stop":
            break
        if kind == "weights":
            spawn(core.load_weights(message[1], message[2]))
        elif kind == "tickets":
            for task, target in message[1]:
                spawn(run_ticket(Ticket(task=task, target=target)))
        else:
            raise ValueError(f"generator: unknown message {kind!r} from the trainer")
    beat.cancel()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, beat, return_exceptions=True)


def _reraise_in_loop(tasks: set) -> Callable[[asyncio.Task], None]:
    """A done-callback that forgets the task and makes its exception kill the process loudly."""

    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Our own bug in a generator: crash so the trainer sees it, restarts us and reports.
            logger.error("generator task failed", exc_info=task.exception())
            os._exit(1)

    return done
