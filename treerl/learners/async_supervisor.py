"""What every AsyncGRPO generator pool does, whatever runs its generators: supervision.

A pool keeps ``num_generators`` generators playing the buffer's tickets. This base holds the
part that does not depend on how a generator runs (a local process, a Ray actor):

- the table of generators, each with its start time, readiness, last heartbeat and figures;
- the monitor thread: receive what generators sent (:meth:`GeneratorPool._poll`), hand out the
  buffer's new tickets, check heartbeats;
- in-flight accounting: a group arrives into the buffer once, tickets a generator started are
  reported to the buffer, and a replaced generator's tickets are lost (and re-issued by the
  buffer), never duplicated;
- replacement: a generator that died, sent no heartbeat for ``heartbeat_timeout`` seconds or
  was not ready within ``startup_timeout`` is reported, stopped and replaced by a new one that
  loads the latest weights; generators that keep dying before they deliver a group stop the
  run with :class:`GeneratorFailed` rather than restart forever;
- weight publishing: each version is published once (:meth:`GeneratorPool._publish`), announced
  to every generator, and to a newcomer when it starts; the time it takes is
  ``last_publish_s``.

A subclass says how a generator starts and stops, how tickets and weights reach it and how its
messages come back; it calls :meth:`GeneratorPool._arrived`, :meth:`GeneratorPool._started`,
:meth:`GeneratorPool._beat` and :meth:`GeneratorPool._replace` as they do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from treerl.learners.async_buffer import GroupBuffer, Ticket
from treerl.learners.async_generator import GeneratorSpec

__all__ = ["GeneratorPool", "GeneratorFailed", "Generator"]

logger = logging.getLogger(__name__)

# Generators that die this many times in a row before delivering a group stop the run (a broken
# environment or model would otherwise be restarted forever).
MAX_FAILED_STARTS = 3


class GeneratorFailed(RuntimeError):
    """Generators keep dying before they are ready: the run cannot make progress."""


@dataclass
class Generator:
    """One generator as the trainer sees it; ``handle`` is the subclass's (a process and pipe, an actor)."""

    id: int
    handle: Any
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    delivered: bool = False
    """It sent at least one group: a death before that counts towards giving up."""
    last_beat: float = field(default_factory=time.monotonic)
    pid: int | None = None
    stats: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while something is sent to it, so messages (and weight transfers) keep their order."""


class GeneratorPool:
    """``num_generators`` generators feeding a :class:`GroupBuffer` (see the module docstring).

    Args:
        spec: what each generator builds itself from.
        num_generators: generators to keep running.
        heartbeat_timeout: seconds without a heartbeat before a ready generator is replaced.
        startup_timeout: seconds a new generator may take to load before it is replaced.
        on_report: called with ``(kind, message)`` when a generator is replaced.
    """

    monitor_name = "treerl-async-monitor"

    def __init__(self, spec: GeneratorSpec, *, num_generators: int, heartbeat_timeout: float,
                 startup_timeout: float = 300.0, on_report: Callable[[str, str], None] | None = None):
        self.spec = spec
        self.buffer: GroupBuffer | None = None
        self.num_generators = num_generators
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.on_report = on_report or (lambda kind, message: None)
        self._gens: dict[int, Generator] = {}
        self._next_id = 0
        self._failed_starts = 0
        self._lock = threading.Lock()
        self._latest: tuple[int, Any] | None = None
        self._closed = threading.Event()
        self._error: BaseException | None = None
        self._monitor: threading.Thread | None = None
        self.restarts = 0
        self.heartbeat_timeouts = 0
        self.last_publish_s = 0.0

    # -- what a subclass provides --------------------------------------------------------------

    def _start(self, gen_id: int) -> Generator:
        """Start generator ``gen_id`` (it loads its model, then waits for weights and tickets)."""
        raise NotImplementedError

    def _stop(self, gen: Generator) -> None:
        """Stop ``gen`` at once (it died, hung or is being replaced); its messages are not read again."""
        raise NotImplementedError

    def _stop_all(self, gens: list[Generator]) -> None:
        """Stop every generator at the end of the run (a polite stop where there is one)."""
        for gen in gens:
            self._stop(gen)

    def _publish(self, weights: Mapping[str, Tensor], version: int) -> Any:
        """Make ``weights`` available once as ``version``; returns what :meth:`_send_weights` announces."""
        raise NotImplementedError

    def _send_weights(self, gen: Generator, version: int, published: Any) -> None:
        """Have ``gen`` load the published ``version`` between its batches."""
        raise NotImplementedError

    def _welcome(self, gen: Generator, version: int, published: Any) -> None:
        """A newcomer's first weights (the latest): by default as any announcement."""
        self._send_weights(gen, version, published)

    def _hand_out(self, gen: Generator, tickets: list[Ticket]) -> None:
        """Send ``tickets`` to ``gen`` (a failure means it is dying: its replacement loses them)."""
        raise NotImplementedError

    def _poll(self, timeout: float) -> None:
        """Read what generators sent, waiting at most ``timeout`` seconds when nothing has."""
        raise NotImplementedError

    def _forget(self, gen: Generator) -> None:
        """Drop whatever the subclass tracks for ``gen`` besides the buffer's tickets (calls in flight)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def launch(self) -> None:
        """Start the generators (they load their model while the trainer builds)."""
        for _ in range(self.num_generators):
            self._spawn()

    def attach(self, buffer: GroupBuffer) -> None:
        """Feed ``buffer`` from now on: its tickets go out, the groups come back into it."""
        self.buffer = buffer
        for gen_id in self.generator_ids:
            buffer.add_generator(gen_id)
        self._monitor = threading.Thread(target=self._watch, name=self.monitor_name, daemon=True)
        self._monitor.start()

    def close(self) -> None:
        """Stop the monitor and every generator."""
        self._closed.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5.0)
        with self._lock:
            gens = list(self._gens.values())
            self._gens.clear()
        self._stop_all(gens)

    def check(self) -> None:
        """Raise the monitor's error, if it hit one (call from the trainer's loop)."""
        if self._error is not None:
            raise self._error

    @property
    def generator_ids(self) -> list[int]:
        with self._lock:
            return list(self._gens)

    @property
    def pids(self) -> dict[int, int]:
        """Generator id -> process id, of the generators running now (once known)."""
        with self._lock:
            return {g.id: g.pid for g in self._gens.values() if g.pid is not None}

    def stats(self) -> dict[int, dict[str, float]]:
        """Generator id -> its last heartbeat's figures (alive and idle seconds, weight loads)."""
        with self._lock:
            return {g.id: dict(g.stats) for g in self._gens.values() if g.stats}

    def _get(self, gen_id: int) -> Generator | None:
        with self._lock:
            return self._gens.get(gen_id)

    # -- weights -----------------------------------------------------------------------------

    def set_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Publish ``weights`` as ``version`` once and announce them to every generator."""
        start = time.perf_counter()
        published = self._publish(weights, version)
        with self._lock:
            self._latest = (version, published)
            gens = list(self._gens.values())
        for gen in gens:
            self._send_weights(gen, version, published)
        self.last_publish_s = time.perf_counter() - start

    # -- generators --------------------------------------------------------------------------

    def _spawn(self) -> Generator:
        with self._lock:
            gen_id, self._next_id = self._next_id, self._next_id + 1
        gen = self._start(gen_id)
        with self._lock:
            self._gens[gen_id] = gen
            latest = self._latest
        if self.buffer is not None:
            self.buffer.add_generator(gen_id)
        if latest is not None:
            self._welcome(gen, *latest)
        return gen

    def _replace(self, gen: Generator, kind: str, message: str) -> None:
        """Report ``gen``, stop it, lose its tickets and start another (once, however many saw it go)."""
        with self._lock:
            if self._gens.pop(gen.id, None) is None:
                return
        self._forget(gen)
        self._stop(gen)
        lost = self.buffer.lose(gen.id)
        if not gen.delivered:
            self._failed_starts += 1
            if self._failed_starts >= MAX_FAILED_STARTS:
                raise GeneratorFailed(
                    f"generators died {self._failed_starts} times in a row before they delivered a group "
                    f"({message}); run the same environment and model with `treerl rollout` to see the error.")
        self.restarts += 1
        text = f"generator {gen.id} (pid {gen.pid}) {message}; {lost} groups in flight lost; replaced"
        logger.warning(text)
        self.on_report(kind, text)
        if not self._closed.is_set():
            self._spawn()

    # -- what generators send (called by the subclass) -----------------------------------------

    def _arrived(self, gen: Generator, task: int, oldest: int, newest: int, payload: str) -> None:
        gen.last_beat = time.monotonic()
        self.buffer.arrive(gen.id, task=task, oldest=oldest, newest=newest, payload=payload)
        gen.delivered, self._failed_starts = True, 0

    def _started(self, gen: Generator, task: int, version: int) -> None:
        gen.last_beat = time.monotonic()
        self.buffer.start(gen.id, task=task, version=version)

    def _beat(self, gen: Generator, stats: dict[str, float] | None = None, pid: int | None = None,
              ready: bool = False) -> None:
        gen.last_beat = time.monotonic()
        if stats is not None:
            gen.stats = stats
        if pid is not None:
            gen.pid = pid
        gen.ready = gen.ready or ready

    # -- the monitor thread ------------------------------------------------------------------

    def _watch(self) -> None:
        try:
            while not self._closed.is_set():
                self._poll(0.05)
                for gen_id, tickets in self.buffer.issue().items():
                    gen = self._get(gen_id)
                    if gen is not None:
                        self._hand_out(gen, tickets)
                self._check_heartbeats()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread by check()
            self._error = exc

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        with self._lock:
            gens = list(self._gens.values())
        for gen in gens:
            if gen.ready and now - gen.last_beat > self.heartbeat_timeout:
                self.heartbeat_timeouts += 1
                self._replace(gen, "heartbeat_timeout",
                              f"sent no heartbeat for {now - gen.last_beat:.1f} s (timeout {self.heartbeat_timeout} s)")
            elif not gen.ready and now - gen.started > self.startup_timeout:
                self._replace(gen, "generator_startup_timeout", f"was not ready after {self.startup_timeout} s")
