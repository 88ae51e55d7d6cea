"""Where a learner's groups come from when the engine does not play them: a trajectory file, a server.

A :class:`GroupSource` hands out groups by position: ``take(indices)`` returns the groups
at those positions of its stream, so a learner's step ``s`` takes positions
``[s * tasks_per_step, (s + 1) * tasks_per_step)`` (each rank its share) and a resumed run
takes up exactly where it stopped. A source that also has ``set_weights(state_dict, version)``
receives every weights version the learner publishes (``treerl serve`` does).

:class:`FileSource` reads a trajectory file (``treerl rollout --out``, ``treerl serve --out``);
position ``i`` is the file's group ``i mod N``, so several steps make epochs over it.
:class:`~treerl.serve.client.ServerSource` waits for groups finished through ``treerl serve``.

>>> import tempfile, os
>>> from treerl.rollout.trajectory import Group, GroupWriter
>>> path = os.path.join(tempfile.mkdtemp(), "r.jsonl")
>>> with GroupWriter(path) as w:
...     for k in range(3):
...         g = Group(task_key=f"seed-{k}", env_id="demo")
...         leaf = g.add_segment("sampled", [1], parent=g.add_segment("prompt", [0]), logprobs=[-0.5])
...         _ = g.add_episode(leaf=leaf, reward=float(k))
...         w.write(g)
>>> groups, stats = FileSource(path).take(range(2, 5))
>>> [g.task_key for g in groups], stats.num_episodes
(['seed-2', 'seed-0', 'seed-1'], 3)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from treerl.rollout.summary import RolloutStats
from treerl.rollout.trajectory import Group, read_all_groups

__all__ = ["GroupSource", "FileSource", "stats_of"]


@runtime_checkable
class GroupSource(Protocol):
    """Groups by position in a stream (see the module docstring)."""

    def take(self, indices: Sequence[int]) -> tuple[list[Group], RolloutStats]:
        """The groups at ``indices`` (in that order) and their rollout stats."""
        ...


def stats_of(groups: Sequence[Group], wall_s: float = 0.0) -> RolloutStats:
    """The :class:`RolloutStats` of groups recorded elsewhere (``wall_s``: how long taking them took)."""
    stats = RolloutStats(wall_s=wall_s)
    for group in groups:
        stats.add(group)
    return stats


class FileSource:
    """The groups of a trajectory file, cycled: position ``i`` is group ``i mod N``.

    The file is read once, at construction; episodes with no sampled token are refused
    there (nothing to train on), with the line that holds them.
    """

    def __init__(self, path: str | os.PathLike):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"from_rollouts={str(path)!r}: no such trajectory file; write one with "
                                    "`treerl rollout --out FILE` or `treerl serve --out FILE`.")
        self.path = path
        self.groups = read_all_groups(path)
        if not self.groups:
            raise ValueError(f"from_rollouts={str(path)!r} holds no complete group: nothing to train on.")
        for lineno, group in enumerate(self.groups, 1):
            if any(e.num_sampled_tokens == 0 for e in group.episodes):
                raise ValueError(f"{path}:{lineno}: group {group.task_key!r} has an episode without sampled "
                                 "tokens; a learner needs the policy's tokens to train on.")

    def take(self, indices: Sequence[int]) -> tuple[list[Group], RolloutStats]:
        groups = [self.groups[i % len(self.groups)] for i in indices]
        return groups, stats_of(groups)
