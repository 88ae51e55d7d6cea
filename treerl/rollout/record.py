"""Record trajectories: N tasks x G generations played by the engine, written as JSON Lines (resumable).

What ``treerl rollout`` runs. Groups are appended and flushed as they finish; a rerun on the
same file skips the tasks already in it, so a killed run loses at most the groups in flight.
The file's header (:func:`run_header`) says what produced it, and a rerun with another
environment, model, tokenizer or sampling is refused rather than mixed in. A file with
an unreadable line is reported by line number; ``--repair`` moves such lines to
``FILE.corrupt`` and resumes, playing their tasks again.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treerl.agents.chat_templates import resolve_chat_template, warn_about_template
from treerl.agents.policy import Policy
from treerl.config import field_help
from treerl.envs.loops import run_until_done
from treerl.errors import ConfigError
from treerl.rollout.options import EpisodeOptions
from treerl.rollout.trajectory import GroupWriter, make_header, repair_trajectory_file

__all__ = ["RolloutConfig", "record", "recorded_model", "run_header", "tokenizer_info"]


@dataclass
class RolloutConfig(EpisodeOptions):
    """Options of ``treerl rollout``."""

    out: str | None = field_help(None, "Output JSON Lines file; an existing one is resumed (finished tasks are "
                                       "skipped).")
    num_tasks: int = field_help(8, "Number of tasks (task i is reset with seed + i).")
    group_size: int = field_help(4, "Generations per task (GRPO's group).")
    seed: int = field_help(0, "Seeds the tasks and every sampling request.")
    branch_at_turn: int | None = field_help(None, "Fork each episode's environment after this many turns.")
    branch_factor: int = field_help(1, "Continuations per fork (with --branch-at-turn).")
    fsync: bool = field_help(False, "fsync the output after each group (survives a machine crash).")
    repair: bool = field_help(False, "Move unreadable lines of an existing --out to OUT.corrupt, then resume.")
    progress: bool = field_help(True, "Show a progress bar.")

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("--out is required: the JSON Lines file to write (e.g. --out r.jsonl).")
        super().__post_init__()
        for name in ("num_tasks", "group_size", "branch_factor"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1.")
        if self.branch_factor > 1 and (self.branch_at_turn is None or self.branch_at_turn < 1):
            raise ValueError("--branch-factor > 1 needs --branch-at-turn K (K >= 1): the turn after which to fork.")


def record(cfg: RolloutConfig, policy: Policy, tokenizer: Any) -> dict[str, Any]:
    """Play ``cfg.num_tasks`` tasks x ``cfg.group_size`` generations into ``cfg.out``; returns the summary."""
    engine = cfg.engine(policy, tokenizer, seed=cfg.seed, branch_at_turn=cfg.branch_at_turn,
                        branch_factor=cfg.branch_factor)
    warn_about_template(tokenizer, cfg.env_factory(), engine.chat_template)
    writer = _open_output(cfg, tokenizer)
    try:
        done = writer.finished_keys()
    except BaseException:
        writer.close()
        raise
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
        _, stats = run_until_done(engine.run(cfg.env_factory(), cfg.env, todo, cfg.group_size, writer=writer,
                                             on_group=on_group, keep=False))  # written: none held in memory
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    summary = stats.summary()
    summary["skipped_finished_tasks"] = cfg.num_tasks - len(todo)
    summary["out"] = str(Path(cfg.out))
    return summary


def tokenizer_info(tokenizer: Any, template: str | None = None) -> dict[str, Any]:
    """What identifies a tokenizer in a trajectory file's header: its class, vocabulary size and the chat
    template episodes are rendered with (``template``, else the tokenizer's own)."""
    template = template if template is not None else getattr(tokenizer, "chat_template", None)
    return {
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "chat_template_sha256": None if template is None else hashlib.sha256(str(template).encode()).hexdigest(),
    }


def recorded_model(model: str | None) -> str | None:
    """``--model`` as a header records it: a local directory as its real path, a Hub id or a shipped
    model's name as given (a path made of them would name a directory that does not exist)."""
    return os.path.realpath(model) if model is not None and os.path.isdir(model) else model


def run_header(cfg: RolloutConfig, tokenizer: Any) -> dict[str, Any]:
    """What makes this run's episodes comparable: a resumed file must have been written with the same."""
    # The template episodes are rendered with: --chat-template may replace the tokenizer's.
    template = resolve_chat_template(cfg.chat_template, tokenizer) or getattr(tokenizer, "chat_template", None)
    return make_header({
        "env_id": cfg.env,
        "env_kwargs": cfg.env_kwargs,
        "model": recorded_model(cfg.model),
        "tokenizer": tokenizer_info(tokenizer, template),
        "sampling": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg.sampling()).items()},
        "group_size": cfg.group_size,
        "branch_at_turn": cfg.branch_at_turn,
        "branch_factor": cfg.branch_factor,
        "max_episode_tokens": cfg.max_episode_tokens,
    })


def _open_output(cfg: RolloutConfig, tokenizer: Any) -> GroupWriter:
    """The writer of ``--out``: repaired first when asked; a path that cannot be written is a ConfigError."""
    out = Path(cfg.out)
    try:
        if cfg.repair and out.is_file():
            moved = repair_trajectory_file(out)
            if moved:
                print(f"--repair: moved unreadable line(s) {', '.join(map(str, moved[:20]))} of {out} to "
                      f"{out}.corrupt; their tasks are played again", file=sys.stderr)
        return GroupWriter(out, fsync=cfg.fsync, header=run_header(cfg, tokenizer))
    except OSError as exc:
        raise ConfigError(f"--out {cfg.out}: cannot write there ({exc.strerror or exc}). Pass a writable file path, "
                          "e.g. --out runs/r.jsonl.") from None
