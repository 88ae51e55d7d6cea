"""AsyncGRPO generators as Ray actors (the ``treerl[ray]`` extra): the same tickets, buffer and weights on a cluster.

:class:`RayPool` is :class:`~treerl.learners.async_pool.ProcessPool`'s counterpart on Ray.
Each generator is an asynchronous Ray actor holding a
:class:`~treerl.learners.async_generator.GeneratorCore`; a ticket is one ``play`` call (many
run at once on the actor's event loop), and its result (the group's JSON line and the
oldest/newest versions of its spans) comes back through Ray's object store. Weights are put
in the object store once per version (``ray.put``) and every actor loads that one object
between its batches. Ray restarts nothing by itself here: the trainer's monitor thread sees
an actor die (its calls raise ``RayActorError``), loses its tickets and starts a new actor
that loads the latest weights; an actor whose heartbeat call does not return within
``heartbeat_timeout`` is reported, killed (``ray.kill``) and replaced the same way. The
tickets an actor started come back with its heartbeats (so the trainer learns of due groups
up to a heartbeat late).

The trainer joins a running cluster with ``--ray-address auto`` (``ray start --head`` on the
head node, ``ray start --address HEAD:6379`` on every other machine); without an address it
starts a local Ray instance. Ray places each actor where it has ``generator_threads`` CPUs
(and one GPU when ``--device cuda``), so adding machines to the cluster adds generators.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from treerl.errors import ConfigError
from treerl.learners.async_buffer import GroupBuffer, Ticket
from treerl.learners.async_generator import GeneratorCore, GeneratorSpec

__all__ = ["RayPool", "GeneratorActor", "import_ray"]

logger = logging.getLogger(__name__)


def import_ray():
    """Ray, or a :class:`~treerl.errors.ConfigError` that says which extra to install."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--backend ray needs Ray: pip install 'treerl[ray]' (or pip install ray).") from None
    return ray


class GeneratorActor:
    """The body of a generator actor (wrapped with ``ray.remote`` when a pool starts)."""

    def __init__(self, spec: GeneratorSpec, generator_id: int):
        self.core = GeneratorCore(spec, generator_id)

    async def load_weights(self, version: int, weights: Mapping[str, Tensor]) -> bool:
        return await self.core.load_weights(version, weights)

    async def play(self, task: int, target: int) -> tuple[int, int, str]:
        return await self.core.play(Ticket(task=task, target=target))

    async def heartbeat(self) -> dict[str, Any]:
        """Alive: the figures, the process id, and the tickets started since the last heartbeat."""
        return {**self.core.stats(), "pid": os.getpid(), "starts": self.core.drain_starts()}


@dataclass
class _Actor:
    id: int
    handle: Any
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    pid: int | None = None
    beat: Any = None
    """The heartbeat call in flight, and when it was sent."""
    beat_sent: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)


class RayPool:
    """``num_generators`` generator actors feeding a :class:`GroupBuffer` (see the module docstring)."""

    def __init__(self, spec: GeneratorSpec, *, num_generators: int, heartbeat_timeout: float,
                 address: str | None = None, startup_timeout: float = 300.0,
                 on_report: Callable[[str, str], None] | None = None):
        self.ray = import_ray()
        self.spec = spec
        self.num_generators = num_generators
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.on_report = on_report or (lambda kind, message: None)
        self.buffer: GroupBuffer | None = None
        self._started_ray = False
        if not self.ray.is_initialized():
            kwargs = {"address": address} if address else {"num_cpus": os.cpu_count(), "include_dashboard": False}
            self.ray.init(logging_level=logging.WARNING, **kwargs)
            self._started_ray = True
        cfg = spec.cfg
        self._actor_class = self.ray.remote(GeneratorActor).options(
            num_cpus=cfg.num_threads or 1, num_gpus=1 if cfg.device.startswith("cuda") else 0,
            max_concurrency=1000)
        self._actors: dict[int, _Actor] = {}
        self._inflight: dict[Any, tuple[int, Ticket]] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._latest: tuple[int, Any] | None = None
        self._closed = threading.Event()
        self._error: BaseException | None = None
        self._monitor: threading.Thread | None = None
        self.restarts = 0
        self.heartbeat_timeouts = 0
        self.last_publish_s = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    def launch(self) -> None:
        for _ in range(self.num_generators):
            self._spawn()

    def attach(self, buffer: GroupBuffer) -> None:
        self.buffer = buffer
        for gen_id in list(self._actors):
            buffer.add_generator(gen_id)
        self._monitor = threading.Thread(target=self._watch, name="treerl-ray-monitor", daemon=True)
        self._monitor.start()

    def close(self) -> None:
        self._closed.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5.0)
        with self._lock:
            actors = list(self._actors.values())
            self._actors.clear()
        for actor in actors:
            self.ray.kill(actor.handle)
        if self._started_ray:
            self.ray.shutdown()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    @property
    def pids(self) -> dict[int, int]:
        with self._lock:
            return {a.id: a.pid for a in self._actors.values() if a.pid is not None}

    def stats(self) -> dict[int, dict[str, float]]:
        with self._lock:
            return {a.id: dict(a.stats) for a in self._actors.values() if a.stats}

    def kill(self, gen_id: int) -> None:
        """Kill actor ``gen_id`` (as a crash would); the monitor replaces it."""
        with self._lock:
            actor = self._actors.get(gen_id)
        if actor is not None:
            self.ray.kill(actor.handle, no_restart=True)

    # -- weights -----------------------------------------------------------------------------

    def set_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Put ``weights`` in the object store once and have every actor load them as ``version``."""
        start = time.perf_counter()
        ref = self.ray.put({k: v.detach().contiguous().cpu() for k, v in weights.items()})
        with self._lock:
            self._latest = (version, ref)
            actors = list(self._actors.values())
        for actor in actors:
            actor.handle.load_weights.remote(version, ref)
        self.last_publish_s = time.perf_counter() - start

    # -- actors ------------------------------------------------------------------------------

    def _spawn(self) -> None:
        with self._lock:
            gen_id, self._next_id = self._next_id, self._next_id + 1
            actor = _Actor(gen_id, self._actor_class.remote(self.spec, gen_id))
            self._actors[gen_id] = actor
            latest = self._latest
        if self.buffer is not None:
            self.buffer.add_generator(gen_id)
        if latest is not None:
            actor.handle.load_weights.remote(*latest)

    def _replace(self, actor: _Actor, kind: str, message: str) -> None:
        with self._lock:
            if self._actors.pop(actor.id, None) is None:
                return
            self._inflight = {ref: v for ref, v in self._inflight.items() if v[0] != actor.id}
        self.ray.kill(actor.handle, no_restart=True)
        lost = self.buffer.lose(actor.id)
        self.restarts += 1
        text = f"generator {actor.id} (pid {actor.pid}) {message}; {lost} groups in flight lost; replaced"
        logger.warning(text)
        self.on_report(kind, text)
        if not self._closed.is_set():
            self._spawn()

    # -- the monitor thread ------------------------------------------------------------------

    def _watch(self) -> None:
        try:
            while not self._closed.is_set():
                for gen_id, tickets in self.buffer.issue().items():
                    with self._lock:
                        actor = self._actors.get(gen_id)
                    for ticket in tickets if actor is not None else ():
                        self._inflight[actor.handle.play.remote(ticket.task, ticket.target)] = (gen_id, ticket)
                self._heartbeats()
                if not self._inflight:
                    time.sleep(0.05)
                    continue
                done, _ = self.ray.wait(list(self._inflight), num_returns=len(self._inflight), timeout=0.05)
                for ref in done:
                    self._collect(ref)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread by check()
            self._error = exc

    def _collect(self, ref: Any) -> None:
        entry = self._inflight.pop(ref, None)
        if entry is None:
            return
        gen_id, ticket = entry
        try:
            oldest, newest, payload = self.ray.get(ref)
        except self.ray.exceptions.RayActorError:
            with self._lock:
                actor = self._actors.get(gen_id)
            if actor is not None:
                self._replace(actor, "generator_died", "died")
            return
        self.buffer.arrive(gen_id, task=ticket.task, oldest=oldest, newest=newest, payload=payload)

    def _heartbeats(self) -> None:
        now = time.monotonic()
        with self._lock:
            actors = list(self._actors.values())
        for actor in actors:
            if actor.beat is not None:
                done, _ = self.ray.wait([actor.beat], timeout=0)
                if done:
                    try:
                        actor.stats = self.ray.get(actor.beat)
                    except self.ray.exceptions.RayActorError:
                        self._replace(actor, "generator_died", "died")
                        continue
                    actor.pid, actor.ready, actor.beat = int(actor.stats.pop("pid")), True, None
                    for task, version in actor.stats.pop("starts"):
                        self.buffer.start(actor.id, task, version)
                elif actor.ready and now - actor.beat_sent > self.heartbeat_timeout:
                    self.heartbeat_timeouts += 1
                    self._replace(actor, "heartbeat_timeout", f"answered no heartbeat for {now - actor.beat_sent:.1f} "
                                                              f"s (timeout {self.heartbeat_timeout} s)")
                    continue
                elif not actor.ready and now - actor.started > self.startup_timeout:
                    self._replace(actor, "generator_startup_timeout", f"was not ready after {self.startup_timeout} s")
                    continue
            if actor.beat is None and now - actor.beat_sent >= self.spec.heartbeat_s:
                actor.beat, actor.beat_sent = actor.handle.heartbeat.remote(), now
