"""Rollout: the engine that plays policies in environments, and trajectory trees with their storage.

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
    read_groups,
    to_flat_records,
)

__all__ = [
    "SCHEMA_VERSION", "Segment", "Episode", "Group", "GroupWriter", "read_groups", "to_flat_records",
    "RolloutEngine", "RolloutStats", "evaluate",
]


def __getattr__(name: str):
    # The engine pulls in torch and the policy code; load it only when asked for.
    if name in ("RolloutEngine", "RolloutStats"):
        from treerl.rollout import engine

        return getattr(engine, name)
    if name == "evaluate":
        from treerl.rollout.evaluate import evaluate

        return evaluate
    raise AttributeError(f"module 'treerl.rollout' has no attribute {name!r}")
