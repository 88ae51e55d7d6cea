"""``GRPOTrainer``: TRL's GRPO entry point over :func:`treerl.learners.train`, so that a TRL script ports by
changing its import; ``SDPOTrainer`` and ``AsyncGRPOTrainer`` do the same for TRL's experimental trainers of
those names, over treerl's SDPO and AsyncGRPO learners (one base, :class:`LearnerTrainer`, with the
learner's config class and train function).

::

    from treerl import GRPOConfig, GRPOTrainer      # was: from trl import GRPOConfig, GRPOTrainer

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    trainer = GRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=reward_len,
                          args=GRPOConfig(output_dir="out"), train_dataset=dataset)
    trainer.train()

What maps, and how:

- ``train_dataset`` (a ``datasets.Dataset`` or a list of dicts with a ``prompt`` column) becomes a
  :class:`~treerl.envs.prompts.PromptEnv`: each row one task, its other columns keyword arguments of
  the reward functions; the rows are played in the order TRL's sampler draws them (``shuffle_dataset``,
  TRL's default: each pass a permutation, drawn from a generator seeded with ``args.seed``, or
  ``args.data_seed`` where set, transformers' meaning, which TRL's sampler does not read; False: as
  written). With ``tools=[...]`` the episodes are multi-turn tool use over the same rows.
- ``reward_funcs`` are called with TRL's arguments. Text prompts give them text ``prompts`` and
  ``completions`` (TRL's standard format: the prompt, the reply's text), message prompts and tool
  episodes lists of messages (its conversational format). The reward trained on is their weighted sum
  (``args.reward_weights``: one per function, TRL's meaning); the environment's reward, 0 here, has
  weight 0. Their ``trainer_state`` is transformers' ``TrainerState`` of the run, as TRL's (``epoch`` included).
- ``environment_factory`` (TRL's: a class, or a function, returning an environment object; or a dict of
  them by name, each row's ``environment`` column picking one) plays one fresh object per episode:
  ``reset(**row)`` is called on it with the row's columns (not ``environment``), the string it returns
  is appended to the prompt's last message, and its public methods (all but ``reset`` and
  ``get_reward``) are the episode's tools, beside ``tools``; one object of each factory is made at once
  to check it, as TRL does. Reward functions get the episodes' objects as ``environments``. A class
  with ``get_reward()`` is one more reward source, called once per episode when the step's episodes are
  scored, named after the class (``reward_fn/NAME_mean``) and weighted 1 after ``args.reward_weights``;
  ``reward_funcs`` may then be omitted, and so may ``train_dataset`` (one factory, whose ``reset()``
  returns the prompt: each task is an empty user message plus that text, for ``max_steps`` as given
  (``steps``; 60 when neither is; ``num_train_epochs`` needs a ``train_dataset``, as in TRL)). A
  row's generations share its prompt (GRPO's group), so ``reset()`` must return the same text for the
  same row, which a ``reset()`` that draws a task at random does not (TRL prompts each rollout apart):
  that is refused when it happens. Branching (``branch_factor`` > 1) is refused: an environment object
  cannot be copied mid-episode.
- ``args.num_train_epochs`` without ``max_steps`` (TRL's ``max_steps=-1``) sets the run's length from the rows
  when the trainer is made (:meth:`~treerl.learners.config.LearnerConfig.resolve_steps`): ``floor(rows /
  tasks_per_step)`` steps an epoch, as TRL's sampler plays whole batches (AsyncGRPO's: ``ceil(E x rows)``
  groups); ``epoch`` in the logs counts those passes.
- ``peft_config`` (a peft ``LoraConfig``) sets ``lora_r``, ``lora_alpha``, ``lora_dropout`` and
  ``lora_target_modules``; any other setting of it is refused by name.
- ``eval_dataset`` is what :meth:`GRPOTrainer.evaluate` scores, each row played ``args.num_generations_eval``
  times (default: ``num_generations``, as TRL) as one group, with the reward functions, sampling at
  ``args.temperature`` as TRL does (``eval_temperature``, when set, wins), and what
  ``args.eval_strategy="steps"`` (``eval_every``) scores during training: every ``eval_steps`` optimizer
  steps (``"epoch"``: at the end of each epoch and of the run), and before the first with
  ``args.eval_on_start`` (False by default, as TRL's), logged in the step's metrics under TRL's names
  (``eval_reward``, ...). The run's own held-out episodes are off (``eval_episodes`` is set to 0: they score
  the environment's reward, which is 0).
- ``callbacks``: functions ``(step, metrics)``, or TRL ``TrainerCallback`` objects (or classes, made as
  transformers makes them; also :meth:`LearnerTrainer.add_callback`), whose
  events are called as transformers' Trainer calls them (``on_train_begin``, ``on_epoch_begin``, ``on_step_begin``,
  ``on_pre_optimizer_step``, ``on_optimizer_step``, ``on_step_end``, ``on_evaluate``, ``on_log``, ``on_save``,
  ``on_epoch_end``, ``on_train_end``: :data:`_CALLED_EVENTS`); the
  ``control`` they set (or return) is read as transformers' Trainer reads it after a step:
  ``should_training_stop`` ends the run after the step (as a run ends: the final checkpoint, ``output_dir/model``,
  the best one with ``load_best_model_at_end``; transformers' ``EarlyStoppingCallback`` works so),
  ``should_evaluate`` scores the ``eval_dataset`` at the step, ``should_save`` writes its checkpoint;
  ``should_log`` changes nothing (every step is logged). A function may return a
  :class:`~treerl.learners.core.StepControl` to the same effect. A warning names its other events it overrides
  (``on_substep_end``: no gradient accumulation here; ``on_prediction_step``, ...).

What does not map is refused with what to do instead: a reward model (a model id or object in
``reward_funcs``), ``reward_processing_classes``, ``quantization_config``, an LR scheduler in
``optimizers`` and ``rollout_func``; ``args`` of another learner's config class (or TRL's own).

``SDPOTrainer`` takes a row's ``privileged_context`` column (TRL's) as the feedback its teacher reads.
``AsyncGRPOTrainer`` takes TRL's argument order, needs ``tools`` that pickle (they travel to the
generator processes) and refuses ``rollout_worker``, ``weight_transfer`` and ``environment_factory``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
import pickle
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from treerl.envs.builtin.math_verify import load_rows
from treerl.envs.prompts import EMPTY_PROMPT, EnvironmentInstances, PromptEnv, environment_tools
from treerl.learners.checkpoints import checkpoint_step, latest_checkpoint
from treerl.learners.core import StepControl, TrainResult, learner_name
from treerl.learners.async_grpo import AsyncGRPOConfig, train_async
from treerl.learners.evaluation import improves, metric_key
from treerl.learners.grpo import GRPOConfig, train
from treerl.learners.sdpo import SDPOConfig
from treerl.learners.sdpo import train as train_sdpo
from treerl.rollout.rewards import RewardFunc, StepState, reward_func_name

__all__ = ["GRPOTrainer", "GRPOConfig", "SDPOTrainer", "SDPOConfig", "AsyncGRPOTrainer", "AsyncGRPOConfig",
           "LearnerTrainer", "TrainerResult", "Accelerator"]

# LoraConfig fields that say nothing about the adapters trained (bookkeeping, or what peft fills in).
_LORA_IGNORED = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                 "inference_mode"}
_LORA_MAPPED = {"r", "lora_alpha", "lora_dropout", "target_modules"}

# TRL's placeholder row where an environment_factory's reset() gives the prompt: an empty user message.
_EMPTY_PROMPT_ROW = {"prompt": [dict(m) for m in EMPTY_PROMPT]}


@dataclass
class TrainerResult(TrainResult):
    """What :meth:`LearnerTrainer.train` returns: treerl's :class:`~treerl.learners.core.TrainResult` with the
    fields of transformers' ``TrainOutput``, which TRL scripts read (``train_result.metrics``)."""

    global_step: int = 0
    """Optimizer steps of the run, as TRL counts them: steps x ``num_iterations`` x ``num_minibatches``."""
    training_loss: float = float("nan")
    """The mean over the run's logged steps of the loss optimized (see :func:`_step_loss`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """TRL's ``train_runtime`` (seconds of this call), ``train_samples_per_second`` (completions generated by
    this call per second), ``train_steps_per_second`` (optimizer steps of this call per second), ``train_loss``
    and ``epoch`` (TRL's: steps over the steps of a pass over the dataset, see :func:`_epoch`); with
    ``include_num_input_tokens_seen``, the run's ``num_input_tokens_seen``."""


class Accelerator:
    """TRL's ``trainer.accelerator``, as far as scripts use it: which process this is, from the process group
    ``accelerate launch`` (or ``torchrun``) set up, else from its environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``) before the group exists; one process without them."""

    @property
    def process_index(self) -> int:
        return dist.get_rank() if _group_started() else int(os.environ.get("RANK", "0"))

    @property
    def num_processes(self) -> int:
        return dist.get_world_size() if _group_started() else int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", str(self.process_index)))

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    def wait_for_everyone(self) -> None:
        """Wait for every process (a no-op on one, or before training started the process group)."""
        if _group_started() and dist.get_world_size() > 1:
            dist.barrier()


def _group_started() -> bool:
    return dist.is_available() and dist.is_initialized()


class LearnerTrainer:
    """TRL's trainer arguments over one of treerl's learners: :attr:`config` is the learner's config class
    (``args`` must be one), :attr:`learn` its train function, :attr:`suffix` the end of TRL's default
    ``output_dir`` (``MODEL-SUFFIX``). :class:`GRPOTrainer`, :class:`SDPOTrainer` and
    :class:`AsyncGRPOTrainer` are this with GRPO's, SDPO's and AsyncGRPO's.
    """

    config: ClassVar[type[GRPOConfig]] = GRPOConfig
    learn: ClassVar[Callable[..., TrainResult]] = staticmethod(train)
    suffix: ClassVar[str] = "GRPO"
    env_class: ClassVar[type[PromptEnv]] = PromptEnv
    """What plays the rows."""

    def __init__(self, model: Any, reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
                 args: GRPOConfig | None = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Sequence[Any] | None = None, optimizers: tuple[Any, Any] = (None, None),
                 quantization_config: Any = None, peft_config: Any = None,
                 tools: Sequence[Callable[..., Any]] | None = None, rollout_func: Any = None,
                 environment_factory: Any = None):
        name = type(self).__name__
        _check_args(name, self.config, args)
        _refuse(name,
                reward_processing_classes=(reward_processing_classes, "it tokenizes for reward models, which treerl "
                                           "does not run; score with reward functions"),
                quantization_config=(quantization_config, "quantized training is not supported; load the model in "
                                     "full precision (args.dtype, args.bf16 set the precision)"),
                rollout_func=(rollout_func, "generation is treerl's rollout engine; a sampler of your own is a "
                              "treerl.agents.Policy passed as treerl.learners.train(cfg, policy=...)"))
        optimizer, scheduler = optimizers
        _refuse(name, optimizers=(scheduler, "the learning-rate schedule is args.warmup_steps (or warmup_ratio) of "
                                  "linear warm-up, then args.lr_scheduler_type's (constant, linear or cosine); pass "
                                  "optimizers=(optimizer, None)"))
        if isinstance(model, str) and args is not None and args.model not in (None, model):
            raise ValueError(f"{name}(model={model!r}) and args.model={args.model!r} differ; keep one.")
        if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
            raise ValueError(f"{name}(model=...) is a peft model: pass its base model and the LoraConfig as "
                             "peft_config= (treerl adds the adapters itself).")
        self.environment_factory = environment_factory
        # TRL's extra reward source: get_reward() of each environment class that has one.
        env_rewards = [_environment_reward(cls) for cls in _environment_classes(environment_factory)
                       if "get_reward" in dict(inspect.getmembers(cls, inspect.isfunction))]
        if train_dataset is None:
            if environment_factory is None:
                raise ValueError(f"{name} needs train_dataset: a datasets.Dataset or a list of dicts with a "
                                 "'prompt' column (or an environment_factory whose reset() returns the prompt).")
            if isinstance(environment_factory, Mapping):
                raise ValueError("A dict environment_factory (several environments) needs a train_dataset with an "
                                 "'environment' column to route each row to its environment; give one, or pass a "
                                 "single factory.")
            train_dataset = [_EMPTY_PROMPT_ROW]  # every task: reset()'s text after an empty user message
            source = "environment_factory"
        else:
            source = "train_dataset"
        if isinstance(eval_dataset, Mapping):
            raise ValueError("eval_dataset is a mapping of several datasets; pass one (a datasets.Dataset or a list "
                             "of rows), or call evaluate(eval_dataset=...) once per dataset.")
        if eval_dataset is None and args is not None and "eval_every" in args.every_epoch:
            raise ValueError(f"args.eval_strategy='epoch' scores an eval_dataset at the end of each epoch: pass "
                             f"{name}(eval_dataset=...), or eval_strategy='no'.")
        if eval_dataset is None and args is not None and (args.eval_every or "eval_steps" in args.fractions_of_run):
            every = args.eval_every or f"eval_steps={args.fractions_of_run['eval_steps']} of the run"
            raise ValueError(f"args.eval_every={every} (eval_strategy='steps') scores an eval_dataset during "
                             f"training: pass {name}(eval_dataset=...), or eval_strategy='no'.")
        self.reward_funcs = _reward_funcs(name, reward_funcs, has_env_reward=bool(env_rewards))
        if args is None:  # TRL's default: a directory named after the model
            path = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            args = self.config(output_dir=f"{(str(path) or 'model').rstrip('/').split('/')[-1]}-{self.suffix}")
        if args.reward_funcs:
            raise ValueError(f"args.reward_funcs={args.reward_funcs!r} names functions for the command line; pass the "
                             f"functions themselves as {name}(reward_funcs=...).")
        weights = [1.0] * len(self.reward_funcs) if args.reward_weights is None else list(args.reward_weights)
        if len(weights) != len(self.reward_funcs):
            raise ValueError(f"args.reward_weights has {len(weights)} entries for {len(self.reward_funcs)} reward "
                             "function(s); give one per function (TRL's meaning: there is no environment reward "
                             "here, and an environment's get_reward() comes after them with weight 1).")
        if environment_factory is not None and args.branch_factor > 1:
            raise ValueError(f"args.branch_factor={args.branch_factor} forks episodes mid-play, and an "
                             "environment_factory's objects cannot be copied (TRL has no branching); set "
                             "branch_factor=1.")
        # As TRL's: each environment class's get_reward() comes after the reward functions, with weight 1.
        self.reward_funcs += env_rewards
        if not self.reward_funcs:
            raise ValueError(f"{name} has no reward source: pass reward_funcs, or an environment_factory whose "
                             "environment defines get_reward().")
        # The environment's reward (0 here) comes first in treerl's weights; weight 0 keeps TRL's sum.
        self.reward_weights = [0.0, *map(float, weights), *[1.0] * len(env_rewards)]
        # config.json names what was trained on: no registered environment (a rerun from it says so).
        # TRL shuffles its rows by default (shuffle_dataset): the permutations its sampler draws with args.seed;
        # it evaluates before the first step only when asked (eval_on_start).
        changes: dict[str, Any] = {"reward_weights": self.reward_weights, "eval_episodes": 0,
                                   "env": f"{name}.{source}", "shuffle_dataset": args.shuffle_dataset is not False,
                                   "eval_on_start": bool(args.eval_on_start)}
        if isinstance(model, str):
            changes["model"] = model
        if args.eval_temperature == self.config.__dataclass_fields__["eval_temperature"].default:
            changes["eval_temperature"] = args.temperature  # TRL samples its evaluation as its training
        if peft_config is not None:
            changes.update(_lora_fields(peft_config, model if not isinstance(model, str) else None,
                                        model if isinstance(model, str) else args.model))
        self.args = dataclasses.replace(args, **changes)
        self._given_model, self.processing_class = model, processing_class
        self._trained_model: Any = None
        self._saved_to: Path | None = None  # where save_model() last wrote the trained model
        self._live: _TrainerCallbacks | None = None  # during train(): the run's TrainerState, kept step by step
        self.optimizer = optimizer
        self.tools = list(tools or [])
        # Read once (a streamed dataset into a list), shared by every episode's environment.
        self.train_dataset = load_rows(None, train_dataset, "")
        self.eval_dataset = None if eval_dataset is None else load_rows(None, eval_dataset, "")
        self.callbacks: list[Any] = []
        for callback in callbacks or []:
            self.add_callback(callback)
        for rows in (self.train_dataset, self.eval_dataset):  # a row without a prompt is said now, not at a step
            if rows is not None:
                self._env_factory(rows)().close()
        self.result: TrainerResult | None = None
        self.accelerator = Accelerator()
        if self.args.num_train_epochs is not None:  # TRL's max_steps=-1: the epochs over the rows set the length
            if source == "environment_factory":  # TRL's rule too: the placeholder rows are no dataset
                raise ValueError(f"args.num_train_epochs={self.args.num_train_epochs} counts passes over "
                                 f"train_dataset, which {name} was not given (the environment_factory's reset() "
                                 "gives the prompt): set args.max_steps, the run's optimizer steps.")
            note = self.args.resolve_steps(len(self.train_dataset))
            if self.accelerator.is_main_process:
                print(f"note: {note}", file=sys.stderr)
        if self.args.every_epoch and source == "environment_factory":  # the run resolves them from the rows
            raise ValueError(f"args.save_strategy / eval_strategy='epoch' act at the end of each pass over "
                             f"train_dataset, which {name} was not given (TRL's placeholder rows make each step an "
                             "epoch): save every N optimizer steps, save_strategy='steps' with save_steps=N "
                             "(eval_strategy='steps' with eval_steps=N).")
        if self.args.metric_for_best_model is not None and self.eval_dataset is not None:
            # The figures each evaluation logs (TRL's names): a metric_for_best_model of none is said now.
            names = [reward_func_name(f) for f in self.reward_funcs]
            figures = _trl_eval_figures(torch.zeros(1, len(self.reward_weights)), self.reward_weights, names, 1)
            metric_key(self.args.metric_for_best_model, figures)
        from transformers import TrainerState

        self.state = TrainerState(max_steps=self.args.steps * self.args.optimizer_steps_per_step())
        """TRL's ``trainer.state``: after :meth:`train`, the run's ``global_step`` and ``log_history``."""

    # -- training --------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainerResult:
        """Train; ``resume_from_checkpoint=True``, or the path of ``args.output_dir``'s latest checkpoint,
        continues the run there (another checkpoint's path is refused: a run resumes from its latest). Returns
        treerl's result with TRL's ``global_step``, ``training_loss`` and ``metrics`` (:class:`TrainerResult`)."""
        resume = resume_from_checkpoint is not None and type(self.args)._resumes_from(resume_from_checkpoint,
                                                                                      self.args.output_dir)
        cfg = dataclasses.replace(self.args, resume=True) if resume else self.args
        # The step this call starts from: a resumed run's checkpoint (its earlier steps are not this call's).
        ckpt = latest_checkpoint(Path(cfg.output_dir)) if cfg.resume else None
        first_step = checkpoint_step(ckpt) if ckpt is not None else 0
        model, tokenizer = self._model_and_tokenizer()
        callbacks = [c for c in self.callbacks if not hasattr(c, "on_log")]
        trainer_callbacks = [c for c in self.callbacks if hasattr(c, "on_log")]
        # Always there: its state (global_step, log_history) is what the reward functions get as trainer_state.
        self._live = _TrainerCallbacks(trainer_callbacks, cfg, rows=max(len(self.train_dataset), 1),
                                       reward_names=self._reward_names())
        callbacks.append(self._live)
        if trainer_callbacks:
            callbacks[-1].event("on_train_begin")
        # eval_strategy="steps" (or a callback's should_evaluate): the eval_dataset scored as evaluate() scores it,
        # with the policy's weights then.
        evaluate = functools.partial(self._score, self.eval_dataset) if self.eval_dataset is not None else None
        started = time.perf_counter()
        try:
            result = self.learn(cfg, model=model, tokenizer=tokenizer,
                                env_factory=self._env_factory(self.train_dataset),
                                reward_funcs=self._reward_funcs_for(self.train_dataset),
                                reward_weights=self.reward_weights, optimizer=self.optimizer, callbacks=callbacks,
                                evaluate=evaluate)
        finally:
            self._live = None
        runtime = time.perf_counter() - started
        self.accelerator.wait_for_everyone()  # rank 0 has written metrics.jsonl
        self.result = self._trainer_result(result, runtime, first_step, cfg)
        self._trained_model = None  # trainer.model: this run's, loaded when read
        if trainer_callbacks:
            callbacks[-1].end()  # the last pass's on_epoch_end
            callbacks[-1].event("on_train_end")
        return self.result

    def _trainer_result(self, result: TrainResult, runtime: float, first_step: int,
                        cfg: GRPOConfig) -> TrainerResult:
        """``result`` with TRL's figures, from ``metrics.jsonl``; :attr:`state` set to the run's. ``cfg`` is the
        run's (``args``, or its copy for a resume), as the run resolved it (``router_aux_loss_coef``)."""
        from transformers import TrainerState

        per_step = cfg.optimizer_steps_per_step()
        lines = _read_metrics(Path(result.output_dir) / "metrics.jsonl")
        losses = [_step_loss(m, cfg) for m in lines if "loss/policy" in m]
        training_loss = sum(losses) / len(losses) if losses else float("nan")
        rows = max(len(self.train_dataset), 1)
        steps_now = max(result.steps - first_step, 0)
        completions = steps_now * cfg.tasks_per_step * cfg.group_size * max(cfg.branch_factor, 1)
        metrics = {"train_runtime": round(runtime, 4),
                   "train_samples_per_second": round(completions / runtime, 3),
                   "train_steps_per_second": round(steps_now * per_step / runtime, 3),
                   "train_loss": training_loss,
                   "epoch": _epoch(result.steps, cfg, rows)}
        seen = [m["num_input_tokens_seen"] for m in lines if "num_input_tokens_seen" in m]
        if seen:  # include_num_input_tokens_seen: the run's count, as transformers' final log adds it
            metrics["num_input_tokens_seen"] = int(seen[-1])
        history = [_trl_log(m, cfg, per_step, rows, self._reward_names()) for m in lines]
        history.append({**metrics, "step": result.steps * per_step})
        self.state = TrainerState(global_step=result.steps * per_step, max_steps=cfg.steps * per_step,
                                  epoch=metrics["epoch"], log_history=history,
                                  train_batch_size=cfg.tasks_per_step * cfg.group_size,
                                  num_input_tokens_seen=int(seen[-1]) if seen else 0)
        if result.best_step is not None:  # metric_for_best_model's, as transformers' Trainer records them
            self.state.best_metric, self.state.best_global_step = result.best_metric, result.best_step * per_step
            self.state.best_model_checkpoint = (str(result.best_model_checkpoint)
                                                if result.best_model_checkpoint is not None else None)
        return TrainerResult(**{f.name: getattr(result, f.name) for f in dataclasses.fields(result)},
                             global_step=result.steps * per_step, training_loss=training_loss, metrics=metrics)

    # -- callbacks, as transformers' Trainer takes them ----------------------------------------------------------

    def add_callback(self, callback: Any) -> None:
        """Add a callback: a function ``(step, metrics)``, a ``TrainerCallback`` object, or its class (made with
        no arguments, as transformers' ``Trainer.add_callback`` makes it). A warning names its events that are
        never called here (:data:`_CALLED_EVENTS` are)."""
        callback = callback() if isinstance(callback, type) else callback
        if ignored := _ignored_events(callback):
            warnings.warn(f"{type(callback).__name__}.{', .'.join(ignored)} will not be called: treerl's "
                          f"{type(self).__name__} calls {', '.join(_CALLED_EVENTS)} only (no substeps: a step's "
                          "micro-batches make one optimizer step; no prediction).",
                          UserWarning, stacklevel=2)
        self.callbacks.append(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return ``callback`` (or the first callback of that class); None when there is none."""
        found = next((c for c in self.callbacks if (isinstance(c, callback) if isinstance(callback, type)
                                                    else c == callback)), None)
        if found is not None:
            self.callbacks.remove(found)
        return found

    def remove_callback(self, callback: Any) -> None:
        """Remove ``callback`` (a ValueError if it is not there), or the first callback of that class (if any)."""
        if isinstance(callback, type):
            self.pop_callback(callback)
        else:
            self.callbacks.remove(callback)

    # -- TRL's reporting ---------------------------------------------------------------------------------------

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process (TRL's: the one that writes and prints)."""
        return self.accelerator.is_main_process

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        """Print ``metrics`` as transformers' ``Trainer.log_metrics`` does (``***** train metrics *****``, one
        aligned line each); the main process only."""
        from transformers.trainer_pt_utils import log_metrics

        log_metrics(self, split, metrics)

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """Write ``metrics`` to ``{split}_results.json`` in ``args.output_dir`` and, with ``combined``, merge them
        into its ``all_results.json``, as transformers' ``Trainer.save_metrics``; the main process only."""
        from transformers.trainer_pt_utils import save_metrics

        save_metrics(self, split, metrics, combined)

    def save_state(self) -> None:
        """Write :attr:`state` to ``trainer_state.json`` in ``args.output_dir`` (TRL's: ``global_step``,
        ``max_steps``, ``log_history`` with one entry per logged step under TRL's names, treerl's beside them);
        the main process only. The run's checkpoints keep their own ``trainer_state.json``."""
        if self.is_world_process_zero():
            self.state.save_to_json(str(Path(self.args.output_dir) / "trainer_state.json"))

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Play each row of ``eval_dataset`` (default: the trainer's) ``args.num_generations_eval`` times (default:
        ``num_generations``, as TRL) with the model as it is now (the trained one after :meth:`train`) and score
        the episodes with the reward functions: TRL's figures (:func:`_trl_eval_figures`), named as transformers'
        ``Trainer.evaluate`` names them, ``{metric_key_prefix}_reward``, ... (``"test"``: ``test_reward``).
        ``ignore_keys`` (transformers': keys of the model's outputs to leave out of its predictions) is taken and
        changes nothing: no predictions are gathered here."""
        from treerl.agents.transformers_policy import TransformersPolicy

        rows = self.eval_dataset if eval_dataset is None else load_rows(None, eval_dataset, "")
        if rows is None:
            raise ValueError(f"evaluate() needs rows: pass eval_dataset= here or to {type(self).__name__}.")
        if self.result is not None:
            from treerl.models import load_model

            model, tokenizer = load_model(str(self.result.model_dir), self.args.device)
        else:
            model, tokenizer = self._model_and_tokenizer()
            if model is None:
                model, tokenizer = self.args.load_model()
            else:
                self.args.apply_chat_template(tokenizer)
        policy = TransformersPolicy(model, tokenizer, device=self.args.device, continuous_batching=False)
        # The reward functions' trainer_state: TRL's, the finished run's steps (before train(), 0 of the run's).
        state = StepState(global_step=self.state.global_step, max_steps=self.state.max_steps)
        try:
            figures = self._score(rows, policy, tokenizer, trainer_state=state)
        finally:
            policy.close()
        return {f"{metric_key_prefix}_{key.removeprefix('eval_')}": value for key, value in figures.items()}

    def _score(self, rows: Any, policy: Any, tokenizer: Any, trainer_state: StepState) -> dict[str, float]:
        """Each of ``rows`` played ``num_generations_eval`` times by ``policy``, as one group sharing the prompt
        (TRL's eval batches repeat each prompt that many times), scored with the reward functions (given
        ``trainer_state``, the run's steps then): TRL's figures."""
        from treerl.rollout.evaluate import evaluate_with

        num_generations = self.args.num_generations_eval or self.args.group_size
        report = evaluate_with(self.args, policy, tokenizer, num_episodes=len(rows), seed=self.args.eval_seed,
                               env_factory=self._env_factory(rows), env_id=f"{type(self).__name__}.eval_dataset",
                               rollouts_per_task=num_generations, reward_funcs=self._reward_funcs_for(rows),
                               reward_weights=self.reward_weights, temperature=self.args.eval_temperature,
                               trainer_state=trainer_state)
        figures = _trl_eval_figures(report.rewards, self.reward_weights, self._reward_names(), num_generations)
        # What the functions logged with log_metric, as TRL's evaluation logs it: eval_NAME.
        _, logged = _reward_fn_figures(report.figures, self._reward_names())
        return {**figures, **{f"eval_{name}": value for name, value in logged.items()
                              if f"eval_{name}" not in figures}}

    def save_model(self, output_dir: str | None = None) -> None:
        """Write the trained model to ``output_dir`` (default: ``args.output_dir``), as transformers'
        ``Trainer.save_model`` does, so that ``from_pretrained(output_dir)`` loads it: the model's files
        (``config.json``, ``model.safetensors``, ...) and its tokenizer (TRL's ``processing_class``); with LoRA
        (``peft_config``), what transformers writes for a ``PeftModel``: the adapter alone
        (``adapter_config.json``, ``adapter_model.safetensors``) beside the tokenizer, which
        ``AutoModelForCausalLM.from_pretrained`` puts on its base model. The main process only.

        In the run's own directory the model's ``config.json`` replaces the run's (with LoRA it is removed: the
        adapter's directory has none), whose settings stay in ``summary.json`` (which ``--resume`` and ``treerl
        compare`` then read); ``output_dir/model`` keeps the trained model (LoRA merged) as the run wrote it."""
        if self.result is None:
            raise ValueError("save_model() saves the trained model: call train() first.")
        target = Path(output_dir or self.args.output_dir)
        self._saved_to = target
        if not self.is_world_process_zero():
            return
        target.mkdir(parents=True, exist_ok=True)
        if self.args.lora_r > 0:  # a PeftModel's save_pretrained: the adapter, then the tokenizer beside it
            from transformers import AutoTokenizer

            shutil.copytree(Path(self.result.output_dir) / "adapter", target, dirs_exist_ok=True)
            AutoTokenizer.from_pretrained(self.result.model_dir, local_files_only=True).save_pretrained(target)
            if target.resolve() == Path(self.result.output_dir).resolve():
                # Beside a config.json, from_pretrained reads the directory as a whole model with the adapter in
                # it, not as the adapter of its base: the run's settings (summary.json keeps them) go, as the
                # model's config.json replaces them without LoRA.
                (target / "config.json").unlink(missing_ok=True)
        else:  # model/ holds the model with its tokenizer, as save_pretrained wrote them
            shutil.copytree(self.result.model_dir, target, dirs_exist_ok=True)

    @property
    def model(self) -> Any:
        """TRL's ``trainer.model``. Before :meth:`train`, the ``model`` argument as given: a loaded model, or the
        name or directory (a string: the learner loads it when training starts, not before). After it, the
        trained model as a transformers causal LM, loaded from ``output_dir/model`` (LoRA merged) on
        ``args.device`` when first read: ``trainer.model.config`` and ``.generation_config`` are the trained model's.
        Its ``config.save_pretrained(args.output_dir)`` (open-r1's last lines) replaces the run's ``config.json``
        there with the model's; the finished run's settings stay in ``summary.json``, which ``--resume`` and
        ``treerl compare`` then read (:func:`~treerl.learners.checkpoints.run_settings`)."""
        if self.result is None:
            return self._given_model
        if self._trained_model is None:
            from treerl.models import load_model

            self._trained_model, _ = load_model(str(self.result.model_dir), self.args.device)
        return self._trained_model

    @model.setter
    def model(self, model: Any) -> None:
        self._given_model, self._trained_model = model, None

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | Sequence[str] | None = None) -> None:
        """Write TRL's model card, ``README.md``, beside the trained model: in ``output_dir/model`` and in the
        directory :meth:`save_model` last wrote it to (``model_name``, ``dataset_name`` and ``tags`` go into it,
        as :meth:`push_to_hub`'s); the main process only."""
        if self.result is None:
            raise ValueError("create_model_card() describes the trained model: call train() first.")
        if not self.is_world_process_zero():
            return
        for folder in dict.fromkeys([self.result.model_dir, *([self._saved_to] if self._saved_to else [])]):
            self._write_card(folder, self.args.hub_repo_id(), model_name, dataset_name, tags)

    def _write_card(self, folder: Path, repo_id: str, model_name: str | None, dataset_name: str | None,
                    tags: str | Sequence[str] | None) -> None:
        from treerl.learners.hub import write_model_card

        given = self._given_model
        base = given if isinstance(given, str) else getattr(getattr(given, "config", None), "_name_or_path", None)
        write_model_card(folder, repo_id, base_model=base, learner=learner_name(self.args), steps=self.result.steps,
                         model_name=model_name, dataset_name=dataset_name,
                         tags=[tags] if isinstance(tags, str) else list(tags or ()))

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, *, model_name: str | None = None,
                    dataset_name: str | None = None, tags: str | Sequence[str] | None = None) -> Any:
        """Push the trained model (``model/`` of the run, LoRA merged) with a model card
        (``model_name``, ``dataset_name`` and ``tags`` go into it, as TRL's) to ``args.hub_model_id`` (default:
        the output directory's name), as TRL's ``push_to_hub``, on the branch ``revision`` (default:
        ``args.hub_revision``, created if missing); ``args.hub_private_repo`` and ``args.hub_token``
        (else ``$HF_TOKEN`` or ``hf auth login``'s) apply. Only the main process pushes; returns the
        ``CommitInfo`` (a ``Future`` of it when not ``blocking``), None on the other processes. With
        ``args.push_to_hub`` the run has pushed it already."""
        from treerl.learners.distributed import is_main_process
        from treerl.learners.hub import create_branch, create_repo, upload_model

        if self.result is None:
            raise ValueError("push_to_hub() pushes the trained model: call train() first.")
        if not is_main_process():
            return None
        token = token or self.args.hub_token
        repo_id = create_repo(self.args.hub_repo_id(), token=token, private=self.args.hub_private_repo)
        revision = revision if revision is not None else self.args.hub_revision  # as transformers' Trainer
        create_branch(repo_id, revision, token=token)
        self._write_card(self.result.model_dir, repo_id, model_name, dataset_name, tags)
        return upload_model(self.result.model_dir, repo_id, commit_message=commit_message or "End of training",
                            token=token, revision=revision, blocking=blocking)

    # -- pieces ----------------------------------------------------------------------------------------------

    def _reward_names(self) -> list[str]:
        """What the metrics call each reward source (``reward_fn/NAME_mean``)."""
        return [reward_func_name(f) for f in self.reward_funcs]

    def _reward_funcs_for(self, rows: Any) -> list[RewardFunc]:
        """The reward functions, each given the format TRL would give it for ``rows``; with an
        ``environment_factory``, the conversational one and the episodes' objects as ``environments``; and as
        ``trainer_state`` transformers' ``TrainerState`` (:meth:`_reward_state`), as TRL gives its own."""
        if self.environment_factory is not None:
            funcs = [_with_environments(f) for f in self.reward_funcs]
        else:
            prompt_key = self.args.env_kwargs.get("prompt_key", "prompt")
            funcs = [_trl_format(f, rows, self.tools, prompt_key) for f in self.reward_funcs]
        return [_with_trainer_state(f, self._reward_state) for f in funcs]

    def _reward_state(self, scored: StepState | None) -> Any:
        """TRL's ``trainer_state`` while the episodes of ``scored`` (the learner's step count then) are scored:
        transformers' ``TrainerState`` of the run (during :meth:`train` the one kept step by step, with its
        ``log_history`` so far; else :attr:`state`), its ``global_step`` and ``epoch`` (passes over
        ``train_dataset``, a float, as transformers counts them) those before the step scored."""
        state = self._live.state if self._live is not None else self.state
        cfg, rows = self.args, max(len(self.train_dataset), 1)
        per_step = cfg.optimizer_steps_per_step()
        if scored is not None:
            state.global_step, state.max_steps = scored.global_step, scored.max_steps
        state.epoch = _epoch(state.global_step / per_step, cfg, rows)
        # transformers' num_train_epochs: the epochs asked for, rounded up, else those max_steps spans.
        per_epoch = cfg.steps_per_epoch(rows)
        state.num_train_epochs = (math.ceil(cfg.num_train_epochs) if cfg.num_train_epochs is not None else
                                  math.ceil(cfg.steps / per_epoch) if per_epoch else cfg.steps)
        state.train_batch_size = cfg.tasks_per_step * cfg.group_size
        state.is_world_process_zero = self.is_world_process_zero()
        state.is_local_process_zero = self.accelerator.is_local_main_process
        return state

    def _env_factory(self, rows: Any) -> Callable[[], PromptEnv]:
        return functools.partial(self.env_class, dataset=rows, tools=self.tools,
                                 environment_factory=self.environment_factory, **self.args.env_kwargs)

    def _model_and_tokenizer(self) -> tuple[Any, Any]:
        """``(None, None)`` for a model named by a string without ``processing_class`` (``train`` loads
        ``args.model``), else the model object and its tokenizer."""
        model, tokenizer = self._given_model, self.processing_class
        if isinstance(model, str):
            if tokenizer is None:
                return None, None
            from treerl.models import load_model

            model, _ = load_model(model, self.args.device)
        elif tokenizer is None:
            from transformers import AutoTokenizer

            from treerl.models import model_directory

            name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
            if not name:
                raise ValueError(f"{type(self).__name__}(model=...) was not loaded from a directory or Hub id, so its "
                                 "tokenizer is unknown: pass processing_class=tokenizer.")
            tokenizer = AutoTokenizer.from_pretrained(model_directory(name), local_files_only=True)
        return model, tokenizer



class _PrivilegedContextEnv(PromptEnv):
    """TRL's SDPO feedback: a row's ``privileged_context`` column (text) is the verdict on each of its episodes'
    answers, which :meth:`~treerl.envs.Env.feedback` hands to SDPO's teacher."""

    def answer_feedback(self, task: Any, completion: str, reward: float) -> str | None:
        context = task.info.get("row", {}).get("privileged_context")
        return context if isinstance(context, str) and context.strip() else None


class GRPOTrainer(LearnerTrainer):
    """TRL's ``GRPOTrainer(model, reward_funcs, args, train_dataset, ...)`` on treerl's GRPO learner.

    ``model`` is a model directory, a cached Hub id or a shipped model name (``"tiny"``), or a loaded
    causal LM (its tokenizer then comes from ``processing_class``, else from where the model was loaded
    from). See the module docstring for what each argument maps to; :meth:`train` returns
    :class:`TrainerResult`: treerl's ``output_dir``, ``steps``, ``model_dir``, ... and TRL's ``metrics``,
    ``global_step`` and ``training_loss``. What TRL scripts call after training is here too: ``log_metrics``,
    ``save_metrics``, ``save_state``, ``save_model``, ``create_model_card``, ``evaluate``, ``push_to_hub``,
    ``accelerator.is_main_process`` and ``model`` (the trained model once trained).
    """


class SDPOTrainer(LearnerTrainer):
    """TRL's experimental ``SDPOTrainer(model, reward_funcs, args, train_dataset, ...)`` on treerl's SDPO
    learner (:mod:`treerl.learners.sdpo`): ``args`` is :class:`~treerl.learners.sdpo.SDPOConfig`, which
    takes TRL's names of its options. The arguments map as :class:`GRPOTrainer`'s; ``tools`` and
    ``environment_factory``, which TRL's SDPOTrainer lacks, are taken too. As in TRL, a row's
    ``privileged_context`` column is the feedback SDPO's teacher reads on each of the row's episodes
    (with ``args.include_environment_feedback``, treerl's ``use_feedback``).
    """

    config = SDPOConfig
    learn = staticmethod(train_sdpo)
    suffix = "SDPO"
    env_class = _PrivilegedContextEnv


class AsyncGRPOTrainer(LearnerTrainer):
    """TRL's experimental ``AsyncGRPOTrainer(model, reward_funcs, args, train_dataset, ...)`` on treerl's
    AsyncGRPO learner (:mod:`treerl.learners.async_grpo`): ``args`` is
    :class:`~treerl.learners.async_grpo.AsyncGRPOConfig`, which takes TRL's names of its options.

    The arguments map as :class:`GRPOTrainer`'s, in TRL's order (``processing_class`` fifth;
    ``eval_dataset``, which TRL's AsyncGRPOTrainer lacks, by keyword). The episodes are played by
    treerl's generator processes, which run no vLLM server of their own to plug into: ``rollout_worker``
    and ``weight_transfer`` are refused. ``tools`` travel to those processes, so they must pickle
    (module-level functions, as TRL requires); the reward functions run in the trainer and need not. Those
    processes import the script again, so its training must sit under ``if __name__ == "__main__":``.
    ``environment_factory`` is refused: its objects would live in the generators, out of the reward
    functions' reach.
    """

    config = AsyncGRPOConfig
    learn = staticmethod(train_async)
    suffix = "AsyncGRPO"

    def __init__(self, model: Any, reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
                 args: AsyncGRPOConfig | None = None, train_dataset: Any = None, processing_class: Any = None,
                 callbacks: Sequence[Any] | None = None, optimizers: tuple[Any, Any] = (None, None),
                 peft_config: Any = None, tools: Sequence[Callable[..., Any]] | None = None,
                 environment_factory: Any = None, rollout_worker: Any = None, weight_transfer: Any = None, *,
                 eval_dataset: Any = None):
        name = type(self).__name__
        _refuse(name, rollout_worker=(rollout_worker, "episodes are played by treerl's generator processes "
                                      "(args.num_generators, args.generator_policy); a sampler of your own is a "
                                      "treerl.agents.Policy passed as treerl.learners.train(cfg, policy=...)"),
                weight_transfer=(weight_transfer, "the trainer publishes each step's weights to its generators "
                                 "itself (args.weight_transport: file or broadcast)"),
                environment_factory=(environment_factory, "its objects would live in the generator processes, "
                                     "out of reach of the reward functions and get_reward(), which run in the "
                                     "trainer; use treerl.GRPOTrainer (or SDPOTrainer) for environment_factory, or "
                                     "tools=[...] here"))
        for tool in tools or []:
            try:
                pickle.dumps(tool)
            except Exception:  # noqa: BLE001 - any pickling failure has the same fix
                raise ValueError(f"{name}(tools=...): {tool!r} cannot be pickled, so it cannot reach the generator "
                                 "processes; define it at module level (as TRL's AsyncGRPOTrainer requires).") from None
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         callbacks=callbacks, optimizers=optimizers, peft_config=peft_config, tools=tools)

def _trl_format(func: RewardFunc, rows: Any, tools: Sequence[Any], prompt_key: str = "prompt") -> RewardFunc:
    """``func`` given text prompts and completions where TRL gives them: rows whose prompts (``prompt_key``)
    are text, played without tools (TRL's standard format); else the lists of messages treerl gives (its
    conversational one)."""
    if tools or not len(rows) or not isinstance(rows[0].get(prompt_key), str):
        return func

    @functools.wraps(func)  # keeps its name for the metrics and its signature for the argument check
    def standard(*, prompts: list[list[dict]], completions: list[list[dict]], **kwargs: Any) -> Any:
        return func(prompts=[p[-1]["content"] for p in prompts],
                    completions=["".join(str(m.get("content") or "") for m in c) for c in completions], **kwargs)

    return standard


def _environment_classes(environment_factory: Any) -> list[type]:
    """The class of each factory's environment, from one object of each (TRL probes them so), checked for TRL's
    contract: a ``reset`` method, and methods that make tools (type hints, docstrings)."""
    if environment_factory is None:
        return []
    factories = environment_factory.values() if isinstance(environment_factory, Mapping) else [environment_factory]
    classes = []
    for factory in factories:
        if not callable(factory):
            raise ValueError(f"environment_factory: {factory!r} is not callable; give a class (or a function) that "
                             "returns an environment object, or a dict of them by name.")
        environment = factory()
        if not callable(getattr(environment, "reset", None)):
            raise ValueError(f"environment_factory: its {type(environment).__name__} object has no reset() method; "
                             "each environment object must define reset(**row) -> str | None (TRL's contract).")
        environment_tools(environment)  # a method that cannot be a tool is said now, not at the first step
        if type(environment) not in classes:  # one reward source per class, as TRL's
            classes.append(type(environment))
    return classes


def _environment_reward(cls: type) -> RewardFunc:
    """TRL's reward source for an environment class with ``get_reward()``: each episode's object of that class
    scores it (``None``, left out, for the episodes of other environments); named after the class."""
    if inspect.iscoroutinefunction(cls.get_reward):
        async def reward(environments: list[Any], **kwargs: Any) -> list[float | None]:
            return [await e.get_reward() if type(e) is cls else None for e in environments]
    else:
        def reward(environments: list[Any], **kwargs: Any) -> list[float | None]:  # type: ignore[misc]
            return [e.get_reward() if type(e) is cls else None for e in environments]
    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward


def _with_trainer_state(func: RewardFunc, state_of: Callable[[StepState | None], Any]) -> RewardFunc:
    """``func`` given ``state_of(trainer_state)`` as ``trainer_state``: transformers' ``TrainerState``, for the
    learner's :class:`~treerl.rollout.rewards.StepState` (TRL passes its Trainer's state)."""
    @functools.wraps(func)  # keeps its name for the metrics and its signature for the argument check
    def call(*, trainer_state: StepState | None = None, **kwargs: Any) -> Any:
        return func(trainer_state=state_of(trainer_state), **kwargs)

    return call


def _with_environments(func: RewardFunc) -> RewardFunc:
    """``func`` given each episode's environment object as ``environments`` (TRL's argument)."""
    @functools.wraps(func)  # keeps its name for the metrics and its signature for the argument check
    def call(*, environments: Sequence[EnvironmentInstances], **kwargs: Any) -> Any:
        return func(environments=_episode_environments(environments), **kwargs)

    return call


def _episode_environments(rows: Sequence[EnvironmentInstances]) -> list[Any]:
    """Each episode's object: a row's episodes come together in generation order, the order in which
    :meth:`PromptEnv.fork` handed out the objects of the row's ``environments`` column."""
    taken: dict[int, int] = {}
    out = []
    for row in rows:
        k = taken.get(id(row), 0)
        if not isinstance(row, EnvironmentInstances) or k >= len(row.instances):
            raise RuntimeError(f"environments: no environment object for episode {len(out)} (the row's column is "
                               f"{row!r}); each episode should have the one its generation played.")
        out.append(row.instances[k])
        taken[id(row)] = k + 1
    return out


def _trl_eval_figures(rewards: torch.Tensor, weights: Sequence[float], names: Sequence[str],
                      num_generations: int) -> dict[str, float]:
    """TRL's evaluation figures of the episodes' rewards ``(E, 1 + F)`` (the environment's, then each reward
    function's, NaN where it returned None; groups of ``num_generations`` episodes in order), ``weights`` one
    per column: ``eval_reward`` and ``eval_reward_std``, the weighted sum's mean and std (Bessel's, as TRL's
    ``nanstd``), ``eval_rewards/NAME/mean`` and ``/std`` each function's, and ``eval_frac_reward_zero_std``, the
    share of completions whose group's rewards all match (TRL's; each one alone when played once).

    TRL takes each figure over an eval batch (``per_device_eval_batch_size`` x processes completions, whole
    groups) and logs its mean over the batches. Here a batch is a group, as at TRL's defaults (8 completions,
    ``num_generations`` 8, one process), or all the completions when each row is played once (a group of
    one has no spread). A completion that every function returned None for is left out of the sum's, as in TRL.

    >>> figures = _trl_eval_figures(torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, 2.0], [0.0, 2.0]]), [0.0, 1.0],
    ...                             ["f"], num_generations=2)
    >>> figures["eval_reward"], round(figures["eval_reward_std"], 4), figures["eval_frac_reward_zero_std"]
    (2.0, 0.7071, 0.5)
    """
    funcs = rewards[:, 1:]  # (E, F)
    total = torch.nansum(rewards * torch.tensor(weights, dtype=rewards.dtype), dim=-1)  # (E,)
    total[torch.isnan(funcs).all(dim=1)] = float("nan")  # unscorable: TRL leaves it out
    per_batch = num_generations if num_generations > 1 else len(total)

    def batches(x: torch.Tensor) -> torch.Tensor:  # (E,) -> (B, per_batch)
        return x.reshape(-1, per_batch)

    def std(x: torch.Tensor) -> torch.Tensor:  # (B, n) -> (B,): Bessel's std of the non-NaN values, NaN below 2
        count = (~torch.isnan(x)).sum(dim=1)
        variance = torch.nansum((x - x.nanmean(dim=1, keepdim=True)) ** 2, dim=1) / (count - 1).clamp(min=1)
        return torch.where(count > 1, variance.sqrt(), float("nan"))

    def mean_over_batches(per_batch_values: torch.Tensor) -> float:  # TRL's: the batches' figures that are numbers
        return per_batch_values.nanmean().item()

    out = {"eval_reward": mean_over_batches(batches(total).nanmean(dim=1)),
           "eval_reward_std": mean_over_batches(std(batches(total)))}
    for i, name in enumerate(names):
        column = batches(funcs[:, i])
        out[f"eval_rewards/{name}/mean"] = mean_over_batches(column.nanmean(dim=1))
        out[f"eval_rewards/{name}/std"] = mean_over_batches(std(column))
    # TRL's is_std_zero: each completion's group's std is 0 (a group of one: 0, as TRL sets it)
    groups = total.reshape(-1, num_generations)
    zero = torch.isclose(std(groups), torch.zeros(())) if num_generations > 1 else torch.ones(len(groups), dtype=bool)
    out["eval_frac_reward_zero_std"] = zero.float().mean().item()
    return out


def _check_args(trainer: str, config: type[GRPOConfig], args: Any) -> None:
    """``args`` is ``config`` (or a subclass of it), not another learner's config nor TRL's own."""
    if args is None:
        return
    learner = next((c for c in (SDPOConfig, AsyncGRPOConfig) if isinstance(args, c)), config)
    if not isinstance(args, config) or learner is not config and issubclass(learner, config):
        kind = type(args)
        shown = kind.__name__ if isinstance(args, GRPOConfig) else f"{kind.__module__}.{kind.__name__}"
        raise TypeError(f"{trainer}(args=...) takes a treerl.{config.__name__} (it takes TRL's option names), not "
                        f"a {shown}.")


def _refuse(trainer: str, **given: tuple[Any, str]) -> None:
    for name, (value, why) in given.items():
        if value is not None:
            raise ValueError(f"{trainer}({name}=...) is not supported: {why}.")


def _reward_funcs(trainer: str, reward_funcs: Any, has_env_reward: bool = False) -> list[RewardFunc]:
    if reward_funcs is None:
        if has_env_reward:  # the environment's get_reward() is the reward source
            return []
        raise ValueError(f"{trainer} needs reward_funcs: a function f(prompts, completions, **kwargs) -> list of "
                         "floats, or a list of them (or an environment_factory whose environment defines "
                         "get_reward()).")
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    for func in funcs:
        if isinstance(func, str) or hasattr(func, "config") and hasattr(func, "forward"):
            shown = repr(func) if isinstance(func, str) else type(func).__name__
            raise ValueError(f"reward_funcs: {shown} is a reward model; treerl scores with functions only: wrap the "
                             "model in a function f(prompts, completions, **kwargs) that returns its scores, one "
                             "per completion.")
        if not callable(func):
            raise ValueError(f"reward_funcs: {func!r} is not callable; give functions f(prompts, completions, "
                             "**kwargs) -> list of floats.")
    return funcs


def _lora_fields(peft_config: Any, model: Any, model_name: str | None) -> dict[str, Any]:
    """``lora_r``, ``lora_alpha``, ``lora_dropout`` and ``lora_target_modules`` from a peft ``LoraConfig``;
    any other setting that differs from peft's default is refused by name."""
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise ValueError(f"peft_config is a {type(peft_config).__name__}; treerl trains LoRA adapters only "
                         "(peft.LoraConfig).")
    default = LoraConfig()
    other = [f.name for f in dataclasses.fields(peft_config)
             if f.name not in _LORA_IGNORED | _LORA_MAPPED and getattr(peft_config, f.name) != getattr(default, f.name)]
    if other:
        raise ValueError(f"peft_config sets {', '.join(other)}, which treerl's LoRA does not take: it trains "
                         "adapters of rank r (lora_alpha, lora_dropout) on target_modules; leave those at peft's "
                         "defaults.")
    targets = peft_config.target_modules
    if targets is None:  # peft's choice for the model's architecture, as get_peft_model makes it
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as BY_TYPE

        model_type = _model_type(model, model_name)
        if model_type not in BY_TYPE:
            raise ValueError(f"peft_config.target_modules is None and peft has no default for model type "
                             f"{model_type!r}; name them, e.g. LoraConfig(target_modules=['q_proj', 'v_proj']) or "
                             "'all-linear'.")
        targets = list(BY_TYPE[model_type])
    elif isinstance(targets, str):
        if targets != "all-linear":
            raise ValueError(f"peft_config.target_modules={targets!r} is a regular expression; treerl takes module "
                             "names (a list, e.g. ['q_proj', 'v_proj']) or 'all-linear'.")
        targets = None
    else:
        targets = sorted(targets)
    return {"lora_r": peft_config.r, "lora_alpha": peft_config.lora_alpha, "lora_dropout": peft_config.lora_dropout,
            "lora_target_modules": targets}


def _model_type(model: Any, model_name: str | None) -> str | None:
    if model is not None:
        return getattr(getattr(model, "config", None), "model_type", None)
    from transformers import AutoConfig

    from treerl.models import model_directory

    return AutoConfig.from_pretrained(model_directory(model_name), local_files_only=True).model_type


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """The lines of a run's ``metrics.jsonl`` (none where this process cannot see the file)."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _step_loss(metrics: Mapping[str, float], cfg: GRPOConfig) -> float:
    """The loss a logged step optimized, from the parts logged (its last pass's, a mean over the pass's
    minibatches): ``loss/policy`` + beta x ``loss/kl`` - entropy_coef x ``loss/entropy``; SDPO's (1 -
    distillation_weight) x that + distillation_weight x ``loss/distill``; plus router_aux_loss_coef x
    ``loss/aux`` (a Mixture-of-Experts router's load balancing, the coefficient as the run resolved it). TRL's
    ``loss``. With
    ``use_adaptive_entropy`` the entropy's coefficient is the one the last update applied
    (``entropy/coef_applied``): where it changed between a pass's minibatches, this differs slightly from the
    mean of their losses."""
    entropy_coef = metrics.get("entropy/coef_applied", getattr(cfg, "entropy_coef", 0.0))
    loss = (metrics["loss/policy"] + getattr(cfg, "beta", 0.0) * metrics.get("loss/kl", 0.0)
            - entropy_coef * metrics.get("loss/entropy", 0.0))
    weight = getattr(cfg, "distillation_weight", 0.0)
    aux = (cfg.router_aux_loss_coef or 0.0) * metrics.get("loss/aux", 0.0)
    return (1.0 - weight) * loss + weight * metrics.get("loss/distill", 0.0) + aux


# The TrainerCallback events LearnerTrainer calls (:class:`_TrainerCallbacks`); a callback's others never run:
# on_substep_end (no gradient accumulation here: a step's micro-batches make one optimizer step), on_prediction_step
# and on_predict (no predict()), on_init_end and on_push_begin.
_CALLED_EVENTS = ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step",
                  "on_step_end", "on_evaluate", "on_log", "on_save", "on_epoch_end", "on_train_end")
# treerl's run events (treerl.learners.core.RUN_EVENTS) as TrainerCallback events.
_RUN_EVENTS = {"step_begin": "on_step_begin", "pre_optimizer_step": "on_pre_optimizer_step",
               "optimizer_step": "on_optimizer_step", "save": "on_save"}


def _ignored_events(callback: Any) -> list[str]:
    """The events ``callback`` defines that are never called: those a ``TrainerCallback`` subclass overrides (its
    base's are no-ops), or any of transformers' that a duck-typed callback has; none for a step function."""
    if not hasattr(callback, "on_log"):  # a function (step, metrics)
        return []
    from transformers import TrainerCallback

    events = [name for name in vars(TrainerCallback) if name.startswith("on_") and name not in _CALLED_EVENTS]
    if isinstance(callback, TrainerCallback):
        return [name for name in events if getattr(type(callback), name) is not getattr(TrainerCallback, name)]
    return [name for name in events if hasattr(callback, name)]


# treerl's name of what TRL logs under another name.
_TRL_NAMES = {"grad_norm": "grad/norm", "learning_rate": "lr", "reward": "reward/mean", "reward_std": "reward/std",
              "entropy_coef": "entropy/coef", "aux_loss": "loss/aux",
              "frac_reward_zero_std": "reward/zero_std_frac"}


def _reward_fn_figures(metrics: Mapping[str, Any], reward_names: Collection[str]) -> tuple[dict[str, Any],
                                                                                           dict[str, Any]]:
    """The ``reward_fn/`` figures of ``metrics`` under TRL's names: each reward function's mean (named in
    ``reward_names``) as ``rewards/NAME/mean``, and what the functions logged with ``log_metric(name, value)``
    under ``name`` itself, as TRL logs it.

    >>> _reward_fn_figures({"reward_fn/fmt_mean": 0.5, "reward_fn/accuracy": 0.25, "loss": 1.0}, ["fmt"])
    ({'rewards/fmt/mean': 0.5}, {'accuracy': 0.25})
    """
    means, logged = {}, {}
    for key, value in metrics.items():
        if not key.startswith("reward_fn/"):
            continue
        name = key[len("reward_fn/"):]
        if name.endswith("_mean") and name[:-len("_mean")] in reward_names:
            means[f"rewards/{name[:-len('_mean')]}/mean"] = value
        else:
            logged[name] = value
    return means, logged


def _trl_log(metrics: Mapping[str, Any], cfg: GRPOConfig, per_step: int, rows: int,
             reward_names: Collection[str] = ()) -> dict[str, Any]:
    """A ``metrics.jsonl`` line as an entry of TRL's ``log_history``: TRL's names (``loss``, ``grad_norm``,
    ``learning_rate``, ``reward``, ``reward_std``, ``frac_reward_zero_std``, ``rewards/NAME/mean`` of the
    reward functions named ``reward_names``, their ``log_metric`` names), ``epoch`` and the optimizer step;
    treerl's names beside them (a ``log_metric`` name that is one of them stays treerl's)."""
    step = int(metrics.get("step", 0))
    out = dict(metrics)
    if "loss/policy" in metrics:
        out["loss"] = _step_loss(metrics, cfg)
    out.update({trl: metrics[ours] for trl, ours in _TRL_NAMES.items() if ours in metrics})
    means, logged = _reward_fn_figures(metrics, reward_names)
    out.update(means)
    out.update({name: value for name, value in logged.items() if name not in out})
    out.update(epoch=_epoch(step, cfg, rows), step=step * per_step)
    return out


def _epoch(step: int, cfg: GRPOConfig, rows: int) -> float:
    """TRL's ``epoch`` after ``step`` steps: the passes over ``rows`` rows, each of ``cfg.steps_per_epoch(rows)``
    steps (GRPO's TRL leaves a pass's short last batch out); tasks played over rows when the rows are fewer
    than one step's (TRL then plays none)."""
    per_epoch = cfg.steps_per_epoch(rows)
    return step / per_epoch if per_epoch else step * cfg.tasks_per_step / rows


class _CallbackArgs:
    """The run's config as TrainerCallbacks read their ``args``: its fields, and TRL's ``eval_strategy``, which the
    config turned into ``eval_every`` (transformers' ``EarlyStoppingCallback`` checks it)."""

    def __init__(self, cfg: GRPOConfig):
        self._cfg = cfg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)

    @property
    def eval_strategy(self) -> str:
        cfg = self._cfg
        return "epoch" if "eval_every" in cfg.every_epoch else "steps" if cfg.eval_every else "no"


class _TrainerCallbacks:
    """TRL ``TrainerCallback`` objects called as a treerl step callback, and told the run's events
    (:meth:`on_event`: ``on_epoch_begin``, ``on_step_begin``, ``on_pre_optimizer_step`` and ``on_optimizer_step``
    around each optimizer step, ``on_save`` after each checkpoint, ``on_epoch_end``, in transformers' Trainer's
    order). A step of several optimizer steps (``num_iterations`` x ``num_minibatches``, TRL's several Trainer
    steps of one generation) has one ``on_step_begin`` and one ``on_step_end``, as it logs once. After each
    step: ``on_step_end``, then ``on_evaluate``
    with the evaluation's figures when the step evaluated (step 0: the evaluation before the first), then
    ``on_log`` with the step's metrics under TRL's names (``loss``, ``grad_norm``, ``learning_rate``,
    ``reward``, ``rewards/NAME/mean``, ``epoch``: :func:`_trl_log`, treerl's beside them), after each step. The
    ``control`` is transformers' ``TrainerControl``, reset and read as its Trainer's ``CallbackHandler`` does:
    what it asks after the step is returned to the run as a :class:`~treerl.learners.core.StepControl`; a second
    call for the step (the evaluation it asked for) calls ``on_evaluate`` and ``on_log`` only. ``state.best_metric``
    is set after each ``on_evaluate``, as transformers' ``_determine_best_metric`` sets it (``EarlyStoppingCallback``
    compares with it). The state counts optimizer steps, as TRL's: a step of N optimizer steps
    (``num_iterations`` x ``num_minibatches``) counts N; ``rows`` is the training dataset's, for ``epoch``."""

    def __init__(self, callbacks: Sequence[Any], cfg: GRPOConfig, rows: int = 1, reward_names: Sequence[str] = ()):
        from transformers import TrainerControl, TrainerState

        self.callbacks, self.cfg, self.rows, self.reward_names = list(callbacks), cfg, rows, list(reward_names)
        self.per_step = cfg.optimizer_steps_per_step()
        self.state, self.control = TrainerState(max_steps=cfg.steps * self.per_step), TrainerControl()
        self.last_step = -1  # the step of the latest call
        self.per_epoch = int(cfg.steps_per_epoch(rows))  # 0: the rows are fewer than a step's, the run one epoch
        self.in_epoch = False  # between on_epoch_begin and on_epoch_end

    def event(self, name: str, **kwargs: Any) -> None:
        """Call ``name`` of each callback that has it, after the reset of ``control`` that transformers'
        ``CallbackHandler`` makes before it."""
        control = self.control
        if name == "on_step_begin":
            control.should_log = control.should_evaluate = control.should_save = False
        elif name == "on_epoch_begin":
            control.should_epoch_stop = False
        elif name == "on_save":
            control.should_save = False
        args = _CallbackArgs(self.cfg)
        for callback in self.callbacks:
            if hasattr(callback, name):
                returned = getattr(callback, name)(args, self.state, self.control, **kwargs)
                if returned is not None:  # transformers' CallbackHandler takes the control a callback returns
                    self.control = returned

    def on_event(self, name: str, global_step: int) -> None:
        """The run's event ``name`` (:data:`~treerl.learners.core.RUN_EVENTS`) at optimizer step ``global_step``,
        as its TrainerCallback event (:data:`_RUN_EVENTS`). A step that begins a pass over the rows (every
        ``steps_per_epoch``-th, and the first of this call, as transformers' Trainer begins the epoch it resumes)
        calls ``on_epoch_end`` of the pass before (after its last step's ``on_save``) and ``on_epoch_begin``
        first; :meth:`end` calls the last ``on_epoch_end``."""
        self.state.global_step = global_step
        self.state.epoch = _epoch(global_step / self.per_step, self.cfg, self.rows)
        if name == "step_begin":
            step = global_step // self.per_step
            if self.in_epoch and self.per_epoch and step % self.per_epoch == 0:
                self.end()
            if not self.in_epoch:
                self.event("on_epoch_begin")
                self.in_epoch = True
        self.event(_RUN_EVENTS[name])

    def end(self) -> None:
        """``on_epoch_end`` of the pass under way (at the run's end: after its last checkpoint's ``on_save``)."""
        if self.in_epoch:
            self.event("on_epoch_end")
            self.in_epoch = False

    def __call__(self, step: int, metrics: dict[str, float]) -> StepControl:
        self.state.global_step = step * self.per_step
        if "num_input_tokens_seen" in metrics:  # include_num_input_tokens_seen: transformers' state counts them
            self.state.num_input_tokens_seen = int(metrics["num_input_tokens_seen"])
        logs = _trl_log({**metrics, "step": step}, self.cfg, self.per_step, self.rows, self.reward_names)
        self.state.log_history.append(logs)
        self.state.epoch = _epoch(step, self.cfg, self.rows)
        if step > self.last_step and step > 0:  # a new step
            self.event("on_step_end")
        self.last_step = step
        if evaluated := {k: v for k, v in metrics.items() if k.startswith(("eval_", "eval/"))}:
            self.event("on_evaluate", metrics=evaluated)
            self.control.should_evaluate = False
            self._track_best(step, evaluated)
        self.event("on_log", logs={k: v for k, v in logs.items() if k != "step"})
        self.control.should_log = False
        return StepControl(stop=self.control.should_training_stop, evaluate=self.control.should_evaluate,
                           save=self.control.should_save)

    def _track_best(self, step: int, evaluated: dict[str, float]) -> None:
        """transformers' ``_determine_best_metric`` after ``on_evaluate`` (none for the evaluation before the first
        step, as transformers' ``eval_on_start``)."""
        name = self.cfg.metric_for_best_model
        if name is None or step == 0:
            return
        value = float(evaluated[metric_key(name, evaluated)])
        if improves(value, self.state.best_metric, self.cfg.greater_is_better):
            self.state.best_metric, self.state.best_global_step = value, step * self.per_step
