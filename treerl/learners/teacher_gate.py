"""SDPO's gate: distill only where the teacher can read its own context (the copy probe).

SDPO's teacher is the policy reading a longer prompt. A model that cannot use that prompt
(a small model trained on one prompt format, say) is not a better teacher but a worse one:
shown a successful attempt verbatim, it still gives that attempt's tokens a *lower*
log-prob than the student does without it, and distilling towards it drags the student
away from what worked. The gate measures that and turns distillation off where it fails.

**The copy probe.** For every episode that demonstrates for a sibling, the teacher scores
the episode's own sampled tokens after a prompt that shows that very attempt (no
feedback), and the student scores them after the student's prompt. The probe's gap is
the teacher's mean log-prob per token minus the student's: a teacher that reads its
context copies what it is shown, so the gap is well above 0.

**The gate**, with margin ``m``: an episode taught with demonstration ``d`` keeps its
teacher iff ``gap(d) >= m``; an episode taught by feedback alone (its group has no
success, so nothing to probe) is judged by the step's pooled gap (token-weighted over all
its probes) or, when the step had none, by the last pooled gap the run measured, and is
kept while the run has measured none. Gated episodes get no teacher: no distillation term
and no teacher forward. GRPO's part of a blended loss is untouched.

>>> gate = TeacherGate(margin=0.0)
>>> keep = gate.decide(demonstrations=[3, None, None], has_prompt=[True, True, False], gaps={3: (-0.8, 10)})
>>> keep, gate.last_pooled
([False, False, False], -0.8)
>>> gate.decide(demonstrations=[None], has_prompt=[True], gaps={})  # no probe this step: the last one judges
[False]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from treerl.learners.forward import packed_logprobs
from treerl.learners.packing import PackingConfig, pack_groups
from treerl.learners.teacher import teacher_trees
from treerl.rollout.trajectory import Group

__all__ = ["TeacherGate", "copy_gaps", "episode_logp", "pooled_gap"]


class TeacherGate:
    """Per episode, whether its teacher is kept (see the module docstring); remembers the last pooled gap."""

    def __init__(self, margin: float):
        self.margin = margin
        self.last_pooled: float | None = None

    def decide(self, demonstrations: Sequence[int | None], has_prompt: Sequence[bool],
               gaps: Mapping[int, tuple[float, int]], pooled: tuple[float, float] | None = None) -> list[bool]:
        """(E,) keep flags.

        Args:
            demonstrations: (E,) per episode, the global index of its demonstration, or None.
            has_prompt: (E,) whether the episode has a teacher prompt at all.
            gaps: global index of a probed demonstration -> (its copy gap, its tokens).
            pooled: the step's (sum of gap x tokens, tokens) over all its probes, when ``gaps``
                holds only some of them (one rank's of several); default: ``gaps``' own.
        """
        gap_tokens, tokens = pooled if pooled is not None else pooled_gap(gaps)
        if tokens > 0:
            self.last_pooled = gap_tokens / tokens
        keep = []
        for demo, present in zip(demonstrations, has_prompt):
            if not present:
                keep.append(False)
            elif demo is not None and demo in gaps:
                keep.append(gaps[demo][0] >= self.margin)
            else:
                keep.append(self.last_pooled is None or self.last_pooled >= self.margin)
        return keep


def pooled_gap(gaps: Mapping[int, tuple[float, int]]) -> tuple[float, float]:
    """(sum of gap x tokens, tokens) over the probes in ``gaps``: the pooled gap's numerator and denominator."""
    return sum(g * n for g, n in gaps.values()), float(sum(n for _, n in gaps.values()))


@torch.no_grad()
def episode_logp(model: torch.nn.Module, groups: Sequence[Group], prompts: Sequence[Sequence[int] | None],
                 packing: PackingConfig, *, temperature: float, device: str | torch.device) -> dict[int, tuple[float, int]]:
    """Per student episode with a prompt in ``prompts`` (E,): (summed log-prob of its sampled tokens after
    that prompt, full vocabulary, tempered; the number of tokens). ``model`` has tree attention on."""
    trees = teacher_trees(groups, prompts)
    if not trees.student_episodes:
        return {}
    student_of = torch.tensor(trees.student_episodes, dtype=torch.long)
    sums = torch.zeros(len(prompts), dtype=torch.float64)
    counts = torch.zeros(len(prompts), dtype=torch.long)
    was_training = model.training
    model.eval()
    try:
        for tb in pack_groups(trees.groups, torch.zeros(len(trees.student_episodes)), packing):
            logp = packed_logprobs(model, tb.to(device), temperature=temperature).logp_vocab.double().cpu()  # (M,)
            episode = student_of[tb.term_episode]  # (M,) student episode of each term
            sums.index_add_(0, episode, logp)
            counts.index_add_(0, episode, torch.ones_like(episode))
    finally:
        model.train(was_training)
    return {e: (float(sums[e]), int(counts[e])) for e in trees.student_episodes}


def copy_gaps(teacher: torch.nn.Module, student: torch.nn.Module, groups: Sequence[Group],
              probe_prompts: Sequence[Sequence[int] | None], packing: PackingConfig, *, temperature: float,
              device: str | torch.device) -> dict[int, tuple[float, int]]:
    """Global index of each probed episode -> (teacher minus student mean log-prob per token, tokens).

    ``probe_prompts`` (E,): per episode to probe, the teacher prompt that shows its own attempt.
    """
    own = [list(g.segments[g.path_indices(e.leaf)[0]].token_ids) for g in groups for e in g.episodes]
    student_prompts = [own[i] if p is not None else None for i, p in enumerate(probe_prompts)]
    taught = episode_logp(teacher, groups, probe_prompts, packing, temperature=temperature, device=device)
    plain = episode_logp(student, groups, student_prompts, packing, temperature=temperature, device=device)
    return {e: ((t - plain[e][0]) / n, n) for e, (t, n) in taught.items() if n > 0 and e in plain}
