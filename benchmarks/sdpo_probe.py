"""Is SDPO's teacher informative? Teacher vs student log-prob of sampled tokens, by context kind.

    python benchmarks/sdpo_probe.py --env treerl/Calculator-v0 --tasks 16 --group-size 8 [--model tiny-reader]

Plays ``--tasks`` groups with the model (default the shipped ``tiny``; ``tiny-reader`` is the one
trained to read such prompts) (temperature 1.0), builds SDPO's teacher
prompts with the learner's defaults, and reports the mean per-token log-prob of the sampled
tokens under the teacher minus under the student (the same weights: the step-0 EMA
teacher), split by what the teacher was shown and whether the episode succeeded:

- ``identity``: the teacher reads the student's own prompt (must be 0: a bug check of the
  teacher's packing and alignment);
- ``self-copy``: a successful episode scored under a prompt that shows *its own* attempt (the
  copy check: a model that reads its context puts this well above 0);
- ``demo``/``feedback``/``demo+feedback``, success or failure: SDPO's real contexts.

An informative teacher raises successful episodes' tokens (gap > 0) and lowers failed ones'.
It also prints one teacher prompt as the model sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import treerl
from treerl.agents.transformers_policy import TransformersPolicy
from treerl.kernels.tree_attention import enable_tree_attention
from treerl.learners.forward import packed_logprobs
from treerl.learners.packing import PackingConfig, pack_groups
from treerl.learners.sdpo import SDPOConfig
from treerl.learners.teacher import teacher_terms
from treerl.learners.teacher_context import TeacherPrompter
from treerl.models import load_model
from treerl.rollout.engine import RolloutEngine


def episode_gaps(model, groups, prompts, temperature: float) -> dict[int, tuple[float, float, int]]:
    """Per episode with a teacher prompt: (mean teacher log-prob, mean student log-prob, tokens)."""
    out: dict[int, tuple[float, float, int]] = {}
    with torch.no_grad():
        for batch in pack_groups(groups, torch.zeros(len(prompts)), PackingConfig()):
            student = packed_logprobs(model, batch, temperature=temperature)
            t = teacher_terms(model, groups, prompts, batch, PackingConfig(), temperature=temperature, device="cpu")
            for e in batch.term_episode[t.mask].unique().tolist():
                rows = (batch.term_episode == e) & t.mask
                out[e] = (float(t.logp[rows].mean()), float(student.logp_vocab[rows].mean()), int(rows.sum()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="treerl/Calculator-v0")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="A shipped model's name (tiny, tiny-reader) or a directory.")
    parser.add_argument("--reprompt-template", default=None)
    parser.add_argument("--solution-template", default=None)
    parser.add_argument("--show", type=int, default=1, help="Teacher prompts to print.")
    args = parser.parse_args()

    model, tok = load_model(args.model)
    env = treerl.make(args.env)
    policy = TransformersPolicy(model, tok)
    groups, _ = asyncio.run(RolloutEngine(policy, tok, seed=args.seed).run(
        lambda: treerl.make(args.env), args.env, range(args.tasks), args.group_size))
    overrides = {k: v for k, v in (("reprompt_template", args.reprompt_template),
                                   ("solution_template", args.solution_template)) if v is not None}
    cfg = SDPOConfig(output_dir="unused", **overrides)
    prompter = TeacherPrompter(tok, cfg.context_config(), tools=env.tool_schemas or None)
    tree = copy.deepcopy(model)
    enable_tree_attention(tree)

    rewards = [e.reward for g in groups for e in g.episodes]
    kinds: list[str] = []
    prompts: list[list[int] | None] = []
    identity: list[list[int] | None] = []
    self_copy: list[list[int] | None] = []
    first = 0
    shown = 0
    for g in groups:
        contexts = prompter.group_contexts(g, rewards[first:first + len(g.episodes)])
        for i, (e, c) in enumerate(zip(g.episodes, contexts)):
            won = e.reward >= cfg.success_threshold
            kind = ("demo+feedback" if c.demonstration is not None and c.feedback else "demo"
                    if c.demonstration is not None else "feedback" if c.feedback else "none")
            kinds.append(f"{kind} {'success' if won else 'failure'}")
            prompts.append(c.prompt_ids)
            identity.append(list(g.segments[g.path_indices(e.leaf)[0]].token_ids))
            self_copy.append(prompter.self_prompt(g, i) if won else None)
            if c.prompt_ids is not None and shown < args.show and c.demonstration is not None:
                print("---- teacher prompt (demo) ----\n" + tok.decode(c.prompt_ids) + "\n---- its completion ----\n"
                      + tok.decode([t for s in g.path_indices(e.leaf)[1:] for t in g.segments[s].token_ids]))
                shown += 1
        first += len(g.episodes)

    print(f"\n{args.env}, model {args.model or 'tiny'}: {len(groups)} groups x {args.group_size}, success {statistics.mean(rewards):.1%}")
    print(f"{'context':28s} {'episodes':>8s} {'tokens':>7s} {'teacher':>8s} {'student':>8s} {'gap':>7s}")
    for name, which, label in (("identity", identity, None), ("self-copy", self_copy, None), ("sdpo", prompts, kinds)):
        gaps = episode_gaps(tree, groups, which, cfg.temperature)
        buckets: dict[str, list[tuple[float, float, int]]] = {}
        for e, v in gaps.items():
            buckets.setdefault(name if label is None else label[e], []).append(v)
        for key, vals in sorted(buckets.items()):
            n = sum(v[2] for v in vals)
            t = sum(v[0] * v[2] for v in vals) / n
            s = sum(v[1] * v[2] for v in vals) / n
            print(f"{key:28s} {len(vals):8d} {n:7d} {t:8.3f} {s:8.3f} {t - s:+7.3f}")


if __name__ == "__main__":
    main()
