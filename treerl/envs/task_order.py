"""The order a dataset's rows play in: as written, or shuffled anew each pass (TRL's ``shuffle_dataset``).

Task ``k`` of a run plays row ``k mod N`` of an ``N``-row dataset. Shuffled, pass ``e`` (tasks
``e N`` to ``e N + N - 1``) plays the rows in the order of a permutation of its own: the ``e``-th
``torch.randperm(N)`` drawn from one generator seeded with the run's seed, which is the order TRL's
``RepeatSampler`` draws its passes in (``shuffle=True``, one process). It depends on ``k`` alone, so a
resumed run or a generator process picks the same rows as an uninterrupted one.

With ``batch_size`` B (a step's tasks) a pass plays only whole batches, as TRL's sampler does: the
last ``N mod B`` rows of each permutation are left out of that pass (others are in the next ones),
so a pass is ``N - N mod B`` tasks and a step never spans two passes.

>>> [shuffled_index(k, 4, seed=0) for k in range(8)]  # two passes, each a permutation of its own
[0, 1, 3, 2, 4, 6, 7, 5]
>>> [shuffled_index(k, 5, seed=0, batch_size=2) % 5 for k in range(8)]  # 4 of each pass's 5 rows
[4, 0, 1, 3, 3, 4, 0, 1]
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch

__all__ = ["shuffled_index", "task_options", "num_rows"]

_passes: dict[tuple[int, int], _Passes] = {}
_lock = threading.Lock()


def shuffled_index(k: int, period: int, seed: int, batch_size: int = 1) -> int:
    """The task that position ``k`` plays when each pass of ``period`` tasks is shuffled with ``seed``:
    ``k``'s pass times ``period`` plus that pass's permutation at ``k``'s place in it. A pass plays only
    whole batches of ``batch_size`` (see the module docstring; all of it where ``period < batch_size``)."""
    if period <= 1:
        return k
    played = period - period % batch_size if batch_size <= period else period  # TRL drops a short last batch
    epoch, place = divmod(k, played)
    with _lock:
        passes = _passes.get((period, seed)) or _passes.setdefault((period, seed), _Passes(period, seed))
        return epoch * period + int(passes.permutation(epoch)[place])


_KEEP_STATE_EVERY = 64
"""Passes between the generator states kept to draw an older pass again."""


class _Passes:
    """The permutations of one (period, seed), drawn in order from one generator as TRL's sampler draws its
    passes. Kept: the latest two, and the generator's state before every 64th pass (a few KB each), from which
    an older one is drawn again; a long run over a large dataset holds neither every pass nor every state."""

    def __init__(self, period: int, seed: int):
        self.period = period
        self.generator = torch.Generator().manual_seed(seed)
        self.drawn = 0
        """Passes the generator has drawn."""
        self.states: list[torch.Tensor] = []
        """Its state before pass ``64 i``, at ``i``."""
        self.recent: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch in self.recent:
            return self.recent[epoch]
        if epoch >= self.drawn:
            while self.drawn <= epoch:
                if self.drawn % _KEEP_STATE_EVERY == 0:
                    self.states.append(self.generator.get_state())
                perm = torch.randperm(self.period, generator=self.generator)
                self.drawn += 1
        else:
            generator = torch.Generator()
            generator.set_state(self.states[epoch // _KEEP_STATE_EVERY])
            for _ in range(epoch % _KEEP_STATE_EVERY + 1):
                perm = torch.randperm(self.period, generator=generator)
        latest = max(self.recent, default=None)
        self.recent = {latest: self.recent[latest]} if latest is not None else {}
        self.recent[epoch] = perm
        return perm


def task_options(env: Any, index: int, shuffle_seed: int | None = None,
                 batch_size: int = 1) -> dict[str, Any] | None:
    """Reset options that pick task ``index``: the environment's own ``task_options(index)`` where it has
    one (an :class:`~treerl.envs.group.EnvGroup` names the member), else a dataset-backed one's row by index.
    With ``shuffle_seed``, each pass over a dataset plays its rows in an order of its own, whole batches of
    ``batch_size`` tasks (:func:`shuffled_index`); a hook of one's own shuffles only if it takes
    ``shuffle_seed`` (and gets ``batch_size`` if it takes that too)."""
    hook = getattr(env, "task_options", None)
    if callable(hook):
        if shuffle_seed is not None and "shuffle_seed" in (takes := inspect.signature(hook).parameters):
            return hook(index, shuffle_seed=shuffle_seed, **({"batch_size": batch_size} if "batch_size" in takes
                                                             else {}))
        return hook(index)
    dataset = getattr(env, "dataset", None)
    if dataset is None:
        return None
    return {"task_index": (shuffled_index(index, len(dataset), shuffle_seed, batch_size) if shuffle_seed is not None
                           else index) % len(dataset)}


def num_rows(env: Any) -> int | None:
    """The rows one pass over ``env``'s training data plays, each once (what TRL's ``num_train_epochs`` counts
    passes over): its own ``num_rows()`` where it has one (an :class:`~treerl.envs.group.EnvGroup`'s mixed
    dataset), else its ``dataset``'s; None for an environment that generates its tasks."""
    own = getattr(env, "num_rows", None)
    if callable(own):
        return own()
    dataset = getattr(env, "dataset", None)
    return None if dataset is None else len(dataset)
