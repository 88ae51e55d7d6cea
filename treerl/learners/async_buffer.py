"""AsyncGRPO's bounded buffer: tickets out to the generators, finished groups back, staleness at the door.

The trainer never asks a generator for "some groups": it hands out **tickets**. A ticket
names one task (its index, so its seed) and the trainer version it is meant to be trained
at (its ``target``). A generator may start a ticket only once its weights are at least
``target - max_staleness``; so with ``max_staleness=0`` a generator plays step ``s``'s tasks
with exactly step ``s``'s weights, as synchronous GRPO does, and with ``k > 0`` it may run up
to ``k`` versions ahead of the trainer.

Capacity is the buffer bound: tickets out plus finished groups waiting are at most
``capacity``. When it is full no new ticket goes out, so generators run out of work and
wait (backpressure). A group comes back with the oldest and newest policy version of its
sampled spans; :meth:`GroupBuffer.take` admits it when ``trainer_version - oldest <=
max_staleness`` and drops it whole otherwise (counted in ``async/dropped_groups``). Its slot
is handed out again with a fresh task.

A generator that dies or is replaced loses its tickets (:meth:`GroupBuffer.lose`): their
groups are counted in ``async/lost_groups`` and their slots re-issued with fresh task
indices. A group that arrives for a ticket its generator no longer holds (a replaced
generator's last words) is ignored, so no group is ever trained twice.

>>> buf = GroupBuffer(tasks_per_step=2, max_staleness=0, capacity=4, next_task=0, version=0)
>>> buf.add_generator(0)
>>> [(t.task, t.target) for t in buf.issue()[0]]
[(0, 0), (1, 0), (2, 1), (3, 1)]
>>> buf.arrive(0, task=1, oldest=0, newest=0, payload="g1")
True
>>> buf.arrive(0, task=0, oldest=0, newest=0, payload="g0")
True
>>> sorted(a.payload for a in buf.take(2, trainer_version=0, timeout=0))
['g0', 'g1']
>>> buf.arrive(0, task=2, oldest=0, newest=0, payload="g2")  # played with version 0 ...
True
>>> buf.take(1, trainer_version=1, timeout=0), buf.dropped  # ... too stale for version 1
([], 1)
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

__all__ = ["Ticket", "Arrival", "GroupBuffer"]


@dataclass(frozen=True)
class Ticket:
    """One task to play, and the trainer version it is meant to be trained at."""

    task: int
    """Task index: the environment is reset with seed ``cfg.seed + task``."""
    target: int
    """The trainer version expected to train it; a generator starts it at weights >= target - max_staleness."""


@dataclass
class Arrival:
    """A finished group waiting in the buffer (the payload is its JSON line)."""

    ticket: Ticket
    generator: int
    oldest: int
    """Oldest policy version among the group's sampled spans."""
    newest: int
    payload: str
    arrived: float = field(default_factory=time.monotonic)


class GroupBuffer:
    """Tickets out, groups in, staleness-checked takes; thread-safe (one lock, one condition).

    Args:
        tasks_per_step: groups the trainer takes per step.
        max_staleness: most versions a group's oldest span may lag the trainer.
        capacity: most tickets out plus groups waiting (the buffer bound).
        next_task: first task index to hand out (a resumed run continues its numbering).
        version: the trainer's version now (the version its next step trains at).
        wait_for_due: let a step wait for due groups still being played (see :meth:`take`).
    """

    def __init__(self, *, tasks_per_step: int, max_staleness: int, capacity: int, next_task: int, version: int,
                 wait_for_due: bool = True):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1.")
        self.tasks_per_step = tasks_per_step
        self.max_staleness = max_staleness
        self.capacity = capacity
        self.wait_for_due = wait_for_due
        self.next_task = next_task
        self._cond = threading.Condition()
        self._ready: deque[Arrival] = deque()
        self._out: dict[int, dict[int, Ticket]] = {}  # generator -> task -> ticket
        self._retarget: list[int] = []  # targets of slots to hand out again (lost or dropped)
        self._version = version  # the version the latest take trained at
        self._slots = 0  # slots handed out at (version, taken) = (first version, 0): their target follows
        self._first_version = version
        self._begun: dict[tuple[int, int], int] = {}  # (generator, task) -> the version it started with
        self.dropped = 0
        self.lost = 0
        self.ignored = 0
        self.staleness: Counter = Counter()  # staleness of trained groups' oldest spans

    # -- generators -----------------------------------------------------------------------

    def add_generator(self, gen: int) -> None:
        with self._cond:
            self._out.setdefault(gen, {})

    def lose(self, gen: int) -> int:
        """Forget generator ``gen`` and its tickets (their groups are lost); returns how many."""
        with self._cond:
            tickets = self._out.pop(gen, {})
            for task in tickets:
                self._begun.pop((gen, task), None)
            self.lost += len(tickets)
            self._retarget.extend(t.target for t in tickets.values())
            self._cond.notify_all()
            return len(tickets)

    @property
    def generators(self) -> list[int]:
        with self._cond:
            return sorted(self._out)

    # -- tickets --------------------------------------------------------------------------

    def issue(self) -> dict[int, list[Ticket]]:
        """New tickets, spread over the generators with the fewest out, while there is room."""
        with self._cond:
            out: dict[int, list[Ticket]] = {}
            if not self._out:
                return out
            while self._in_pipeline() < self.capacity:
                gen = min(self._out, key=lambda g: (len(self._out[g]), g))
                ticket = Ticket(task=self.next_task, target=self._next_target())
                self.next_task += 1
                self._out[gen][ticket.task] = ticket
                out.setdefault(gen, []).append(ticket)
            return out

    def _in_pipeline(self) -> int:
        return sum(len(t) for t in self._out.values()) + len(self._ready)

    def _next_target(self) -> int:
        if self._retarget:
            # A lost or dropped slot: trained as soon as possible, never at a version already past.
            return max(self._retarget.pop(0), self._version)
        target = self._first_version + self._slots // self.tasks_per_step
        self._slots += 1
        return max(target, self._version)

    # -- groups ---------------------------------------------------------------------------

    def start(self, gen: int, task: int, version: int) -> None:
        """Generator ``gen`` started ``task`` with weights ``version`` (its group's oldest span)."""
        with self._cond:
            if task in self._out.get(gen, {}):
                self._begun[(gen, task)] = version
                self._cond.notify_all()

    def arrive(self, gen: int, *, task: int, oldest: int, newest: int, payload: str) -> bool:
        """A finished group from ``gen``; False (ignored) when ``gen`` does not hold that ticket."""
        with self._cond:
            self._begun.pop((gen, task), None)
            ticket = self._out.get(gen, {}).pop(task, None)
            if ticket is None:
                self.ignored += 1
                return False
            self._ready.append(Arrival(ticket, gen, oldest, newest, payload))
            self._cond.notify_all()
            return True

    @property
    def occupancy(self) -> int:
        """Finished groups waiting to be trained."""
        with self._cond:
            return len(self._ready)

    @property
    def outstanding(self) -> int:
        with self._cond:
            return sum(len(t) for t in self._out.values())

    def take(self, n: int, *, trainer_version: int, timeout: float | None = None,
             on_wait=None) -> list[Arrival]:
        """Up to ``n`` admitted groups, the stalest first; waits for them (``timeout`` None: forever).

        Groups whose oldest span is more than ``max_staleness`` versions behind
        ``trainer_version`` are dropped whole and their slots re-issued. A group at the bound
        (``max_staleness`` behind) is due: trained now or dropped at the next version. So a
        fresher group is taken only while room is left for every due group still being played
        (started at ``trainer_version - max_staleness``, see :meth:`start`); otherwise the take
        waits for those rather than drop them, since the groups that take longest would be the
        ones dropped (a bias against long episodes). ``wait_for_due=False`` trains on what has
        arrived instead: faster when episode lengths vary a lot, at that bias. ``on_wait`` is
        called (outside the lock) after each wait, so the caller can give up.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        taken: list[Arrival] = []
        while True:
            with self._cond:
                self._version = trainer_version
                due_version = trainer_version - self.max_staleness
                owed = sum(1 for v in self._begun.values() if v == due_version) if self.wait_for_due else 0
                ready = sorted(self._ready, key=lambda a: a.oldest)  # the stalest first
                self._ready.clear()
                kept: list[Arrival] = []
                for arrival in ready:
                    lag = trainer_version - arrival.oldest
                    if lag > self.max_staleness:
                        self.dropped += 1
                        self._retarget.append(trainer_version)
                    elif len(taken) < n and (arrival.oldest == due_version or len(taken) + owed < n):
                        self.staleness[lag] += 1
                        taken.append(arrival)
                    else:
                        kept.append(arrival)
                self._ready.extend(sorted(kept, key=lambda a: a.arrived))
                if len(taken) >= n:
                    return taken
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return taken
                self._cond.wait(timeout=1.0 if left is None else min(left, 1.0))
            if on_wait is not None:
                on_wait()
