"""``treerl rollout``: play a model in an environment and store trajectory trees as JSON Lines."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treerl.config import SamplingOptions, field_help
from treerl.rollout.evaluate import two_column_table

__all__ = ["RolloutConfig", "run_rollout", "format_summary"]


@dataclass
class RolloutConfig(SamplingOptions):
    """Options of ``treerl rollout``."""

    env: str = field_help("treerl/Calculator-v0", "Registered environment id (see `treerl envs`).")
    out: str | None = field_help(None, "Output JSON Lines file; an existing one is resumed (finished tasks are skipped).")
    model: str | None = field_help(None, "A local transformers model directory; default: the shipped tiny model.")
    num_tasks: int = field_help(8, "Number of tasks (task i is reset with seed + i).")
    group_size: int = field_help(4, "Generations per task (GRPO's group).")
    max_concurrency: int = field_help(32, "Episodes in flight at once.")
    seed: int = field_help(0, "Seeds the tasks and every sampling request.")
    max_episode_tokens: int = field_help(2048, "An episode whose context reaches this many tokens is truncated.")
    max_episode_seconds: float = field_help(300.0, "Wall-clock limit of one episode.")
    branch_at_turn: int | None = field_help(None, "Fork each episode's environment after this many turns.")
    branch_factor: int = field_help(1, "Continuations per fork (with --branch-at-turn).")
    fsync: bool = field_help(False, "fsync the output after each group (survives a machine crash).")
    device: str = field_help("cpu", "Torch device of the policy.")
    progress: bool = field_help(True, "Show a progress bar.")

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("--out is required: the JSON Lines file to write (e.g. --out r.jsonl).")
        for name in ("num_tasks", "group_size", "max_concurrency", "max_new_tokens", "max_episode_tokens", "branch_factor"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1.")
        if self.branch_factor > 1 and (self.branch_at_turn is None or self.branch_at_turn < 1):
            raise ValueError("--branch-factor > 1 needs --branch-at-turn K (K >= 1): the turn after which to fork.")
        if self.max_episode_seconds <= 0:
            raise ValueError(f"--max-episode-seconds={self.max_episode_seconds} must be > 0.")
        self.sampling()



def format_summary(summary: dict[str, Any]) -> str:
    rows = [
        ("groups / episodes", f"{summary['groups']} / {summary['episodes']}"),
        ("reward mean / std", f"{summary['reward/mean']:.3f} / {summary['reward/std']:.3f}"),
        ("success rate", f"{summary['success_rate']:.1%}"),
        ("tool calls", ", ".join(f"{k}={v}" for k, v in sorted(summary["tool_calls"].items())) or "none"),
        ("terminations", ", ".join(f"{k}={v}" for k, v in sorted(summary["terminations"].items())) or "none"),
        ("tokens/s", f"{summary['perf/tokens_per_s']:.0f}"),
        ("packing ratio", f"{summary['tree/packing_ratio']:.2f}"),
        ("wall time", f"{summary['wall_s']:.1f} s"),
    ]
    return two_column_table(rows)


def run_rollout(cfg: RolloutConfig, model, tokenizer) -> dict[str, Any]:
    """Run the rollout described by ``cfg`` with a loaded model; returns the summary."""
    import treerl
    from treerl.agents.transformers_policy import TransformersPolicy
    from treerl.rollout.engine import RolloutEngine
    from treerl.rollout.trajectory import GroupWriter

    policy = TransformersPolicy(model, tokenizer, device=cfg.device)
    engine = RolloutEngine(
        policy, tokenizer, params=cfg.sampling(), max_concurrency=cfg.max_concurrency,
        max_episode_tokens=cfg.max_episode_tokens, max_episode_seconds=cfg.max_episode_seconds,
        branch_at_turn=cfg.branch_at_turn, branch_factor=cfg.branch_factor, seed=cfg.seed,
    )
    writer = GroupWriter(cfg.out, fsync=cfg.fsync)
    done = writer.finished_keys()
    todo = [i for i in range(cfg.num_tasks) if f"seed-{cfg.seed + i}" not in done]
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.num_tasks, initial=cfg.num_tasks - len(todo), desc="rollout", unit="task",
                   file=sys.stderr, dynamic_ncols=True)

    def on_group(group) -> None:
        if bar is not None:
            rewards = group.rewards
            bar.set_postfix(reward=f"{sum(rewards) / max(len(rewards), 1):.2f}")
            bar.update(1)

    try:
        _, stats = asyncio.run(engine.run(lambda: treerl.make(cfg.env), cfg.env, todo, cfg.group_size,
                                          writer=writer, on_group=on_group))
    finally:
        writer.close()
        if bar is not None:
            bar.close()
        close = getattr(policy, "close", None)
        if close is not None:
            close()
    summary = stats.summary()
    summary["skipped_finished_tasks"] = cfg.num_tasks - len(todo)
    summary["out"] = str(Path(cfg.out))
    return summary


def cmd_rollout(args: argparse.Namespace) -> int:
    from treerl.cli import config_for_command, load_model

    cfg = config_for_command(RolloutConfig, args)
    model, tokenizer = load_model(cfg.model, cfg.device)
    summary = run_rollout(cfg, model, tokenizer)
    print(format_summary(summary))
    return 0
