"""Generator processes on one machine: started, fed, watched and replaced by the trainer.

:class:`ProcessPool` starts ``num_generators`` processes (``multiprocessing`` with the
``spawn`` start method, each running :func:`~treerl.learners.async_generator.generator_main`
with one duplex pipe to the trainer) and a monitor thread in the trainer that

- reads every message as it comes: finished groups go into the
  :class:`~treerl.learners.async_buffer.GroupBuffer`, heartbeats update the generator's clock;
- hands out the buffer's new tickets, to the generators with the fewest;
- replaces a generator whose pipe reached end-of-file (the process died, e.g. SIGKILL): its
  tickets are lost and re-issued, a new process takes its place and loads the latest weights;
- replaces a generator that sent no heartbeat for ``heartbeat_timeout`` seconds (hung,
  stopped): it is reported, killed with SIGKILL and replaced the same way.

Weights are published as a safetensors file in a directory on shared memory (``/dev/shm``
where it exists, else a temporary directory): written once per version, renamed into place,
and announced to every generator, which loads it between its batches. No generator ever gets
a copy per episode; a generator that starts later loads the latest file.

Generators that keep dying before they deliver a group (a broken environment or model) stop
the run with the exit code rather than restart forever.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from torch import Tensor

from treerl.learners.async_buffer import GroupBuffer, Ticket
from treerl.learners.async_generator import GeneratorSpec, generator_main

__all__ = ["ProcessPool", "GeneratorFailed", "weights_dir"]

logger = logging.getLogger(__name__)

# Generators that die this many times in a row before delivering a group stop the run (a broken
# environment or model would otherwise be restarted forever).
_MAX_FAILED_STARTS = 3


class GeneratorFailed(RuntimeError):
    """Generators keep dying before they are ready: the run cannot make progress."""


def weights_dir() -> Path:
    """A fresh directory for weight files, on shared memory when the machine has it."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="treerl-weights-", dir=base))


@dataclass
class _Generator:
    id: int
    process: Any
    conn: Any
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    delivered: bool = False
    """It sent at least one group: a death before that counts towards giving up."""
    last_beat: float = field(default_factory=time.monotonic)
    stats: dict[str, float] = field(default_factory=dict)
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class ProcessPool:
    """``num_generators`` generator processes feeding ``buffer`` (see the module docstring).

    Args:
        spec: what each generator builds itself from.
        buffer: where finished groups go and tickets come from.
        num_generators: processes to keep running.
        heartbeat_timeout: seconds without a heartbeat before a ready generator is replaced.
        startup_timeout: seconds a new generator may take to load before it is replaced.
        on_report: called with ``(kind, message)`` when a generator is replaced.
    """

    def __init__(self, spec: GeneratorSpec, *, num_generators: int, heartbeat_timeout: float,
                 startup_timeout: float = 300.0, on_report: Callable[[str, str], None] | None = None):
        self.spec = spec
        self.buffer: GroupBuffer | None = None
        self.num_generators = num_generators
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.on_report = on_report or (lambda kind, message: None)
        self._ctx = multiprocessing.get_context("spawn")
        self._gens: dict[int, _Generator] = {}
        self._next_id = 0
        self._failed_starts = 0
        self._lock = threading.Lock()
        self._weights_dir = weights_dir()
        self._latest: tuple[int, str] | None = None
        self._closed = threading.Event()
        self._error: BaseException | None = None
        self._monitor: threading.Thread | None = None
        self.restarts = 0
        self.heartbeat_timeouts = 0
        self.last_publish_s = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    def launch(self) -> None:
        """Start the generator processes (they load their model, then wait for weights and tickets)."""
        for _ in range(self.num_generators):
            self._spawn()

    def attach(self, buffer: GroupBuffer) -> None:
        """Feed ``buffer`` from now on: its tickets go out, the groups come back into it."""
        self.buffer = buffer
        for gen_id in self.pids:
            buffer.add_generator(gen_id)
        self._monitor = threading.Thread(target=self._watch, name="treerl-async-monitor", daemon=True)
        self._monitor.start()

    def close(self) -> None:
        """Stop every generator (a polite stop, then SIGKILL) and remove the weight files."""
        self._closed.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5.0)
        with self._lock:
            gens = list(self._gens.values())
            self._gens.clear()
        for gen in gens:
            self._send(gen, ("stop",))
        deadline = time.monotonic() + 5.0
        for gen in gens:
            gen.process.join(timeout=max(deadline - time.monotonic(), 0.1))
            if gen.process.is_alive():
                gen.process.kill()
                gen.process.join(timeout=5.0)
            gen.conn.close()
        shutil.rmtree(self._weights_dir, ignore_errors=True)

    def check(self) -> None:
        """Raise the monitor's error, if it hit one (call from the trainer's loop)."""
        if self._error is not None:
            raise self._error

    @property
    def pids(self) -> dict[int, int]:
        """Generator id -> process id, of the generators running now."""
        with self._lock:
            return {g.id: g.process.pid for g in self._gens.values()}

    def stats(self) -> dict[int, dict[str, float]]:
        """Generator id -> its last heartbeat's figures (alive and idle seconds, weight loads)."""
        with self._lock:
            return {g.id: dict(g.stats) for g in self._gens.values() if g.stats}

    # -- weights -----------------------------------------------------------------------------

    def set_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Publish ``weights`` as ``version``: one file, announced to every generator."""
        from safetensors.torch import save_file

        start = time.perf_counter()
        path = self._weights_dir / f"v{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp))
        os.replace(tmp, path)  # a generator opens either no file or a whole one
        with self._lock:
            previous, self._latest = self._latest, (version, str(path))
            gens = [g for g in self._gens.values()]
        for gen in gens:
            self._send(gen, ("weights", version, str(path)))
        if previous is not None:
            # A generator may still be reading the one before: keep it, drop older ones.
            for old in self._weights_dir.glob("v*.safetensors"):
                if int(old.stem[1:]) < previous[0]:
                    old.unlink(missing_ok=True)
        self.last_publish_s = time.perf_counter() - start

    # -- generators --------------------------------------------------------------------------

    def _spawn(self) -> _Generator:
        parent, child = self._ctx.Pipe(duplex=True)
        with self._lock:
            gen_id, self._next_id = self._next_id, self._next_id + 1
        process = self._ctx.Process(target=generator_main, args=(self.spec, gen_id, child),
                                    name=f"treerl-generator-{gen_id}", daemon=True)
        process.start()
        child.close()  # only the child holds its end now: its death reads as end-of-file here
        gen = _Generator(gen_id, process, parent)
        with self._lock:
            self._gens[gen_id] = gen
            latest = self._latest
        if self.buffer is not None:
            self.buffer.add_generator(gen_id)
        if latest is not None:
            self._send(gen, ("weights", *latest))
        return gen

    def _send(self, gen: _Generator, message: tuple) -> bool:
        try:
            with gen.send_lock:
                gen.conn.send(message)
            return True
        except (BrokenPipeError, OSError):
            return False  # it is dying; the monitor sees the end-of-file and replaces it

    def kill(self, gen_id: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to generator ``gen_id`` (tests and a heartbeat timeout use it)."""
        with self._lock:
            gen = self._gens.get(gen_id)
        if gen is not None and gen.process.pid is not None:
            os.kill(gen.process.pid, sig)

    def _replace(self, gen: _Generator, kind: str, message: str) -> None:
        with self._lock:
            if self._gens.pop(gen.id, None) is None:
                return
        if gen.process.is_alive():
            gen.process.kill()
        gen.process.join(timeout=5.0)
        gen.conn.close()
        lost = self.buffer.lose(gen.id)
        if not gen.delivered:
            self._failed_starts += 1
            if self._failed_starts >= _MAX_FAILED_STARTS:
                raise GeneratorFailed(
                    f"generator processes died {self._failed_starts} times in a row before they delivered a group "
                    f"(last exit code {gen.process.exitcode}); run the same environment and model with `treerl "
                    "rollout` to see the error.")
        self.restarts += 1
        text = f"generator {gen.id} (pid {gen.process.pid}) {message}; {lost} groups in flight lost; replaced"
        logger.warning(text)
        self.on_report(kind, text)
        if not self._closed.is_set():
            self._spawn()

    # -- the monitor thread ------------------------------------------------------------------

    def _watch(self) -> None:
        try:
            while not self._closed.is_set():
                with self._lock:
                    by_conn = {g.conn: g for g in self._gens.values()}
                for conn in wait(list(by_conn), timeout=0.05):
                    self._receive(by_conn[conn])
                for gen_id, tickets in self.buffer.issue().items():
                    self._hand_out(gen_id, tickets)
                self._check_heartbeats()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread by check()
            self._error = exc

    def _hand_out(self, gen_id: int, tickets: list[Ticket]) -> None:
        with self._lock:
            gen = self._gens.get(gen_id)
        # A send that fails means the generator is dying: its end-of-file comes next, and with it
        # the replacement that loses these tickets.
        if gen is not None:
            self._send(gen, ("tickets", [(t.task, t.target) for t in tickets]))

    def _receive(self, gen: _Generator) -> None:
        try:
            message = gen.conn.recv()
        except (EOFError, OSError):
            gen.process.join(timeout=1.0)
            self._replace(gen, "generator_died", f"exited (code {gen.process.exitcode})")
            return
        kind = message[0]
        gen.last_beat = time.monotonic()
        if kind == "group":
            _, task, oldest, newest, payload = message
            self.buffer.arrive(gen.id, task=task, oldest=oldest, newest=newest, payload=payload)
            gen.delivered, self._failed_starts = True, 0
        elif kind == "started":
            self.buffer.start(gen.id, task=message[1], version=message[2])
        elif kind == "heartbeat":
            gen.stats = message[1]
        elif kind == "ready":
            gen.ready = True

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
                self._replace(gen, "generator_startup_timeout",
                              f"was not ready after {self.startup_timeout} s")
