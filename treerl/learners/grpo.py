"""The GRPO learner: rollout trees -> rewards -> advantages -> tree packing -> loss -> step -> sync.

:func:`train` is the loop of the learner core (:mod:`treerl.learners.core`) over GRPO's stages,
one function each::

    run = build(cfg, ...)
    for step in run.steps():
        groups, stats = run.rollout()                     # the engine, G generations per task
        rewards = score(groups, ...)                      # environment reward + TRL-style reward functions
        adv = advantages(groups, rewards, ...)            # group baseline, scaled
        run.keep_sample(step, groups, adv)                # every N steps, a few groups for `treerl view`
        batches = pack_groups(groups, adv, ...)           # each unique token once, rows by attention work
        optimize(run, batches, ...)                       # forward with tree attention, loss, backward, step
                                                          # (num_minibatches: one on each shuffled part of them)
        run.publish_weights(...)                          # the sampler gets the new weights and version
        run.end_step(...)                                 # log, diagnose, checkpoint
    finish(run)

Everything after the rollout is :func:`update`, which AsyncGRPO (:mod:`~treerl.learners.async_grpo`)
calls with the groups it takes from its buffer instead.

The loss is any of :data:`~treerl.learners.losses.POLICY_LOSSES` (``--loss dapo`` and its
variants, or one added with :func:`~treerl.learners.losses.register_loss`). On-policy with one
update per step, the PPO ratio is 1 and the sampler/trainer gap is corrected by importance
weights (:mod:`~treerl.learners.importance`).

Under ``accelerate launch`` (or ``torchrun``) each process plays every ``R``-th task of the
step, the loss normalizers and the gradients are summed over the ``R`` processes, and every
process takes the single-process optimizer step; rank 0 logs, checkpoints, saves and
evaluates (:mod:`treerl.learners.distributed`)::

    accelerate launch --multi_gpu --num_processes 2 -m treerl.cli learn --env ID --output-dir runs/x
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch

from treerl.agents.policy import Policy
from treerl.config import field_help
from treerl.learners.advantages import MULTI_REWARD_MODES, AdvantageConfig, compute_advantages
from treerl.learners.centering import batch_centering
from treerl.learners.config import LearnerConfig
from treerl.learners.core import (Evaluator, OptimizerSpec, Run, StepCallback, TrainResult, build, finish,
                                  register_learner)
from treerl.learners.distributed import Ranks
from treerl.learners.entropy_control import AdaptiveEntropy
from treerl.learners.forward import (PackedLogprobs, loss_inputs, packed_logprobs, router_aux_loss_coef,
                                     router_top_k)
from treerl.learners.importance import ImportanceConfig, importance_weights
from treerl.learners.metrics import read_floats
from treerl.learners.losses import (POLICY_LOSSES, LossCoefficients, LossConfig, LossNormalizer, compute_loss,
                                   high_entropy_threshold)
from treerl.learners.packing import PackedBatch, pack_groups
from treerl.learners.precision import Precision
from treerl.rollout.rewards import RewardFunc, StepState, reward_func_name, score, write_extras
from treerl.rollout.summary import RolloutStats
from treerl.rollout.trajectory import Episode, Group

__all__ = ["GRPOConfig", "TrainResult", "train", "RewardFunc"]


@dataclass
class GRPOConfig(LossCoefficients, LearnerConfig):
    """Options of ``treerl learn`` (GRPO and its loss variants on trajectory trees)."""

    # TRL's importance-sampling options (its vLLM correction), translated into the is_* fields below.
    TRANSLATED: ClassVar[dict[str, tuple[type, str]]] = {
        **LearnerConfig.TRANSLATED,
        "vllm_importance_sampling_correction": (bool, "TRL's: false is --is-mode off; true (TRL's default) keeps the "
                                                      "--is-* settings (treerl's: token-level, truncated at 2)."),
        "vllm_importance_sampling_mode": (str, "TRL's token_truncate, token_mask, sequence_truncate or "
                                               "sequence_mask: --is-level and --is-mode."),
        **dict.fromkeys(("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap"),
                        (float | None, "TRL's: --is-ratio-high (none: no upper bound).")),
        "vllm_importance_sampling_clip_min": (float | None, "TRL's: --is-ratio-low (none: 0)."),
    }

    loss: str = field_help("dapo", "Policy loss: grpo, dapo, dr_grpo, gspo, cispo, sapo, vespo, dppo, or one added "
                                   "with register_loss (--import your module).")
    max_completion_length: int | None = field_help(None, "TRL's: the most tokens an episode's completion (its turns, "
                                                         "tool results between them) may have; it ends there, and "
                                                         "--max-new-tokens is this unless given. Also dr_grpo's "
                                                         "constant normalizer (default: max_episode_tokens).")
    advantage_estimator: str = field_help("grpo", "Baseline: grpo (group mean) or rloo (leave-one-out).")
    advantage_scale: str = field_help("group", "Divide advantages by the std of the group, the batch, or none.")
    multi_objective_aggregation: str = field_help(
        "sum_then_normalize", "How the reward columns (the environment's reward, then each --reward-funcs function) "
                              "make one advantage, TRL's choices: sum_then_normalize (their --reward-weights sum, "
                              "then the baseline and --advantage-scale) or normalize_then_sum (GDPO: each column "
                              "(r - group mean) / (group std + 1e-4), None left out; their weighted sum, then "
                              "(x - batch mean) / (batch std + 1e-4); an episode no function scored gets 0). With "
                              "normalize_then_sum the environment's reward is one more column, left out when "
                              "weighted 0 (as treerl.GRPOTrainer weights it), and --advantage-scale changes nothing, "
                              "as in TRL.")
    is_level: str = field_help("token", "Importance sampling between sampler and trainer: token or sequence.")
    is_mode: str = field_help("truncate", "truncate, mask or off.")
    is_ratio_high: float = field_help(2.0, "Upper bound of the sampler/trainer ratio.")
    is_ratio_low: float = field_help(0.0, "Lower bound of the sampler/trainer ratio (0: none).")
    off_policy_mask_threshold: float | None = field_help(
        None, "Off-policy sequence masking (DeepSeek-V3.2, TRL's): an episode with a negative advantage whose mean "
              "log(sampler / trainer) over its tokens exceeds this adds no policy loss (e.g. 0.5); unset: off.")
    skip_zero_advantage: bool = field_help(True, "Leave groups whose advantages are all 0 out of the forward pass "
                                                 "(the same update when beta and entropy_coef are 0 and no "
                                                 "router_aux_loss_coef applies; one process).")
    mask_truncated_completions: bool = field_help(
        False, "TRL's (DAPO's overlong filtering): an episode a token limit cut (its last turn stopped at "
               "--max-new-tokens, or it reached --max-episode-tokens) adds no loss: none of its tokens, in every "
               "turn, is trained on or counted in the loss's token count; it still counts in its group's "
               "advantages and, as in TRL, among the episodes a sequence-mean loss averages over.")
    top_entropy_quantile: float = field_help(
        1.0, "TRL's (Beyond the 80/20 Rule's rho): only the sampled tokens whose entropy is in this top share of "
             "the optimizer step's (every micro-batch's, every process's; with num_minibatches, the minibatch's) "
             "add policy loss (and entropy bonus); the KL and the normalizers keep every token. 1 keeps all; the "
             "paper uses 0.2; 0 the highest-entropy token(s).")
    use_adaptive_entropy: bool = field_help(
        False, "TRL's (Skywork-OR1's adaptive entropy control): --entropy-coef is the starting coefficient; after "
               "each optimizer step it grows by entropy_coef_delta when the step's mean entropy was at or below "
               "entropy_target, else shrinks by it, within [entropy_coef_min, entropy_coef_max]; a step's bonus "
               "applies only when the previous optimizer step's entropy was at or below the target.")
    entropy_coef_min: float = field_help(0.0, "With use_adaptive_entropy: the coefficient's lower bound.")
    entropy_coef_max: float = field_help(1.0, "With use_adaptive_entropy: the coefficient's upper bound.")
    entropy_coef_delta: float = field_help(0.005, "With use_adaptive_entropy: the coefficient's change per "
                                                  "optimizer step.")
    entropy_target: float = field_help(0.2, "With use_adaptive_entropy: the mean entropy (nats) of a step's trained "
                                            "tokens at or below which the bonus applies and grows; models start at "
                                            "2-10 nats, so set it near the early entropy/mean (TRL's advice).")
    num_iterations: int = field_help(1, "Optimizer steps on each step's episodes (GRPO's mu, TRL's num_iterations). "
                                        "The old policy of the clipped losses is the weights before the first, so "
                                        "above 1 the ratio moves and --epsilon-low/--epsilon-high clip; 1 (the "
                                        "default) is on-policy: ratio 1, only the sampler's importance weights act.")
    sync_ref_model: bool = field_help(False, "TR-DPO's moving reference (TRL's): every ref_model_sync_steps "
                                             "optimizer steps the --beta reference becomes ref_model_mixup_alpha x "
                                             "the policy + (1 - alpha) x itself, instead of staying the starting "
                                             "weights. Needs --beta > 0 and no LoRA, as in TRL.")
    ref_model_mixup_alpha: float = field_help(0.6, "With sync_ref_model: the policy's share of each reference update "
                                                   "(TR-DPO's alpha, in [0, 1]).")
    ref_model_sync_steps: int = field_help(512, "With sync_ref_model: optimizer steps between reference updates "
                                                "(TR-DPO's tau), counted over the run as TRL's global_step (a step "
                                                "takes num_iterations x num_minibatches of them).")
    num_minibatches: int = field_help(
        1, "Optimizer steps per pass over each step's episodes (TRL's steps_per_generation / "
           "gradient_accumulation_steps): the episodes are shuffled (by --seed and the step) and split into this "
           "many equal minibatches, episodes not groups, each packed on its own and taking one optimizer step; "
           "num_iterations passes. The clipped losses' old policy is the weights that sampled (before the first "
           "step); dapo's token normalizer is the step's tokens / num_minibatches, the sequence means each "
           "minibatch's, as TRL's. 1: one optimizer step on all of them.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epsilon_high is None:  # TRL's default: epsilon_low's value (config.json then says which)
            self.epsilon_high = self.epsilon_low
        # TRL's older boolean scale_rewards: True is the group's std, False none (as TRL maps it).
        scale = {"true": "group", "false": "none"}.get(str(self.advantage_scale).lower())
        if scale is not None:
            self.advantage_scale = scale
        if self.multi_objective_aggregation not in MULTI_REWARD_MODES:
            raise ValueError(f"multi_objective_aggregation={self.multi_objective_aggregation!r}: use "
                             "sum_then_normalize or normalize_then_sum (TRL's choices).")
        if self.multi_objective_aggregation == "normalize_then_sum":
            AdvantageConfig(scale=self.advantage_scale)  # its own message for a scale that is none of them
            if self.advantage_estimator != "grpo":
                raise ValueError(f"advantage_estimator={self.advantage_estimator!r}: multi_objective_aggregation="
                                 "'normalize_then_sum' centres each reward on its group's mean (TRL's formula); use "
                                 "--advantage-estimator grpo, or sum_then_normalize with rloo.")
            if self.advantage_scale != "group":
                warnings.warn(f"advantage_scale (TRL's scale_rewards)={self.advantage_scale!r} changes nothing with "
                              "multi_objective_aggregation='normalize_then_sum': each reward is divided by its "
                              "group's std and their sum by the batch's, as in TRL.", stacklevel=3)
        if self.group_size < 2 and self.advantage_estimator == "grpo":
            raise ValueError("group_size must be >= 2: GRPO's baseline is the mean reward of a task's group.")
        if self.loss not in POLICY_LOSSES:
            raise ValueError(f"loss={self.loss!r} is not one of {sorted(POLICY_LOSSES)}; a loss of your own needs "
                             "register_loss in a module given with --import.")
        if isinstance(self.num_iterations, bool) or not isinstance(self.num_iterations, int) or self.num_iterations < 1:
            raise ValueError(f"num_iterations={self.num_iterations!r} must be a whole number >= 1 (optimizer steps on "
                             "each step's episodes; 1 is on-policy).")
        episodes = self.tasks_per_step * self.group_size
        if (isinstance(self.num_minibatches, bool) or not isinstance(self.num_minibatches, int)
                or self.num_minibatches < 1 or episodes % self.num_minibatches):
            raise ValueError(f"num_minibatches={self.num_minibatches!r} must be a whole number >= 1 that divides "
                             f"tasks_per_step x group_size = {episodes} (equal minibatches, as TRL's "
                             "steps_per_generation splits its generation): e.g. 2 or 1.")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile!r} must be in [0, 1]: the share of "
                             "the step's highest-entropy tokens trained on (1 keeps all; the paper uses 0.2).")
        if self.sync_ref_model:
            self._check_sync_ref_model()
        if self.use_adaptive_entropy:
            self._check_adaptive_entropy()
        # Validate the pieces with their own messages.
        self.loss_config()
        self.advantage_config()
        self.importance_config()

    def _check_sync_ref_model(self) -> None:
        """TRL's refusals of sync_ref_model (no reference without beta; under PEFT the reference is the base with
        its adapters off, no copy to move), and the values a mix and a period can take."""
        if self.beta == 0:
            raise ValueError("sync_ref_model=True with beta=0: the KL term is off, so there is no reference model to "
                             "synchronize (as in TRL); set --beta > 0 (e.g. 0.04), or sync_ref_model=False.")
        if self.lora_r > 0:
            raise ValueError(f"sync_ref_model=True with LoRA (lora_r={self.lora_r}): the reference is the base model "
                             "with its adapters off, not a copy of its own to synchronize (TRL refuses it under PEFT "
                             "too); train every weight (--lora-r 0), or sync_ref_model=False.")
        steps = self.ref_model_sync_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"ref_model_sync_steps={steps!r} must be a whole number >= 1 (optimizer steps between "
                             "reference updates; TRL's default 512).")
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ValueError(f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1]: the policy's "
                             "share of the new reference (TRL's default 0.6).")

    def optimizer_steps_per_step(self) -> int:
        """``num_iterations`` passes over ``num_minibatches`` minibatches, one optimizer step each."""
        return self.num_iterations * self.num_minibatches

    def _check_adaptive_entropy(self) -> None:
        """The bounds, step and target the controller can work with (TRL checks none of them)."""
        low, high = self.entropy_coef_min, self.entropy_coef_max
        delta, target = self.entropy_coef_delta, self.entropy_target
        if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= high):
            raise ValueError(f"entropy_coef_min={low}, entropy_coef_max={high}: the adaptive entropy coefficient "
                             "stays in [min, max], so they must be finite with 0 <= min <= max (TRL's 0 and 1).")
        if not (math.isfinite(delta) and delta >= 0.0):
            raise ValueError(f"entropy_coef_delta={delta} must be a finite number >= 0: the coefficient's change per "
                             "optimizer step (TRL's 0.005).")
        if not (math.isfinite(target) and target >= 0.0):
            raise ValueError(f"entropy_target={target} must be a finite number >= 0: a mean entropy in nats, which is "
                             "never below 0, so the bonus would never apply (TRL's 0.2; near the early "
                             "entropy/mean).")

    def loss_config(self) -> LossConfig:
        return LossConfig(policy_loss=self.loss, **self.coefficients(),
                          max_completion_length=self.max_completion_length or self.max_episode_tokens)

    def advantage_config(self) -> AdvantageConfig:
        if self.multi_objective_aggregation == "normalize_then_sum":  # TRL's formula: group, then batch std
            return AdvantageConfig(multi_reward="normalize_then_sum")
        return AdvantageConfig(estimator=self.advantage_estimator, scale=self.advantage_scale)

    def importance_config(self) -> ImportanceConfig:
        return ImportanceConfig(level=self.is_level, mode=self.is_mode, ratio_low=self.is_ratio_low,
                                ratio_high=self.is_ratio_high, opsm_threshold=self.off_policy_mask_threshold)

    def engine(self, policy: Any, tokenizer: Any, **kwargs: Any) -> Any:
        """The learner's engine, each episode's completion bounded by ``max_completion_length`` (TRL's)."""
        return super().engine(policy, tokenizer, max_completion_tokens=self.max_completion_length, **kwargs)

    @classmethod
    def translate_options(cls, given: dict[str, Any]) -> dict[str, Any]:
        """The learner's translations, TRL's ``max_completion_length`` as ``max_new_tokens`` too where that is
        not given, and TRL's importance-sampling options into the ``is_*`` fields.

        >>> GRPOConfig.translate_options({"vllm_importance_sampling_mode": "sequence_mask",
        ...                                "vllm_importance_sampling_clip_max": 3.0})
        {'is_level': 'sequence', 'is_mode': 'mask', 'is_ratio_high': 3.0}
        """
        values = dict(given)
        if values.get("max_completion_length") is not None and "max_new_tokens" not in values:
            values["max_new_tokens"] = values["max_completion_length"]  # TRL's one turn may use the whole budget
        cap = "vllm_importance_sampling_cap"  # TRL's older name of clip_max
        trl = {k: values.pop(k) for k in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                                          "vllm_importance_sampling_clip_max", cap,
                                          "vllm_importance_sampling_clip_min") if k in values}
        if cap in trl:
            if "vllm_importance_sampling_clip_max" in trl:
                raise TypeError(f"{cls.__name__}(): {cap} and vllm_importance_sampling_clip_max name the same option; "
                                "keep one.")
            trl["vllm_importance_sampling_clip_max"] = trl.pop(cap)
        fields: dict[str, Any] = {}
        mode = trl.get("vllm_importance_sampling_mode")
        if mode is not None:
            level, _, kind = str(mode).partition("_")
            if level not in ("token", "sequence") or kind not in ("truncate", "mask"):
                raise ValueError(f"vllm_importance_sampling_mode={mode!r}: TRL's modes are token_truncate, "
                                 "token_mask, sequence_truncate and sequence_mask.")
            fields.update(is_level=level, is_mode=kind)
        if trl.get("vllm_importance_sampling_correction", True) is False:
            fields["is_mode"] = "off"
        if "vllm_importance_sampling_clip_max" in trl:
            high = trl["vllm_importance_sampling_clip_max"]
            fields["is_ratio_high"] = math.inf if high is None else high
        if "vllm_importance_sampling_clip_min" in trl:
            fields["is_ratio_low"] = trl["vllm_importance_sampling_clip_min"] or 0.0
        if both := sorted(set(fields) & set(values)):
            raise TypeError(f"{cls.__name__}(): TRL's vllm_importance_sampling_* options and {', '.join(both)} set "
                            "the same thing; keep one.")
        return super().translate_options({**values, **fields})


# -- the stages -----------------------------------------------------------------------------------


def score_step(run: Run, step: int, groups: Sequence[Group], metrics: dict[str, float]) -> torch.Tensor:
    """(E, R) the step's reward columns (:func:`~treerl.rollout.rewards.score`), with the reward
    functions' means and their ``log_extra`` values (``reward_extras.jsonl``, one line per step)
    over every rank's episodes."""
    extras: dict[str, list[Any]] = {}
    # TRL's trainer_state counts optimizer steps: a step here takes num_iterations x num_minibatches of them.
    per_step = run.cfg.optimizer_steps_per_step()
    state = StepState(global_step=step * per_step, max_steps=run.cfg.steps * per_step)
    rewards = score(groups, run.reward_funcs, metrics, extras, state)
    if run.ranks.enabled and run.reward_funcs:
        extras = run.ranks.gather_episode_values(extras, [len(g.episodes) for g in groups])
        # A function's mean is over the episodes it applies to, which a rank may lack (NaN there).
        columns = rewards[:, 1:].double()  # (E, F)
        applies = ~columns.isnan()
        sums = run.ranks.sum([*columns.nan_to_num(0.0).sum(0).tolist(), *applies.sum(0).tolist()])
        num_funcs = len(run.reward_funcs)
        for func, total, count in zip(run.reward_funcs, sums[:num_funcs], sums[num_funcs:]):
            metrics[f"reward_fn/{reward_func_name(func)}_mean"] = total / count if count else math.nan
    if extras and run.ranks.is_main:
        write_extras(run.out_dir / "reward_extras.jsonl", step + 1, extras)
    return rewards


def advantages(groups: Sequence[Group], rewards: torch.Tensor, weights: Sequence[float],
               cfg: GRPOConfig, metrics: dict[str, float], ranks: Ranks = Ranks()) -> torch.Tensor:
    """(E,) each episode's advantage within its group, from the weighted reward columns."""
    group_ids = torch.tensor([g_idx for g_idx, g in enumerate(groups) for _ in g.episodes])
    # Every rank's rewards, so that scale="batch" and the metrics see the whole step.
    all_rewards, all_group_ids, own = ranks.gather_episodes(rewards, group_ids)
    # TRL's unscorable episode: every reward function returned None, those weighted 0 too; the environment's
    # reward (column 0) makes it scorable only where it is weighted (treerl.GRPOTrainer's is 0 and no reward).
    scorers = [weights[0] != 0, *[True] * (len(weights) - 1)]
    out = compute_advantages(all_rewards, all_group_ids, cfg.advantage_config(), weights=torch.tensor(weights),
                             scorers=scorers)
    metrics.update({k: float(v) for k, v in out.metrics.items()})
    return out.adv[own]


def skips_zero_advantage_groups(cfg: GRPOConfig, ranks: Ranks) -> bool:
    """Whether groups whose advantages are all exactly 0 can be left out of the forward pass.

    Every policy loss multiplies by the advantage, so such a group's gradient is exactly 0
    unless a KL or entropy term is on; the normalizer still counts its tokens, so the update
    is the same as training on it. Not with ``top_entropy_quantile`` below 1: its tokens count
    in the entropy quantile; nor with ``use_adaptive_entropy``: in the step's measured entropy; nor with a
    Mixture-of-Experts router's load-balancing loss (``router_aux_loss_coef``, as the run resolves it): over
    every token of the micro-batch. (One process only: ranks must all run the same collectives.)
    """
    return (cfg.skip_zero_advantage and cfg.beta == 0 and cfg.entropy_coef == 0 and cfg.top_entropy_quantile == 1.0
            and not cfg.use_adaptive_entropy and not cfg.router_aux_loss_coef and not ranks.enabled)


def pack_step(groups: Sequence[Group], adv: torch.Tensor, cfg: GRPOConfig, ranks: Ranks, metrics: dict[str, float],
              *, skip_zero_advantage: bool) -> tuple[list[PackedBatch], LossNormalizer | None]:
    """The step's micro-batches and the normalizer of the whole step, from one packing.

    With ``skip_zero_advantage`` (see :func:`skips_zero_advantage_groups`) the groups whose
    advantages are all exactly 0 are left out of the rows; their episodes still count in the
    normalizer, so the update is the one of training on them. The normalizer is None when
    every group was left out (there is no loss to normalize).
    """
    skip = zero_advantage_groups(groups, adv, metrics) if skip_zero_advantage else []
    episodes = [e for g in groups for e in g.episodes]
    mask = [i for i, e in enumerate(episodes) if e.cut_by_token_limit] if cfg.mask_truncated_completions else []
    batches = pack_groups(groups, adv, cfg.packing_config(), skip=skip, mask=mask)
    if cfg.mask_truncated_completions:
        return batches, _masked_normalizer(batches, [episodes[i] for i in mask], len(episodes), ranks, metrics)
    if not skip:
        return batches, ranks.normalizer(batches)
    if not batches:
        return [], None
    counts = batches[0].episode_num_tokens  # (E,) over the whole step, skipped episodes included
    # One process (skipping is off with several ranks): nothing to sum over ranks.
    return batches, LossNormalizer(num_tokens=int(counts.sum()), num_sequences=int((counts > 0).sum()),
                                   episode_num_tokens=counts)


def zero_advantage_groups(groups: Sequence[Group], adv: torch.Tensor, metrics: dict[str, float]) -> list[int]:
    """The indices of the groups whose advantages are all exactly 0 (see :func:`skips_zero_advantage_groups`);
    logs their share, ``train/skipped_groups_frac``."""
    starts = np.cumsum([0] + [len(g.episodes) for g in groups])
    skip = [i for i in range(len(groups)) if not bool((adv[starts[i]:starts[i + 1]] != 0).any())]
    metrics["train/skipped_groups_frac"] = 1.0 - (len(groups) - len(skip)) / max(len(groups), 1)
    return skip


Minibatch = tuple[list[PackedBatch], LossNormalizer | None]
"""One optimizer step's micro-batches and its normalizer (None where it has nothing to train on)."""


def minibatch_split(num_episodes: int, num_minibatches: int, seed: Sequence[int]) -> list[np.ndarray]:
    """TRL's split of a generation (``shuffle_sequence_dict``, then ``split_tensor_dict`` into
    ``steps_per_generation`` chunks): the episode indices in an order drawn from ``seed``, cut into
    ``num_minibatches`` consecutive parts of equal size (differing by one where the count does not divide,
    as a step of uneven groups may). Episodes, not groups: a group's episodes may land in several parts.

    >>> [part.tolist() for part in minibatch_split(6, 3, seed=(0, 1))]
    [[1, 4], [3, 0], [2, 5]]
    """
    order = np.random.default_rng(list(seed)).permutation(num_episodes)
    return np.array_split(order, num_minibatches)


def pack_minibatches(groups: Sequence[Group], adv: torch.Tensor, cfg: GRPOConfig, ranks: Ranks,
                     metrics: dict[str, float], *, skip_zero_advantage: bool, seed: Sequence[int]) -> list[Minibatch]:
    """The step's episodes split into ``cfg.num_minibatches`` (:func:`minibatch_split`), each packed on its own
    (shared prefixes within it), with the normalizer of its optimizer step.

    The normalizers are TRL's: its token count (dapo's, ``num_items_in_batch``) spans the generation, every
    process's, and each optimizer step divides by its share, ``steps_per_generation /
    gradient_accumulation_steps`` of it: here the step's count over every rank / ``num_minibatches``. The
    sequence means (grpo, dr_grpo) are over the minibatch's own episodes, as TRL's over its micro-batches.
    Groups left out (``skip_zero_advantage``) and episodes masked (``mask_truncated_completions``) count as in
    :func:`pack_step`.
    """
    episodes = [e for g in groups for e in g.episodes]
    skip = zero_advantage_groups(groups, adv, metrics) if skip_zero_advantage else []
    cut = {i for i, e in enumerate(episodes) if e.cut_by_token_limit} if cfg.mask_truncated_completions else set()
    packed, counts = [], []
    for part in minibatch_split(len(episodes), cfg.num_minibatches, seed):
        kept = set(part.tolist()) - cut
        batches, terms = _pack_part(groups, adv, cfg, skip, [i for i in range(len(episodes)) if i not in kept])
        packed.append(batches if bool((terms > 0).any()) else [])  # rows of prompts alone train nothing
        # A cut episode has no terms but stays among the sequences, as in pack_step.
        counts += [int(terms.sum()), int((terms > 0).sum()) + sum(episodes[i].num_sampled_tokens > 0
                                                                  for i in set(part.tolist()) & cut)]
    *counts, num_cut, num_episodes = ranks.sum([*counts, len(cut), len(episodes)])
    if cfg.mask_truncated_completions:
        metrics["train/masked_episodes_frac"] = num_cut / max(num_episodes, 1)
    num_tokens = sum(counts[0::2]) / len(packed)
    # A minibatch with micro-batches has terms, so tokens and sequences to count; one without has no loss.
    # The entropy bonus is a mean over the minibatch's own tokens (TRL's over its batch's), not num_tokens.
    return [(batches, LossNormalizer(num_tokens=num_tokens, num_sequences=num_sequences,
                                     episode_num_tokens=batches[0].episode_num_tokens,
                                     window_num_tokens=own_tokens) if batches else None)
            for batches, own_tokens, num_sequences in zip(packed, counts[0::2], counts[1::2])]


def _pack_part(groups: Sequence[Group], adv: torch.Tensor, cfg: GRPOConfig, skip: Sequence[int],
               mask: Sequence[int]) -> tuple[list[PackedBatch], torch.Tensor]:
    """The micro-batches of the episodes not in ``mask``, the groups of ``skip`` left out of the rows, and
    (E,) those episodes' term counts (the skipped groups' too, which the step's token count includes)."""
    batches = pack_groups(groups, adv, cfg.packing_config(), skip=skip, mask=mask)
    if batches or not skip:
        return batches, batches[0].episode_num_tokens if batches else torch.zeros(len(adv), dtype=torch.long)
    # Every group of it was left out: no rows, so no counts from them; a packing that keeps them counts.
    kept = pack_groups(groups, adv, cfg.packing_config(), mask=mask)
    return [], kept[0].episode_num_tokens if kept else torch.zeros(len(adv), dtype=torch.long)


def _masked_normalizer(batches: Sequence[PackedBatch], masked: Sequence[Episode], num_episodes: int, ranks: Ranks,
                       metrics: dict[str, float]) -> LossNormalizer | None:
    """The step's normalizer when ``masked`` episodes were left out of the terms (``mask_truncated_completions``),
    over every rank: their tokens leave the token count, as TRL's zeroed completion mask takes them out of its
    denominator, but they stay among the sequences (TRL's sequence mean divides by every completion). None when
    no rank has a term left. Logs ``train/masked_episodes_frac``."""
    counts = batches[0].episode_num_tokens if batches else torch.zeros(num_episodes, dtype=torch.long)  # (E,)
    num_tokens, num_sequences, num_masked, total = ranks.sum([
        int(counts.sum()), int((counts > 0).sum()) + sum(e.num_sampled_tokens > 0 for e in masked), len(masked),
        num_episodes])
    metrics["train/masked_episodes_frac"] = num_masked / max(total, 1)
    if num_tokens == 0:  # every episode of the step was cut: nothing to train on
        return None
    return LossNormalizer(num_tokens=num_tokens, num_sequences=num_sequences, episode_num_tokens=counts)


ExtraLoss = Callable[[PackedBatch, PackedLogprobs], torch.Tensor]
"""``extra_loss(batch, out) -> loss``: another objective's share of the window loss for one
micro-batch (on the device), from the same forward (``out.hidden`` holds its hidden states)."""


def optimize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             batches: Sequence[PackedBatch], cfg: GRPOConfig, device: str, metrics: dict[str, float],
             ranks: Ranks = Ranks(), ref_model: torch.nn.Module | None = None,
             normalizer: LossNormalizer | None = None, policy_coef: float = 1.0,
             extra_loss: ExtraLoss | None = None, precision: Precision | None = None,
             keep_logp: list[torch.Tensor] | None = None, ref_logps: list[torch.Tensor] | None = None,
             entropy_control: AdaptiveEntropy | None = None,
             before_step: Callable[[], None] | None = None) -> None:
    """One optimizer step over all micro-batches of the step (one accumulation window).

    With several ranks the window is every rank's micro-batches: the normalizer counts them
    all, and the gradients are summed over ranks before clipping. ``normalizer`` defaults to
    the one of ``batches``; pass the full window's when some batches were left out (see
    :func:`pack_step`). The loss
    backpropagated is ``policy_coef * policy loss + extra_loss(batch, out)`` (SDPO blends its
    distillation loss in this way). ``precision`` (the run's) sets the forward's autocast and
    the float16 loss scaling; log-probs and the loss stay float32. ``keep_logp``, when given,
    receives each micro-batch's log-probs (M,), detached: those of the weights before this step.
    ``cfg.top_entropy_quantile`` below 1 keeps only the policy terms at or above the step's entropy
    threshold (:func:`step_entropy_threshold`), which a pass without gradients gives first when the
    step is more than one micro-batch or process.
    ``ref_logps``, when given, holds each micro-batch's reference log-probs (M,): an empty list is filled
    with those ``ref_model`` computes, a filled one is read instead (TRL computes them once per generation).
    ``entropy_control`` (``use_adaptive_entropy``) sets the entropy bonus's coefficient of the whole window and
    takes the window's mean entropy afterwards (:mod:`~treerl.learners.entropy_control`).
    ``before_step()`` is called right before the optimizer steps, the gradients clipped
    (:meth:`Run.before_optimizer_step`).
    A Mixture-of-Experts model adds ``cfg.router_aux_loss_coef`` (:func:`router_aux_loss_coef`) times its
    router's load-balancing loss, TRL's: each micro-batch's (its forward's tokens, counted as unpacked), a mean
    over the window's micro-batches on every rank, as TRL divides it by its gradient accumulation steps and
    averages the ranks' gradients; logged as ``loss/aux`` (TRL's ``aux_loss``).
    """
    precision = precision or Precision(weights=None, autocast=None)
    loss_cfg, is_cfg = cfg.loss_config(), cfg.importance_config()
    aux_coef = router_aux_loss_coef(model, cfg.router_aux_loss_coef)
    top_k = router_top_k(model) if aux_coef else None
    # Each micro-batch's load-balancing loss is 1 / (the window's micro-batches, every rank's) of the window's.
    num_aux = ranks.sum([len(batches)])[0] if aux_coef else 0
    window_entropy: list[torch.Tensor] = []  # (2,) per micro-batch: the entropy summed over its kept terms, their count
    if entropy_control is not None:  # the previous optimizer step's coefficient and gate, for every micro-batch
        loss_cfg = replace(loss_cfg, entropy_coef=entropy_control.applied_coef())
    if normalizer is None and batches:  # none without batches: every group skipped or every episode masked
        normalizer = ranks.normalizer(batches)
    # Each micro-batch's metrics stay tensors until the window ends, then are read back at once:
    # on an accelerator a read per metric and micro-batch would wait for its backward each time.
    pending: list[_MicroBatchMetrics] = []
    model.train()
    entropy_cut = None  # top_entropy_quantile's (threshold, kept share), over the whole step
    entropy_masks = None  # (M,) per micro-batch, from the pass that gave the threshold
    if cfg.top_entropy_quantile < 1.0 and (len(batches) > 1 or ranks.enabled):
        entropies = step_entropies(model, batches, cfg, device, precision)
        entropy_cut = step_entropy_threshold(entropies, cfg.top_entropy_quantile, ranks)
        # With dropout on (LoRA's, the model's) the training forward draws other entropies: compared with this
        # threshold they would keep another share than the one logged and dividing the entropy bonus.
        entropy_masks = [e >= entropy_cut[0].to(e.device) for e in entropies]
    for index, batch in enumerate(batches):
        batch = batch.to(device)
        out = packed_logprobs(model, batch, temperature=cfg.temperature, impl="auto", head=is_cfg.centering,
                              precision=precision, router_top_k=top_k)
        # On-policy, one update per batch: the old policy is the current one (ratio 1). With several
        # (num_iterations) it is the batch's term_old_logp, the weights before the first update. The
        # sampler/old-policy gap is corrected by importance weights, detached.
        old = batch.term_old_logp if batch.term_old_logp is not None else out.logp.detach()
        if keep_logp is not None:
            keep_logp.append(out.logp.detach())
        iw = importance_weights(old, batch.term_sampler_logp.to(out.logp.device),
                                batch.term_episode.to(out.logp.device), batch.num_episodes, is_cfg,
                                adv=batch.term_adv.to(out.logp.device))
        centering = batch_centering(batch, out.head_logp, is_cfg) if is_cfg.centering else None
        entropy_mask = None
        if cfg.top_entropy_quantile < 1.0:
            if entropy_cut is None:  # the step is this one micro-batch: its own forward has every entropy
                entropy_cut = step_entropy_threshold([out.entropy.detach()], cfg.top_entropy_quantile, ranks)
            threshold, kept_frac = entropy_cut
            entropy_mask = (entropy_masks[index].to(out.entropy.device) if entropy_masks is not None
                            else out.entropy.detach() >= threshold.to(out.entropy.device))
            normalizer = replace(normalizer, entropy_kept_frac=kept_frac)
        ref_logp = None
        if ref_logps and len(ref_logps) == len(batches):  # computed by an earlier update on these batches
            ref_logp = ref_logps[index].to(out.logp.device)
        elif ref_model is not None:
            with torch.no_grad():
                ref_logp = packed_logprobs(ref_model, batch, temperature=cfg.temperature, impl="auto",
                                           precision=precision).logp
            if ref_logps is not None:
                ref_logps.append(ref_logp)
        inputs = loss_inputs(batch, out, ref_logp=ref_logp, is_weight=iw.weight, is_mask=iw.mask,
                             centering=None if centering is None else centering.terms, entropy_mask=entropy_mask)
        result = compute_loss(inputs, loss_cfg, normalizer)
        if entropy_control is not None:  # over the terms the bonus acts on (TRL's mask x entropy_mask)
            entropy = out.entropy.detach().float()
            kept = torch.ones_like(entropy) if entropy_mask is None else entropy_mask.to(entropy.dtype)
            window_entropy.append(torch.stack([(entropy * kept).sum(), kept.sum()]))
        loss = result.loss if policy_coef == 1.0 else policy_coef * result.loss
        if extra_loss is not None:
            loss = loss + extra_loss(batch, out)
        aux = {}
        if out.aux_loss is not None:
            aux["loss/aux"] = out.aux_loss / num_aux  # this micro-batch's share of the window's mean
            loss = loss + aux_coef * aux["loss/aux"]
        precision.backward(loss)
        batch_metrics = {**result.metrics, **iw.metrics, **(centering.metrics if centering else {}), **aux}
        pending.append(_MicroBatchMetrics(
            batch.num_terms, {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in batch_metrics.items()},
            out.entropy.detach().sum()))
    if entropy_cut is not None and entropy_cut[1] > 0:
        metrics["entropy/kept_frac"] = entropy_cut[1]
    if entropy_control is not None:
        # Every rank's sum and count, for the token mean of the whole window (TRL clamps an empty one's count to 1).
        total, count = ranks.sum(torch.stack(window_entropy).sum(0).tolist() if window_entropy else [0.0, 0.0])
        entropy_control.update(total / max(count, 1.0))
        metrics["entropy/coef_applied"] = loss_cfg.entropy_coef
    if loss_cfg.entropy_coef > 0 or entropy_control is not None:  # TRL's entropy_coef: after this step's update
        metrics["entropy/coef"] = entropy_control.coef if entropy_control is not None else loss_cfg.entropy_coef
    totals, maxima = _window_totals(pending)
    totals = ranks.sum_dicts(totals)
    totals.setdefault("loss/policy", 0.0)  # a step that trained on nothing (every group skipped)
    terms = max(totals.pop("_terms", 1.0), 1.0)
    for k, v in totals.items():
        metrics[k] = v if k.startswith("loss/") else v / terms
    parts = ranks.gather(maxima)
    for k in dict.fromkeys(k for part in parts for k in part):
        metrics[k] = max(part[k] for part in parts if k in part)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # nothing was trained on (all groups skipped): a zero gradient, as training would give
            p.grad = torch.zeros_like(p)
    ranks.all_reduce_gradients(params)  # each rank's loss is its share of the global one: sum them
    precision.unscale(optimizer)
    if cfg.max_grad_norm > 0:
        metrics["grad/norm"] = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
    metrics["lr"] = scheduler.get_last_lr()[0]  # the rate this update takes (as transformers' Trainer logs it)
    if before_step is not None:
        before_step()
    precision.step(optimizer)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def optimize_minibatches(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                         minibatches: Sequence[Minibatch], cfg: GRPOConfig, device: str, metrics: dict[str, float],
                         ranks: Ranks = Ranks(), ref_model: torch.nn.Module | None = None,
                         precision: Precision | None = None,
                         before_update: Callable[[int], None] | None = None,
                         after_update: Callable[[int], None] | None = None,
                         entropy_control: AdaptiveEntropy | None = None) -> list[PackedBatch]:
    """``cfg.num_iterations`` passes over the step's minibatches, in the same order each time (TRL reuses its
    shuffled chunks so), one :func:`optimize` (optimizer step) on each; returns every micro-batch.
    ``before_update(n)`` and ``after_update(n)`` are called before and after the step's n-th optimizer step (from
    1; :meth:`Run.before_optimizer_step`, :meth:`Run.after_optimizer_step`);
    ``entropy_control`` (``use_adaptive_entropy``) moves at each of them, as :func:`optimize` says.

    The reference's log-probs are each minibatch's first update's for every later one, as TRL's of the
    generation: a ``sync_ref_model`` update between two of them does not change the step's KL target
    (with several minibatches, all of them before the first update).

    Every update's old policy is the weights that sampled. The first minibatch's first forward runs on them and
    keeps its log-probs (for the passes after the first); the other minibatches' come from a forward without
    gradients before the first optimizer step, as TRL computes its old log-probs at generation when a
    generation serves several optimizer steps. A pass logs the mean over its optimizer steps of each metric (the
    largest ``*_max``, the last ``lr``); the last pass's are the step's, as with one minibatch.
    """
    precision = precision or Precision(weights=None, autocast=None)
    minibatches = list(minibatches)
    ref_logps: list[list[torch.Tensor]] = [[] for _ in minibatches]  # filled by each one's first update
    if len(minibatches) > 1:
        model.train()
        minibatches[1:] = [(generation_logprobs(model, batches, cfg, device, precision), normalizer)
                           for batches, normalizer in minibatches[1:]]
        if ref_model is not None:
            with torch.no_grad():
                ref_logps = [[packed_logprobs(ref_model, b.to(device), temperature=cfg.temperature, impl="auto",
                                              precision=precision).logp for b in batches]
                             for batches, _ in minibatches]
    updated = 0
    for iteration in range(cfg.num_iterations):
        updates: list[dict[str, float]] = []
        for i, (batches, normalizer) in enumerate(minibatches):
            keep = i == 0 and iteration == 0 and cfg.num_iterations > 1
            old_logp: list[torch.Tensor] = []
            updates.append({})
            optimize(model, optimizer, scheduler, batches, cfg, device, updates[-1], ranks, ref_model=ref_model,
                     normalizer=normalizer, precision=precision, keep_logp=old_logp if keep else None,
                     ref_logps=ref_logps[i], entropy_control=entropy_control,
                     before_step=None if before_update is None else functools.partial(before_update, updated + 1))
            if keep:
                minibatches[0] = ([b.with_old_logp(logp.to(b.term_sampler_logp.device))
                                   for b, logp in zip(batches, old_logp)], normalizer)
            updated += 1
            if after_update is not None:
                after_update(updated)
        metrics.update(_mean_over_updates(updates))
    return [b for batches, _ in minibatches for b in batches]


def generation_logprobs(model: torch.nn.Module, batches: Sequence[PackedBatch], cfg: GRPOConfig, device: str,
                        precision: Precision) -> list[PackedBatch]:
    """``batches`` carrying the current weights' log-probs as their old policy's, from a forward without
    gradients: called before the step's first update, while the weights are those that sampled."""
    with torch.no_grad():
        return [b.with_old_logp(packed_logprobs(model, b.to(device), temperature=cfg.temperature, impl="auto",
                                                precision=precision).logp.to(b.term_sampler_logp.device))
                for b in batches]


def _mean_over_updates(updates: Sequence[dict[str, float]]) -> dict[str, float]:
    """Several optimizer steps' metrics as one: each metric's mean over the steps that logged it, the largest
    of those named ``*_max``, the last of the settings an update took (``lr``, the adaptive entropy
    coefficient: :data:`_LAST_UPDATES`)."""
    merged: dict[str, float] = {}
    for key in dict.fromkeys(k for update in updates for k in update):
        values = [update[key] for update in updates if key in update]
        merged[key] = (max(values) if key.endswith("_max") else values[-1] if key in _LAST_UPDATES
                       else sum(values) / len(values))
    return merged


_LAST_UPDATES = frozenset({"lr", "entropy/coef", "entropy/coef_applied"})
"""Metrics of a setting that moves from update to update, which a step logs as its last update's."""


def step_entropies(model: torch.nn.Module, batches: Sequence[PackedBatch], cfg: GRPOConfig, device: str,
                   precision: Precision) -> list[torch.Tensor]:
    """Each micro-batch's (M,) entropies under the current weights, from a forward without gradients.

    ``top_entropy_quantile``'s threshold is over the whole step, and the first micro-batch's loss
    needs it: this pass costs a forward, where keeping every micro-batch's graph would cost memory.
    The training forward computes the same values (same weights, same kernels, the same with gradient
    checkpointing or autocast) unless dropout is on, so the masks are taken from these.
    """
    with torch.no_grad():
        return [packed_logprobs(model, batch.to(device), temperature=cfg.temperature, impl="auto",
                                precision=precision).entropy for batch in batches]


def step_entropy_threshold(entropies: Sequence[torch.Tensor], top_quantile: float,
                           ranks: Ranks) -> tuple[torch.Tensor, float]:
    """TRL's threshold of ``top_entropy_quantile`` (:func:`~treerl.learners.losses.high_entropy_threshold`),
    (), over every term of the step, and the share of the terms it keeps (0 without terms). ``entropies`` are
    this rank's micro-batches' (M,), pooled with every rank's as TRL gathers its batch's over processes.

    The terms are the (token, episode) pairs, so a token that packing shares among ``k`` episodes counts
    ``k`` times, as in the unpacked batch TRL sees.
    """
    local = torch.cat(list(entropies)) if entropies else torch.zeros(0)
    pooled = torch.cat([part.to(local.device) for part in ranks.gather(local.cpu())]) if ranks.enabled else local
    if pooled.numel() == 0:  # nothing to train on anywhere: no term to mask
        return torch.tensor(math.inf), 0.0
    threshold = high_entropy_threshold(pooled, top_quantile)
    return threshold, float((pooled >= threshold).sum()) / pooled.numel()


@dataclass
class _MicroBatchMetrics:
    num_terms: int
    metrics: dict[str, torch.Tensor | float]
    """The loss's, the importance weights' and the centering's metrics, detached."""
    entropy_sum: torch.Tensor


def _window_totals(pending: Sequence[_MicroBatchMetrics]) -> tuple[dict[str, float], dict[str, float]]:
    """Sums over the window's micro-batches (``loss/*`` as they are, the others weighted by the
    micro-batch's terms; ``_terms``; ``entropy/mean`` summed over terms), and the largest of the
    metrics named ``*_max``. Every value is read back in one go (:func:`read_floats`)."""
    values = iter(read_floats([v for part in pending for v in (*part.metrics.values(), part.entropy_sum)]))
    totals: dict[str, float] = {}
    maxima: dict[str, float] = {}  # metrics named *_max (is/ratio_max): the window's largest, not a mean
    for part in pending:
        n = part.num_terms
        for k, v in zip(part.metrics, values):
            if k.endswith("_max"):
                if n:  # a micro-batch without terms has no ratios
                    maxima[k] = max(maxima.get(k, -math.inf), v)
                continue
            totals[k] = totals.get(k, 0.0) + v * (1.0 if k.startswith("loss/") else n)
        totals["_terms"] = totals.get("_terms", 0.0) + n
        totals["entropy/mean"] = totals.get("entropy/mean", 0.0) + next(values)
    return totals, maxima


def grpo_step(run: Run, step: int) -> dict[str, float]:
    """One GRPO step on the run's parts; returns the logged metrics."""
    metrics: dict[str, float] = {}
    start = time.perf_counter()
    groups, stats = run.rollout()
    metrics["perf/rollout_s"] = time.perf_counter() - start
    return update(run, step, groups, stats, metrics)


def update(run: Run, step: int, groups: Sequence[Group], stats: RolloutStats, metrics: dict[str, float], *,
           next_task: int | None = None) -> dict[str, float]:
    """Everything of a step after its rollout: score, advantages, pack, optimize, publish, log.

    AsyncGRPO calls it with the groups it took from its buffer; ``next_task`` is then the
    first task index its generators have not been handed yet (see :meth:`Run.end_step`).
    """
    cfg = run.cfg
    rewards = score_step(run, step, groups, metrics)
    adv = advantages(groups, rewards, run.reward_weights, cfg, metrics, run.ranks)
    run.keep_sample(step, groups, adv, rewards)
    skip = skips_zero_advantage_groups(cfg, run.ranks)
    if cfg.num_minibatches > 1:  # TRL's steps_per_generation: a shuffled split, an optimizer step on each part
        minibatches = pack_minibatches(groups, adv, cfg, run.ranks, metrics, skip_zero_advantage=skip,
                                       seed=(cfg.seed, step))
    else:  # The normalizer counts every episode, trained or skipped.
        minibatches = [pack_step(groups, adv, cfg, run.ranks, metrics, skip_zero_advantage=skip)]
    first = step * cfg.optimizer_steps_per_step()  # the run's optimizer steps before this step's (TRL's)
    entropy_control = AdaptiveEntropy.of_run(cfg, run.state.extra)
    batches = optimize_minibatches(run.model, run.optimizer, run.scheduler, minibatches, cfg, run.device, metrics,
                                   run.ranks, ref_model=run.reference, precision=run.precision,
                                   before_update=lambda n: run.before_optimizer_step(first + n),
                                   after_update=lambda n: run.after_optimizer_step(first + n, metrics),
                                   entropy_control=entropy_control)
    if entropy_control is not None:
        entropy_control.save(run.state.extra)  # the step's checkpoint keeps it
    run.publish_weights(metrics)
    return run.end_step(step, metrics, stats, num_episodes=len(adv), batches=batches, next_task=next_task,
                        passes=cfg.num_iterations)


def train(cfg: GRPOConfig, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
          policy: Policy | None = None, env_factory: Callable[[], Any] | None = None,
          reward_funcs: Sequence[RewardFunc] = (), reward_weights: Sequence[float] | None = None,
          optimizer: OptimizerSpec | None = None, callbacks: Sequence[StepCallback] = (),
          evaluate: Evaluator | None = None) -> TrainResult:
    """Train with GRPO on ``cfg.env``; see the module docstring for the loop.

    Every argument after ``cfg`` is optional: ``model`` and ``tokenizer`` (default: loaded
    from ``cfg.model``); ``policy``, any :class:`~treerl.agents.policy.Policy` that samples
    (default: a :class:`~treerl.agents.transformers_policy.TransformersPolicy` on the
    learner's own copy of the model; it receives the weights after every step);
    ``env_factory``, a function returning a fresh environment (default:
    ``treerl.make(cfg.env, **cfg.env_kwargs)``); ``reward_funcs`` with TRL's signature and
    ``reward_weights`` (one for the environment's reward, then one per function);
    ``optimizer``, a torch optimizer or a function of the trained parameters that makes one
    (default: AdamW); ``callbacks``, functions ``(step, metrics)`` called after each step's
    metrics are logged, on the main process; ``evaluate``, what ``cfg.eval_every`` measures instead
    of the held-out episodes (:data:`~treerl.learners.core.Evaluator`).

    Under ``accelerate launch --multi_gpu --num_processes R -m treerl.cli learn ...`` (or
    ``torchrun``), or in processes that initialized a ``torch.distributed`` group, the ``R``
    processes split each step's tasks and take together the step one process would take on
    all of them; only rank 0 writes to ``output_dir`` and evaluates, and every rank returns
    once the model is saved.
    """
    run = build(cfg, model=model, tokenizer=tokenizer, policy=policy, env_factory=env_factory,
                reward_funcs=reward_funcs, reward_weights=reward_weights, optimizer=optimizer, reference=cfg.beta > 0,
                callbacks=callbacks, evaluate=evaluate)
    with run:
        for step in run.steps():
            grpo_step(run, step)
    return finish(run)


register_learner("grpo", GRPOConfig, train, "GRPO and its loss variants on trajectory trees (the default).")
