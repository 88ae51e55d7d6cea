"""Trajectory samples: a few of a step's groups, kept in the output directory for people to look at.

Every ``sample_every`` steps (and at the first and the last) a learner keeps its first
``sample_groups`` groups as ``output_dir/trajectories/step-000010.jsonl``: today's trajectory
format, readable by :func:`~treerl.rollout.trajectory.read_groups` and by ``treerl view``,
with two optional fields filled in:

- ``advantage`` on each episode: what the learner trained the episode with;
- ``trainer_logprobs`` on each sampled segment: the trainer's log-prob of each token under
  the weights it is about to update, at the sampler's temperature and renormalized over the
  sampler's candidate set, as the importance weights see it. ``exp(trainer - sampler)`` is
  the sampler/trainer ratio the viewer colours tokens by.

The step number is the one ``metrics.jsonl`` uses (1-based). A resumed run that replays a
step rewrites its file whole, never appends to it.

>>> from types import SimpleNamespace
>>> cfg = SimpleNamespace(sample_groups=4, sample_every=10, steps=25)
>>> [s for s in range(1, 26) if keeps_sample(s, cfg)]
[1, 10, 20, 25]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from treerl.learners.forward import packed_logprobs
from treerl.learners.packing import PackingConfig, pack_groups
from treerl.rollout.trajectory import Episode, Group, sample_path

__all__ = ["keeps_sample", "sample_path", "annotate_sample", "add_trainer_logprobs", "write_groups", "completion_rows",
           "format_completions"]


def keeps_sample(step: int, cfg: Any) -> bool:
    """Whether step ``step`` (1-based) keeps a sample: the first, every ``sample_every``-th, the last."""
    if cfg.sample_groups <= 0 or cfg.sample_every <= 0:
        return False
    return step == 1 or step % cfg.sample_every == 0 or step == cfg.steps


def annotate_sample(groups: Sequence[Group], adv: torch.Tensor | Sequence[float], num_groups: int) -> list[Group]:
    """Copies of the first ``num_groups`` groups with each episode's advantage set.

    ``adv`` (E,) holds one advantage per episode of ``groups``, groups in order (the
    learner's own groups are left untouched).
    """
    adv = torch.as_tensor(adv, dtype=torch.float32).reshape(-1)
    kept, first = [], 0
    for group in groups[:num_groups]:
        copy = Group.from_json(group.to_json())
        for i, episode in enumerate(copy.episodes):
            episode.advantage = float(adv[first + i])
        first += len(group.episodes)
        kept.append(copy)
    return kept


@torch.no_grad()
def add_trainer_logprobs(model: torch.nn.Module, groups: Sequence[Group], *, temperature: float, device: str,
                         paths_per_batch: int = 4) -> None:
    """Fill ``trainer_logprobs`` of every sampled segment of ``groups`` with ``model``'s log-probs.

    Each root-to-leaf path is forwarded on its own (``padded`` packing, which any causal LM
    runs, tree attention or not), so its terms come back in path order; a segment on several
    paths has the same context on each and takes its values from the first.
    """
    was_training = model.training
    model.eval()
    try:
        for group in groups:
            leaves = list(dict.fromkeys(leaf for e in group.episodes for leaf in e.leaves))
            if not leaves:
                continue
            paths = [group.path_indices(leaf) for leaf in leaves]
            longest = max(sum(len(group.segments[s].token_ids) for s in path) for path in paths)
            chains = Group(task_key=group.task_key, env_id=group.env_id, segments=group.segments)
            chains.episodes = [Episode(leaf=leaf, reward=0.0, group=chains) for leaf in leaves]
            cfg = PackingConfig(max_tokens_per_row=max(longest, 1), mode="padded", rows_per_batch=paths_per_batch)
            per_path: dict[int, list[float]] = {}
            per_path_ids: dict[int, list[int]] = {}
            filled: set[tuple[int, int]] = set()
            for batch in pack_groups([chains], torch.zeros(len(leaves)), cfg):
                out = packed_logprobs(model, batch.to(device), temperature=temperature)
                for e, logp, target in zip(batch.term_episode.tolist(), out.logp.float().cpu().tolist(),
                                           batch.term_target.tolist()):
                    per_path.setdefault(e, []).append(logp)
                    per_path_ids.setdefault(e, []).append(target)
            for e, path in enumerate(paths):
                positions = [(s, off) for s in path if group.segments[s].kind == "sampled"
                             for off in range(len(group.segments[s].token_ids))]
                first = next(((s, 0) for s in path if group.segments[s].token_ids), None)
                if positions and positions[0] == first:
                    positions = positions[1:]  # a path's first token has no context that predicts it
                ids = [group.segments[s].token_ids[off] for s, off in positions]
                if per_path_ids.get(e, []) != ids:
                    raise RuntimeError(f"trainer log-probs of {group.task_key!r} path {e} do not line up with its "
                                       "sampled tokens; this is a bug in treerl.")
                for (s, off), logp in zip(positions, per_path.get(e, [])):
                    seg = group.segments[s]
                    if seg.trainer_logprobs is None:  # 0.0 where nothing predicts a token, as the sampler's mask
                        seg.trainer_logprobs = [0.0] * len(seg.token_ids)
                    if (s, off) not in filled:
                        seg.trainer_logprobs[off] = logp
                        filled.add((s, off))
    finally:
        model.train(was_training)


def write_groups(path: str | os.PathLike, groups: Sequence[Group]) -> Path:
    """Write ``groups`` as a trajectory file, replacing any earlier one whole (a replayed step)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(g.to_json() + "\n" for g in groups), encoding="utf-8")
    os.replace(tmp, path)
    return path


def completion_rows(groups: Sequence[Group], adv: torch.Tensor | Sequence[float], reward_names: Sequence[str],
                    limit: int | None = None, rewards: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """The rows of ``--log-completions``' table (TRL's): one per episode, groups in order, at most ``limit``:
    ``prompt``, the opening messages but the system prompt (whose tool schemas would fill the screen);
    ``completion``, every message after them, tool results included; each reward column under its name
    in ``reward_names``; and ``advantage``. ``rewards`` (E, R) holds the columns, the environment's first
    (:func:`~treerl.rollout.rewards.score`'s); without it, the environment's reward of each episode alone
    (its turns' sum: ``Episode.rewards`` holds one reward per turn, not one per reward function).

    >>> from treerl.rollout.trajectory import Segment
    >>> g = Group(task_key="t", env_id="e", segments=[Segment(kind="prompt", token_ids=[1])])
    >>> g.episodes = [Episode(leaf=0, reward=1.0, rewards=[0.0, 1.0], group=g, messages=[
    ...     {"role": "system", "content": "tools..."}, {"role": "user", "content": "2+2?"},
    ...     {"role": "assistant", "content": "4"}])]
    >>> completion_rows([g], [0.5], ["env", "correct"], rewards=torch.tensor([[1.0, 0.75]]))
    [{'prompt': 'user: 2+2?', 'completion': 'assistant: 4', 'env': 1.0, 'correct': 0.75, 'advantage': 0.5}]
    """
    adv = torch.as_tensor(adv, dtype=torch.float32).reshape(-1).tolist()
    episodes = [e for group in groups for e in group.episodes]
    columns = rewards.tolist() if rewards is not None else [[e.reward] for e in episodes]  # (E, R)
    rows = []
    for episode, advantage, figures in list(zip(episodes, adv, columns))[:limit]:
        messages = [m for m in episode.messages if m.get("role") != "system"]
        opening = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        rows.append({"prompt": _conversation(messages[:opening]), "completion": _conversation(messages[opening:]),
                     **{name: float(r) for name, r in zip(reward_names, figures)}, "advantage": advantage})
    return rows


def format_completions(step: int, rows: Sequence[dict[str, Any]], total: int) -> str:
    """``rows`` (see :func:`completion_rows`) as text for the terminal, each episode's rewards on its header line."""
    lines = [f"step {step}: {len(rows)} of {total} completions"]
    for i, row in enumerate(rows, 1):
        figures = " · ".join(f"{k} {v:.3f}" for k, v in row.items() if k not in ("prompt", "completion"))
        lines += [f"-- {i} · {figures}", "prompt:", _indented(row["prompt"]), "completion:",
                  _indented(row["completion"])]
    return "\n".join(lines)


def _conversation(messages: Sequence[dict[str, Any]]) -> str:
    return "\n".join(f"{m.get('role')}: {m.get('content') or ''}" for m in messages)


def _indented(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines() or [""])
