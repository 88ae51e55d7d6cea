"""The learner core: what every learner builds, runs each step, and does at the end.

A learner is the loop of its own stages on these parts::

    run = build(cfg, ...)                 # models, policy, optimizer, engine, log; resume; eval at start
    with run:
        for step in run.steps():
            groups, stats = run.rollout()                 # this step's tasks, played by the engine (or taken
                                                          # from a trajectory file or `treerl serve`)
            ...                                           # the algorithm: rewards, advantages
            run.keep_sample(step, groups, adv)            # a few groups for `treerl view` (every N steps)
            ...                                           # the algorithm: loss, optimizer step
            run.publish_weights(metrics)                  # the policy samples the new weights
            run.end_step(step, metrics, stats, ...)       # summary, diagnostics, eval every N, log, checkpoint
    return finish(run)                    # final checkpoint, model (or the best), eval at end, summary.json

:func:`build` loads the model (or takes the caller's), keeps the sampler's own copy in a
:class:`~treerl.agents.transformers_policy.TransformersPolicy` unless a policy is given,
applies LoRA, switches the trainer to tree attention, makes the optimizer (AdamW unless
given) and its constant-with-warm-up schedule, resumes from the latest checkpoint when asked,
and evaluates at the start. With ``source`` (or ``cfg.from_rollouts`` / ``cfg.from_server``)
the step's groups come from a :class:`~treerl.rollout.sources.GroupSource` instead of the
engine, and a source that takes weights receives each published version. The parts it uses
each live in their own module:
:mod:`~treerl.learners.checkpoints`, :mod:`~treerl.learners.metrics`,
:mod:`~treerl.learners.weight_sync`, :mod:`~treerl.rollout.rewards`,
:mod:`~treerl.learners.evaluation`, :mod:`~treerl.learners.diagnostics`,
:mod:`~treerl.learners.samples` (trajectory samples for ``treerl view``),
:mod:`~treerl.learners.plots` and :mod:`~treerl.learners.distributed` (several processes
under ``accelerate launch``).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from treerl.agents.chat_templates import warn_about_template
from treerl.agents.policy import Policy
from treerl.envs.group import EnvGroup
from treerl.envs.loops import run_until_done
from treerl.envs.registry import env_id_of, factory_env_id
from treerl.envs.task_order import num_rows
from treerl.errors import ConfigError
from treerl.kernels.tree_attention import (
    TreeAttentionChoice,
    TreeAttentionError,
    check_model_supported,
    enable_tree_attention,
)
from treerl.learners.checkpoints import (
    TrainerState,
    checkpoint_path,
    checkpoint_step,
    clear_run,
    earlier_run,
    is_model_only,
    keep_only_best,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    prune_checkpoints,
    resume_checkpoint,
    run_settings,
    save_checkpoint,
)
from treerl.learners.config import LEARNER_CONFIGS, LearnerConfig
from treerl.learners.diagnostics import RECORDED_ACTIONS, Diagnostics
from treerl.learners.distributed import Ranks
from treerl.learners.evaluation import eval_metrics, evaluate_at_start, evaluate_policy, improves, metric_key
from treerl.learners.forward import router_aux_loss_coef, router_top_k
from treerl.learners.hub import HubPusher
from treerl.learners.losses.base import same_definition
from treerl.learners.metrics import MetricsLog, tracker_for, truncate_metrics
from treerl.learners.packing import PackedBatch, packing_metrics
from treerl.learners.plots import MatplotlibMissing, write_plots
from treerl.learners.precision import (
    SMALL_MODEL_PARAMS,
    Precision,
    check_learning_rate,
    checkpoint_dtype,
    enable_gradient_checkpointing,
    model_size,
    resolve_precision,
    set_tf32,
)
from treerl.rollout.rewards import RewardFunc, StepState, check_reward_weights, reward_func_name
from treerl.learners.samples import (add_trainer_logprobs, annotate_sample, completion_rows, format_completions,
                                     keeps_sample, sample_path, write_groups)
from treerl.learners.weight_sync import WeightSync, policy_state_dict
from treerl.rollout.engine import RolloutEngine
from treerl.rollout.sources import GroupSource
from treerl.rollout.summary import RolloutStats
from treerl.rollout.trajectory import Group

__all__ = ["Run", "TrainResult", "build", "finish", "make_optimizer", "make_scheduler", "OptimizerSpec",
           "StepCallback", "StepControl", "RUN_EVENTS", "Evaluator", "LearnerSpec", "LEARNERS", "register_learner",
           "learner_name"]

logger = logging.getLogger(__name__)


@dataclass
class StepControl:
    """What a :data:`StepCallback` may return to act on the step it was called after, as transformers'
    ``TrainerControl`` lets a ``TrainerCallback`` (``should_training_stop``, ``should_evaluate``, ``should_save``).

    >>> StepControl(stop=True)
    StepControl(stop=True, evaluate=False, save=False)
    """

    stop: bool = False
    """End the run after this step, as a run ends (:func:`finish`: the final checkpoint, the model, or the best
    one with ``load_best_model_at_end``, and the evaluation at the end)."""
    evaluate: bool = False
    """Evaluate now, where the step did not: the figures are logged as a second line of the step and passed to
    the callbacks in a second call with the same step."""
    save: bool = False
    """Write a checkpoint of this step (the run's last step writes one anyway)."""


StepCallback = Callable[[int, dict[str, float]], StepControl | None]
"""Called after each step on the main process with the step number (from 1) and a copy of the
metrics it logged (TRL's ``TrainerCallback.on_log``, in one function); with ``eval_every`` and
``eval_on_start``, also with step 0 and the evaluation before the first step. It may return a
:class:`StepControl` to stop the run, evaluate or save at that step (anything else is ignored). One with a method
``on_event(name, global_step)`` is also told the run's events (:data:`RUN_EVENTS`)."""

RUN_EVENTS = ("step_begin", "pre_optimizer_step", "optimizer_step", "save")
"""What :meth:`Run.notify` tells a callback that has a method ``on_event(name, global_step)`` (besides being called
with ``(step, metrics)`` after each step), on the main process: a step begins, the optimizer is about to step and
has stepped (each of a step's ``num_iterations`` x ``num_minibatches`` optimizer steps), a checkpoint was written.
``global_step`` counts optimizer steps as TRL's ``state.global_step`` does when transformers' Trainer calls its
``on_step_begin``, ``on_pre_optimizer_step``, ``on_optimizer_step`` and ``on_save``: those done before (the one
just taken is counted at the step's end, as transformers counts it), the checkpoint's for ``save``."""

Evaluator = Callable[..., dict[str, float]]
"""What ``eval_every`` measures instead of the held-out episodes: called on the main process with the
policy (sampling the weights as they are now), the tokenizer and, as ``trainer_state``, the run's
:class:`~treerl.rollout.rewards.StepState` then (TRL's ``trainer_state`` of reward functions), it returns the
metrics to log with the step (``treerl.GRPOTrainer``: its ``eval_dataset`` scored with the reward functions,
TRL's ``eval_reward``)."""

OptimizerSpec = torch.optim.Optimizer | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
"""An optimizer over the trained parameters, or a function that makes one from them (the
parameters exist only after LoRA is applied, so a factory is the usual form)."""


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    policy_version: int
    eval_start: dict[str, Any] | None
    eval_end: dict[str, Any] | None
    model_dir: Path
    best_metric: float | None = None
    """With ``metric_for_best_model``: the best evaluation's value (transformers' ``state.best_metric``)."""
    best_step: int | None = None
    """Its step."""
    best_model_checkpoint: Path | None = None
    """Its checkpoint, once one was written at that step; with ``load_best_model_at_end``, what ``model_dir`` holds."""


@dataclass(frozen=True)
class LearnerSpec:
    """A learner ``treerl learn --learner NAME`` can run: its config dataclass and its ``train``."""

    name: str
    config: type[LearnerConfig]
    """The learner's config dataclass; its fields are the flags of ``treerl learn --learner NAME``."""
    train: Callable[..., TrainResult]
    """``train(cfg, **extension_points) -> TrainResult``."""
    help: str = ""


LEARNERS: dict[str, LearnerSpec] = {}
"""The learners by name; each learner module registers itself at import."""


def register_learner(name: str, config: type[LearnerConfig], train: Callable[..., TrainResult], help: str = "", *,
                     override: bool = False) -> LearnerSpec:
    """Make ``treerl learn --learner NAME`` run ``train`` with ``config``'s flags; returns the spec.

    A learner of your own registers in a module that ``treerl learn --import FILE`` runs first.
    """
    if not (isinstance(config, type) and issubclass(config, LearnerConfig)):
        raise TypeError(f"register_learner({name!r}): config must be a LearnerConfig subclass, not {config!r}.")
    if name in LEARNERS and not override and not same_definition(LEARNERS[name].train, train):
        raise ValueError(f"register_learner: a learner named {name!r} exists already; pick another name or pass "
                         "override=True.")
    LEARNERS[name] = LearnerSpec(name=name, config=config, train=train, help=help)
    LEARNER_CONFIGS[name] = config  # what a config's option hints read (treerl.learners.config sits below core)
    return LEARNERS[name]


_TOKENS_SEEN = "num_input_tokens_seen"
"""``state.extra``'s count of ``include_num_input_tokens_seen`` so far, which a resumed run continues."""
_REFERENCE_SYNCED = "ref_model_synced_at"
"""``state.extra``'s optimizer step of the reference's latest sync_ref_model update; absent before the first."""


@dataclass
class Run:
    """Everything a learner's loop works on (see the module docstring)."""

    cfg: LearnerConfig
    ranks: Ranks
    device: str
    out_dir: Path
    model: torch.nn.Module
    """The trained model: tree attention on, a peft model with LoRA."""
    tokenizer: Any
    policy: Policy
    optimizer: torch.optim.Optimizer
    scheduler: Any
    engine: RolloutEngine
    env_factory: Callable[[], Any]
    sync: WeightSync
    state: TrainerState
    reward_funcs: Sequence[RewardFunc] = ()
    reward_weights: list[float] = field(default_factory=lambda: [1.0])
    reference: torch.nn.Module | None = None
    """A frozen copy of the starting weights (with tree attention), when the learner asked for one; with
    ``sync_ref_model``, :meth:`sync_reference` moves it towards the trained weights."""
    attention: TreeAttentionChoice | None = None
    policy_model: torch.nn.Module | None = None
    """The default policy's own model (the final weights are exported from it)."""
    log: MetricsLog | None = None
    diagnostics: Diagnostics | None = None
    eval_start: dict[str, Any] | None = None
    source: GroupSource | None = None
    """Where the groups come from instead of the engine (a trajectory file, ``treerl serve``)."""
    precision: Precision | None = None
    """Which dtype the weights, the forward/backward and the sampler use (``--dtype``, ``--bf16``, ``--fp16``)."""
    eval_env_factory: Callable[[], Any] | None = None
    """The held-out evaluation's environments (``eval_env_kwargs``; default: ``env_factory``)."""
    env_id: str = ""
    """What groups and figures call the environment: ``cfg.env``, or the id of what a given ``env_factory`` builds."""
    callbacks: Sequence[StepCallback] = ()
    evaluator: Evaluator | None = None
    """What :meth:`evaluate` runs instead of the held-out episodes."""
    eval_end: dict[str, Any] | None = None
    """The held-out figures of the latest evaluation (at step :attr:`eval_end_step`), which :func:`finish`
    reports instead of evaluating the same weights again when that step is the run's last."""
    eval_end_step: int | None = None
    stop_requested: bool = False
    """A callback asked the run to end after the step it was called on (:attr:`StepControl.stop`)."""
    hub: HubPusher | None = None
    """Where the model is pushed on rank 0 (``cfg.push_to_hub``; see :mod:`~treerl.learners.hub`)."""
    _step_started: float = 0.0

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.log is not None:
            self.log.close()

    # -- the loop ----------------------------------------------------------------------------

    def steps(self) -> Iterator[int]:
        """The steps still to run (from the resumed one), each timed for ``perf/step_s``; none after a
        callback's request to stop (:attr:`stop_requested`, made on the main process: every rank stops)."""
        for step in range(self.state.step, self.cfg.steps):
            if self.ranks.enabled:  # the main process's request reaches every rank
                self.stop_requested = self.ranks.sum([float(self.stop_requested)])[0] > 0
            if self.stop_requested:
                if self.ranks.is_main:
                    print(f"stopping after step {self.state.step} of {self.cfg.steps}: a callback asked to stop",
                          file=sys.stderr)
                return
            self._step_started = time.perf_counter()
            self.notify("step_begin", step * self.cfg.optimizer_steps_per_step())
            yield step

    def rollout(self) -> tuple[list[Group], RolloutStats]:
        """Play the step's ``tasks_per_step`` tasks (this rank's share) ``group_size`` times each,
        or take the groups at those positions from the run's source."""
        first = self.state.next_task
        tasks = self.ranks.shard(range(first, first + self.cfg.tasks_per_step))
        if self.source is not None:
            groups, stats = self.source.take(tasks)
            check_sampling_temperature(groups, self.cfg.temperature)
            return groups, stats
        return run_until_done(self.engine.run(self.env_factory, self.env_id or self.cfg.env, tasks, self.cfg.group_size))

    def publish_weights(self, metrics: dict[str, float]) -> None:
        """Send the updated weights to the policy under the next version."""
        metrics["perf/sync_s"] = self.sync.publish()

    def keep_sample(self, step: int, groups: Sequence[Group], adv: torch.Tensor | Sequence[float],
                    rewards: torch.Tensor | None = None) -> Path | None:
        """On a sampled step, write the first ``cfg.sample_groups`` groups with their advantages
        ``adv`` (E,) to ``output_dir/trajectories`` (see :mod:`~treerl.learners.samples`); on every
        step with ``cfg.log_completions``, print and log the step's completions with their reward
        columns ``rewards`` (E, 1 + reward functions), the step's scores (default: the environment's alone).

        Call it before the optimizer step, so that the trainer log-probs it stores are the ones
        the step's importance weights compare with the sampler's. Returns the file, if written.
        """
        if self.ranks.is_main and self.cfg.log_completions and self.log is not None:
            names = ["env", *(reward_func_name(f) for f in self.reward_funcs)]
            rows = completion_rows(groups, adv, names, self.cfg.num_completions_to_print, rewards)
            total = sum(len(g.episodes) for g in groups)
            self.log.log_completions(step + 1, rows, format_completions(step + 1, rows, total))
        if not (self.ranks.is_main and keeps_sample(step + 1, self.cfg)):
            return None
        sample = annotate_sample(groups, adv, self.cfg.sample_groups)
        if self.cfg.sample_trainer_logprobs:
            add_trainer_logprobs(self.model, sample, temperature=self.cfg.temperature, device=self.device)
        return write_groups(sample_path(self.out_dir, step + 1), sample)

    def end_step(self, step: int, metrics: dict[str, float], stats: RolloutStats, *, num_episodes: int,
                 batches: Sequence[PackedBatch] = (), next_task: int | None = None,
                 passes: int = 1) -> dict[str, float]:
        """The step's summary, diagnostics, metrics line and checkpoint; returns the logged metrics.

        ``metrics`` holds the algorithm's own (losses, rewards, ``perf/rollout_s``); the
        rollout summary, packing figures and times are added here, combined over ranks.
        ``batches`` are the micro-batches the step trained on, each forwarded ``passes`` times
        (``num_iterations``). ``next_task`` is the first task index a resumed run plays (default:
        the step's ``tasks_per_step`` tasks after this step's first).
        """
        summary = RolloutStats.merge(self.ranks.gather(stats)).summary()
        local = {  # this rank's own: averaged over ranks by episodes (times: the slowest rank)
            **{k: v for k, v in metrics.items() if k.startswith(("reward_fn/", "perf/"))},
            "perf/step_s": time.perf_counter() - self._step_started,
            **{k: float(v) for k, v in packing_metrics(batches).items()},
        }
        rewards = {"reward/mean": summary["reward/mean"], "reward/std": summary["reward/std"]}
        if self.reward_funcs and "reward/mean" in metrics:
            # The reward trained on is the weighted sum of the environment's and the functions' (TRL's
            # `reward`), as the advantages computed it over every rank; the environment's own beside it.
            rewards = {"reward/env_mean": summary["reward/mean"], "reward/env_std": summary["reward/std"]}
        metrics.update({
            **rewards,
            **{f"reward/{name}": mean for name, mean in summary["reward_by_env"].items()},  # an EnvGroup's members
            **{f"success_rate/{name}": rate for name, rate in summary["success_by_env"].items()},
            "reward/success_rate": summary["success_rate"],
            "tools/invalid_rate": summary["tools/invalid_rate"],
            "episode/length_limit_frac": summary["episode/length_limit_frac"],
            # The step's trees; the packed rows' own ratio replaces it below, unless nothing was trained.
            "tree/packing_ratio": summary["tree/packing_ratio"],
            "perf/tokens_per_s": summary["perf/tokens_per_s"],
            **{f"tool_calls/{kind}": float(n) for kind, n in summary["tool_calls"].items()},  # counts by outcome
            **summary["env_metrics"],  # the environments' own numbers (env/NAME), each one's mean over its episodes
            "policy/version": self.sync.version,
            **self.ranks.mean_metrics(local, weight=num_episodes),
        })
        if self.cfg.include_num_input_tokens_seen != "no":
            metrics["num_input_tokens_seen"] = self._count_input_tokens(batches, passes)
        if next_task is None:
            next_task = self.state.next_task + self.cfg.tasks_per_step
        # The learner's own counters (state.extra) are its to update before the step ends; they carry over.
        self.state = replace(self.state, step=step + 1, policy_version=self.sync.version, next_task=next_task)
        if self.ranks.is_main:
            metrics.update(self.diagnostics.check(step + 1, metrics))
            # Also at the last step, as transformers' Trainer evaluates at the end of training (eval_strategy
            # "steps") and of the last epoch, a short one included ("epoch"); its figures are the end's. Not
            # before eval_delay. Before the checkpoint: a resumed run continues after it.
            improved, evaluated = False, {}
            if self.cfg.evaluates_after(step + 1):
                evaluated = self.evaluate(step + 1)
                metrics.update(evaluated)
                improved = self.track_best(step + 1, evaluated)
            self.log.log(step + 1, metrics)
            control = self.call_back(step + 1, metrics)
            if control.evaluate and not evaluated:  # transformers' should_evaluate: at this step, if it did not
                if self.evaluator is None and not self.cfg.eval_episodes:
                    raise ConfigError(f"a callback asked to evaluate at step {step + 1}, but the run has nothing to "
                                      "evaluate: give it held-out episodes (--eval-episodes, or an eval_dataset to "
                                      "treerl.GRPOTrainer).")
                evaluated = self.evaluate(step + 1)
                improved = self.track_best(step + 1, evaluated)
                self.log.log(step + 1, evaluated)
                asked = self.call_back(step + 1, evaluated)
                control.stop, control.save = control.stop or asked.stop, control.save or asked.save
            self.stop_requested |= control.stop
            saves = self.cfg.save_every and (step + 1) % self.cfg.save_every == 0 or control.save
            last = step + 1 == self.cfg.steps or control.stop  # the last step's checkpoint is finish's
            if (saves or self.cfg.save_on_best and improved) and not last:
                self.save_checkpoint()
        return metrics

    def _count_input_tokens(self, batches: Sequence[PackedBatch], passes: int) -> int:
        """transformers' ``num_input_tokens_seen`` after this step: the run's count before it (``state.extra``,
        which checkpoints keep) plus the input tokens of its training forwards on every rank, each of
        ``batches`` forwarded ``passes`` times: its rows' every slot (``include_num_input_tokens_seen`` "all",
        transformers' ``input_ids.numel()``) or their tokens ("non_padding", its attention mask's sum)."""
        if self.cfg.include_num_input_tokens_seen == "all":
            local = sum(b.input_ids.numel() for b in batches)
        else:
            local = sum(b.num_tokens for b in batches)
        seen = int(self.state.extra.get(_TOKENS_SEEN, 0)) + int(self.ranks.sum([local * passes])[0])
        self.state.extra[_TOKENS_SEEN] = seen
        return seen

    def notify(self, event: str, global_step: int) -> None:
        """Call ``on_event(event, global_step)`` of each callback that has one, on the main process (see
        :data:`RUN_EVENTS`)."""
        if not self.ranks.is_main:
            return
        for callback in self.callbacks:
            if hasattr(callback, "on_event"):
                callback.on_event(event, global_step)

    def call_back(self, step: int, metrics: dict[str, float]) -> StepControl:
        """Call each callback with ``step`` and a copy of ``metrics``; what they asked for, together."""
        out = StepControl()
        for callback in self.callbacks:
            asked = callback(step, dict(metrics))
            if isinstance(asked, StepControl):
                out = StepControl(out.stop or asked.stop, out.evaluate or asked.evaluate, out.save or asked.save)
        return out

    def evaluate(self, step: int) -> dict[str, float]:
        """The evaluation of ``eval_every`` after step ``step`` (0: before the first), as metrics of that step:
        the :attr:`evaluator`'s, or the held-out episodes' figures under ``eval/`` (:func:`eval_metrics`)."""
        if self.evaluator is not None:
            per_step = self.cfg.optimizer_steps_per_step()  # TRL's state counts optimizer steps
            state = StepState(global_step=step * per_step, max_steps=self.cfg.steps * per_step)
            return dict(self.evaluator(self.policy, self.tokenizer, trainer_state=state))
        if step == 0 and self.eval_start is not None:
            figures = self.eval_start
        else:
            figures = evaluate_policy(self.cfg, self.policy, self.tokenizer, self.eval_env_factory or self.env_factory,
                                      env_id=self.env_id)
            print(f"eval at step {step}: success rate {figures['success_rate']:.1%} over {figures['episodes']} "
                  "held-out episodes", file=sys.stderr)
        self.eval_end, self.eval_end_step = figures, step
        return eval_metrics(figures)

    def track_best(self, step: int, evaluated: dict[str, float]) -> bool:
        """transformers' ``_determine_best_metric`` after the evaluation of step ``step``: whether its
        ``metric_for_best_model`` improves on the best so far (recorded in :attr:`state` then, the step too). Step
        0, the evaluation before the first step, only has the metric's name checked, as transformers compares
        none of ``eval_on_start``'s."""
        name = self.cfg.metric_for_best_model
        if name is None:
            return False
        value = float(evaluated[metric_key(name, evaluated)])
        if step == 0:
            return False
        if not improves(value, self.state.best_metric, self.cfg.greater_is_better):
            return False
        self.state.best_metric, self.state.best_step = value, step
        return True

    def load_best_model(self) -> bool:
        """transformers' ``_load_best_model`` with ``load_best_model_at_end``: the best checkpoint's weights into
        the trained model and the policy (the model and adapter the run writes, and the end's evaluation, are
        then the best's). Returns whether they were loaded (a run with no best checkpoint keeps its last)."""
        best = self.state.best_model_checkpoint
        if not self.cfg.load_best_model_at_end or best is None:
            return False
        load_weights(Path(best), self.model)
        # The policy alone, not the sync's targets (AsyncGRPO's generators have stopped): the end's evaluation
        # samples it, and the model written is its copy (see _export_model).
        self.policy.set_weights(policy_state_dict(self.model), version=self.sync.version)
        print(f"loaded the best model, {best} ({self.cfg.metric_for_best_model} {self.state.best_metric:g}), into "
              f"{self.out_dir / 'model'}", file=sys.stderr)
        return True

    def before_optimizer_step(self, optimizer_step: int) -> None:
        """What precedes the run's optimizer step ``optimizer_step`` (from 1), its gradients clipped: the
        callbacks told (``pre_optimizer_step``, :meth:`notify`)."""
        self.notify("pre_optimizer_step", optimizer_step - 1)

    def after_optimizer_step(self, optimizer_step: int, metrics: dict[str, float]) -> None:
        """What follows the run's optimizer step ``optimizer_step`` (from 1, TRL's ``global_step``): the callbacks
        told (``optimizer_step``, :meth:`notify`), ``sync_ref_model``'s update of the reference
        (:meth:`sync_reference`), and every ``torch_empty_cache_steps``-th, the accelerator's cache emptied
        (:func:`empty_device_cache`)."""
        self.notify("optimizer_step", optimizer_step - 1)
        self.sync_reference(optimizer_step, metrics)
        every = self.cfg.torch_empty_cache_steps
        if every and optimizer_step % every == 0:
            empty_device_cache()

    def sync_reference(self, optimizer_step: int, metrics: dict[str, float]) -> None:
        """After the run's optimizer step ``optimizer_step`` (from 1, TRL's ``global_step``), TR-DPO's update of
        the reference with ``sync_ref_model`` (TRL's ``SyncRefModelCallback``): every ``ref_model_sync_steps``-th,
        reference = alpha x model + (1 - alpha) x reference. ``ref/last_sync_step`` logs the latest."""
        cfg = self.cfg
        if not getattr(cfg, "sync_ref_model", False):
            return
        if optimizer_step % cfg.ref_model_sync_steps == 0:
            mix_weights(self.reference, self.model, cfg.ref_model_mixup_alpha)
            self.state.extra[_REFERENCE_SYNCED] = optimizer_step  # a checkpoint then saves the reference
        metrics["ref/last_sync_step"] = self.state.extra.get(_REFERENCE_SYNCED, 0)

    def save_checkpoint(self) -> None:
        # The reference is saved once it is no longer the starting weights (sync_ref_model).
        reference = self.reference if _REFERENCE_SYNCED in self.state.extra else None
        path = checkpoint_path(self.out_dir, self.state.step)
        if self.state.best_step is not None:
            # transformers': the best evaluation's checkpoint, once one exists at its step (this one, or earlier)
            best = checkpoint_path(self.out_dir, self.state.best_step)
            if best == path or best.is_dir():
                self.state.best_model_checkpoint = str(best)
        save_checkpoint(path, self.model, self.optimizer, self.scheduler, self.state, reference=reference,
                        model_only=self.cfg.save_only_model)
        prune_checkpoints(self.out_dir, self.cfg.save_total_limit, best=self.state.best_model_checkpoint)
        if self.hub is not None and self.cfg.hub_strategy == "every_save" and self.state.step < self.cfg.steps:
            # The model as it is now, uploaded while training goes on; the final one is finish's to push.
            model_dir = self.out_dir / "model"
            self.hub.push(model_dir, f"Training in progress, step {self.state.step}", steps=self.state.step,
                          write=lambda: _write_model(self, model_dir))
        self.notify("save", self.state.step * self.cfg.optimizer_steps_per_step())


# -- build ---------------------------------------------------------------------------------------


ADAMW_OPTIONS = ("optim", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay")
"""The fields :func:`make_optimizer` reads besides ``learning_rate``: an optimizer passed in takes none of them."""


def make_optimizer(params: list[torch.nn.Parameter], cfg: LearnerConfig) -> torch.optim.Optimizer:
    """The optimizer of ``cfg``: torch's AdamW with ``learning_rate``, betas ``(adam_beta1, adam_beta2)``,
    ``adam_epsilon`` and ``weight_decay``; with ``optim="adamw_torch_fused"`` its fused kernel (as transformers
    builds TRL's default, on every device torch has it for).

    >>> from treerl.learners.grpo import GRPOConfig
    >>> cfg = GRPOConfig(output_dir="x", learning_rate=1e-3, adam_beta2=0.95, optim="adamw_torch_fused")
    >>> group = make_optimizer([torch.zeros(1, requires_grad=True)], cfg).param_groups[0]
    >>> group["betas"], group["eps"], group["fused"]
    ((0.9, 0.95), 1e-08, True)
    """
    return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay,
                             fused=True if cfg.optim == "adamw_torch_fused" else None)


def _refuse_unused_adamw_options(cfg: LearnerConfig) -> None:
    """A given optimizer trains with its own settings: ``cfg``'s AdamW options set away from their defaults
    would change nothing, so they are refused rather than ignored."""
    fields = type(cfg).__dataclass_fields__
    # Not optim: its every choice is a default, treerl's adamw_torch or TRL's adamw_torch_fused, which a TRL
    # config written out names.
    changed = [f"{name}={getattr(cfg, name)!r}" for name in ADAMW_OPTIONS
               if name != "optim" and getattr(cfg, name) != fields[name].default]
    if changed:
        raise ConfigError(f"{', '.join(changed)}: these configure the AdamW treerl makes, but an optimizer was "
                          "passed (optimizer= or GRPOTrainer's optimizers=), which trains with its own settings: set "
                          "them on that optimizer (e.g. torch.optim.AdamW(params, betas=(0.9, 0.95), eps=1e-6)), or "
                          "leave them at their defaults.")


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: LearnerConfig) -> Any:
    """The learning-rate schedule of ``cfg``: ``warmup_steps`` of linear warm-up, then ``lr_scheduler_type``'s
    (``linear`` and ``cosine`` reach 0 at the run's last optimizer step: ``steps`` x ``num_iterations`` x
    ``num_minibatches``, the optimizer steps TRL's ``max_steps`` counts). Stepped once per optimizer step.

    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    >>> from treerl.learners.grpo import GRPOConfig
    >>> sched = make_scheduler(opt, GRPOConfig(output_dir="x", steps=4, lr_scheduler_type="linear"))
    >>> lrs = []
    >>> for _ in range(4):
    ...     opt.step(); sched.step(); lrs.append(round(sched.get_last_lr()[0], 2))
    >>> lrs
    [0.75, 0.5, 0.25, 0.0]
    """
    from transformers import get_scheduler

    name = "constant_with_warmup" if cfg.lr_scheduler_type == "constant" else cfg.lr_scheduler_type
    total = cfg.steps * cfg.optimizer_steps_per_step()
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total)


def check_sampling_temperature(groups: Sequence[Group], temperature: float) -> None:
    """Refuse groups whose tokens were sampled at another temperature than the trainer's.

    The trainer recomputes every sampled token's log-prob at ``temperature``: the importance
    weights compare it with the sampler's, and the loss trains it. Groups recorded elsewhere
    (a trajectory file, ``treerl serve``) say what they were sampled at: the engine's in
    ``info["sampling"]``, the server's in ``info["temperatures"]``. Greedy turns (top_k=1)
    are left out: a one-token candidate set has log-prob 0 at any temperature.
    """
    for group in groups:
        sampling = group.info.get("sampling")
        if isinstance(sampling, dict) and sampling.get("top_k") != 1:
            recorded = [sampling.get("temperature")]
        else:
            recorded = list(group.info.get("temperatures") or [])
        other = sorted({t for t in recorded if isinstance(t, (int, float)) and not math.isclose(t, temperature)})
        if other:
            raise ConfigError(
                f"group {group.task_key!r} was sampled at temperature {', '.join(map(str, other))}, but the trainer "
                f"recomputes log-probs at temperature={temperature}: the importance weights and the loss would "
                f"use another distribution than the one that drew the tokens. Pass --temperature {other[0]} "
                "(or have the agents leave temperature unset, so that `treerl serve` uses its own)."
            )


def empty_device_cache() -> None:
    """transformers' ``torch_empty_cache_steps`` call: the accelerator's cached memory that no tensor uses handed
    back, as its Trainer does it (accelerate's ``clear_device_cache``: ``torch.cuda.empty_cache()`` or the XPU's,
    NPU's, MPS's, ...; nothing on the CPU), and MPS's graph cache."""
    from accelerate.utils.memory import clear_device_cache

    clear_device_cache()
    if torch.backends.mps.is_available() and hasattr(torch.mps, "clear_graph_cache"):
        torch.mps.clear_graph_cache()


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def seed_run(cfg: LearnerConfig) -> None:
    """Seed Python's, numpy's and torch's generators with ``cfg.seed``; with ``cfg.full_determinism``, transformers'
    ``enable_full_determinism`` (which seeds them too) instead, as its Trainer does: deterministic algorithms only,
    and the environment variables CUDA's need."""
    if cfg.full_determinism:
        from transformers.trainer_utils import enable_full_determinism

        enable_full_determinism(cfg.seed)
    else:
        set_seed(cfg.seed)


def build(cfg: LearnerConfig, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
          policy: Policy | None = None, env_factory: Callable[[], Any] | None = None,
          reward_funcs: Sequence[RewardFunc] = (), reward_weights: Sequence[float] | None = None,
          optimizer: OptimizerSpec | None = None, reference: bool = False, source: GroupSource | None = None,
          callbacks: Sequence[StepCallback] = (), evaluate: Evaluator | None = None) -> Run:
    """Everything a learner's loop needs, resumed and evaluated at the start (see the module docstring).

    ``model``/``tokenizer`` default to ``cfg.model`` (the shipped tiny model when unset);
    ``policy`` to a :class:`TransformersPolicy` on the learner's own copy of the model;
    ``env_factory`` to ``make(cfg.env, **cfg.env_kwargs)`` (training plays it through
    ``cfg.train_env_factory``); ``optimizer`` to :func:`make_optimizer`'s AdamW (a given one
    with AdamW options of ``cfg`` set is refused: they would change nothing). ``reference=True`` keeps a frozen copy of
    the starting weights (a KL term's reference). ``source`` (default: ``cfg.group_source()``)
    replaces the engine in :meth:`Run.rollout`. ``callbacks`` are called after each step's metrics
    are logged (:data:`StepCallback`). ``evaluate`` replaces the held-out episodes of ``eval_every``
    (:data:`Evaluator`); without it ``eval_every`` needs ``eval_episodes``.
    """
    from treerl.agents.transformers_policy import TransformersPolicy, cast_lm_head_to_fp32

    if optimizer is not None:
        _refuse_unused_adamw_options(cfg)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if not reward_funcs and (cfg.reward_funcs or cfg.judge):  # named on the command line
        reward_funcs = cfg.reward_functions()
    if reward_weights is None and cfg.reward_weights is not None:
        reward_weights = cfg.reward_weights
    weights = check_reward_weights(reward_funcs, reward_weights)
    # num_train_epochs: the run's length (and what is a fraction of it) from the rows, before anything reads it;
    # save_strategy / eval_strategy "epoch" (every_epoch): save_every / eval_every from them.
    epochs_note = (_resolve_epochs(cfg, env_factory, source) if cfg.num_train_epochs is not None or cfg.every_epoch
                   else None)
    if cfg.eval_every and not cfg.eval_episodes and evaluate is None:
        raise ConfigError(f"eval_every={cfg.eval_every} evaluates the held-out episodes every N steps, but "
                          "eval_episodes=0 plays none; set --eval-episodes (e.g. 32) or --eval-every 0.")
    tracker_for(cfg.report_to)  # a tracker that is not installed is said now, not after the model loads
    ranks = Ranks.from_env(cfg.device, timeout_s=cfg.ddp_timeout)
    if cfg.tasks_per_step < ranks.world_size:
        raise ValueError(f"tasks_per_step={cfg.tasks_per_step} is fewer than the {ranks.world_size} processes, so "
                         f"some would have no task; use --tasks-per-step {ranks.world_size} or more, or fewer "
                         f"processes.")
    if epochs_note and ranks.is_main:
        print(f"note: {epochs_note}", file=sys.stderr)
    device = ranks.device(cfg.device)
    set_tf32(cfg.tf32, device)
    out_dir = Path(cfg.output_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--output-dir {cfg.output_dir}: cannot create a directory there ({exc.strerror or exc}); "
                          "pass a new or existing directory, e.g. --output-dir runs/x.") from None
    if not cfg.resume:
        # A second run would append to the first's metrics, and a later --resume take the first's checkpoints.
        found = earlier_run(out_dir)
        if found and not cfg.overwrite_output_dir:
            raise ConfigError(f"--output-dir {cfg.output_dir} holds an earlier run ({', '.join(found)}): pass --resume "
                              "to continue it, --overwrite-output-dir to start over there, or a new --output-dir.")
        if cfg.overwrite_output_dir:  # every rank decides alike (the files are read before any is removed)
            if ranks.is_main and found:
                clear_run(out_dir)
            ranks.barrier()
    else:
        _refuse_model_only_resume(cfg, out_dir)  # before the model loads
    seed_run(cfg)

    # Models: the trainer's (tree attention, maybe LoRA) and the sampler's own copy.
    if model is None:
        model, tokenizer = cfg.load_model(device)
    elif tokenizer is None:
        raise ValueError("train(model=...) needs its tokenizer too: pass tokenizer=...")
    else:
        cfg.apply_chat_template(tokenizer)
    # TRL's: unset takes a Mixture-of-Experts model config's own weight, set here so that config.json records it
    # (a dense model refuses another value than 0; its unset stays unset); an unknown top-k is refused now.
    if aux_coef := router_aux_loss_coef(model, cfg.router_aux_loss_coef):
        router_top_k(model)
        cfg.router_aux_loss_coef = aux_coef
    precision = resolve_precision(cfg.dtype, cfg.bf16, cfg.fp16, device, fp32_head=cfg.cast_lm_head_to_fp32)
    loaded = checkpoint_dtype(model)
    if precision.weights is not None and loaded != precision.weights:
        model.to(precision.weights)  # float32 master weights: a bfloat16 checkpoint's small updates would round away
    ranks.broadcast_parameters(model)  # every rank starts from rank 0's weights
    policy_model = None
    if policy is None and cfg.use_vllm:
        from treerl.learners.vllm_colocate import vllm_policy

        policy = vllm_policy(cfg, precision, model, tokenizer)
    elif policy is None:  # the sampler computes in the trainer's compute precision
        policy_model = copy.deepcopy(model).to(precision.sampler_dtype(checkpoint_dtype(model))).eval()
        policy = TransformersPolicy(policy_model, tokenizer, device=device,
                                    continuous_batching=cfg.continuous_batching, fp32_head=cfg.cast_lm_head_to_fp32)
    if cfg.cast_lm_head_to_fp32:  # TRL's: the head's own weights, so that its updates do not round away
        cast_lm_head_to_fp32(model)  # (a float32 head is left as it is); the reference copies it
    _fall_back_to_padded_packing(cfg, model, ranks.is_main)
    ref_model = _reference_model(model, cfg) if reference and cfg.lora_r == 0 else None
    if cfg.lora_r > 0:
        model = _apply_lora(model, cfg)
        ranks.broadcast_parameters(model)
        if reference:  # the frozen base is the starting model: no copy of it
            ref_model = AdaptersOff(model)
    if cfg.disable_dropout:  # TRL's: the dropout modules of the trained model, LoRA's included, after LoRA
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    attention = None
    if cfg.pack_mode != "padded":
        attention = enable_tree_attention(model.get_base_model() if cfg.lora_r > 0 else model, impl=cfg.attention_impl)
        if attention.no_backward is not None:  # else the first step's backward pass fails, after the rollout
            raise ConfigError(f"attention_impl={cfg.attention_impl!r} cannot train on {device}: {attention.no_backward}. "
                              "Use attention_impl='auto' (or 'segment'), which runs everywhere.")
        logger.info("tree attention: %s (%s)", attention.impl, attention.reason)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    params = [p for p in model.parameters() if p.requires_grad]
    _check_size_defaults(cfg, model, ranks.is_main)
    if optimizer is None:
        optimizer = make_optimizer(params, cfg)
    elif not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(params)
    scheduler = make_scheduler(optimizer, cfg)
    engine = cfg.engine(policy, tokenizer, seed=cfg.seed, branch_at_turn=cfg.branch_at_turn,
                        branch_factor=cfg.branch_factor)
    if env_factory is not None and cfg.eval_env_kwargs:
        raise ConfigError(f"eval_env_kwargs={cfg.eval_env_kwargs!r} configure make(env={cfg.env!r}), not the env_factory "
                          "passed to train(): register your environment (treerl.register) and set env= and "
                          "env_kwargs= instead of env_factory=, or leave eval_env_kwargs empty to evaluate on "
                          "env_factory's environments.")
    # Training and the held-out evaluation differ only where the learner sets malformed_ends_episode.
    eval_env_factory = cfg.eval_env_factory() if cfg.eval_env_kwargs else (env_factory or cfg.env_factory())
    given_factory, env_factory = env_factory, cfg.train_env_factory(env_factory)
    if ranks.is_main and cfg.eval_episodes and (shared := cfg.eval_reads_training_data()):
        print("warning: the held-out evaluation draws its tasks from the training data (env_kwargs "
              + ", ".join(shared) + "); pass --eval-env-kwargs '{\"data_path\": \"test.jsonl\"}' (a group's "
              "environment: '{\"NAME\": {\"data_path\": \"test.jsonl\"}}') to evaluate on held-out rows.",
              file=sys.stderr)

    state = TrainerState()
    if cfg.resume and (ckpt := resume_checkpoint(out_dir)) is not None:
        try:
            state = load_checkpoint(ckpt, model, optimizer, scheduler,
                                    reference=ref_model if cfg.lora_r == 0 else None)
        except (RuntimeError, ValueError, KeyError) as exc:  # weights or optimizer of another shape (e.g. LoRA)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"--resume: {ckpt} does not fit this run's model ({first}); resume with the settings it "
                              f"was made with (see {out_dir / 'config.json'}, e.g. --lora-r), or start a new "
                              "--output-dir.") from None
        state.best_model_checkpoint = _resumed_best(state, out_dir, ranks.is_main)
        if ranks.is_main:
            print(f"resumed from {ckpt} at step {state.step}", file=sys.stderr)
            # The checkpoint's optimizer keeps its own settings: config.json records those, not the ignored flags.
            for name, value in _warn_if_settings_changed(run_settings(out_dir), cfg).items():
                setattr(cfg, name, value)
            for name in ("metrics.jsonl", "diagnostics.jsonl"):  # the steps the resumed run replays
                truncate_metrics(out_dir / name, state.step)
    elif cfg.resume and ranks.is_main and (found := earlier_run(out_dir)):
        # Nothing to continue from (no checkpoint was written before the run stopped): appending would
        # repeat its steps in metrics.jsonl, so it starts over in a clean directory.
        print(f"no checkpoint in {out_dir / 'checkpoints'} to resume from: starting over (the earlier run's "
              f"{', '.join(found)} are replaced; --save-every N checkpoints along the way)", file=sys.stderr)
        clear_run(out_dir)
    source = source if source is not None else cfg.group_source()
    # What groups and figures call the environment; a learner fed by a source plays no environment.
    plays = source is None or cfg.eval_episodes > 0
    env_id = (factory_env_id(given_factory) if given_factory is not None and plays else None) or cfg.env
    if ranks.is_main and source is None:  # groups from a source were rendered elsewhere
        warn_about_template(tokenizer, env_factory, engine.chat_template)
    sync = WeightSync(model, policy, version=state.policy_version)
    if hasattr(source, "set_weights"):  # e.g. `treerl serve`: its later requests sample the new weights
        sync.targets.append(source)
    if state.step > 0:
        sync.publish(version=state.policy_version)

    run = Run(cfg=cfg, ranks=ranks, device=device, out_dir=out_dir, model=model, tokenizer=tokenizer, policy=policy,
              optimizer=optimizer, scheduler=scheduler, engine=engine, env_factory=env_factory, sync=sync,
              state=state, reward_funcs=tuple(reward_funcs), reward_weights=weights, reference=ref_model,
              attention=attention, policy_model=policy_model, source=source, precision=precision,
              eval_env_factory=eval_env_factory, env_id=env_id, callbacks=tuple(callbacks), evaluator=evaluate)
    if ranks.is_main:
        # The other ranks write nothing and wait for rank 0 at the first step's collectives.
        print(f"precision: {precision.describe(checkpoint=loaded, weights=checkpoint_dtype(model))}", file=sys.stderr)
        learner = learner_name(cfg)
        # Which learner too (treerl compare lists it among the differences of runs).
        (out_dir / "config.json").write_text(json.dumps(_settings(cfg), indent=2))
        if cfg.push_to_hub:  # the repository is created now: a missing token fails before training, not after
            base = cfg.model or getattr(getattr(model, "config", None), "_name_or_path", None)  # (given: its id)
            run.hub = HubPusher.create(cfg, learner=learner, base_model=base)
        run.log = MetricsLog(out_dir, report_to=cfg.report_to, config=cfg.recorded(), total_steps=cfg.steps,
                             start_step=state.step, progress=cfg.progress)
        # Groups from a source were sampled elsewhere, under limits the run's flags do not set.
        run.diagnostics = Diagnostics(out_dir / "diagnostics.jsonl",
                                      actions=RECORDED_ACTIONS if source is not None else None)
        run.eval_start = evaluate_at_start(cfg, policy, tokenizer, eval_env_factory, out_dir,
                                           resumed=state.step > 0, env_id=env_id)
        if run.eval_start is not None and state.step == 0:
            # The episodes played, not cfg.eval_episodes: a dataset smaller than that plays each row once.
            print(f"eval at start: success rate {run.eval_start['success_rate']:.1%} over "
                  f"{run.eval_start['episodes']} held-out episodes", file=sys.stderr)
        started = run.eval_start is not None or evaluate is not None and cfg.eval_on_start is not False
        if cfg.eval_every and state.step == 0 and started:
            # Step 0 of the curve eval_every draws (TRL's eval_on_start); a resumed run kept its line.
            start = run.evaluate(0)
            run.track_best(0, start)  # a metric_for_best_model it lacks is said now, not after the first step
            run.log.log(0, start)
            run.stop_requested = run.call_back(0, start).stop
    return run


def _resumed_best(state: TrainerState, out_dir: Path, is_main: bool) -> str | None:
    """A resumed state's best model checkpoint, in this ``out_dir`` (the run's directory may have moved); None,
    with a warning, where it no longer exists (transformers' ``train``)."""
    if state.best_model_checkpoint is None:
        return None
    path = checkpoint_path(out_dir, checkpoint_step(Path(state.best_model_checkpoint)))
    if path.is_dir():
        return str(path)
    if is_main:
        print(f"warning: the best checkpoint {state.best_model_checkpoint} recorded in the resumed state does not "
              "exist anymore; the run goes on without it (a later evaluation that improves on its metric saves "
              "one, with save_strategy 'best').", file=sys.stderr)
    return None


def _refuse_model_only_resume(cfg: LearnerConfig, out_dir: Path) -> None:
    """A resumed run whose latest checkpoint holds the model only (``save_only_model``) is refused while steps
    remain: without the optimizer's state, the schedule's and the random generators, the steps after it would
    not be the run's. With none left it resumes, to write the checkpoint's weights as ``output_dir/model``."""
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None or not is_model_only(ckpt) or cfg.steps <= checkpoint_step(ckpt):
        return
    step = checkpoint_step(ckpt)
    raise ConfigError(f"--resume: {ckpt} holds the model only (save_only_model wrote it): no optimizer state, "
                      "learning-rate schedule or random generators to continue from, so the steps after it would not "
                      "be this run's (transformers says the same of such checkpoints). Start over with "
                      "--overwrite-output-dir, or in a new --output-dir, leaving save_only_model off for checkpoints "
                      f"a run can resume from; or write its weights to {out_dir / 'model'} with --resume --steps "
                      f"{step} (no step left to train).")


def _resolve_epochs(cfg: LearnerConfig, env_factory: Callable[[], Any] | None, source: GroupSource | None) -> str:
    """``cfg.steps`` from ``num_train_epochs`` and the rows of the training environment's dataset
    (:meth:`~treerl.learners.config.LearnerConfig.resolve_steps`), then the fields of ``cfg.every_epoch``
    (:meth:`~treerl.learners.config.LearnerConfig.resolve_every_epoch`); the line it says."""
    if source is not None or cfg.from_rollouts or cfg.from_server:
        given = "--from-rollouts" if cfg.from_rollouts else "--from-server" if cfg.from_server else "a source"
        if cfg.num_train_epochs is None:
            return cfg.resolve_every_epoch(None, f"the groups come from {given}")
        raise ConfigError(f"num_train_epochs={cfg.num_train_epochs:g} counts passes over the environment's dataset, but "
                          f"the groups come from {given}: give the run's length in steps, --steps N.")
    env = (env_factory or cfg.env_factory())()
    try:
        rows = num_rows(env)
        where = (f"the group {cfg.env} is mixed by weights: its members' rows make no one dataset (a mixed one is "
                 "the group's data_path with an env column)" if isinstance(env, EnvGroup) else
                 f"{env_id_of(env) or cfg.env} generates its tasks (no data_path or dataset)")
    finally:
        env.close()
    notes = [cfg.resolve_steps(rows, where)] if cfg.num_train_epochs is not None else []
    if cfg.every_epoch:
        notes.append(cfg.resolve_every_epoch(rows, where))
    return "; ".join(notes)


# Settings a resumed run may change without changing what its earlier steps were.
_RESUMABLE_CHANGES = frozenset({"steps", "resume", "progress", "save_every", "save_total_limit", "num_threads",
                                "report_to", "sample_every", "sample_groups", "eval_episodes", "num_generations_eval",
                                "overwrite_output_dir", "eval_every", "eval_on_start", "do_eval", "push_to_hub",
                                "hub_model_id", "hub_strategy", "hub_private_repo", "hub_revision", "project",
                                "vllm_server_wait_s", "every_epoch", "load_best_model_at_end", "save_on_best",
                                "save_only_model", "eval_delay",
                                "include_num_input_tokens_seen"})


def learner_name(cfg: LearnerConfig) -> str | None:
    """The registered name of the learner whose config ``cfg`` is (``grpo``, ``sdpo``, ...), or None."""
    return next((name for name, spec in LEARNERS.items() if type(cfg) is spec.config), None)


def _settings(cfg: LearnerConfig) -> dict[str, Any]:
    """The run's settings as config.json records them: which learner, and its options."""
    return {"learner": learner_name(cfg), **cfg.recorded()}


def _warn_if_settings_changed(before: dict[str, Any] | None, cfg: LearnerConfig) -> dict[str, Any]:
    """Say which settings differ from those the resumed run was started with (``before``: its config.json);
    return the optimizer's among them with their values in ``before``, which the checkpoint's optimizer keeps."""
    if before is None:
        return {}
    now = json.loads(json.dumps(cfg.recorded(), default=str))
    changed = [k for k, v in now.items() if k in before and k not in _RESUMABLE_CHANGES and before[k] != v]
    said = {k: f"{k} {before[k]!r} -> {now[k]!r}" for k in changed}
    # The checkpoint's optimizer comes back with its own learning rate and AdamW settings (as transformers' does).
    optimizer = {"learning_rate", *ADAMW_OPTIONS}
    held = [said[k] for k in changed if k in optimizer]
    others = [said[k] for k in changed if k not in optimizer]
    if others:
        print(f"warning: resuming with settings that differ from the run's: {'; '.join(others)} (config.json "
              "will record the new ones)", file=sys.stderr)
    if held:
        print(f"warning: resuming with optimizer settings that differ from the run's: {'; '.join(held)}: they "
              "change nothing, the checkpoint's optimizer keeps its own (start a new run to change them)",
              file=sys.stderr)
    return {k: before[k] for k in changed if k in optimizer}


def _check_size_defaults(cfg: LearnerConfig, model: torch.nn.Module, is_main: bool) -> None:
    """The learning rate for the model's size when not given (``cfg.learning_rate`` is set to it, so
    config.json records it); warnings for a learning rate or a token limit that do not fit the model."""
    num_params = sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name)
    cfg.learning_rate, warning = check_learning_rate(cfg.learning_rate, num_params, lora=cfg.lora_r > 0)
    notes = [warning] if warning else []
    if num_params >= SMALL_MODEL_PARAMS and cfg.max_new_tokens < 256:
        notes.append(f"max_new_tokens={cfg.max_new_tokens} is the shipped tiny model's limit; a "
                     f"{model_size(num_params)}-parameter model's answers (and its thinking) are usually longer, so "
                     "most turns would be cut off: pass e.g. --max-new-tokens 1024.")
    for message in notes if is_main else ():
        logger.info(message)  # printed below: at warning level Python's last-resort handler printed it twice
        print(f"warning: {message}", file=sys.stderr)


def _fall_back_to_padded_packing(cfg: LearnerConfig, model: torch.nn.Module, is_main: bool) -> None:
    """``cfg.pack_mode = "padded"``, with a note, when tree attention cannot serve ``model`` (gpt-oss's
    attention sinks, linear-attention layers): a padded row is one root-to-leaf chain, which the model's
    own causal attention computes exactly. Said now, not at the first training forward."""
    if cfg.pack_mode == "padded":
        return
    try:
        check_model_supported(model)
    except TreeAttentionError as exc:
        cfg.pack_mode = "padded"  # config.json records the mode that runs
        if is_main:
            message = f"packing padded (--pack-mode padded): tree attention cannot serve this model. {exc}"
            logger.info(message)  # printed below: at warning level Python's last-resort handler printed it twice
            print(f"note: {message}", file=sys.stderr)


def _apply_lora(model: torch.nn.Module, cfg: LearnerConfig) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_target_modules
    if not targets or targets == ["all-linear"]:
        targets = "all-linear"
    else:
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        missing = [t for t in targets if not any(name == t or name.endswith("." + t) for name, _ in model.named_modules())]
        if missing:
            raise ConfigError(f"lora_target_modules: {', '.join(missing)} names no module of this model; its linear "
                              f"layers are {', '.join(linear)} (or pass all-linear).")
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft reads an attribute transformers renamed: not the user's to act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        # On a Mixture-of-Experts model peft sets gate_up_proj's rank and alpha by pattern (2r, 2 alpha: gate_proj
        # and up_proj fused), applies them, then warns they matched no module: it checks modules, not parameters.
        warnings.filterwarnings("ignore", message=r".*_pattern keys did not match any targeted module.*gate_up_proj",
                                category=RuntimeWarning)
        return get_peft_model(model, lora)


def _reference_model(model: torch.nn.Module, cfg: LearnerConfig) -> torch.nn.Module:
    """A frozen copy of the starting weights with tree attention."""
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    if cfg.pack_mode != "padded":
        enable_tree_attention(ref, impl=cfg.attention_impl)
    return ref


def mix_weights(target: torch.nn.Module, source: torch.nn.Module, alpha: float) -> None:
    """``target``'s parameters = alpha x ``source``'s + (1 - alpha) x their own, in place (TR-DPO's reference
    update, as TRL's ``SyncRefModelCallback`` computes it; buffers are left as they are).

    >>> a, b = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    >>> _ = a.weight.data.fill_(1.0), b.weight.data.fill_(3.0)
    >>> mix_weights(a, b, 0.25); a.weight.item()
    1.5
    """
    with torch.no_grad():
        for mixed, other in zip(target.parameters(), source.parameters(), strict=True):
            mixed.mul_(1.0 - alpha).add_(other, alpha=alpha)


class AdaptersOff(torch.nn.Module):
    """A LoRA model's starting weights without a copy of them: the same model with its adapters
    switched off, in eval mode and without gradients, for every forward through :meth:`get_decoder`
    (TRL's reference under PEFT). The LM head is LoRA's untouched output layer.

    The learners run a model only through ``get_decoder()`` and ``get_output_embeddings()``
    (:func:`treerl.learners.forward.packed_hidden_states`), which is all this offers.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "lora_model", model)  # not a submodule: it owns no parameters

    @property
    def config(self) -> Any:
        return self.lora_model.config

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lora_model.get_output_embeddings()

    def get_decoder(self) -> Callable[..., Any]:
        model, decoder = self.lora_model, self.lora_model.get_decoder()

        def forward(*args: Any, **kwargs: Any) -> Any:
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    return self.run_decoder(decoder, args, kwargs)
            finally:
                model.train(was_training)

        return forward

    def run_decoder(self, decoder: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One forward of the LoRA model's ``decoder`` as this view sees it: with the adapters off."""
        with self.lora_model.disable_adapter():
            return decoder(*args, **kwargs)


# -- finish --------------------------------------------------------------------------------------


def finish(run: Run) -> TrainResult:
    """Final checkpoint, the trained model in transformers format (with ``load_best_model_at_end``, the best
    checkpoint's weights), evaluation at the end, ``summary.json``, and with ``push_to_hub`` the model pushed to
    the Hub.

    Only rank 0 writes, evaluates and pushes; every rank returns once the model is saved.
    """
    cfg, model_dir, eval_end, state = run.cfg, run.out_dir / "model", None, run.state
    if run.ranks.is_main:
        run.save_checkpoint()  # the last step's weights, which --resume continues from
        if run.hub is not None:
            run.hub.wait()  # a checkpoint's push may still be reading model_dir
        loaded = run.load_best_model()
        _write_model(run, model_dir)
        if cfg.lora_r > 0:  # the adapter alone too (a few MB), loadable with peft.PeftModel.from_pretrained
            run.model.save_pretrained(run.out_dir / "adapter")
        if cfg.save_total_limit == 1 and state.best_model_checkpoint is not None:
            keep_only_best(run.out_dir, state.best_model_checkpoint)  # transformers' end of training
        # eval_every's at the last step, unless the best weights replaced those
        eval_end = run.eval_end if run.eval_end_step == state.step and (not loaded or state.best_step == state.step) \
            else None
        if eval_end is None and cfg.eval_episodes > 0:
            eval_end = evaluate_policy(cfg, run.policy, run.tokenizer, run.eval_env_factory or run.env_factory,
                                       env_id=run.env_id)
        # The settings too: a TRL script may save a model's config.json over the run's (see run_settings).
        result = {"steps": state.step, "policy_version": run.sync.version, "eval_start": run.eval_start,
                  "eval_end": eval_end, "model_dir": str(model_dir), "config": _settings(cfg)}
        if cfg.metric_for_best_model is not None:  # transformers' state.best_metric and best_model_checkpoint
            result.update(best_metric=state.best_metric, best_step=state.best_step,
                          best_model_checkpoint=state.best_model_checkpoint)
        (run.out_dir / "summary.json").write_text(json.dumps(result, indent=2))
        _write_plots(run.out_dir)
        if run.hub is not None:
            run.hub.push(model_dir, f"End of training, step {run.state.step}", steps=run.state.step, blocking=True)
            run.hub.close()
    run.ranks.barrier()
    run.policy.close()
    best = Path(state.best_model_checkpoint) if state.best_model_checkpoint is not None else None
    return TrainResult(run.out_dir, state.step, run.sync.version, run.eval_start, eval_end, model_dir,
                       best_metric=state.best_metric, best_step=state.best_step, best_model_checkpoint=best)


def _write_plots(out_dir: Path) -> None:
    """The run's plots next to ``metrics.jsonl``; without matplotlib, a note instead (plots are optional)."""
    try:
        paths = write_plots([out_dir])
    except MatplotlibMissing as exc:
        logger.warning("no plots: %s", exc)
        print(f"no plots: {exc}", file=sys.stderr)
        return
    logger.info("plots: %s", ", ".join(str(p) for p in paths))


def _write_model(run: Run, model_dir: Path) -> None:
    """The trained model as it is now, with its tokenizer, in transformers format in ``model_dir``."""
    _export_model(run).save_pretrained(model_dir, safe_serialization=True)
    run.tokenizer.save_pretrained(model_dir)


def _export_model(run: Run) -> torch.nn.Module:
    """A plain transformers model with the trained weights (LoRA merged), without tree attention."""
    if run.policy_model is not None and checkpoint_dtype(run.policy_model) == checkpoint_dtype(run.model):
        return run.policy_model  # the default policy's copy, which received the last publish
    # (A sampler in bfloat16 over float32 master weights: the master weights are saved.)
    from peft import PeftModel

    exported = copy.deepcopy(run.model)
    if isinstance(exported, PeftModel):
        exported = exported.merge_and_unload()
    if run.attention is not None:
        exported.set_attn_implementation(run.attention.previous)
    return exported
