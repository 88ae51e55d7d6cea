"""AsyncGRPO generators as Ray actors (the ``treerl[ray]`` extra): the same tickets, buffer and weights on a cluster.

:class:`RayPool` is the :class:`~treerl.learners.async_supervisor.GeneratorPool` whose
generators are Ray actors (:class:`~treerl.learners.async_pool.ProcessPool`'s counterpart).
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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from treerl.errors import ConfigError
from treerl.learners.async_buffer import Ticket
from treerl.learners.async_generator import GeneratorCore, GeneratorSpec
from treerl.learners.async_supervisor import Generator, GeneratorPool
from treerl.user_modules import import_user_modules

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
        import_user_modules(spec.imports)  # an actor's process (or machine) has not imported them
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
    """An actor's handle and the heartbeat call in flight (heartbeats are pulled: one call at a time)."""

    handle: Any
    beat: Any = None
    beat_sent: float = 0.0


class RayPool(GeneratorPool):
    """``num_generators`` generator actors feeding a buffer (see the module docstring).

    Args:
        address: the Ray cluster to join; None starts a local Ray instance unless one is running.
        The others are :class:`~treerl.learners.async_supervisor.GeneratorPool`'s.
    """

    monitor_name = "treerl-ray-monitor"

    def __init__(self, spec: GeneratorSpec, *, num_generators: int, heartbeat_timeout: float,
                 address: str | None = None, startup_timeout: float = 300.0,
                 on_report: Callable[[str, str], None] | None = None):
        super().__init__(spec, num_generators=num_generators, heartbeat_timeout=heartbeat_timeout,
                         startup_timeout=startup_timeout, on_report=on_report)
        self.ray = import_ray()
        self._started_ray = False
        if not self.ray.is_initialized():
            kwargs = {"address": address} if address else {"num_cpus": os.cpu_count(), "include_dashboard": False}
            self.ray.init(logging_level=logging.WARNING, **kwargs)
            self._started_ray = True
        cfg = spec.cfg
        self._actor_class = self.ray.remote(GeneratorActor).options(
            num_cpus=cfg.num_threads or 1, num_gpus=1 if cfg.device.startswith("cuda") else 0,
            max_concurrency=1000)
        self._inflight: dict[Any, tuple[int, Ticket]] = {}
        """``play`` calls in flight: their result, the generator and the ticket."""

    # -- actors ------------------------------------------------------------------------------

    def _start(self, gen_id: int) -> Generator:
        return Generator(gen_id, _Actor(self._actor_class.remote(self.spec, gen_id)))

    def _stop(self, gen: Generator) -> None:
        self.ray.kill(gen.handle.handle, no_restart=True)

    def _stop_all(self, gens: list[Generator]) -> None:
        super()._stop_all(gens)
        if self._started_ray:
            self.ray.shutdown()

    def _forget(self, gen: Generator) -> None:
        with self._lock:
            self._inflight = {ref: v for ref, v in self._inflight.items() if v[0] != gen.id}

    def kill(self, gen_id: int) -> None:
        """Kill actor ``gen_id`` (as a crash would); the monitor replaces it."""
        gen = self._get(gen_id)
        if gen is not None:
            self._stop(gen)

    def _hand_out(self, gen: Generator, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            ref = gen.handle.handle.play.remote(ticket.task, ticket.target)
            with self._lock:
                self._inflight[ref] = (gen.id, ticket)

    # -- weights -----------------------------------------------------------------------------

    def _publish(self, weights: Mapping[str, Tensor], version: int) -> Any:
        """The weights in the object store, once; every actor loads that one object."""
        return self.ray.put({k: v.detach().contiguous().cpu() for k, v in weights.items()})

    def _send_weights(self, gen: Generator, version: int, published: Any) -> None:
        gen.handle.handle.load_weights.remote(version, published)

    # -- results and heartbeats --------------------------------------------------------------

    def _poll(self, timeout: float) -> None:
        self._heartbeats()
        with self._lock:
            refs = list(self._inflight)
        if not refs:
            time.sleep(timeout)
            return
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for ref in done:
            self._collect(ref)

    def _collect(self, ref: Any) -> None:
        with self._lock:
            entry = self._inflight.pop(ref, None)
        gen = self._get(entry[0]) if entry is not None else None
        if gen is None:
            return  # its generator was replaced: the ticket is lost already
        try:
            oldest, newest, payload = self.ray.get(ref)
        except self.ray.exceptions.RayActorError:
            self._replace(gen, "generator_died", "died")
            return
        self._arrived(gen, entry[1].task, oldest, newest, payload)

    def _heartbeats(self) -> None:
        """Collect the heartbeat answers that came, and ask again every ``heartbeat_s``."""
        now = time.monotonic()
        with self._lock:
            gens = list(self._gens.values())
        for gen in gens:
            actor: _Actor = gen.handle
            if actor.beat is not None:
                done, _ = self.ray.wait([actor.beat], timeout=0)
                if not done:
                    continue  # unanswered: the base's heartbeat check times it out
                try:
                    stats = self.ray.get(actor.beat)
                except self.ray.exceptions.RayActorError:
                    self._replace(gen, "generator_died", "died")
                    continue
                actor.beat = None
                pid, starts = int(stats.pop("pid")), stats.pop("starts")
                self._beat(gen, stats=stats, pid=pid, ready=True)
                for task, version in starts:
                    self._started(gen, task, version)
            if now - actor.beat_sent >= self.spec.heartbeat_s:
                actor.beat, actor.beat_sent = actor.handle.heartbeat.remote(), now
