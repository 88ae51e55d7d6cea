"""The SDPO learner: self-distillation from successful siblings and environment feedback.

SDPO (Hübotter et al., "Reinforcement Learning via Self-Distillation", arXiv 2601.20802)
turns what an attempt could have known into a dense, per-token signal. The **teacher** is
the policy itself (an EMA of it, its starting weights, or the live student) reading a
prompt that also shows a successful sibling's attempt and/or the environment's feedback
on this attempt (:mod:`treerl.learners.teacher_context`). It re-scores the **same sampled
tokens** the student produced, and the student is trained towards it token by token
(:mod:`treerl.learners.divergences`), blended with GRPO's loss by ``distillation_weight``::

    run = build(cfg, ...)
    for step in run.steps():
        groups, stats = run.rollout()                       # the engine records each episode's feedback
        rewards = score_step(run, step, groups, metrics)    # environment reward + reward functions
        adv = advantages(groups, rewards, ...)              # GRPO's, for the blended part
        run.keep_sample(step, groups, adv)                  # every N steps, a few groups for `treerl view`
        prompts = teacher_prompts(groups, rewards, ...)     # per episode: demonstration / feedback -> tokens
        prompts = gate_prompts(...)                         # no teacher where it cannot copy what it is shown
        batches = pack_groups(groups, adv, ...)
        optimize(..., policy_coef=1 - w, extra_loss=Distillation(...))   # + w * distillation, per micro-batch
        ema_update(teacher, model, rate)                    # the EMA teacher follows the student
        run.publish_weights(...); run.end_step(...)
    finish(run)

Per micro-batch, :class:`Distillation` runs the teacher over the same episodes packed as
teacher trees (the teacher prompt once per distinct prompt, each completion a branch:
:mod:`treerl.learners.teacher`), then computes per term the divergence of the student
from the teacher, weighted by the detached IS ratio ``min(exp(logp - sampler_logp),
is_clip)``, and aggregates over the terms that have a teacher (``token_mean`` as in the
authors' code, or ``sequence_mean``). Terms without a teacher (no successful sibling and
no feedback) add nothing to the distillation loss; a step where most groups have nothing
to learn from raises the ``sdpo_no_teacher`` diagnostic.

Defaults follow the authors' runs (top-k 100 with a tail bucket, ``alpha = 0.5``, EMA
rate 0.05, IS clip 2, a successful sample taught by another) with the environment's
feedback shown with or without a demonstration (the authors show it only without one:
``--feedback-only-without-solution true``); ``--distillation-mode sampled_token
--distillation-alpha 1`` is TRL's default objective. Two defaults differ from the paper,
for models that cannot read a teacher prompt (the shipped tiny model, shown a successful
attempt verbatim, gives its tokens 0.8 nats less per token than without it): the **gate**
(:mod:`treerl.learners.teacher_gate`, ``--distillation-gate-margin``) drops the teacher
where a copy probe finds it uninformative, and ``distillation_weight`` is 0.5, so GRPO's
half still learns where the gate closes (``--distillation-weight 1
--distillation-gate-margin none`` is the paper's SDPO). The README's SDPO section lists how
the loss and its aggregation compare with TRL's and the authors' code.

    treerl learn --learner sdpo --env treerl/Calculator-v0 --output-dir runs/sdpo
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from treerl.agents.policy import Policy
from treerl.config import field_help
from treerl.learners.checkpoints import checkpoint_path, latest_checkpoint
from treerl.learners.core import (Evaluator, OptimizerSpec, Run, StepCallback, TrainResult, build, finish,
                                  register_learner)
from treerl.learners.diagnostics import Check
from treerl.learners.distributed import Ranks
from treerl.learners.divergences import (
    DISTILLATION_MODES,
    LMHead,
    chunked_divergence,
    importance_clip,
    sampled_token_reverse_kl,
)
from treerl.learners.entropy_control import AdaptiveEntropy
from treerl.learners.forward import PackedLogprobs
from treerl.learners.grpo import (
    GRPOConfig,
    advantages,
    optimize,
    pack_step,
    score_step,
    skips_zero_advantage_groups,
)
from treerl.learners.losses import AGGREGATIONS, LossInputs, LossNormalizer
from treerl.learners.metrics import read_floats
from treerl.learners.packing import PackedBatch
from treerl.rollout.rewards import RewardFunc, combine_rewards
from treerl.learners.teacher import TEACHER_KINDS, EMAAdapters, ema_update, make_teacher, rebasable, teacher_terms
from treerl.learners.teacher_context import TeacherContext, TeacherContextConfig, TeacherPrompter, context_metrics
from treerl.learners.teacher_gate import TeacherGate, copy_gaps, pooled_gap
from treerl.rollout.trajectory import Group

__all__ = ["SDPOConfig", "Distillation", "SDPO_CHECKS", "gate_prompts", "teacher_prompts", "train"]

DISTILLATION_AGGREGATIONS = ("token_mean", "sequence_mean")

SDPO_CHECKS: tuple[Check, ...] = (
    Check("sdpo_no_teacher", "sdpo/no_teacher_group_frac", 0.9, True,
          "Most groups gave SDPO nothing to learn from: no episode reached success_threshold (so no sibling "
          "could demonstrate) and the environment gave no feedback. Lower --success-threshold, raise "
          "--group-size, keep --use-feedback on with an environment whose feedback() says what went wrong, or "
          "blend in GRPO with --distillation-weight below 1."),
    Check("sdpo_teacher_gated", "sdpo/gated_frac", 0.9, True,
          "The gate turned most of SDPO's teachers off: shown a successful attempt, the teacher gives it a lower "
          "log-prob than the student (sdpo/copy_gap < --distillation-gate-margin), so this model does not read "
          "its teacher prompt. Learning comes from GRPO's share (--distillation-weight below 1); try other "
          "--reprompt-template/--solution-template, or a model that can use its context (--model tiny-reader "
          "instead of the shipped tiny)."),
)


@dataclass
class SDPOConfig(GRPOConfig):
    """Options of ``treerl learn --learner sdpo`` (GRPO's, plus the distillation, the teacher and its prompts)."""

    # TRL's experimental SDPOConfig names where the meaning is the same (its teacher_model_kind="base" and
    # distillation_mode="topk_logits"/"full_logits" are taken as the values of their own names here).
    ALIASES: ClassVar[dict[str, str]] = {
        **GRPOConfig.ALIASES, "teacher_model_kind": "teacher", "success_reward_threshold": "success_threshold",
        "include_environment_feedback": "use_feedback",
        "environment_feedback_only_without_solution": "feedback_only_without_solution",
        "max_reprompt_len": "max_teacher_prompt_tokens",
    }
    UNSUPPORTED: ClassVar[dict[str, str]] = {
        **GRPOConfig.UNSUPPORTED,
        **dict.fromkeys(("diagnostics_warning_interval", "diagnostics_flat_tolerance"),
                        "SDPO's diagnostics (sdpo_no_teacher, sdpo_teacher_gated) are checked after every step and "
                        "written to output_dir/diagnostics.jsonl with their fix; they take no options"),
    }
    # TRL's options taken at the one value that is what this learner does, refused at any other.
    FIXED: ClassVar[dict[str, tuple[Any, str]]] = {
        "dont_reprompt_on_self_success": (True, "an episode is never its own demonstration: a successful one is "
                                                "taught by another successful sibling"),
        "teacher_sync_steps": (1, "the EMA teacher (teacher='ema') follows the student after every step, at "
                                  "teacher_update_rate"),
        "use_teacher_server": (False, "the teacher is scored in the learner (a copy of the initial weights, an EMA "
                                      "or the live student), never by a vLLM server"),
    }
    TRANSLATED: ClassVar[dict[str, tuple[type, str]]] = {
        **GRPOConfig.TRANSLATED,
        **{name: (type(value), f"TRL's: {value} only ({why}).") for name, (value, why) in FIXED.items()},
    }

    distillation_weight: float = field_help(0.5, "Loss = (1 - w) * GRPO loss + w * distillation loss; 1 is SDPO "
                                                 "alone (the paper's), 0 is GRPO. The default blends: where the "
                                                 "gate finds the teacher uninformative, GRPO still learns.")
    distillation_gate_margin: float | None = field_help(
        0.0, "Distill only where the teacher can copy: shown a successful attempt, it must give that attempt's "
             "tokens a mean log-prob at least the student's plus this margin (per demonstration; feedback-only "
             "episodes by the step's pooled probe). Unset (none): always distill.")
    distillation_mode: str = field_help("topk", "sampled_token (reverse KL at the sampled token), topk (over the "
                                                "student's top-k; TRL's topk_logits) or full (the whole vocabulary; "
                                                "TRL's full_logits).")
    distillation_alpha: float = field_help(0.5, "0 forward KL(teacher||student), 1 reverse KL, between: generalized "
                                                "JSD (sampled_token needs 1).")
    distillation_topk: int = field_help(100, "Tokens of the student's top-k support (topk mode).")
    distillation_add_tail: bool = field_help(True, "topk: the mass outside the top-k is one more category (else "
                                                   "the top-k are renormalized).")
    distillation_is_clip: float | None = field_help(2.0, "Clip of the detached ratio exp(logp - sampler_logp) "
                                                         "weighting each distillation term; unset: no weight.")
    distillation_aggregation: str = field_help("token_mean", "Over the terms that have a teacher: token_mean or "
                                                             "sequence_mean.")
    distillation_chunk_tokens: int = field_help(256, "Rows of logits built at once for topk/full (memory bound).")
    teacher: str = field_help("initial", "The teacher's weights: initial (the frozen start, the default; TRL's "
                                         "base), ema (of the student, the paper's) or live (the student). The start "
                                         "keeps the reading of its context it began with; an EMA teacher follows the "
                                         "student and can lose it (BENCHMARKS.md, SDPO vs GRPO).")
    teacher_update_rate: float = field_help(0.05, "EMA teacher: teacher <- (1 - rate) teacher + rate student, "
                                                  "each step.")
    success_threshold: float = field_help(1.0, "An episode whose reward reaches this can demonstrate for its "
                                               "siblings.")
    use_successful_as_teacher: bool = field_help(True, "Show a successful sibling's attempt to the teacher.")
    use_feedback: bool = field_help(True, "Show the environment's feedback on the attempt (Env.feedback()) to the "
                                          "teacher.")
    feedback_only_without_solution: bool = field_help(False, "Show feedback only when no sibling demonstrates.")
    remove_thinking_from_demonstration: bool = field_help(False, "Drop <think>...</think> from demonstrations.")
    max_teacher_prompt_tokens: int = field_help(1024, "Length bound of a teacher prompt; the demonstration and "
                                                      "feedback are shortened to fit.")
    reprompt_template: str = field_help(TeacherContextConfig.reprompt_template,
                                        "The teacher's last user turn, from {prompt}, {solution} and {feedback}.")
    solution_template: str = field_help(TeacherContextConfig.solution_template,
                                        "The {solution} part, around {successful_previous_attempt}.")
    feedback_template: str = field_help(TeacherContextConfig.feedback_template,
                                        "The {feedback} part, around {feedback_raw}.")

    @classmethod
    def translate_options(cls, given: dict[str, Any]) -> dict[str, Any]:
        """GRPO's translations, and TRL's options of :attr:`FIXED` taken at their value only.

        >>> SDPOConfig.translate_options({"teacher_sync_steps": 1, "teacher": "ema"})
        {'teacher': 'ema'}
        """
        values = dict(given)
        for name, (value, why) in cls.FIXED.items():
            if name in values and values.pop(name) != value:
                raise TypeError(f"{cls.__name__}() has no option {name} other than {value}: {why}.")
        return super().translate_options(values)

    def __post_init__(self) -> None:
        # TRL's values of teacher_model_kind and distillation_mode, read as their names here.
        self.teacher = {"base": "initial"}.get(self.teacher, self.teacher)
        self.distillation_mode = {"topk_logits": "topk", "full_logits": "full"}.get(self.distillation_mode,
                                                                                    self.distillation_mode)
        super().__post_init__()
        if self.num_iterations != 1:
            raise ValueError(f"num_iterations={self.num_iterations}: SDPO takes one update per step (its teacher's "
                             "terms are for the weights that sampled); use --learner grpo for several.")
        if self.num_minibatches != 1:
            raise ValueError(f"num_minibatches={self.num_minibatches} (TRL's steps_per_generation / "
                             "gradient_accumulation_steps): SDPO takes one update per step, on all of its episodes "
                             "(its teacher's terms are for the weights that sampled); use --learner grpo to split a "
                             "step into several optimizer steps.")
        if not 0.0 <= self.distillation_weight <= 1.0:
            raise ValueError(f"distillation_weight={self.distillation_weight} must be in [0, 1] (1: SDPO alone, "
                             "0: GRPO alone, between: a blend).")
        if self.distillation_mode not in DISTILLATION_MODES:
            raise ValueError(f"distillation_mode={self.distillation_mode!r}: use one of {DISTILLATION_MODES}.")
        if not 0.0 <= self.distillation_alpha <= 1.0:
            raise ValueError(f"distillation_alpha={self.distillation_alpha} must be in [0, 1] (0 forward KL, "
                             "1 reverse KL, 0.5 JSD).")
        if self.distillation_mode == "sampled_token" and self.distillation_alpha != 1.0:
            raise ValueError(f"distillation_alpha={self.distillation_alpha} with distillation_mode=sampled_token: "
                             "the sampled-token form estimates the reverse KL only; pass --distillation-alpha 1, "
                             "or --distillation-mode topk for other divergences.")
        if self.distillation_topk is None:  # TRL's default (unset outside its topk_logits mode)
            raise ValueError("distillation_topk=None: here it is always a number, the top-k of topk mode (default "
                             "100, unused by the other modes); drop it or give one.")
        if self.distillation_topk < 1:
            raise ValueError(f"distillation_topk={self.distillation_topk} must be >= 1 (the authors use 100).")
        if self.distillation_is_clip is not None and not self.distillation_is_clip > 0:
            raise ValueError(f"distillation_is_clip={self.distillation_is_clip} must be > 0 (e.g. 2), or unset for "
                             "no importance weight.")
        if self.distillation_aggregation not in DISTILLATION_AGGREGATIONS:
            raise ValueError(f"distillation_aggregation={self.distillation_aggregation!r}: use one of "
                             f"{DISTILLATION_AGGREGATIONS}.")
        if self.distillation_chunk_tokens < 1:
            raise ValueError(f"distillation_chunk_tokens={self.distillation_chunk_tokens} must be >= 1.")
        if self.teacher not in TEACHER_KINDS:
            raise ValueError(f"teacher={self.teacher!r}: use one of {TEACHER_KINDS}.")
        if self.sync_ref_model and self.teacher == "initial":
            raise ValueError("sync_ref_model=True with teacher='initial': the initial teacher is the --beta "
                             "reference here, which sync_ref_model moves away from the starting weights; use "
                             "--teacher ema (itself a moving average of the student) or live, or "
                             "sync_ref_model=False.")
        if not 0.0 <= self.teacher_update_rate <= 1.0:
            raise ValueError(f"teacher_update_rate={self.teacher_update_rate} must be in [0, 1] (the authors use "
                             "0.05).")
        if self.max_teacher_prompt_tokens + self.max_episode_tokens > self.max_tokens_per_row:
            raise ValueError(f"max_teacher_prompt_tokens={self.max_teacher_prompt_tokens} plus max_episode_tokens="
                             f"{self.max_episode_tokens} exceed max_tokens_per_row={self.max_tokens_per_row}, so a "
                             "teacher sequence might not fit one packed row; raise --max-tokens-per-row or lower "
                             "--max-teacher-prompt-tokens.")
        self.context_config()

    def context_config(self) -> TeacherContextConfig:
        return TeacherContextConfig(
            success_threshold=self.success_threshold, use_successful=self.use_successful_as_teacher,
            use_feedback=self.use_feedback, feedback_only_without_solution=self.feedback_only_without_solution,
            remove_thinking=self.remove_thinking_from_demonstration, max_prompt_tokens=self.max_teacher_prompt_tokens,
            reprompt_template=self.reprompt_template, solution_template=self.solution_template,
            feedback_template=self.feedback_template)


# -- the stages -----------------------------------------------------------------------------------


def weighted_rewards(rewards: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """(E, R) reward columns -> (E,) each episode's reward as the advantages weigh it: a reward function's
    None (NaN) left out of the sum."""
    return combine_rewards(rewards, torch.tensor(weights, dtype=rewards.dtype))


def teacher_prompts(groups: Sequence[Group], rewards: torch.Tensor, weights: Sequence[float],
                    prompter: TeacherPrompter, metrics: dict[str, float],
                    contexts_out: list[list[TeacherContext]] | None = None,
                    ranks: Ranks = Ranks()) -> list[list[int] | None]:
    """(E,) per episode (groups in order) its teacher prompt ids, or None when it has no teacher.

    ``contexts_out``, if given, receives each group's :class:`TeacherContext` list. The
    ``sdpo/*`` fractions added to ``metrics`` count every rank's episodes and groups."""
    totals = weighted_rewards(rewards, weights).tolist()
    contexts, prompts, first = [], [], 0
    for group in groups:
        group_contexts = prompter.group_contexts(group, totals[first:first + len(group.episodes)])
        for i, context in enumerate(group_contexts):
            if context.prompt_ids is not None and not rebasable(group, i):
                context.prompt_ids = None  # re-rooted by a template that was not append-only
            prompts.append(context.prompt_ids)
        contexts.append(group_contexts)
        first += len(group.episodes)
    local = context_metrics(contexts)
    # Each fraction is over episodes or over groups: weighted by those, the ranks' means are the step's.
    by_group = {k: v for k, v in local.items() if k.endswith("_group_frac")}
    metrics.update(ranks.mean_metrics({k: v for k, v in local.items() if k not in by_group}, weight=len(prompts)))
    metrics.update(ranks.mean_metrics(by_group, weight=len(groups)))
    if contexts_out is not None:
        contexts_out.extend(contexts)
    return prompts


def gate_prompts(run: Run, teacher: torch.nn.Module, gate: TeacherGate, groups: Sequence[Group],
                 contexts: Sequence[Sequence[TeacherContext]], prompts: list[list[int] | None],
                 prompter: TeacherPrompter, metrics: dict[str, float]) -> list[list[int] | None]:
    """``prompts`` with the teacher removed where the copy probe finds it uninformative
    (:mod:`treerl.learners.teacher_gate`); adds ``sdpo/gated_frac`` and ``sdpo/copy_gap``."""
    start = time.perf_counter()
    demonstrations: list[int | None] = []
    probes: list[list[int] | None] = [None] * len(prompts)
    first = 0
    for group, group_contexts in zip(groups, contexts):
        for c in group_contexts:
            demo = None if c.demonstration is None or c.prompt_ids is None else first + c.demonstration
            demonstrations.append(demo)
            if demo is not None and probes[demo] is None:
                probes[demo] = prompter.self_prompt(group, c.demonstration)
        first += len(group.episodes)
    gaps = copy_gaps(teacher, run.model, groups, probes, run.cfg.packing_config(), temperature=run.cfg.temperature,
                     device=run.device) if any(p is not None for p in probes) else {}
    # Feedback-only episodes are judged by the step's pooled gap: every rank's probes, as on one process.
    gap_tokens, tokens = run.ranks.sum(pooled_gap(gaps))
    keep = gate.decide(demonstrations, [p is not None for p in prompts], gaps, pooled=(gap_tokens, tokens))
    gated = [p if k else None for p, k in zip(prompts, keep)]
    with_teacher, kept, probed = run.ranks.sum([sum(p is not None for p in prompts),
                                                sum(p is not None for p in gated), len(gaps)])
    metrics["sdpo/gated_frac"] = (with_teacher - kept) / max(with_teacher, 1)
    metrics["sdpo/copy_probes"] = probed
    if tokens > 0:
        metrics["sdpo/copy_gap"] = gap_tokens / tokens
    metrics["perf/gate_s"] = time.perf_counter() - start
    return gated


class Distillation:
    """SDPO's loss for :func:`~treerl.learners.grpo.optimize`'s ``extra_loss``: one micro-batch at a time.

    Holds the step's teacher prompts and the normalizer over every term that has a teacher
    (all micro-batches, all ranks), and accumulates the step's ``sdpo/*`` metrics. With
    ``success`` (E,) it also reports the teacher's log-prob minus the student's on the tokens
    of successful and of failed episodes (``sdpo/logp_gap_success``, ``.._failure``): an
    informative teacher raises the first and lowers the second.
    """

    def __init__(self, run: Run, teacher: torch.nn.Module, groups: Sequence[Group],
                 prompts: Sequence[list[int] | None], batches: Sequence[PackedBatch],
                 success: torch.Tensor | None = None):
        cfg = run.cfg
        self.run, self.cfg, self.teacher, self.groups, self.prompts = run, cfg, teacher, groups, prompts
        self.has_teacher = torch.tensor([p is not None for p in prompts], dtype=torch.bool)  # (E,)
        self.success = success
        counts = torch.zeros(len(prompts), dtype=torch.long)  # (E,) each episode's terms with a teacher
        for b in batches:
            counts += torch.bincount(b.term_episode[self.has_teacher[b.term_episode]], minlength=len(prompts))
        num_tokens, num_sequences = run.ranks.sum([int(counts.sum()), int((counts > 0).sum())])
        self.normalizer = None if num_tokens == 0 else LossNormalizer(
            num_tokens=num_tokens, num_sequences=num_sequences, episode_num_tokens=counts)
        # What each micro-batch adds, tensors kept as they are: read back once in step_metrics, not
        # as host syncs in the middle of every micro-batch's forward.
        self._added: list[tuple[str, torch.Tensor | float]] = []

    def __call__(self, batch: PackedBatch, out: PackedLogprobs) -> torch.Tensor:
        """The micro-batch's share of ``distillation_weight * distillation loss`` (0 without teacher terms)."""
        zero = out.logp.sum() * 0.0  # keeps the graph whole when there is nothing to distill
        if self.normalizer is None or not bool(self.has_teacher[batch.term_episode.cpu()].any()):
            return zero
        cfg, device = self.cfg, out.logp.device
        start = time.perf_counter()
        fp32_head = getattr(getattr(self.run, "precision", None), "fp32_head", False)
        t = teacher_terms(self.teacher, self.groups, self.prompts, batch, cfg.packing_config(),
                          temperature=cfg.temperature, device=device, fp32_head=fp32_head)
        self._add("perf/teacher_s", time.perf_counter() - start)
        self._add("_teacher_tokens", t.num_tokens)
        self._add("_teacher_path_tokens", t.num_path_tokens)
        idx = t.mask.nonzero().squeeze(1)  # (K,) terms with a teacher
        student_logp = out.logp_vocab[idx]  # (K,) full vocabulary, as the teacher's
        if cfg.distillation_mode == "sampled_token":
            per_term = sampled_token_reverse_kl(student_logp, t.logp[idx])
            divergence = (student_logp - t.logp[idx]).detach()  # the sampled estimate of KL(student || teacher)
        else:
            per_term = chunked_divergence(
                out.hidden[batch.term_loss.to(device)[idx]], LMHead.of(self.run.model), t.hidden[idx],
                LMHead.of(self.teacher), mode=cfg.distillation_mode, alpha=cfg.distillation_alpha,
                topk=cfg.distillation_topk, add_tail=cfg.distillation_add_tail, temperature=cfg.temperature,
                chunk_tokens=cfg.distillation_chunk_tokens, fp32_head=fp32_head)
            divergence = per_term.detach()
        sampler_logp = batch.term_sampler_logp.to(device)[idx]
        weight = importance_clip(out.logp[idx], sampler_logp, cfg.distillation_is_clip)  # (K,) detached
        per_term = per_term * weight
        episode = batch.term_episode.to(device)[idx]
        inputs = LossInputs(logp=student_logp, old_logp=student_logp.detach(), sampler_logp=sampler_logp,
                            adv=torch.zeros_like(sampler_logp), episode=episode, num_episodes=batch.num_episodes)
        loss = AGGREGATIONS[cfg.distillation_aggregation](per_term, inputs, cfg.loss_config(), self.normalizer)
        self._add("loss/distill", loss.detach())
        self._add("_terms", idx.numel())
        self._add("_divergence", divergence.sum())
        self._add("_teacher_logp", t.logp[idx].detach().sum())
        self._add("_student_logp", student_logp.detach().sum())
        if cfg.distillation_is_clip is not None:
            raw = (out.logp[idx].detach() - sampler_logp).clamp(max=20.0).exp()
            self._add("_is_clipped", (raw > cfg.distillation_is_clip).sum())
        if self.success is not None:
            gap = t.logp[idx].detach() - student_logp.detach()  # (K,)
            won = self.success.to(device)[episode]
            self._add("_gap_success", gap[won].sum())
            self._add("_terms_success", won.sum())
            self._add("_gap_failure", gap[~won].sum())
            self._add("_terms_failure", (~won).sum())
        return cfg.distillation_weight * loss

    def _add(self, key: str, value: torch.Tensor | float) -> None:
        self._added.append((key, value))

    def step_metrics(self) -> dict[str, float]:
        """The step's distillation metrics, summed over ranks (means over the terms with a teacher)."""
        mine: dict[str, float] = {}
        for (key, _), value in zip(self._added, read_floats([value for _, value in self._added])):
            mine[key] = mine.get(key, 0.0) + value
        keys = ["loss/distill", "_terms", "_divergence", "_teacher_logp", "_student_logp", "_is_clipped",
                "_teacher_tokens", "_teacher_path_tokens", "_gap_success", "_terms_success", "_gap_failure",
                "_terms_failure"]
        totals = dict(zip(keys, self.run.ranks.sum([mine.get(k, 0.0) for k in keys])))
        terms = totals["_terms"]
        metrics = {"loss/distill": totals["loss/distill"], "sdpo/distill_terms": terms,
                   "perf/teacher_s": mine.get("perf/teacher_s", 0.0)}
        if terms > 0:
            metrics.update({
                "sdpo/divergence": totals["_divergence"] / terms,
                "sdpo/teacher_logp": totals["_teacher_logp"] / terms,
                "sdpo/student_logp": totals["_student_logp"] / terms,
                "sdpo/is_clip_frac": totals["_is_clipped"] / terms,
                "sdpo/teacher_packing_ratio": totals["_teacher_path_tokens"] / max(totals["_teacher_tokens"], 1.0),
            })
        for side in ("success", "failure"):
            if totals[f"_terms_{side}"] > 0:
                metrics[f"sdpo/logp_gap_{side}"] = totals[f"_gap_{side}"] / totals[f"_terms_{side}"]
        return metrics


def sdpo_step(run: Run, teacher: torch.nn.Module, prompter: TeacherPrompter, step: int,
              gate: TeacherGate | None = None) -> dict[str, float]:
    """One SDPO step on the run's parts; returns the logged metrics."""
    cfg, metrics = run.cfg, {}
    start = time.perf_counter()
    groups, stats = run.rollout()
    metrics["perf/rollout_s"] = time.perf_counter() - start
    rewards = score_step(run, step, groups, metrics)
    adv = advantages(groups, rewards, run.reward_weights, cfg, metrics, run.ranks)
    # Before the update, as GRPO: the stored trainer log-probs are those the step's IS weights saw.
    # The advantage shown is GRPO's (what the (1 - w) part trains with; SDPO alone ignores it).
    run.keep_sample(step, groups, adv, rewards)
    contexts: list[list[TeacherContext]] = []
    prompts = teacher_prompts(groups, rewards, run.reward_weights, prompter, metrics, contexts, run.ranks)
    if gate is not None and cfg.distillation_weight > 0:
        prompts = gate_prompts(run, teacher, gate, groups, contexts, prompts, prompter, metrics)
    # GRPO alone (no distillation) may leave groups without advantages out: its shortcut holds.
    batches, normalizer = pack_step(groups, adv, cfg, run.ranks, metrics, skip_zero_advantage=(
        cfg.distillation_weight == 0 and skips_zero_advantage_groups(cfg, run.ranks)))
    distill = None
    if cfg.distillation_weight > 0:
        success = weighted_rewards(rewards, run.reward_weights) >= cfg.success_threshold
        distill = Distillation(run, teacher, groups, prompts, batches, success)
    entropy_control = AdaptiveEntropy.of_run(cfg, run.state.extra)
    optimize(run.model, run.optimizer, run.scheduler, batches, cfg, run.device, metrics, run.ranks,
             ref_model=run.reference if cfg.beta > 0 else None, normalizer=normalizer,
             policy_coef=1.0 - cfg.distillation_weight, extra_loss=distill, precision=run.precision,
             entropy_control=entropy_control, before_step=lambda: run.before_optimizer_step(step + 1))
    if entropy_control is not None:
        entropy_control.save(run.state.extra)
    if distill is not None:
        metrics.update(distill.step_metrics())
    if cfg.teacher == "ema":
        ema_update(teacher, run.model, cfg.teacher_update_rate)
    run.after_optimizer_step(step + 1, metrics)  # one optimizer step per step
    run.publish_weights(metrics)
    return run.end_step(step, metrics, stats, num_episodes=len(adv), batches=batches)


# -- the EMA teacher in checkpoints -------------------------------------------------------------

_TEACHER_FILE = "teacher.safetensors"


def _save_teacher(run: Run, teacher: torch.nn.Module) -> None:
    """Next to the checkpoint the core just wrote (if any), the EMA teacher's weights (with LoRA, its adapters),
    unless it holds the model only (``save_only_model``: the teacher is training state)."""
    from safetensors.torch import save_file, save_model

    path = checkpoint_path(run.out_dir, run.state.step)
    if (run.ranks.is_main and not run.cfg.save_only_model and path.is_dir()
            and not (path / _TEACHER_FILE).exists()):
        if isinstance(teacher, EMAAdapters):
            save_file({k: v.contiguous() for k, v in teacher.weights.items()}, str(path / _TEACHER_FILE))
        else:
            save_model(teacher, str(path / _TEACHER_FILE))


def _resume_teacher(run: Run, teacher: torch.nn.Module) -> None:
    """A resumed run's EMA teacher continues from its checkpoint (or from the resumed student)."""
    from safetensors.torch import load_file, load_model

    ckpt = latest_checkpoint(run.out_dir) if run.state.step > 0 else None
    if ckpt is not None and Path(ckpt, _TEACHER_FILE).exists():
        if isinstance(teacher, EMAAdapters):
            teacher.load(load_file(str(Path(ckpt, _TEACHER_FILE))))
        else:
            load_model(teacher, str(Path(ckpt, _TEACHER_FILE)))


def train(cfg: SDPOConfig, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
          policy: Policy | None = None, env_factory: Callable[[], Any] | None = None,
          reward_funcs: Sequence[RewardFunc] = (), reward_weights: Sequence[float] | None = None,
          optimizer: OptimizerSpec | None = None, callbacks: Sequence[StepCallback] = (),
          evaluate: Evaluator | None = None) -> TrainResult:
    """Train with SDPO on ``cfg.env``; the arguments are those of :func:`treerl.learners.grpo.train`."""
    run = build(cfg, model=model, tokenizer=tokenizer, policy=policy, env_factory=env_factory,
                reward_funcs=reward_funcs, reward_weights=reward_weights, optimizer=optimizer,
                reference=cfg.beta > 0 or cfg.teacher == "initial", callbacks=callbacks, evaluate=evaluate)
    teacher = make_teacher(cfg.teacher, run.model, run.reference)
    if cfg.teacher == "ema":
        _resume_teacher(run, teacher)
    env = run.env_factory()
    try:
        prompter = TeacherPrompter(run.tokenizer, cfg.context_config(), tools=env.tool_schemas or None)
    finally:
        env.close()
    gate = None if cfg.distillation_gate_margin is None else TeacherGate(cfg.distillation_gate_margin)
    if run.diagnostics is not None:
        run.diagnostics.checks = (*run.diagnostics.checks, *SDPO_CHECKS)
    with run:
        for step in run.steps():
            sdpo_step(run, teacher, prompter, step, gate)
            if cfg.teacher == "ema":
                _save_teacher(run, teacher)
    result = finish(run)
    if cfg.teacher == "ema":
        _save_teacher(run, teacher)
    return result


register_learner("sdpo", SDPOConfig, train, "SDPO: self-distillation from successful siblings and environment "
                                            "feedback, blended with GRPO by --distillation-weight.")
