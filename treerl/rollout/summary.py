"""One summary of a set of episodes, for ``treerl eval``, ``treerl rollout`` and ``treerl learn``.

:class:`RolloutStats` accumulates groups as they finish (:meth:`RolloutStats.add`), merges
the stats of several processes (:meth:`RolloutStats.merge`), and :meth:`RolloutStats.summary`
turns them into the figures every command reports, under the same names:

- ``reward/mean``, ``reward/std``: the episode reward (the sum over turns);
- ``success_rate``: episodes whose *final* reward reaches ``success_threshold`` (1.0: a
  correct answer in Calculator and MathVerify, all hidden tests in CodeSandbox, the secret
  found in GuessNumber);
- ``tool_calls`` by outcome (``ok`` or an error kind) and ``tools/invalid_rate``;
- ``reward_by_env``, ``success_by_env``: with an :class:`~treerl.envs.group.EnvGroup`, each
  member's mean episode reward (the environment's) and success rate, by the name its groups
  carry in ``info["env"]``; empty otherwise;
- ``terminations`` by reason, ``episode/length_limit_frac`` (final turns cut by
  ``max_new_tokens``), ``perf/tokens_per_s``, ``tree/packing_ratio``, ``template/branches``;
- ``env_metrics``: the numbers environments report about their episodes (the episode's
  ``metrics["env/NAME"]``, from :meth:`~treerl.envs.Env.episode_metrics`), each one's mean over
  the episodes that reported it, by its ``env/NAME``.

>>> stats = RolloutStats()
>>> stats.summary()["episodes"]
0
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import numpy as np

from treerl.rollout.trajectory import Group

__all__ = ["RolloutStats", "ENV_METRIC_PREFIX", "env_metric_numbers", "summary_table", "two_column_table",
           "format_table", "task_rows", "task_table"]

ENV_METRIC_PREFIX = "env/"
"""An episode's ``metrics`` under this prefix are its environment's own numbers, averaged over episodes."""


def env_metric_numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``values`` that are finite numbers (bools as 0/1; numpy's numbers and bools too),
    as floats; the rest are left out.

    >>> import numpy as np
    >>> env_metric_numbers({"ok": True, "chars": 12, "note": "text", "bad": float("nan"), "np": np.bool_(True)})
    {'ok': 1.0, 'chars': 12.0, 'np': 1.0}
    """
    numbers = {}
    for name, value in values.items():
        if isinstance(value, np.bool_):  # not a numbers.Real, unlike numpy's other scalars
            value = bool(value)
        if isinstance(value, Real) and math.isfinite(value):
            numbers[name] = float(value)
    return numbers


@dataclass
class RolloutStats:
    """Totals over the groups of a run."""

    num_groups: int = 0
    num_episodes: int = 0
    rewards: list[float] = field(default_factory=list)
    final_rewards: list[float] = field(default_factory=list)
    tool_calls: Counter = field(default_factory=Counter)
    terminations: Counter = field(default_factory=Counter)
    sampled_tokens: int = 0
    final_turns: int = 0
    """Episodes whose last segment was sampled (the others ended on the environment's side)."""
    length_limited: int = 0
    """Of those, the ones whose last turn stopped at ``max_new_tokens``."""
    packing_ratios: list[float] = field(default_factory=list)
    branches: int = 0
    wall_s: float = 0.0
    env_rewards: dict[str, list[float]] = field(default_factory=dict)
    """Episode rewards by the member of an EnvGroup that played them (``group.info["env"]``)."""
    env_final_rewards: dict[str, list[float]] = field(default_factory=dict)
    """Final rewards (what success is measured on) by the member of an EnvGroup that played them."""
    env_metrics: dict[str, list[float]] = field(default_factory=dict)
    """The episodes' own numbers (``metrics["env/NAME"]``) by name, one per episode that reported it."""

    def add(self, group: Group) -> None:
        self.num_groups += 1
        self.packing_ratios.append(group.packing_ratio)
        if isinstance(group.info.get("env"), str):
            self.env_rewards.setdefault(group.info["env"], []).extend(e.reward for e in group.episodes)
            self.env_final_rewards.setdefault(group.info["env"], []).extend(
                e.rewards[-1] if e.rewards else 0.0 for e in group.episodes)
        # Each segment once: a turn sampled before a fork was generated once, not once per continuation.
        self.sampled_tokens += sum(len(s.token_ids) for s in group.segments if s.kind == "sampled")
        for e in group.episodes:
            self.num_episodes += 1
            self.rewards.append(e.reward)
            self.final_rewards.append(e.rewards[-1] if e.rewards else 0.0)
            self.terminations[str(e.termination)] += 1
            self.branches += len(e.extra_leaves)
            last = e.path()[-1]
            if last.kind == "sampled":
                self.final_turns += 1
                self.length_limited += last.finish_reason == "length"
            for r in e.tool_calls:
                self.tool_calls[r.get("error") or "ok"] += 1
            own = {k: v for k, v in e.metrics.items() if k.startswith(ENV_METRIC_PREFIX)}
            for name, value in env_metric_numbers(own).items():
                self.env_metrics.setdefault(name, []).append(value)

    @classmethod
    def merge(cls, parts: Sequence[RolloutStats]) -> RolloutStats:
        """One set of stats over several (e.g. every rank's); wall time is the slowest part's."""
        merged = cls()
        for s in parts:
            merged.num_groups += s.num_groups
            merged.num_episodes += s.num_episodes
            merged.rewards += s.rewards
            merged.final_rewards += s.final_rewards
            merged.tool_calls.update(s.tool_calls)
            merged.terminations.update(s.terminations)
            merged.sampled_tokens += s.sampled_tokens
            merged.final_turns += s.final_turns
            merged.length_limited += s.length_limited
            merged.packing_ratios += s.packing_ratios
            merged.branches += s.branches
            for name, rewards in s.env_rewards.items():
                merged.env_rewards.setdefault(name, []).extend(rewards)
            for name, rewards in s.env_final_rewards.items():
                merged.env_final_rewards.setdefault(name, []).extend(rewards)
            for name, values in s.env_metrics.items():
                merged.env_metrics.setdefault(name, []).extend(values)
            merged.wall_s = max(merged.wall_s, s.wall_s)
        return merged

    def summary(self, success_threshold: float = 1.0) -> dict[str, Any]:
        """The figures every command reports (see the module docstring)."""
        n = max(len(self.rewards), 1)
        mean = sum(self.rewards) / n
        num_calls = sum(self.tool_calls.values())
        return {
            "groups": self.num_groups,
            "episodes": self.num_episodes,
            "reward/mean": mean,
            "reward/std": math.sqrt(sum((r - mean) ** 2 for r in self.rewards) / n),
            "success_rate": sum(r >= success_threshold for r in self.final_rewards) / n,
            "tool_calls": dict(self.tool_calls),
            "reward_by_env": {name: sum(r) / len(r) for name, r in sorted(self.env_rewards.items()) if r},
            "success_by_env": {name: sum(x >= success_threshold for x in r) / len(r)
                               for name, r in sorted(self.env_final_rewards.items()) if r},
            "tools/invalid_rate": (num_calls - self.tool_calls.get("ok", 0)) / num_calls if num_calls else 0.0,
            "terminations": dict(self.terminations),
            "env_metrics": {name: sum(v) / len(v) for name, v in sorted(self.env_metrics.items()) if v},
            "episode/length_limit_frac": self.length_limited / self.final_turns if self.final_turns else 0.0,
            "perf/tokens_per_s": self.sampled_tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "tree/packing_ratio": sum(self.packing_ratios) / max(len(self.packing_ratios), 1),
            "template/branches": self.branches,
            "wall_s": self.wall_s,
        }


def two_column_table(rows: Sequence[tuple[str, str]]) -> str:
    """Label/value rows, labels padded to one width.

    >>> print(two_column_table([("a", "1"), ("long label", "2")]))
    a           1
    long label  2
    """
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, a dashed rule under the header.

    >>> print(format_table(["metric", "a", "b"], [["reward", "0.5", "0.75"]]))
    metric  a    b
    ------  ---  ----
    reward  0.5  0.75
    """
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def task_rows(groups: Sequence[Group], success_threshold: float = 1.0) -> list[dict[str, Any]]:
    """One record per task (group): its id, answer, reward, success, turns, tool calls and how it ended."""
    rows = []
    for g in groups:
        n = max(len(g.episodes), 1)
        calls = Counter(r.get("error") or "ok" for e in g.episodes for r in e.tool_calls)
        rows.append({
            "task": g.task_key,
            "id": g.info.get("task_id"),  # the environment's own id of the task (a dataset row's id)
            "answer": g.info.get("answer"),
            "episodes": len(g.episodes),
            "reward": sum(e.reward for e in g.episodes) / n,
            "success_rate": sum((e.rewards[-1] if e.rewards else 0.0) >= success_threshold for e in g.episodes) / n,
            "turns": sum(e.metrics.get("turns", 0) for e in g.episodes) / n,
            "sampled_tokens": sum(e.num_sampled_tokens for e in g.episodes) / n,
            "tool_calls": dict(calls),
            "terminations": dict(Counter(str(e.termination) for e in g.episodes)),
        })
    return rows


def task_table(rows: Sequence[dict[str, Any]]) -> str:
    """The per-task table of ``treerl eval --per-task``."""
    def counts(d: dict[str, int]) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(d.items())) or "none"

    body = [[r["task"], "-" if r.get("id") is None else str(r["id"]), "-" if r["answer"] is None else str(r["answer"]),
             f"{r['reward']:.3f}",
             f"{r['success_rate']:.0%}", f"{r['turns']:.1f}", f"{r['sampled_tokens']:.0f}", counts(r["tool_calls"]),
             counts(r["terminations"])] for r in rows]
    return format_table(["task", "id", "answer", "reward", "success", "turns", "tokens", "tool calls", "ended"], body)


def summary_table(summary: dict[str, Any], **extra: str) -> str:
    """The table the commands print for a :meth:`RolloutStats.summary` (``extra`` rows first)."""
    rows = [(k.replace("_", " "), v) for k, v in extra.items()]
    rows += [
        ("groups / episodes", f"{summary['groups']} / {summary['episodes']}"),
        ("success rate", f"{summary['success_rate']:.1%}"),
    ]
    if pass_at := [(k, v) for k, v in summary.items() if k.startswith("pass@")]:  # eval, several per task
        rows.append(("pass@k", ", ".join(f"{k} {v:.1%}" for k, v in pass_at)))
    if "reward/env_mean" in summary:  # with reward functions: the weighted sum, the environment's, each function's
        rows.append(("reward (weighted) mean / std", f"{summary['reward/mean']:.3f} / {summary['reward/std']:.3f}"))
        rows.append(("env reward mean / std", f"{summary['reward/env_mean']:.3f} / {summary['reward/env_std']:.3f}"))
        rows += [(k, f"{v:.3f}") for k, v in summary.items() if k.startswith("reward_fn/")]
    else:
        rows.append(("reward mean / std", f"{summary['reward/mean']:.3f} / {summary['reward/std']:.3f}"))
    if summary.get("reward_by_env"):  # an EnvGroup: each environment's own
        rows.append(("reward mean by env", ", ".join(f"{k} {v:.3f}" for k, v in summary["reward_by_env"].items())))
    if summary.get("success_by_env"):
        rows.append(("success rate by env", ", ".join(f"{k} {v:.1%}" for k, v in summary["success_by_env"].items())))
    if summary.get("env_metrics"):  # the environments' own numbers, each one's mean over the episodes reporting it
        rows.append(("env metrics", ", ".join(f"{k} {v:.3f}" for k, v in summary["env_metrics"].items())))
    rows += [
        ("tool calls", ", ".join(f"{k}={v}" for k, v in sorted(summary["tool_calls"].items())) or "none"),
        ("terminations", ", ".join(f"{k}={v}" for k, v in sorted(summary["terminations"].items())) or "none"),
        ("tokens/s", f"{summary['perf/tokens_per_s']:.0f}"),
        ("packing ratio", f"{summary['tree/packing_ratio']:.2f}"),
        ("wall time", f"{summary['wall_s']:.1f} s"),
    ]
    return two_column_table(rows)
