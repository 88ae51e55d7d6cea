"""Rollout: the engine that plays policies in environments, trajectory trees and their storage, evaluation.

>>> from treerl.rollout import read_groups          # doctest: +SKIP
>>> for group in read_groups("r.jsonl"):            # doctest: +SKIP
...     print(group.packing_ratio, [e.reward for e in group.episodes])
"""

from treerl.rollout.trajectory import (
    SCHEMA_VERSION,
    Episode,
    Group,
    GroupWriter,
    Segment,
    read_all_groups,
    read_groups,
    to_flat_records,
)

__all__ = [
    "SCHEMA_VERSION", "Segment", "Episode", "Group", "GroupWriter", "read_groups", "read_all_groups",
    "to_flat_records",
    "RolloutEngine", "RolloutStats", "EpisodeOptions", "evaluate", "record", "GroupSource", "FileSource",
]

# The engine pulls in torch and the policy code; load it only when asked for.
_LAZY = {
    "RolloutEngine": "treerl.rollout.engine",
    "RolloutStats": "treerl.rollout.summary",
    "EpisodeOptions": "treerl.rollout.options",
    "evaluate": "treerl.rollout.evaluate",
    "record": "treerl.rollout.record",
    "GroupSource": "treerl.rollout.sources",
    "FileSource": "treerl.rollout.sources",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'treerl.rollout' has no attribute {name!r}")
