"""Generator processes on one machine: started, fed, watched and replaced by the trainer.

:class:`ProcessPool` is the :class:`~treerl.learners.async_supervisor.GeneratorPool` whose
generators are processes (``multiprocessing`` with the ``spawn`` start method), each running
:func:`~treerl.learners.async_generator.generator_main` with one duplex pipe to the trainer.
The monitor thread reads every message as it comes (finished groups, started tickets,
heartbeats); a pipe that reaches end-of-file means the process died (e.g. SIGKILL), and the
base replaces it. A generator replaced for a missed heartbeat is killed with SIGKILL.

Weights reach the generators by one of two transports (``weight_transport``):

- ``file``: a safetensors file in a directory on shared memory (``/dev/shm`` where it exists,
  else a temporary directory), written once per version, renamed into place and announced to
  every generator, which loads it between its batches; a generator that starts later loads the
  latest file. No generator ever gets a copy per episode.
- ``broadcast``: a ``torch.distributed`` broadcast over a process group the trainer forms with
  each generator (:mod:`~treerl.learners.weight_broadcast`; NCCL on GPUs, gloo on CPU), bucketed,
  with the version in its header; the generator receives as soon as it is announced and loads
  between its batches.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from torch import Tensor

from treerl.learners.async_buffer import Ticket
from treerl.learners.async_generator import GeneratorSpec, generator_main
from treerl.learners.async_supervisor import Generator, GeneratorFailed, GeneratorPool
from treerl.learners.weight_broadcast import (DEFAULT_BUCKET_BYTES, GroupAddress, WeightGroup, backend_for,
                                              layout_of, serve_store)

__all__ = ["ProcessPool", "GeneratorFailed", "weights_dir", "WEIGHT_TRANSPORTS"]

logger = logging.getLogger(__name__)

WEIGHT_TRANSPORTS = ("file", "broadcast")


def unguarded_script() -> str | None:
    """The path of the script run as ``__main__`` when this call comes from its top level outside an ``if
    __name__ == "__main__":`` block, else None. A process started with ``spawn`` runs that script again, so
    such a script would start training in each generator (Python refuses it there, and the generator dies).
    No script (an interactive session, ``python -c``) or no source to read: None."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    frame = inspect.currentframe()
    while frame is not None and (frame.f_code.co_name, frame.f_globals.get("__name__")) != ("<module>", "__main__"):
        frame = frame.f_back
    if path is None or frame is None:
        return None
    try:
        tree = ast.parse(Path(path).read_text(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    guarded = any(isinstance(node, ast.If) and _is_main_test(node.test)
                  and node.lineno <= line <= (node.end_lineno or node.lineno) for node in ast.walk(tree))
    return None if guarded else path


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(test.left), ast.dump(test.comparators[0])}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


def weights_dir() -> Path:
    """A fresh directory for weight files, on shared memory when the machine has it."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="treerl-weights-", dir=base))


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT while a generator process is spawned, so that it starts ignoring it.

    The spawned interpreter imports torch and treerl for seconds before
    :func:`~treerl.learners.async_generator.generator_main` ignores Ctrl-C itself; an ignored
    disposition survives the exec, and Python then installs no KeyboardInterrupt handler.
    Only the main thread may change it: a replacement started by the monitor thread keeps
    the short window (and the trainer's own Ctrl-C is never off for longer than a spawn).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@dataclass
class _Process:
    """A generator's process, the trainer's end of its pipe and, for broadcasts, its weight group."""

    process: Any
    conn: Any
    group: WeightGroup | None = None
    group_ready: threading.Event = field(default_factory=threading.Event)
    group_error: BaseException | None = None


class ProcessPool(GeneratorPool):
    """``num_generators`` generator processes feeding a buffer (see the module docstring).

    Args:
        weight_transport: ``file`` or ``broadcast``.
        bucket_bytes: bytes per broadcast call (``broadcast`` only).
        The others are :class:`~treerl.learners.async_supervisor.GeneratorPool`'s.
    """

    def __init__(self, spec: GeneratorSpec, *, num_generators: int, heartbeat_timeout: float,
                 startup_timeout: float = 300.0, on_report: Callable[[str, str], None] | None = None,
                 weight_transport: str = "file", bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport={weight_transport!r}: use one of {', '.join(WEIGHT_TRANSPORTS)}.")
        script = unguarded_script()
        if script is not None:
            raise RuntimeError(f"{script} starts training at its top level, outside `if __name__ == \"__main__\":`. "
                               "The generators are processes started with `spawn`, which import the script again "
                               "and would start training again in each generator; put the training under "
                               "`if __name__ == \"__main__\":` (the reward and tool functions stay at module level).")
        super().__init__(spec, num_generators=num_generators, heartbeat_timeout=heartbeat_timeout,
                         startup_timeout=startup_timeout, on_report=on_report)
        self._ctx = multiprocessing.get_context("spawn")
        self.weight_transport = weight_transport
        self.bucket_bytes = bucket_bytes
        self._weights_dir = weights_dir() if weight_transport == "file" else None
        # The broadcast groups' rendezvous: one store, one key prefix per generator.
        self._store = serve_store(startup_timeout) if weight_transport == "broadcast" else None

    # -- processes ---------------------------------------------------------------------------

    def _start(self, gen_id: int) -> Generator:
        parent, child = self._ctx.Pipe(duplex=True)
        address = None
        if self._store is not None:
            address = GroupAddress(port=self._store.port, prefix=f"generator-{gen_id}",
                                   backend=backend_for(self.spec.cfg.device), timeout_s=self.startup_timeout)
        process = self._ctx.Process(target=generator_main, args=(self.spec, gen_id, child, address),
                                    name=f"treerl-generator-{gen_id}", daemon=True)
        with _sigint_ignored():
            process.start()
        child.close()  # only the child holds its end now: its death reads as end-of-file here
        handle = _Process(process, parent)
        if address is not None:
            # The pair forms when both sides construct it; the generator does so first thing, so this
            # thread returns within its start-up, without holding up the monitor meanwhile.
            threading.Thread(target=self._form_group, args=(handle, address), daemon=True,
                             name=f"treerl-weight-group-{gen_id}").start()
        return Generator(gen_id, handle, pid=process.pid)

    def _form_group(self, handle: _Process, address: GroupAddress) -> None:
        try:
            handle.group = WeightGroup(address, rank=0, device=self.spec.cfg.device, store=self._store)
        except Exception as exc:  # noqa: BLE001 - the generator died or never came; the monitor replaces it
            handle.group_error = exc
        handle.group_ready.set()

    def _stop(self, gen: Generator) -> None:
        process = gen.handle.process
        if process.is_alive():
            process.kill()
        process.join(timeout=5.0)
        gen.handle.conn.close()

    def _stop_all(self, gens: list[Generator]) -> None:
        for gen in gens:
            self._send(gen, ("stop",))
        deadline = time.monotonic() + 5.0
        for gen in gens:
            gen.handle.process.join(timeout=max(deadline - time.monotonic(), 0.1))
            self._stop(gen)
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)

    def kill(self, gen_id: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to generator ``gen_id`` (tests and a heartbeat timeout use it)."""
        gen = self._get(gen_id)
        if gen is not None:
            os.kill(gen.pid, sig)

    def _send(self, gen: Generator, message: tuple) -> bool:
        try:
            with gen.lock:
                gen.handle.conn.send(message)
            return True
        except (BrokenPipeError, OSError):
            return False  # it is dying; the monitor sees the end-of-file and replaces it

    def _hand_out(self, gen: Generator, tickets: list[Ticket]) -> None:
        self._send(gen, ("tickets", [(t.task, t.target) for t in tickets]))

    # -- weights -----------------------------------------------------------------------------

    def _publish(self, weights: Mapping[str, Tensor], version: int) -> Any:
        if self.weight_transport == "broadcast":
            return {k: v.detach() for k, v in weights.items()}  # sent to each generator from where they are
        from safetensors.torch import save_file

        path = self._weights_dir / f"v{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp))
        os.replace(tmp, path)  # a generator opens either no file or a whole one
        if self._latest is not None:
            # A generator may still be reading the previous version: keep it, drop older ones.
            for old in self._weights_dir.glob("v*.safetensors"):
                if int(old.stem[1:]) < self._latest[0]:
                    old.unlink(missing_ok=True)
        return str(path)

    def _send_weights(self, gen: Generator, version: int, published: Any) -> None:
        if self.weight_transport == "file":
            self._send(gen, ("weights", version, published))
            return
        handle: _Process = gen.handle
        if not handle.group_ready.wait(self.startup_timeout) or handle.group is None:
            return  # it never joined: the monitor replaces it (dead, or not ready in time)
        with gen.lock:  # the announcement and its broadcast stay together, in order
            try:
                handle.conn.send(("weights_broadcast", version, layout_of(published), self.bucket_bytes))
                handle.group.send(published, version, self.bucket_bytes)
            except Exception as exc:  # noqa: BLE001 - a broken pair: end the process, the monitor replaces it
                logger.warning("weight broadcast to generator %d failed (%s); it will be replaced", gen.id, exc)
                if handle.process.is_alive():
                    handle.process.kill()

    def _welcome(self, gen: Generator, version: int, published: Any) -> None:
        if self.weight_transport == "file":
            self._send_weights(gen, version, published)
        else:  # waits for the pair to form: not on the monitor thread that spawned it
            threading.Thread(target=self._send_weights, args=(gen, version, published), daemon=True,
                             name=f"treerl-weights-to-{gen.id}").start()

    # -- messages ----------------------------------------------------------------------------

    def _poll(self, timeout: float) -> None:
        with self._lock:
            by_conn = {g.handle.conn: g for g in self._gens.values()}
        for conn in wait(list(by_conn), timeout=timeout):
            self._receive(by_conn[conn])

    def _receive(self, gen: Generator) -> None:
        try:
            message = gen.handle.conn.recv()
        except (EOFError, OSError):
            gen.handle.process.join(timeout=1.0)
            self._replace(gen, "generator_died", f"exited (code {gen.handle.process.exitcode})")
            return
        kind = message[0]
        if kind == "group":
            _, task, oldest, newest, payload = message
            self._arrived(gen, task, oldest, newest, payload)
        elif kind == "started":
            self._started(gen, task=message[1], version=message[2])
        elif kind == "heartbeat":
            self._beat(gen, stats=message[1])
        elif kind == "ready":
            self._beat(gen, ready=True)
