"""What every learner is configured with: :class:`LearnerConfig`, the base of each learner's config.

The episodes (environment and its keyword arguments, model, sampling, limits) come from
:class:`~treerl.rollout.options.EpisodeOptions`; this adds the step (tasks x generations),
the optimizer, packing, LoRA, evaluation, checkpoints and logging. A learner's own config
(:class:`~treerl.learners.grpo.GRPOConfig`) derives from it and adds its algorithm's
fields, so ``treerl learn`` flags and YAML keys are spelled once for every learner.

>>> cfg = LearnerConfig(output_dir="runs/x", steps=3)
>>> cfg.packing_config().mode
'tree'
>>> LearnerConfig(output_dir="runs/x", report_to="mlflow")
Traceback (most recent call last):
...
ValueError: report_to='mlflow': use none, tensorboard, wandb or trackio.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from treerl.config import AcceptsAliases, field_help
from treerl.envs.core import ToolEnv
from treerl.envs.group import EnvGroup
from treerl.envs.registry import group_members
from treerl.errors import ConfigError
from treerl.kernels.tree_attention import BACKENDS
from treerl.learners.checkpoints import latest_checkpoint
from treerl.learners.packing import PackingConfig
from treerl.learners.precision import DTYPES, resolve_precision
from treerl.rollout.options import EpisodeOptions
from treerl.rollout.rewards import RewardOptions

__all__ = ["LearnerConfig", "REPORT_TO", "LR_SCHEDULERS", "HUB_STRATEGIES", "OPTIMIZERS", "INPUT_TOKEN_COUNTS"]

LEARNER_CONFIGS: dict[str, type] = {}
"""Each registered learner's config class, by name (``treerl.learners.core.register_learner`` fills it): which
learner has an option another lacks, for :meth:`LearnerConfig.option_hints`."""

REPORT_TO = ("none", "tensorboard", "wandb", "trackio")
LR_SCHEDULERS = ("constant", "linear", "cosine")
"""``lr_scheduler_type`` choices, each after ``warmup_steps`` of linear warm-up: ``linear`` (TRL's default)
and ``cosine`` decay to 0 at the run's last optimizer step."""
HUB_STRATEGIES = ("every_save", "end")
"""``hub_strategy`` choices (see :mod:`treerl.learners.hub`)."""
INPUT_TOKEN_COUNTS = ("no", "all", "non_padding")
"""``include_num_input_tokens_seen`` choices (transformers'; its booleans mean ``all`` and ``no``)."""
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
"""``optim`` choices, TRL's names of torch's AdamW: ``adamw_torch_fused`` (TRL's default) runs its fused kernel."""


@dataclass
class LearnerConfig(RewardOptions, EpisodeOptions, metaclass=AcceptsAliases):
    """Options every learner of ``treerl learn`` shares."""

    ALIASES: ClassVar[dict[str, str]] = {  # TRL's names where the meaning is the same (flags, YAML keys, Python)
        "num_generations": "group_size", "loss_type": "loss",
        "model_name_or_path": "model", "epsilon": "epsilon_low", "use_bias_correction_kl": "kl_bias_correction",
        "scale_rewards": "advantage_scale", "vllm_server_base_url": "vllm_server_url",
        "sapo_temperature_pos": "sapo_tau_pos", "sapo_temperature_neg": "sapo_tau_neg",
        # TRL's wait for its vLLM server to come up
        "vllm_server_timeout": "vllm_server_wait_s",
    }
    # TRL's options with no field here, and what to use instead: a flag, YAML key or keyword argument of
    # one of these names is refused with this hint, not with a "did you mean" for a look-alike name.
    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "max_prompt_length": "prompts are never cut here: --max-episode-tokens limits the whole context (prompt, "
                             "turns and tool results)",
        "remove_unused_columns": "every column of the dataset reaches the reward functions (TRL's GRPO default, "
                                 "remove_unused_columns=False); drop the columns you do not want from the dataset",
        "importance_sampling_level": "sequence-level ratios are --loss gspo; --is-level sets the level of the "
                                     "sampler/trainer importance weights (TRL's vllm_importance_sampling_mode)",
        "hub_always_push": "not supported: a checkpoint's push is skipped while the previous one still uploads, as "
                           "transformers' default does (the next one, or the end of the run, pushes newer weights)",
        "gradient_checkpointing_kwargs": "--gradient-checkpointing recomputes each decoder layer without "
                                         "reentrancy; it takes no other options",
        **dict.fromkeys(("model_init_kwargs", "torch_dtype"),
                        "--dtype sets the dtype the weights are loaded and trained in (auto: the checkpoint's)"),
        "delta": "not supported (the two-sided clip of --loss dppo is --dppo-delta-low/--dppo-delta-high)",
        "trust_remote_code": "not supported: --model loads architectures transformers ships",
        "cache_implementation": "not supported: generation uses the policy's own KV cache",
        "generation_kwargs": "sampling takes --temperature, --top-k, --top-p, --min-p, --repetition-penalty and "
                             "--max-new-tokens",
        "log_level": "not supported: treerl prints its progress and warnings to stderr and every step to "
                     "metrics.jsonl; transformers' own logging follows $TRANSFORMERS_VERBOSITY",
        "use_peft": "LoRA is on when --lora-r is set (TRL's lora_r, lora_alpha, lora_dropout and "
                    "lora_target_modules are options here)",
        **dict.fromkeys(("dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split"),
                        "a script's dataset option, not TRL's GRPOConfig: here the rows are the environment's, "
                        "--env-kwargs '{\"data_path\": \"train.jsonl\"}' (a local JSON Lines or Parquet file), or "
                        "treerl.GRPOTrainer(train_dataset=...) in Python"),
        **dict.fromkeys(("model_revision", "attn_implementation"),
                        "a script's model option (TRL's ModelConfig): --model takes a directory or a cached Hub id "
                        "as it is, and its attention is treerl's tree attention (--attention-impl)"),
        **dict.fromkeys(("use_liger_kernel", "vllm_enable_sleep_mode", "ds3_gather_for_generation",
                         "dataloader_num_workers", "lr_scheduler_kwargs",
                         "liger_kernel_config", "optim_args", "optim_target_modules", "average_tokens_across_devices",
                         "label_smoothing_factor", "use_cache", "neftune_noise_alpha",
                         "auto_find_batch_size", "skip_memory_metrics", "debug",
                         "accelerator_config", "parallelism_config", "label_names", "length_column_name",
                         "save_on_each_node", "enable_jit_checkpoint", "restore_callback_states_from_checkpoint",
                         "ignore_data_skip", "pad_to_multiple_of", "vllm_structured_outputs_regex",
                         "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
                         *(f"dataloader_{k}" for k in ("drop_last", "pin_memory", "persistent_workers",
                                                       "prefetch_factor", "multiprocessing_context", "in_order"))),
                        "not supported (taken at transformers' and TRL's defaults, which mean what happens here)"),
        # transformers' TrainingArguments with a counterpart of their own here
        "activation_checkpointing_kwargs": "--gradient-checkpointing (TRL's activation_checkpointing) recomputes each "
                                           "decoder layer without reentrancy; it takes no other options",
        **dict.fromkeys(("log_on_each_node", "log_level_replica", "logging_nan_inf_filter"),
                        "not supported: rank 0 alone prints progress and writes metrics.jsonl, each step's values as "
                        "they are; transformers' own logging follows $TRANSFORMERS_VERBOSITY"),
        **dict.fromkeys(("torch_compile", "torch_compile_backend", "torch_compile_mode"),
                        "not supported: the model runs uncompiled, with treerl's tree attention (--attention-impl)"),
        **dict.fromkeys(("bf16_full_eval", "fp16_full_eval", "prediction_loss_only",
                         "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps",
                         "include_for_metrics", "batch_eval_metrics"),
                        "not supported: the evaluation plays held-out episodes with the sampler, at the run's "
                        "precision (--eval-episodes, --eval-every N steps, --eval-on-start)"),
        "train_sampling_strategy": "--shuffle-dataset plays a dataset's rows in a new order each pass (TRL's GRPO "
                                   "sampler does not read train_sampling_strategy either)",
        **dict.fromkeys(("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph",
                         "ddp_backend", "fsdp", "fsdp_config", "deepspeed", "local_rank"),
                        "processes come from accelerate launch or torchrun (their LOCAL_RANK): no DDP wrapper, rank "
                        "0's weights are broadcast and every rank's gradients summed (over nccl on GPUs, gloo on "
                        "CPUs; --ddp-timeout bounds a collective), no FSDP or DeepSpeed sharding"),
        **dict.fromkeys(("use_transformers_continuous_batching", "use_transformers_paged",
                         "transformers_continuous_batching_config"),
                        "the transformers sampler is treerl's own: --continuous-batching lets requests join its "
                        "running batch between decode steps; or --use-vllm"),
        "vllm_tensor_parallel_size": "not supported: the colocated engine runs on each process's own GPU; a model that "
                                     "needs several sample with --vllm-mode server (vllm serve MODEL "
                                     "--tensor-parallel-size N)",
        "vllm_group_port": "--vllm-weight-sync nccl picks an open port itself",
    }
    # TRL's options at the values that mean what happens here anyway, mostly TRL's defaults: taken and dropped
    # (treerl.config.without_neutral), so that a script or YAML file writing them out runs; other values of
    # those in UNSUPPORTED are refused with its hint. TRL's None is "off" for min_p, generation_kwargs and the
    # like, and "the other option decides" for generation_batch_size and steps_per_generation.
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        **dict.fromkeys(("min_p", "chat_template_kwargs", "vllm_server_base_url", "generation_batch_size",
                         "steps_per_generation", "cache_implementation", "delta", "model_init_kwargs"), (None,)),
        "max_tool_calling_iterations": (None,),  # TRL's "no limit of its own": the environment's max_turns limits
        "generation_kwargs": (None, {}),
        **dict.fromkeys(("trust_remote_code", "log_unique_prompts", "hub_always_push"), (False,)),
        # read only beside log_completions=True: taken at TRL's defaults
        "log_completions_hub_repo": (None,),
        "log_multimodal": (True,),
        "importance_sampling_level": ("token",),  # token-level ratios, as every --loss but gspo
        "gradient_checkpointing_kwargs": (None, {}, {"use_reentrant": False}),  # what --gradient-checkpointing does
        "log_level": ("passive",),  # transformers' default: its logging as it is set
        # transformers' and TRL's defaults of what has no counterpart here: no Liger kernels, no vLLM sleep, no
        # DeepSpeed, no DataLoader, no scheduler arguments
        **dict.fromkeys(("use_liger_kernel", "vllm_enable_sleep_mode"), (False,)),
        "ds3_gather_for_generation": (True,), "dataloader_num_workers": (0,),
        "lr_scheduler_kwargs": (None, {}), "do_train": (True, False),  # transformers' Trainer does not read do_train
        "do_predict": (True, False),  # nor do_predict
        # transformers' TrainingArguments at their defaults: nothing here they would change (see UNSUPPORTED)
        **dict.fromkeys(("optim_args", "optim_target_modules", "liger_kernel_config", "neftune_noise_alpha",
                         "accelerator_config", "parallelism_config", "label_names",
                         "torch_compile_backend", "torch_compile_mode", "eval_accumulation_steps",
                         "activation_checkpointing",
                         "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "ddp_bucket_cap_mb",
                         "ddp_broadcast_buffers", "ddp_backend", "fsdp_config", "deepspeed", "disable_tqdm",
                         "resume_from_checkpoint", "vllm_structured_outputs_regex", "vllm_max_model_length",
                         "trackio_space_id", "trackio_bucket_id"), (None,)),
        **dict.fromkeys(("bf16_full_eval", "fp16_full_eval", "torch_compile", "use_cache", "auto_find_batch_size",
                         "prediction_loss_only", "eval_use_gather_object", "batch_eval_metrics", "save_on_each_node",
                         "enable_jit_checkpoint", "ignore_data_skip", "use_cpu",
                         "restore_callback_states_from_checkpoint", "dataloader_drop_last",
                         "dataloader_persistent_workers", "use_transformers_continuous_batching",
                         "use_transformers_paged"), (False,)),
        **dict.fromkeys(("average_tokens_across_devices", "log_on_each_node", "logging_nan_inf_filter",
                         "eval_do_concat_batches", "skip_memory_metrics", "dataloader_pin_memory",
                         "dataloader_in_order"), (True,)),
        "activation_checkpointing_kwargs": (None, {}, {"use_reentrant": False}), "label_smoothing_factor": (0.0,),
        "log_level_replica": ("warning",),
        "include_for_metrics": ([],), "debug": ("", []), "fsdp": (None, "", []), "local_rank": (-1,),
        "train_sampling_strategy": ("random",), "length_column_name": ("length",),
        "transformers_continuous_batching_config": (None, {}), "trackio_static_space_id": (None, False),
        # no DDP wrapper here (see distributed.py): its switches change nothing
        **dict.fromkeys(("ddp_find_unused_parameters", "ddp_static_graph"), (None, True, False)),
        "pad_to_multiple_of": ("auto", None),  # TRL's "auto" pads on Neuron only; packed rows have no padding
        "vllm_model_impl": ("vllm",), "vllm_tensor_parallel_size": (1,), "vllm_group_port": (51216,),
        "vllm_server_host": ("0.0.0.0",), "vllm_server_port": (8000,),  # treerl's --vllm-server-url's server
        "vllm_importance_sampling_cap": (None,),  # TRL's deprecated name of clip_max, unset
    }
    # TRL's options that translate_options turns into fields, or takes with a note where they change nothing
    # here; each (type, help) is also a flag and a YAML key.
    TRANSLATED: ClassVar[dict[str, tuple[type, str]]] = {
        "max_steps": (int, "TRL's: optimizer steps; steps = max_steps / (num_iterations x num_minibatches) (a step "
                           "takes that many optimizer steps on its episodes); -1: num_train_epochs sets the run's "
                           "length (TRL's 3 when not given)."),
        "save_steps": (int | float, "TRL's: optimizer steps (below 1: that fraction of the run's, rounded up); "
                                    "save_every = save_steps / (num_iterations x num_minibatches)."),
        "warmup_ratio": (float, "TRL's: warmup_steps = that fraction of the run's optimizer steps (steps x "
                                "num_iterations x num_minibatches), rounded up."),
        "per_device_train_batch_size": (int, "TRL's: tasks_per_step = per_device_train_batch_size x "
                                             "steps_per_generation x processes / group_size, the completions of "
                                             "TRL's generation (TRL's defaults: 8, and steps_per_generation = "
                                             "gradient_accumulation_steps, 1)."),
        "gradient_accumulation_steps": (int, "TRL's: see --per-device-train-batch-size; num_minibatches = "
                                             "steps_per_generation / gradient_accumulation_steps."),
        "steps_per_generation": (int, "TRL's: micro-batches of --per-device-train-batch-size per generation "
                                      "(default: gradient_accumulation_steps); a multiple of "
                                      "gradient_accumulation_steps here: num_minibatches = steps_per_generation / "
                                      "gradient_accumulation_steps optimizer steps per generation."),
        "generation_batch_size": (int, "TRL's: completions per generation (per_device_train_batch_size x processes "
                                       "x steps_per_generation, which it sets instead): tasks_per_step = "
                                       "generation_batch_size / group_size."),
        **{name: (tp, "TRL's: changes nothing, every step is logged.")
           for name, tp in (("logging_steps", int | float), ("logging_first_step", bool), ("logging_strategy", str))},
        "remove_unused_columns": (bool, "TRL's: false only, as every column reaches the reward functions."),
        "max_tool_calling_iterations": (int, "TRL's: rounds of tool calls and another assistant turn after the "
                                             "first; the environment's max_turns = N + 1 (--env-kwargs' max_turns). "
                                             "Unset: the environment's own limit."),
        "eval_strategy": (str, "TRL's: steps evaluates every eval_steps optimizer steps (eval_every); no, TRL's "
                               "default, only at the start and the end; epoch at the end of each pass over the "
                               "training rows and of the run (as --save-strategy epoch)."),
        "save_strategy": (str, "TRL's: steps (its default) checkpoints every save_steps optimizer steps (save_every); "
                               "epoch at the end of each pass over the training rows, every floor(rows / "
                               "tasks_per_step) steps (AsyncGRPO's TRL streams its groups: one epoch, the run), set "
                               "when the run starts (an environment that generates its tasks refuses it); no, none "
                               "(save_every 0); best, after each evaluation that improves on metric_for_best_model "
                               "(save_on_best). save_steps is then ignored, as in TRL. Every run still ends with a "
                               "checkpoint (what --resume continues) and the model in output_dir/model (what a TRL "
                               "script writes with trainer.save_model)."),
        "eval_steps": (int | float | None, "TRL's, with --eval-strategy steps: optimizer steps (below 1: that "
                                           "fraction of the run's, rounded up; default: logging_steps, TRL's 10); "
                                           "eval_every = eval_steps / (num_iterations x num_minibatches)."),
        "per_device_eval_batch_size": (int, "TRL's: changes nothing; the held-out episodes play --max-concurrency at "
                                            "a time."),
        # transformers' and TRL's names of what is set here otherwise (see _translate_trainer_options)
        "activation_checkpointing": (bool, "transformers 5's name of --gradient-checkpointing (its TrainingArguments "
                                           "write both out, at one value)."),
        "use_cpu": (bool, "TRL's: true trains and samples on the CPU (--device cpu)."),
        "disable_tqdm": (bool, "TRL's: true hides the progress bar (--progress false)."),
        "resume_from_checkpoint": (bool | str, "TRL's: true, or the path of output_dir's latest checkpoint, continues "
                                              "from it (--resume)."),
        "vllm_server_host": (str, "TRL's: the server of --vllm-mode server is http://HOST:PORT (--vllm-server-url)."),
        "vllm_server_port": (int, "TRL's: see --vllm-server-host (TRL's defaults 0.0.0.0 and 8000)."),
        "vllm_max_model_length": (int, "TRL's: the colocated engine's context window, vLLM's max_model_len (default: "
                                       "max_episode_tokens + max_new_tokens, at most the model's positions)."),
        "vllm_model_impl": (str, "TRL's: the colocated engine's model implementation, vLLM's model_impl: vllm "
                                 "(its own) or transformers."),
    }
    # The field each of TRANSLATED's options sets: a flag of one overrides the other in a --config file.
    TRANSLATED_INTO: ClassVar[dict[str, str]] = {
        "max_steps": "steps", "save_steps": "save_every", "per_device_train_batch_size": "tasks_per_step",
        "gradient_accumulation_steps": "tasks_per_step", "steps_per_generation": "tasks_per_step",
        "generation_batch_size": "tasks_per_step", "warmup_ratio": "warmup_steps",
        "eval_strategy": "eval_every", "eval_steps": "eval_every", "save_strategy": "save_every",
        "activation_checkpointing": "gradient_checkpointing", "use_cpu": "device", "disable_tqdm": "progress",
        "resume_from_checkpoint": "resume", "vllm_server_host": "vllm_server_url", "vllm_server_port": "vllm_server_url",
    }
    # TRL's epsilon_high defaults to epsilon; treerl's stays 0.28 (DAPO's clip-higher): pass both to match TRL.

    output_dir: str | None = field_help(None, "Where metrics, checkpoints and the final model go (required).")
    steps: int = field_help(60, "Steps: each plays tasks_per_step x group_size episodes and takes num_iterations "
                                "x num_minibatches optimizer steps on them (TRL's max_steps counts optimizer "
                                "steps).")
    num_train_epochs: float | None = field_help(None, "TRL's: the run's length in passes over the training dataset "
                                                      "when steps (TRL's max_steps) is not given: an epoch is "
                                                      "floor(rows / tasks_per_step) steps (TRL's sampler leaves a "
                                                      "pass's short last batch out), E epochs ceil(E x that x "
                                                      "num_iterations x num_minibatches) optimizer steps (TRL's "
                                                      "max_steps), rounded up to whole steps (AsyncGRPO: TRL's "
                                                      "ceil(E x rows) groups). Set when the run starts, from the "
                                                      "environment's data_path or dataset (an environment that "
                                                      "generates its tasks refuses it); config.json records the "
                                                      "steps. Beside steps or max_steps it changes nothing, as in "
                                                      "TRL.")
    fractions_of_run: dict[str, float] = field_help(
        help="TRL's options given as a fraction of the run (warmup_ratio; save_steps, eval_steps below 1) while "
             "num_train_epochs has yet to set its length; applied, and emptied, when it does.",
        default_factory=dict, metadata={"cli": False})
    every_epoch: list[str] = field_help(
        help="The fields TRL's save_strategy and eval_strategy 'epoch' set (save_every, eval_every): the steps of an "
             "epoch (epoch_interval), set when the run starts from the training rows; eval_every then also "
             "evaluates at the run's last step, the end of its last epoch (transformers' on_epoch_end).",
        default_factory=list, metadata={"cli": False})
    tasks_per_step: int = field_help(8, "Tasks per step; each is played group_size times.")
    group_size: int = field_help(8, "Generations per task (GRPO's group).")
    learning_rate: float | None = field_help(None, "AdamW learning rate (default: by the model's size, see "
                                                   "treerl.learners.precision.usual_learning_rate: 2e-4 for the "
                                                   "shipped tiny model, 1e-6 to fine-tune all weights of a model of "
                                                   "100M+ parameters, 1e-5 with LoRA).")
    weight_decay: float = field_help(0.0, "AdamW weight decay.")
    adam_beta1: float = field_help(0.9, "AdamW's beta1: the decay rate of its gradient average (TRL's name and "
                                        "default).")
    adam_beta2: float = field_help(0.999, "AdamW's beta2: the decay rate of its squared-gradient average (TRL's "
                                          "name and default).")
    adam_epsilon: float = field_help(1e-8, "AdamW's epsilon, added to the denominator of its update (TRL's name and "
                                           "default).")
    optim: str = field_help("adamw_torch", "torch's AdamW, adamw_torch, or adamw_torch_fused: the same update in one "
                                           "fused kernel (TRL's default; faster on a GPU). Another optimizer is "
                                           "passed from Python (treerl.learners.train(cfg, optimizer=...)).")
    warmup_steps: int = field_help(0, "Optimizer steps of linear warm-up (TRL's; a step takes num_iterations x "
                                      "num_minibatches of them), then lr_scheduler_type's schedule. In Python, below "
                                      "1: that fraction of the run's, as transformers 5 reads it (TRL's warmup_ratio).")
    lr_scheduler_type: str = field_help("constant", "After the warm-up: constant, linear or cosine (decay to 0 at the "
                                                    "run's last optimizer step; TRL's default is linear).")
    max_grad_norm: float = field_help(1.0, "Gradient clipping norm (0 disables).")
    max_new_tokens: int = field_help(64, "Token limit of each assistant turn (shorter than eval's: faster steps).")
    max_episode_tokens: int = field_help(1024, "Context limit of one episode.")
    max_concurrency: int = field_help(64, "Episodes in flight during rollout.")
    continuous_batching: bool = field_help(False, "Rollout requests join the running batch between decode steps: "
                                                  "faster rollouts, but runs no longer repeat bit for bit (off: "
                                                  "static batches, reproducible runs and resumes).")
    lockstep: bool = field_help(True, "Rollout generation in waves of every episode in play, in a fixed order: "
                                      "runs and resumes repeat bit for bit (off: batches form as requests arrive, "
                                      "a little faster when tool calls vary in length; needs "
                                      "--continuous-batching false).")
    branch_at_turn: int | None = field_help(None, "Fork episodes after this many turns (deeper trees).")
    branch_factor: int = field_help(1, "Continuations per fork.")
    max_tokens_per_row: int = field_help(4096, "Token budget of one packed row.")
    pack_mode: str = field_help("tree", "tree (shared prefixes once), flat, or padded.")
    attention_impl: str = field_help("auto", "Tree attention backend: auto, segment, flex, triton, reference.")
    lora_r: int = field_help(0, "LoRA rank; 0 trains all weights.")
    lora_alpha: int = field_help(16, "LoRA alpha.")
    lora_dropout: float = field_help(0.0, "LoRA dropout.")
    disable_dropout: bool = field_help(False, "TRL's: every torch.nn.Dropout of the trained model, LoRA's "
                                              "--lora-dropout too, drops nothing (p=0), as TRL sets it. The "
                                              "attention's dropout, a model config value (0 in Qwen3 and Llama "
                                              "checkpoints), is not a module and stays, as in TRL.")
    lora_target_modules: list[str] | None = field_help(None, "Modules LoRA adapts, by name or suffix as peft "
                                                             "matches them (e.g. q_proj v_proj; TRL's name); default: "
                                                             "every linear layer but the LM head (all-linear).")
    dtype: str = field_help("float32", "Master weights and AdamW states: float32 (a bfloat16 checkpoint is upcast; "
                                       "pair with --bf16/--fp16 for mixed precision), bfloat16 or float16 (pure low "
                                       "precision: small updates round away), or auto (the checkpoint's dtype).")
    bf16: bool | None = field_help(None, "Forward and backward under bfloat16 autocast; log-probs and the loss stay "
                                         "float32 (default: on for a CUDA GPU with bfloat16, off on CPU).")
    fp16: bool = field_help(False, "Forward and backward under float16 autocast with a loss scaler (GPUs without "
                                   "bfloat16); needs --dtype float32.")
    cast_lm_head_to_fp32: bool = field_help(False, "TRL's (ScaleRL): the LM head's logits in float32 from bfloat16 or "
                                                   "float16 weights and hidden states, the head's weights held "
                                                   "and trained in float32 (TRL's): the trainer's log-probs and "
                                                   "entropies (the reference's and SDPO's teacher's too) and the "
                                                   "transformers sampler's logits. A float32 head already is: with "
                                                   "--dtype float32 (the default) only a --bf16/--fp16 sampler's "
                                                   "changes; vLLM's sampler keeps its own head, as in TRL.")
    router_aux_loss_coef: float | None = field_help(None, "TRL's: the weight of a Mixture-of-Experts model's "
                                                          "load-balancing loss (its router's auxiliary loss, "
                                                          "transformers' load_balancing_loss_func over each "
                                                          "micro-batch's tokens, a token shared by k episodes "
                                                          "counted k times, as unpacked), added to the loss and "
                                                          "logged as loss/aux. Unset: the model config's "
                                                          "router_aux_loss_coef (0.001 in Qwen3-MoE and Mixtral "
                                                          "checkpoints); 0 turns it off. A dense model takes unset "
                                                          "or 0 (nothing to add) and refuses another value, as TRL.")
    use_vllm: bool = field_help(False, "Sample with vLLM: an engine in this process (the vllm extra, a CUDA GPU; "
                                       "the weights loaded into it in place after each step), or a server started "
                                       "separately with --vllm-mode server (the weights pushed to it).")
    vllm_gpu_memory_utilization: float = field_help(0.3, "Share of the GPU's memory the colocated vLLM engine takes "
                                                         "(weights and KV cache); the rest is training's.")
    vllm_kwargs: dict[str, Any] = field_help(help='More keyword arguments of vllm.LLM, e.g. \'{"enforce_eager": '
                                                  'true, "max_num_seqs": 64}\'.', default_factory=dict)
    vllm_mode: str = field_help("colocate", "With --use-vllm: colocate (an engine in this process) or server (a "
                                            "`vllm serve` started separately, at --vllm-server-url).")
    vllm_server_url: str = field_help("http://127.0.0.1:8000", "The vLLM OpenAI server of --vllm-mode server, started "
                                                               "as VLLM_SERVER_DEV_MODE=1 vllm serve MODEL "
                                                               "--logprobs-mode processed_logprobs.")
    vllm_server_model: str | None = field_help(None, "The name the server serves the model under (default: "
                                                     "--model, as `vllm serve MODEL` names it).")
    vllm_weight_sync: str = field_help("disk", "How --vllm-mode server gets each step's weights: disk (a safetensors "
                                               "directory the server reads, then its /collective_rpc reload_weights) "
                                               "or nccl (vLLM's GPU-to-GPU weight transfer; the server needs "
                                               "--weight-transfer-config '{\"backend\": \"nccl\"}').")
    vllm_weights_dir: str | None = field_help(None, "Where disk weight sync writes (default: output_dir/vllm_weights);"
                                                    " the server must read the same path.")
    vllm_server_timeout_s: float = field_help(600.0, "Limit of one request to the vLLM server, in seconds.")
    vllm_server_wait_s: float = field_help(0.0, "How long --vllm-mode server waits for the server to come up (to "
                                                "answer /v1/models) before failing, in seconds (TRL's "
                                                "vllm_server_timeout, whose default is 240; 0: fail at once).")
    tf32: bool | None = field_help(None, "TRL's: on a CUDA GPU, float32 matmuls and convolutions in TensorFloat-32 "
                                         "(true) or full float32 (false), as transformers sets torch's backends; "
                                         "unset: torch's setting. Nothing changes on the CPU.")
    gradient_checkpointing: bool = field_help(False, "Recompute each decoder layer's activations in the backward "
                                                     "instead of keeping them: less memory for long episodes, about "
                                                     "a third more compute (works with tree attention and LoRA).")
    torch_empty_cache_steps: int | None = field_help(None, "transformers': after every N-th optimizer step of the run "
                                                           "(TRL's global_step), hand the accelerator's cached, "
                                                           "unused memory back (torch.cuda.empty_cache() and its "
                                                           "likes; nothing on the CPU): a lower memory peak when the "
                                                           "sampler's KV cache and training's activations take turns, "
                                                           "a little slower. Unset: never.")
    malformed_ends_episode: bool = field_help(True, "In training, a malformed tool call ends its episode at reward 0 "
                                                    "(ToolEnv environments, as in TRL): an error message the model "
                                                    "recovers from costs it only a turn, and malformed calls then "
                                                    "grow unchecked. The held-out evaluation keeps the environment's "
                                                    "own setting; a value in env_kwargs wins over this one.")
    malformed_penalty: float = field_help(0.0, "In training, each malformed tool call costs its episode this much "
                                               "reward (ToolEnv environments; success is unchanged): a reply of "
                                               "many broken calls costs more than one. The held-out evaluation "
                                               "keeps the environment's own setting; a value in env_kwargs wins.")
    eval_episodes: int = field_help(64, "Held-out tasks evaluated at the start and the end, and every eval_every "
                                        "steps, each played num_generations_eval times (0 skips).")
    eval_seed: int = field_help(10_000, "First seed of the held-out tasks (training uses seed + i).")
    num_generations_eval: int | None = field_help(None, "Episodes per evaluation task, played as one group sharing "
                                                        "the prompt (TRL's): the held-out evaluation plays each of "
                                                        "its eval_episodes tasks this many times (default 1; above "
                                                        "1 it adds pass@k), treerl.GRPOTrainer each eval_dataset "
                                                        "row (default: group_size, TRL's num_generations).")
    eval_env_kwargs: dict[str, Any] = field_help(
        help='The held-out evaluation\'s environment keyword arguments, merged over env_kwargs (a group\'s: each '
             'environment\'s over its own), e.g. \'{"data_path": "test.jsonl"}\' (default: the training environment, '
             'whose rows the evaluation would then draw).',
        default_factory=dict)
    eval_temperature: float = field_help(1.0, "Sampling temperature of the evaluation.")
    eval_every: int = field_help(0, "Also evaluate every N steps during training and at the last step (as "
                                    "transformers' Trainer ends), logged in that step's metrics as "
                                    "eval/success_rate, eval/reward/mean, ... (TRL's eval_strategy steps with "
                                    "eval_steps; 0: only at the start and the end).")
    eval_delay: float = field_help(0, "transformers': no evaluation of eval_every before this many optimizer steps of "
                                      "the run (TRL's global_step; epochs with TRL's eval_strategy epoch). The "
                                      "evaluations at the start (eval_on_start) and at the end of the run "
                                      "(summary.json's eval_end) are not eval_every's and stay.")
    eval_on_start: bool | None = field_help(None, "Evaluate before the first step (TRL's eval_on_start); with "
                                                  "eval_every, also logged as step 0 of metrics.jsonl. Default: "
                                                  "true in treerl learn, false (TRL's) in treerl.GRPOTrainer.")
    do_eval: bool = field_help(False, "TRL's: changes nothing, as in transformers' Trainer, which does not read it "
                                      "either; kept for scripts that read it (open-r1's `if training_args.do_eval:` "
                                      "then calls trainer.evaluate()).")
    save_every: int = field_help(0, "Checkpoint every N steps (0: only at the end).")
    save_total_limit: int | None = field_help(None, "Keep only the N latest checkpoints, removing older ones as "
                                                    "new ones are written (default: keep all); never the best "
                                                    "model's (metric_for_best_model), as transformers' rotation: "
                                                    "with 1, the run ends with the best one alone.")
    metric_for_best_model: str | None = field_help(
        None, "TRL's: the evaluation figure that picks the best checkpoint, which --save-total-limit keeps and "
              "--load-best-model-at-end loads; a name of the evaluation's metrics with or without its eval_ or eval/ "
              "prefix, in TRL's names (reward: eval_reward, TRL's GRPO evaluation, treerl learn's eval/reward/mean; "
              "reward_std; rewards/NAME/mean) or treerl learn's (success_rate, reward/mean, ...). Compared after each "
              "evaluation during training (not the one before the first step). Default with "
              "--load-best-model-at-end: reward (transformers' loss: GRPO's evaluation has none).")
    greater_is_better: bool | None = field_help(None, "TRL's: whether a higher metric_for_best_model is better "
                                                      "(default, as transformers': true unless its name ends in "
                                                      "loss).")
    load_best_model_at_end: bool = field_help(False, "TRL's: at the end of the run, output_dir/model (and adapter, "
                                                     "with LoRA) get the weights of the best checkpoint "
                                                     "(metric_for_best_model) instead of the last step's; the last "
                                                     "checkpoint still holds the last step's, for --resume. Needs an "
                                                     "evaluation during training and a checkpoint at each one that "
                                                     "may be best: --save-every a multiple of --eval-every, both "
                                                     "'epoch', or --save-strategy best.")
    save_on_best: bool = field_help(False, "Checkpoint after each evaluation during training whose "
                                           "metric_for_best_model improves on the best so far (TRL's save_strategy "
                                           "'best', which sets it).", metadata={"cli": False})
    save_only_model: bool = field_help(False, "transformers': checkpoints hold the trained weights and "
                                              "trainer_state.json alone, without the optimizer's state, the "
                                              "learning-rate schedule's and the random generators (a third of a "
                                              "full fine-tune's checkpoint under AdamW): --resume cannot continue "
                                              "from them and refuses to while steps remain (with none left, it "
                                              "writes the checkpoint's weights to output_dir/model).")
    resume: bool = field_help(False, "Continue from the latest checkpoint in output_dir.")
    overwrite_output_dir: bool = field_help(False, "Start over in an output_dir that holds an earlier run: its "
                                                   "metrics, checkpoints, samples and model are removed first "
                                                   "(without it or --resume such a directory is refused).")
    push_to_hub: bool = field_help(False, "Push the trained model (output_dir/model, with a model card) to the Hugging "
                                          "Face Hub at the end of the run (and after each checkpoint with "
                                          "--hub-strategy every_save); the repository is created at the start.")
    hub_model_id: str | None = field_help(None, "The Hub repository, USER/NAME or ORG/NAME (default: the output "
                                                "directory's name, under the token's user, as transformers does).")
    hub_strategy: str = field_help("every_save", "With --push-to-hub: every_save (also after each --save-every "
                                                 "checkpoint, in the background; one still uploading makes the next "
                                                 "skip) or end (the final model only). Checkpoints themselves stay "
                                                 "local: TRL's checkpoint and all_checkpoints are refused.")
    hub_revision: str | None = field_help(None, "The branch pushes go to (created from the main branch if missing, "
                                                "as transformers' push_to_hub does; default: main).")
    hub_private_repo: bool | None = field_help(None, "Create the repository private (default: the Hub's default for "
                                                     "the user or organization).")
    hub_token: str | None = field_help(None, "The Hugging Face token pushing (default: $HF_TOKEN or `hf auth login`'s, "
                                             "which keep it off the command line); never written to config.json.",
                                       repr=False)
    sample_groups: int = field_help(4, "Groups of a sampled step kept in output_dir/trajectories for `treerl view` "
                                       "(0 keeps none).")
    sample_every: int = field_help(10, "Keep a trajectory sample every N steps (and at the first and last step).")
    include_num_input_tokens_seen: str | bool = field_help(
        "no", "transformers': log num_input_tokens_seen, the input tokens of the run's training forwards so far, "
              "summed over processes (each pass of num_iterations forwards again, as transformers counts every "
              "training forward): all (true) counts every slot of the packed rows, non_padding their tokens, the "
              "same here (the rows trained on hold no padding); no (false) logs nothing. Tree packing forwards a "
              "shared prefix once, so it counts once; TRL's GRPO counts its generated episodes' prompt and "
              "completion tokens instead (its num_tokens).")
    log_completions: bool = field_help(False, "Print each step's completions to stderr with their rewards and "
                                              "advantages (TRL's; the prompt without its system message), and log "
                                              "them as a completions table to --report-to's tracker.")
    num_completions_to_print: int | None = field_help(None, "How many of a step's completions --log-completions "
                                                            "shows (default: all, as TRL).")
    sample_trainer_logprobs: bool = field_help(True, "Store the trainer's log-probs in the samples too (one "
                                                     "forward of the kept groups): the viewer's sampler/trainer "
                                                     "ratio colouring.")
    seed: int = field_help(0, "Seeds tasks, sampling and initialization.")
    full_determinism: bool = field_help(False, "transformers': seed the run with its enable_full_determinism instead "
                                               "of set_seed: torch's deterministic algorithms (an op that has none "
                                               "raises), cuDNN's deterministic mode, and the environment variables "
                                               "CUDA needs for them (CUBLAS_WORKSPACE_CONFIG=:16:8, "
                                               "CUDA_LAUNCH_BLOCKING=1, ...), in the trainer's process and "
                                               "AsyncGRPO's generators: GPU kernels repeat bit for bit, slower. A run "
                                               "on the CPU repeats without it (--lockstep, --seed).")
    shuffle_dataset: bool | None = field_help(None, "Play a dataset's rows (an environment's data_path or dataset, "
                                                    "a group's) in a new order each pass, the permutations TRL's "
                                                    "sampler draws with --seed, or --data-seed where set (TRL's "
                                                    "shuffle_dataset). Default: "
                                                    "on in treerl.GRPOTrainer, as TRL's; off in treerl learn, whose "
                                                    "step s plays the next tasks_per_step rows as written.")
    data_seed: int | None = field_help(None, "transformers': the seed of the order --shuffle-dataset plays a "
                                             "dataset's rows in, apart from --seed (which still seeds the tasks' "
                                             "resets, sampling and initialization). Unset: --seed, as in "
                                             "transformers. (TRL's own GRPOTrainer does not read it: its sampler "
                                             "shuffles with seed.)")
    num_threads: int | None = field_help(None, "torch CPU threads (default: torch's choice).")
    ddp_timeout: int = field_help(1800, "Under several processes, seconds a collective may wait (TrainingArguments' "
                                        "name and default): the other ranks wait while rank 0 alone evaluates, "
                                        "saves and plots.")
    progress: bool = field_help(True, "Show a progress bar.")
    report_to: str | list[str] = field_help("none", "Also log to: none, tensorboard, wandb or trackio (when "
                                                    "installed); TRL's list of one tracker is taken too.")
    run_name: str | None = field_help(None, "The run's name in wandb or trackio (TRL's run_name; default: the "
                                            "tracker's own).")
    project: str | None = field_help(None, "The wandb or trackio project the run is logged in (TRL's project, whose "
                                           "default is huggingface; default: treerl); $WANDB_PROJECT, where set, "
                                           "names wandb's, as in transformers.")
    from_rollouts: str | None = field_help(None, "Train on the groups of this trajectory file (treerl rollout/serve "
                                                 "--out) instead of playing the environment; step s takes the "
                                                 "file's next tasks_per_step groups, cycling.")
    from_server: str | None = field_help(None, "Train on the groups that finish through `treerl serve` at this URL "
                                               "(e.g. http://127.0.0.1:8000), in order; each new weights version "
                                               "is published to it (with the token in $TREERL_SERVE_TOKEN).")
    server_timeout_s: float = field_help(600.0, "How long one step waits for the server's groups before failing.")

    # Options not written where the run's settings are recorded (config.json, the tracker's config).
    SECRETS: ClassVar[tuple[str, ...]] = ("hub_token",)

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("output_dir is required: where metrics, checkpoints and the model go "
                             "(--output-dir runs/x).")
        super().__post_init__()
        epochs = self.num_train_epochs
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, (int, float))
                                   or not 0 < epochs < float("inf")):
            raise ValueError(f"num_train_epochs={epochs!r} must be a number > 0: passes over the training dataset "
                             "(0.5: half of one), e.g. --num-train-epochs 1.")
        for name in ("steps", "tasks_per_step", "group_size", "branch_factor", "max_tokens_per_row", "ddp_timeout"):
            if getattr(self, name) < 1 and not (name == "steps" and self.steps == -1 and epochs is not None):
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.branch_factor > 1 and (self.branch_at_turn is None or self.branch_at_turn < 1):
            raise ValueError("branch_factor > 1 needs branch_at_turn K (K >= 1): the turn after which to fork.")
        if self.learning_rate is not None and self.learning_rate <= 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be > 0 (e.g. 2e-4).")
        self.optim = str(getattr(self.optim, "value", self.optim))  # transformers' OptimizerNames member too
        if self.optim not in OPTIMIZERS:
            raise ValueError(f"optim={self.optim!r} is not supported: the optimizer is torch's AdamW (optim "
                             "adamw_torch, or adamw_torch_fused: its fused kernel); another one is a torch optimizer "
                             "passed from Python: treerl.learners.train(cfg, optimizer=...) or "
                             "GRPOTrainer(optimizers=(optimizer, None)).")
        for name, usual in (("adam_beta1", 0.9), ("adam_beta2", 0.999)):
            value = getattr(self, name)
            if isinstance(value, bool) or not 0 <= value < 1:
                raise ValueError(f"{name}={value!r} must be in [0, 1): the decay rate of one of AdamW's averages "
                                 f"(TRL's default: {usual}).")
        if isinstance(self.adam_epsilon, bool) or not 0 < self.adam_epsilon < float("inf"):
            raise ValueError(f"adam_epsilon={self.adam_epsilon!r} must be > 0: it keeps AdamW's update finite where "
                             "the squared-gradient average is 0 (TRL's default: 1e-8).")
        if self.attention_impl != "auto" and self.attention_impl not in BACKENDS:
            raise ValueError(f"attention_impl={self.attention_impl!r} is not a tree-attention backend: use auto or one "
                             f"of {', '.join(sorted(BACKENDS))} (--attention-impl auto).")
        if isinstance(self.report_to, (list, tuple)):  # TRL's list: [] and ["none"] log nowhere else
            trackers = [t for t in self.report_to if t != "none"]
            if len(trackers) > 1:
                raise ValueError(f"report_to={list(self.report_to)!r}: treerl logs to one tracker; keep one of "
                                 "tensorboard, wandb or trackio.")
            self.report_to = trackers[0] if trackers else "none"
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r}: use one of {', '.join(LR_SCHEDULERS)} "
                             "(each after warmup_steps of linear warm-up).")
        if self.report_to not in REPORT_TO:
            raise ValueError(f"report_to={self.report_to!r}: use none, tensorboard, wandb or trackio.")
        if not isinstance(self.eval_env_kwargs, dict):
            raise ValueError(f"eval_env_kwargs={self.eval_env_kwargs!r} must be a mapping, e.g. --eval-env-kwargs "
                             "'{\"data_path\": \"test.jsonl\"}'.")
        self.check_reward_options()
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} must be in (0, 1], e.g. "
                             "0.3 leaves 70% of the GPU to training.")
        if self.use_vllm and (self.from_rollouts or self.from_server):
            raise ValueError("use_vllm samples the environment's episodes, but from_rollouts/from_server bring "
                             "their own groups; drop --use-vllm.")
        if self.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"vllm_mode={self.vllm_mode!r}: use colocate (an engine in this process) or server (a "
                             "`vllm serve` started separately), e.g. --vllm-mode server.")
        if self.vllm_mode == "server" and not self.use_vllm:
            raise ValueError("vllm_mode=server samples with vLLM, but use_vllm is off; add --use-vllm.")
        if not self.vllm_server_url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_url={self.vllm_server_url!r} must be an http(s) URL, e.g. "
                             "--vllm-server-url http://127.0.0.1:8000.")
        if self.vllm_weight_sync not in ("disk", "nccl"):
            raise ValueError(f"vllm_weight_sync={self.vllm_weight_sync!r}: use disk (a directory the server reads) "
                             "or nccl (GPU to GPU), e.g. --vllm-weight-sync disk.")
        if self.vllm_weight_sync == "nccl" and self.lora_r > 0:
            raise ValueError("vllm_weight_sync=nccl broadcasts the trainer's own parameters, which under LoRA are "
                             "adapter and base layers, not the checkpoint's; use --vllm-weight-sync disk (it sends "
                             "the adapter merged into the base weights).")
        if not self.vllm_server_timeout_s > 0:
            raise ValueError(f"vllm_server_timeout_s={self.vllm_server_timeout_s} must be > 0 (seconds).")
        if isinstance(self.vllm_server_wait_s, bool) or not 0 <= self.vllm_server_wait_s < float("inf"):
            raise ValueError(f"vllm_server_wait_s={self.vllm_server_wait_s!r} must be a number of seconds >= 0 (TRL's "
                             "vllm_server_timeout; 0 fails at once when no server answers).")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {', '.join(DTYPES)} (--dtype float32 keeps float32 "
                             "master weights; add --bf16 for bfloat16 compute).")
        if self.bf16 and self.fp16:
            raise ValueError("bf16 and fp16 are both set: autocast runs in one dtype; drop --bf16 or --fp16.")
        resolve_precision(self.dtype, self.bf16, self.fp16, "cpu")  # its own messages (float16 weights with fp16)
        coef = self.router_aux_loss_coef
        if coef is not None and (isinstance(coef, bool) or not 0 <= coef < float("inf")):
            raise ValueError(f"router_aux_loss_coef={coef!r} must be a finite number >= 0: the weight of a "
                             "Mixture-of-Experts router's load-balancing loss (0 turns it off; unset: the model "
                             "config's own, e.g. 0.001).")
        if self.lora_r < 0:
            raise ValueError(f"lora_r={self.lora_r} must be >= 0 (0 trains all weights).")
        if self.data_seed is not None and (isinstance(self.data_seed, bool) or not isinstance(self.data_seed, int)):
            raise ValueError(f"data_seed={self.data_seed!r} must be a whole number (the seed of the rows' order with "
                             "--shuffle-dataset), e.g. --data-seed 7; unset: --seed.")
        every = self.torch_empty_cache_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"torch_empty_cache_steps={every!r} must be a whole number > 0 (as transformers "
                             "requires): the optimizer steps between two emptyings of the accelerator's memory "
                             "cache, e.g. --torch-empty-cache-steps 10; leave it unset to never empty it.")
        seen = self.include_num_input_tokens_seen
        if isinstance(seen, bool) or seen in ("true", "false"):  # transformers' booleans ("true": a flag's text)
            seen = self.include_num_input_tokens_seen = "all" if seen in (True, "true") else "no"
        if seen not in INPUT_TOKEN_COUNTS:
            raise ValueError(f"include_num_input_tokens_seen={seen!r}: use no, all (every slot of the rows trained "
                             "on) or non_padding (their tokens), or true/false (all/no), as transformers, e.g. "
                             "--include-num-input-tokens-seen all.")
        if self.num_completions_to_print is not None and self.num_completions_to_print < 1:
            raise ValueError(f"num_completions_to_print={self.num_completions_to_print} must be >= 1 (unset: all).")
        if self.sample_groups < 0 or self.sample_every < 1:
            raise ValueError(f"sample_groups={self.sample_groups}, sample_every={self.sample_every}: keep >= 0 groups "
                             "every >= 1 steps (--sample-groups 0 keeps no trajectory samples).")
        if not isinstance(self.malformed_ends_episode, bool):
            raise ValueError(f"malformed_ends_episode={self.malformed_ends_episode!r} must be true or false "
                             "(--malformed-ends-episode false lets training episodes go on after an error message).")
        if isinstance(self.malformed_penalty, bool) or not 0 <= self.malformed_penalty < float("inf"):
            raise ValueError(f"malformed_penalty={self.malformed_penalty!r} must be a finite number >= 0 (the reward "
                             "a malformed call costs; 0 costs nothing), e.g. --malformed-penalty 0.1.")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ValueError(f"save_total_limit={self.save_total_limit} must be >= 1 (the latest checkpoint is what "
                             "--resume continues from); leave it unset to keep all.")
        if self.num_generations_eval is not None and (isinstance(self.num_generations_eval, bool)
                                                      or self.num_generations_eval < 1):
            raise ValueError(f"num_generations_eval={self.num_generations_eval!r} must be >= 1: the episodes each "
                             "evaluation task is played (unset: TRL's num_generations in GRPOTrainer, 1 in learn).")
        if not set(self.every_epoch) <= set(_EPOCH_STRATEGIES):
            raise ValueError(f"every_epoch={self.every_epoch!r}: name save_every and/or eval_every (what TRL's "
                             "save_strategy and eval_strategy 'epoch' set).")
        delay = self.eval_delay
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay < float("inf"):
            raise ValueError(f"eval_delay={delay!r} must be a number >= 0: the optimizer steps (epochs with "
                             "eval_strategy 'epoch') before eval_every's first evaluation, e.g. --eval-delay 100 "
                             "(0: from the first).")
        if self.eval_episodes < 0 or self.save_every < 0 or self.eval_every < 0:
            raise ValueError("eval_episodes, eval_every and save_every must be >= 0 (0 skips evaluation / "
                             "evaluation during training / intermediate checkpoints).")
        self._check_best_model_options()
        self.sampling(temperature=self.eval_temperature)
        self.packing_config()
        if self.from_rollouts and self.from_server:
            raise ValueError("from_rollouts and from_server are both set: a learner takes its groups from one "
                             "source; drop one of --from-rollouts / --from-server.")
        if self.from_server and not self.from_server.startswith(("http://", "https://")):
            raise ValueError(f"from_server={self.from_server!r} must be an http(s) URL, e.g. http://127.0.0.1:8000.")
        if not self.server_timeout_s > 0:
            raise ValueError(f"server_timeout_s={self.server_timeout_s} must be > 0 (seconds).")
        self._check_hub_options()

    def _check_best_model_options(self) -> None:
        """transformers' rules for the best model: ``metric_for_best_model`` defaults with
        ``load_best_model_at_end`` (to ``reward``: TRL's GRPO evaluation logs ``eval_reward``, and no ``eval_loss``,
        transformers' default), ``greater_is_better`` with the metric's name; saving or loading the best needs
        evaluations during training, and ``load_best_model_at_end`` a checkpoint at each one that may be best
        (TrainingArguments: save and eval strategies that match, save_steps a multiple of eval_steps, or
        save_strategy ``"best"``). Again once ``num_train_epochs`` sets what were fractions of the run."""
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "reward"
        metric = self.metric_for_best_model
        if metric is not None and (not isinstance(metric, str) or not metric.strip()):
            raise ValueError(f"metric_for_best_model={metric!r} must name an evaluation figure, e.g. reward (TRL's "
                             "eval_reward) or success_rate (treerl learn's eval/success_rate).")
        if self.greater_is_better is None and metric is not None:
            self.greater_is_better = not metric.endswith("loss")
        if self.save_on_best and metric is None:
            raise ValueError("save_strategy='best' saves after each evaluation that improves on metric_for_best_model, "
                             "which is unset: set metric_for_best_model (e.g. reward, TRL's eval_reward, or "
                             "success_rate), or load_best_model_at_end=True (whose default metric is reward).")
        if not (self.save_on_best or self.load_best_model_at_end):
            return
        named = "load_best_model_at_end" if self.load_best_model_at_end else "save_strategy='best'"
        by_epoch = "eval_every" in self.every_epoch, "save_every" in self.every_epoch
        pending = {"eval_steps", "save_steps"} & set(self.fractions_of_run)  # set with the run's length
        if not (self.eval_every or by_epoch[0] or "eval_steps" in pending):
            raise ValueError(f"{named} compares the evaluations during training, but there are none (eval_every=0, "
                             "TRL's eval_strategy='no'): evaluate every N steps (--eval-every N, or eval_strategy="
                             "'steps' with eval_steps=N) or at each epoch's end (eval_strategy='epoch').")
        if not self.load_best_model_at_end or self.save_on_best:
            return
        if by_epoch[0] != by_epoch[1]:
            raise ValueError("load_best_model_at_end needs a checkpoint at each evaluation that may be best, so the "
                             "save and eval strategies must match (transformers' rule): eval_strategy="
                             f"{'epoch' if by_epoch[0] else 'steps'} with save_strategy="
                             f"{'epoch' if by_epoch[1] else 'steps'}; make both 'epoch', or save_strategy='best'.")
        if not by_epoch[0] and not pending and (not self.save_every or self.save_every % self.eval_every):
            saves = (f"save_every={self.save_every} is not a multiple of eval_every={self.eval_every}"
                     if self.save_every else "save_every=0 (TRL's save_strategy='no') writes none during the run")
            raise ValueError(f"load_best_model_at_end needs a checkpoint at each evaluation that may be best, but "
                             f"{saves} (transformers' rule: save and eval strategies that match, save_steps a "
                             f"multiple of eval_steps); save every {self.eval_every} steps (or a multiple: "
                             "--save-every, TRL's save_steps), or save_strategy='best'.")

    def _check_hub_options(self) -> None:
        if self.hub_strategy in ("checkpoint", "all_checkpoints"):
            raise ValueError(f"hub_strategy={self.hub_strategy!r}: checkpoints here are the trainer's resume state "
                             "(weights as it holds them, optimizer, random generators), not a model to load, and "
                             "stay in output_dir/checkpoints for --resume; use every_save (the model pushed at each "
                             "checkpoint and at the end) or end.")
        if self.hub_strategy not in HUB_STRATEGIES:
            raise ValueError(f"hub_strategy={self.hub_strategy!r}: use every_save (the model pushed at each "
                             "checkpoint and at the end) or end (at the end only).")
        if self.push_to_hub or self.hub_model_id is not None:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(self.hub_repo_id())
            except HFValidationError as exc:
                source = "hub_model_id" if self.hub_model_id is not None else "the output directory's name"
                raise ValueError(f"{source} {self.hub_repo_id()!r} is not a Hub repository name: {exc} Give "
                                 "--hub-model-id USER/NAME.") from None

    def hub_repo_id(self) -> str:
        """The Hub repository the model is pushed to: ``hub_model_id``, or the output directory's name (under
        the token's user), as transformers names it.

        >>> LearnerConfig(output_dir="runs/calc-grpo").hub_repo_id()
        'calc-grpo'
        """
        return self.hub_model_id or Path(self.output_dir).absolute().name

    def recorded(self) -> dict[str, Any]:
        """The options as config.json and the tracker record them: all but :attr:`SECRETS`."""
        return {k: v for k, v in asdict(self).items() if k not in self.SECRETS}

    @classmethod
    def option_hints(cls) -> dict[str, str]:
        """What to use instead of a name that is not an option of this config, in Python, on the command line
        and in --config files: :attr:`UNSUPPORTED`'s hints, and another learner's option (``max_staleness`` is
        AsyncGRPO's), naming the learners that have it."""
        own = {f.name for f in fields(cls)}
        where = next((f"--learner {name}" for name, config in LEARNER_CONFIGS.items() if config is cls), cls.__name__)
        owners: dict[str, list[str]] = {}
        for name, config in sorted(LEARNER_CONFIGS.items()):
            for f in fields(config):
                if f.init and f.name not in own:
                    owners.setdefault(f.name, []).append(name)
        others = {option: f"an option of treerl learn {' or '.join(f'--learner {n}' for n in names)}, not of {where}"
                  for option, names in owners.items()}
        return {**cls.UNSUPPORTED, **others}

    def optimizer_steps_per_step(self) -> int:
        """Optimizer steps a step takes (TRL's ``max_steps`` counts these): 1 here; GRPO's config says more."""
        return 1

    @classmethod
    def translate_options(cls, given: dict[str, Any]) -> dict[str, Any]:
        """``given`` (keyword arguments, aliases resolved) with TRL's options of :attr:`TRANSLATED` turned into
        fields: its batch sizes into ``tasks_per_step`` and ``num_minibatches`` (:meth:`_translate_batch_sizes`),
        its optimizer-step counts into steps; the options that change nothing here dropped with a note; the others
        refused with what to do instead.

        >>> LearnerConfig.translate_options({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4})
        {'tasks_per_step': 2}
        >>> LearnerConfig.translate_options({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        ...                                  "steps_per_generation": 4, "group_size": 4})
        {'group_size': 4, 'tasks_per_step': 4, 'num_minibatches': 2}
        """
        values = cls._translate_batch_sizes(dict(given))
        # TRL's optimizer steps; a step here (one generation, as TRL's generation every num_iterations x
        # steps_per_generation / gradient_accumulation_steps optimizer steps) takes this many of them.
        iterations = values.get("num_iterations", 1)
        minibatches = values.get("num_minibatches", 1)
        per_step = f"num_iterations={iterations}"
        if isinstance(iterations, int) and isinstance(minibatches, int) and minibatches > 1:
            per_step = (f"num_iterations={iterations} x num_minibatches={minibatches}" if iterations > 1
                        else f"num_minibatches={minibatches}")
            iterations *= minibatches
        cls._translate_eval_strategy(values)
        cls._translate_save_strategy(values)
        cls._translate_epochs(values)
        cls._translate_trainer_options(values)
        eval_steps_unset = "eval_steps" in values and "eval_steps" not in given  # logging_steps', as TRL's
        for trl_name, name in (("max_steps", "steps"), ("save_steps", "save_every"), ("eval_steps", "eval_every")):
            if trl_name not in values:
                continue
            if name in values:
                raise TypeError(f"{cls.__name__}(): {trl_name} and {name} name the same option; keep one.")
            value = given_as = values.pop(trl_name)
            named = (f"eval_steps (unset, so logging_steps={value}, as in TRL)"
                     if trl_name == "eval_steps" and eval_steps_unset else f"{trl_name}={value}")
            if trl_name in ("save_steps", "eval_steps") and isinstance(value, float) and 0 < value < 1:
                # TRL's fraction of the run's optimizer steps, rounded up (as transformers' Trainer does)
                steps = values.get("steps", cls.__dataclass_fields__["steps"].default)
                if steps == -1:  # num_train_epochs': the run's length is known with the rows (resolve_steps)
                    values["fractions_of_run"] = {**values.get("fractions_of_run", {}), trl_name: value}
                    continue
                if isinstance(steps, int) and isinstance(iterations, int):
                    value = _fraction_of_run(named, trl_name, value, steps, iterations, per_step)
            if isinstance(value, float) and not isinstance(value, bool):
                if not value.is_integer():
                    raise ValueError(f"{named}: a whole number of optimizer steps"
                                     f"{', or a fraction < 1 of the run (TRL)' if trl_name != 'max_steps' else ''}.")
                value = int(value)
            if isinstance(iterations, int) and iterations > 1 and isinstance(value, int) and value > 0:
                if value % iterations:
                    raise ValueError(f"{named} counts optimizer steps (TRL's), and {per_step} of them per "
                                     f"step here: give a multiple of {iterations}, or "
                                     f"{name}={-(-value // iterations)} in steps.")
                value //= iterations
            values[name] = value
        if values.get("top_k") == 0 and not isinstance(values["top_k"], bool):
            values["top_k"] = None  # TRL's and vLLM's 0: no top-k, the whole vocabulary (treerl's None)
        warmup = values.get("warmup_steps")
        if isinstance(warmup, float) and 0 < warmup < 1:  # transformers 5's (TRL 1.16's) warmup_ratio
            if "warmup_ratio" in values:
                raise TypeError(f"{cls.__name__}(): warmup_ratio and warmup_steps set the same thing; keep one.")
            values["warmup_ratio"] = values.pop("warmup_steps")
        elif isinstance(warmup, float) and warmup >= 1:  # whole steps, as get_warmup_steps truncates them
            values["warmup_steps"] = int(warmup)
        if "warmup_ratio" in values:
            ratio = values.pop("warmup_ratio")
            if "warmup_steps" in values:
                raise TypeError(f"{cls.__name__}(): warmup_ratio and warmup_steps set the same thing; keep one.")
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
                raise ValueError(f"warmup_ratio={ratio!r} must be a fraction of the run, between 0 and 1.")
            steps = values.get("steps", cls.__dataclass_fields__["steps"].default)
            if steps == -1:  # num_train_epochs': the run's length is known with the rows (resolve_steps)
                values["fractions_of_run"] = {**values.get("fractions_of_run", {}), "warmup_ratio": ratio}
            elif isinstance(steps, int) and isinstance(iterations, int):  # else the fields' checks say what is wrong
                values["warmup_steps"] = math.ceil(steps * iterations * ratio)  # as transformers' get_warmup_steps
        ignored = {k: values.pop(k) for k in ("logging_steps", "logging_first_step", "logging_strategy") if k in values}
        for name, value in ignored.items():
            warnings.warn(f"{name}={value!r} changes nothing here: every step is logged (metrics.jsonl, and "
                          "--report-to).", stacklevel=3)
        if "max_tool_calling_iterations" in values:  # N rounds of tools, each then a turn: N + 1 assistant turns
            rounds = values.pop("max_tool_calling_iterations")
            if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
                raise ValueError(f"max_tool_calling_iterations={rounds!r} must be a whole number >= 0.")
            env_kwargs = values.get("env_kwargs", {})
            env = values.get("env", cls.__dataclass_fields__["env"].default)
            if isinstance(env_kwargs, Mapping):
                # A group's keyword arguments are keyed by member: each member gets the limit.
                members = [n for n, _ in group_members(env)] if isinstance(env, str) and "," in env else [None]
                for name in members:
                    own = env_kwargs if name is None else env_kwargs.get(name) or {}
                    if not isinstance(own, Mapping):
                        continue  # the group says what is wrong with it
                    if own.get("max_turns", rounds + 1) != rounds + 1:
                        where = "env_kwargs'" if name is None else f"env_kwargs[{name!r}]'s"
                        raise TypeError(f"{cls.__name__}(): max_tool_calling_iterations={rounds} (max_turns="
                                        f"{rounds + 1}) and {where} max_turns={own['max_turns']} set the same limit; "
                                        "keep one.")
                    own = {**own, "max_turns": rounds + 1}
                    env_kwargs = own if name is None else {**env_kwargs, name: own}
                values["env_kwargs"] = env_kwargs
        if "remove_unused_columns" in values:
            if values.pop("remove_unused_columns") is not False:
                raise TypeError(f"{cls.__name__}(): remove_unused_columns=True: "
                                f"{cls.UNSUPPORTED['remove_unused_columns']}.")
        return values

    @classmethod
    def _translate_batch_sizes(cls, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` with TRL's batch sizes turned into ``tasks_per_step`` and ``num_minibatches``, as TRL 1.16's
        GRPOConfig derives its generation: ``generation_batch_size = per_device_train_batch_size x processes x
        steps_per_generation`` completions (``steps_per_generation`` defaults to ``gradient_accumulation_steps``,
        or follows ``generation_batch_size``), ``num_generations`` of each prompt; an optimizer step every
        ``gradient_accumulation_steps`` micro-batches of it. A step here is one generation: ``tasks_per_step =
        generation_batch_size / group_size``, split into ``num_minibatches = steps_per_generation /
        gradient_accumulation_steps`` optimizer steps (TRL's options at their defaults: one)."""
        batch = {k: values.pop(k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                            "steps_per_generation", "generation_batch_size") if k in values}
        if not batch:
            return values
        if "tasks_per_step" in values:
            raise TypeError(f"{cls.__name__}(): {' and '.join(batch)} and tasks_per_step set the same thing; keep one.")
        for name, value in batch.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a whole number >= 1.")
        if "steps_per_generation" in batch and "generation_batch_size" in batch:  # TRL's own rule
            raise ValueError("generation_batch_size and steps_per_generation set the same thing (TRL's generation); "
                             "keep one.")
        if "num_minibatches" in values and {"steps_per_generation", "generation_batch_size"} & set(batch):
            raise TypeError(f"{cls.__name__}(): {' and '.join(k for k in batch if 'generation' in k)} and "
                            "num_minibatches set the same thing; keep one.")
        per_device = batch.get("per_device_train_batch_size", 8)  # TRL's defaults
        accumulation = batch.get("gradient_accumulation_steps", 1)
        processes = int(os.environ.get("WORLD_SIZE", "1"))  # accelerate launch / torchrun, as TRL's world_size
        group_size = values.get("group_size", cls.__dataclass_fields__["group_size"].default)
        if "generation_batch_size" in batch:
            if batch["generation_batch_size"] % (per_device * processes):
                raise ValueError(f"generation_batch_size={batch['generation_batch_size']} must be divisible by "
                                 f"per_device_train_batch_size x processes = {per_device} x {processes} (TRL's rule: "
                                 "whole micro-batches per process).")
            generations = batch["generation_batch_size"] // (per_device * processes)
        else:
            generations = batch.get("steps_per_generation", accumulation)
        if generations % accumulation:
            named = (f"generation_batch_size={batch['generation_batch_size']} (steps_per_generation={generations})"
                     if "generation_batch_size" in batch else f"steps_per_generation={generations}")
            raise ValueError(f"{named} is not a multiple of gradient_accumulation_steps="
                             f"{accumulation}: TRL would take an optimizer step on the completions of two generations; "
                             "here each optimizer step takes its completions from one: give steps_per_generation "
                             f"a multiple of {accumulation} (num_minibatches = steps_per_generation / "
                             "gradient_accumulation_steps).")
        completions = per_device * processes * generations
        if not isinstance(group_size, int) or group_size < 1 or completions % group_size:
            raise ValueError(f"per_device_train_batch_size x steps_per_generation x processes = {per_device} x "
                             f"{generations} x {processes} = {completions} completions per generation must be "
                             f"divisible by num_generations={group_size} (TRL's rule: whole groups), e.g. "
                             f"per_device_train_batch_size={group_size}.")
        values["tasks_per_step"] = completions // group_size
        if {"steps_per_generation", "generation_batch_size"} & set(batch):
            values["num_minibatches"] = generations // accumulation
        return values

    def engine(self, policy: Any, tokenizer: Any, **kwargs: Any) -> Any:
        """The training episodes' :class:`~treerl.rollout.engine.RolloutEngine`: the episode options', with a
        dataset's rows shuffled each pass where ``shuffle_dataset`` says so (seeded with ``data_seed``, else
        ``seed``), a pass playing whole steps of ``tasks_per_step`` rows (TRL's sampler leaves a pass's short last
        batch out)."""
        data_seed = self.seed if self.data_seed is None else self.data_seed  # transformers' default: seed
        engine = super().engine(policy, tokenizer, shuffle_seed=data_seed if self.shuffle_dataset else None, **kwargs)
        engine.shuffle_batch_size = self.tasks_per_step
        return engine

    @classmethod
    def _translate_epochs(cls, values: dict[str, Any]) -> None:
        """TRL's run length in ``values``, in place: ``num_train_epochs`` beside ``max_steps`` (or ``steps``) is
        dropped with a note, as TRL follows ``max_steps``; without them, or beside TRL's ``max_steps=-1`` (alone:
        TRL's default, 3 epochs), it stays, with ``steps=-1`` until the rows are known (:meth:`resolve_steps`)."""
        epochs = values.pop("num_train_epochs", None)
        length = values.get("max_steps", values.get("steps"))  # None: not given
        if epochs is not None and length not in (None, -1):
            warnings.warn(f"num_train_epochs={epochs!r} changes nothing beside max_steps, as in TRL.", stacklevel=4)
        elif epochs is not None or length == -1:
            values["num_train_epochs"] = 3.0 if epochs is None else epochs  # TRL's default
            if length is None:
                values["steps"] = -1

    def steps_per_epoch(self, rows: int) -> float:
        """Steps of one pass over a dataset of ``rows`` rows, as TRL counts them: whole steps of
        ``tasks_per_step`` rows (TRL's sampler leaves a pass's short last batch out), 0 when ``rows`` are
        fewer than one step's. TRL's ``epoch`` after step ``s`` is ``s`` over this."""
        return rows // self.tasks_per_step

    def steps_for_epochs(self, rows: int) -> int:
        """The steps of ``num_train_epochs`` passes over ``rows`` rows: TRL's ``max_steps``, ``ceil(E x
        num_update_steps_per_epoch)`` optimizer steps (transformers' ``set_initial_training_values``, with GRPO's
        ``floor(rows / P) x num_iterations`` updates an epoch), in steps of :meth:`optimizer_steps_per_step`,
        rounded up.

        >>> cfg = LearnerConfig(output_dir="x", num_train_epochs=1, tasks_per_step=4)
        >>> cfg.steps_for_epochs(10), cfg.steps_for_epochs(12)  # 10 rows: 2 whole steps, 2 rows left out
        (2, 3)
        """
        per_step, per_epoch = self.optimizer_steps_per_step(), int(self.steps_per_epoch(rows))
        if per_epoch == 0:  # TRL's dataloader is empty then, and its Trainer refuses max_steps=-1
            raise ConfigError(f"num_train_epochs={self.num_train_epochs:g}: the dataset has {rows} row(s), fewer than "
                              f"a step's tasks_per_step={self.tasks_per_step}, so an epoch has no step (TRL's sampler "
                              "plays whole batches only): add rows, lower tasks_per_step (TRL's "
                              "per_device_train_batch_size), or give the run's length with --steps (--max-steps).")
        optimizer_steps = math.ceil(self.num_train_epochs * (per_epoch * per_step))  # TRL's max_steps, as it computes
        return -(-optimizer_steps // per_step)

    def resolve_steps(self, rows: int | None,
                      where: str = "the environment generates its tasks (no data_path or dataset)") -> str:
        """Set ``steps`` from ``num_train_epochs`` and the training dataset's ``rows`` (:meth:`steps_for_epochs`),
        and the options given as fractions of the run (``fractions_of_run``) from them, as TRL's Trainer sets
        ``max_steps`` when training starts; the config then reads as one given its steps (``num_train_epochs``
        None, so config.json and a resumed run see the steps). ``rows`` None is refused, ``where`` saying why
        there are none. Returns a line that says how many steps, for the run to print."""
        epochs, per_step = self.num_train_epochs, self.optimizer_steps_per_step()
        if rows is None:
            raise ConfigError(f"num_train_epochs={epochs:g} counts passes over a training dataset, but {where}: "
                              "give the run's length in steps, --steps N (TRL's --max-steps, optimizer steps), or "
                              "train on rows (--env-kwargs '{\"data_path\": \"train.jsonl\"}').")
        self.steps = self.steps_for_epochs(rows)
        fractions = self.fractions_of_run
        if "warmup_ratio" in fractions:
            self.warmup_steps = math.ceil(self.steps * per_step * fractions["warmup_ratio"])
        for trl_name, name in (("save_steps", "save_every"), ("eval_steps", "eval_every")):
            if trl_name in fractions:
                fraction = fractions[trl_name]
                setattr(self, name, _fraction_of_run(f"{trl_name}={fraction}", trl_name, fraction, self.steps,
                                                     per_step) // per_step)
        self.num_train_epochs, self.fractions_of_run = None, {}
        self._check_best_model_options()  # save_every and eval_every are known now
        optimizer_steps = "" if per_step == 1 else f", {self.steps * per_step} optimizer steps"
        return (f"num_train_epochs={epochs:g}: {self.steps} steps{optimizer_steps} ({rows} rows, "
                f"{self.tasks_per_step} tasks a step)")

    @classmethod
    def _translate_trainer_options(cls, values: dict[str, Any]) -> None:
        """transformers' and TRL's names of what a field sets here, in ``values``, in place (their values that
        change nothing were dropped as :attr:`NEUTRAL` already): ``activation_checkpointing`` as
        ``gradient_checkpointing``, ``use_cpu`` and ``disable_tqdm`` as ``device`` and ``progress``, ``resume_from_checkpoint`` as ``resume``, the vLLM server's host and port as
        ``vllm_server_url``, and the colocated engine's options as ``vllm_kwargs``."""
        settings: dict[str, Any] = {}  # field: (TRL's name, the value it sets)
        if "activation_checkpointing" in values:  # beside gradient_checkpointing at one value, as transformers dumps
            settings["gradient_checkpointing"] = ("activation_checkpointing", values.pop("activation_checkpointing"))
        if values.pop("use_cpu", False):  # transformers' default False: the device as --device says
            settings["device"] = ("use_cpu", "cpu")
        if "disable_tqdm" in values:
            settings["progress"] = ("disable_tqdm", not values.pop("disable_tqdm"))
        if "resume_from_checkpoint" in values:
            settings["resume"] = ("resume_from_checkpoint",
                                  cls._resumes_from(values.pop("resume_from_checkpoint"), values.get("output_dir")))
        host, port = values.pop("vllm_server_host", None), values.pop("vllm_server_port", None)
        if (host is not None or port is not None) and "vllm_server_url" not in values:  # TRL: the base URL wins
            settings["vllm_server_url"] = ("vllm_server_host/port", f"http://{host or '0.0.0.0'}:{port or 8000}")
        for name, value in settings.items():
            if name in values and values[name] != value[1]:
                raise TypeError(f"{cls.__name__}(): {value[0]} and {name} set the same thing; keep one.")
            values[name] = value[1]
        engine = {key: values.pop(name) for name, key in (("vllm_max_model_length", "max_model_len"),
                                                          ("vllm_model_impl", "model_impl")) if name in values}
        if engine:
            given = values.get("vllm_kwargs") or {}
            if both := sorted(k for k in engine if k in given and given[k] != engine[k]):
                raise TypeError(f"{cls.__name__}(): TRL's vllm options and vllm_kwargs' {', '.join(both)} set the "
                                "same thing; keep one.")
            values["vllm_kwargs"] = {**given, **engine}

    @staticmethod
    def _resumes_from(checkpoint: Any, output_dir: Any) -> bool:
        """TRL's ``resume_from_checkpoint`` as ``resume``: true (or false), or a checkpoint's path, which must be
        ``output_dir``'s latest, the one a run here resumes from."""
        if isinstance(checkpoint, bool):
            return checkpoint
        latest = latest_checkpoint(Path(output_dir)) if isinstance(output_dir, str) else None
        if latest is None or Path(str(checkpoint)).resolve() != latest.resolve():
            raise ValueError(f"resume_from_checkpoint={checkpoint!r}: a run resumes from the latest checkpoint in "
                             f"its output_dir ({latest or 'none yet'}); pass resume_from_checkpoint=True (--resume), "
                             "or that checkpoint's run directory as output_dir.")
        return True

    @property
    def resume_from_checkpoint(self) -> bool | None:
        """TRL's (transformers') name, for scripts that read it (open-r1's ``trainer.train(resume_from_checkpoint=
        training_args.resume_from_checkpoint)``): True when the run resumes, else None."""
        return True if self.resume else None

    @classmethod
    def _translate_eval_strategy(cls, values: dict[str, Any]) -> None:
        """TRL's evaluation options in ``values``, in place: ``eval_strategy="steps"`` keeps ``eval_steps`` (default:
        ``logging_steps``, as transformers' Trainer) for :meth:`translate_options` to turn into ``eval_every``;
        ``"no"`` and ``"epoch"`` (an evaluation at each epoch's end, :attr:`every_epoch`) drop it, as TRL ignores it
        then; ``per_device_eval_batch_size`` changes nothing."""
        if "eval_steps" in values and values["eval_steps"] is None:  # TRL's default: logging_steps decides
            del values["eval_steps"]
        if values.get("per_device_eval_batch_size", 8) != 8:  # TRL's default is said nothing about
            warnings.warn(f"per_device_eval_batch_size={values['per_device_eval_batch_size']!r} changes nothing here: "
                          "the held-out episodes play --max-concurrency at a time.", stacklevel=4)
        values.pop("per_device_eval_batch_size", None)
        if "eval_strategy" not in values:
            if "eval_steps" in values:
                warnings.warn(f"eval_steps={values.pop('eval_steps')!r} changes nothing without eval_strategy='steps' "
                              "(TRL's default is 'no'), as in TRL.", stacklevel=4)
            return
        strategy = values.pop("eval_strategy")
        strategy = getattr(strategy, "value", strategy)  # transformers' IntervalStrategy
        if "eval_every" in values:
            raise TypeError(f"{cls.__name__}(): eval_strategy and eval_every set the same thing; keep one.")
        if strategy == "steps":
            values.setdefault("eval_steps", values.get("logging_steps", 10))  # GRPOConfig's logging_steps: 10
        elif strategy in ("epoch", "no"):
            values.pop("eval_steps", None)  # as TRL ignores it
            if strategy == "epoch":  # set when the rows are known (resolve_every_epoch)
                values["every_epoch"] = sorted({*values.get("every_epoch", ()), "eval_every"})
        else:
            raise ValueError(f"eval_strategy={strategy!r}: use steps (with eval_steps=N), epoch or no.")

    @classmethod
    def _translate_save_strategy(cls, values: dict[str, Any]) -> None:
        """TRL's ``save_strategy`` in ``values``, in place: ``"steps"`` (its default) leaves ``save_steps`` to
        :meth:`translate_options`; ``"no"`` is ``save_every=0``, ``"epoch"`` a checkpoint at each epoch's end
        (:attr:`every_epoch`), ``"best"`` one after each evaluation that improves on ``metric_for_best_model``
        (``save_on_best``), each dropping ``save_steps`` as transformers' Trainer ignores it then."""
        if "save_strategy" not in values:
            return
        strategy = values.pop("save_strategy")
        strategy = getattr(strategy, "value", strategy)  # transformers' SaveStrategy
        if strategy not in ("steps", "epoch", "no", "best"):
            raise ValueError(f"save_strategy={strategy!r}: use steps (with save_steps=N), epoch, best (with "
                             "metric_for_best_model) or no.")
        if strategy == "steps":
            return
        if "save_every" in values:
            raise TypeError(f"{cls.__name__}(): save_strategy={strategy!r} and save_every set the same thing; keep "
                            "one.")
        values.pop("save_steps", None)  # as TRL ignores it
        if strategy in ("no", "best"):
            values["save_every"] = 0
            if strategy == "best":
                values["save_on_best"] = True
        else:  # set when the rows are known (resolve_every_epoch)
            values["every_epoch"] = sorted({*values.get("every_epoch", ()), "save_every"})

    def evaluates_after(self, step: int) -> bool:
        """Whether ``eval_every`` evaluates after step ``step`` (from 1): every ``eval_every`` steps and at the run's
        last (where transformers' Trainer evaluates at the end of training, or of its last epoch), once
        ``eval_delay`` has passed (transformers' ``eval_delay <= global_step``, or ``<= epoch`` with
        ``eval_strategy`` "epoch": here ``step`` x :meth:`optimizer_steps_per_step`, or ``step / eval_every``, the
        steps of an epoch).

        >>> cfg = LearnerConfig(output_dir="x", steps=7, eval_every=2, eval_delay=3)
        >>> [step for step in range(1, 8) if cfg.evaluates_after(step)]
        [4, 6, 7]
        """
        if not self.eval_every or (step % self.eval_every and step != self.steps):
            return False
        done = step / self.eval_every if "eval_every" in self.every_epoch else step * self.optimizer_steps_per_step()
        return self.eval_delay <= done

    def epoch_interval(self, rows: int | None, where: str) -> int:
        """The steps between the ends of epochs, where TRL's save_strategy and eval_strategy ``"epoch"`` save and
        evaluate (transformers' ``DefaultFlowCallback.on_epoch_end``): :meth:`steps_per_epoch` of the training
        ``rows``, whole steps (GRPO's epoch is ``floor(rows / tasks_per_step)`` generations). ``rows`` None is
        refused, ``where`` saying why there are none.

        >>> LearnerConfig(output_dir="x", tasks_per_step=2).epoch_interval(7, "")
        3
        """
        named = " and ".join(f"{_EPOCH_STRATEGIES[name]}='epoch'" for name in self.every_epoch) or "epoch"
        if rows is None:
            raise ConfigError(f"{named} acts at the end of each pass over a training dataset, but {where}: save or "
                              "evaluate every N optimizer steps instead (save_strategy='steps' with save_steps=N, "
                              "eval_strategy='steps' with eval_steps=N), or train on rows (--env-kwargs "
                              "'{\"data_path\": \"train.jsonl\"}').")
        per_epoch = int(self.steps_per_epoch(rows))
        if per_epoch == 0:
            raise ConfigError(f"{named}: the dataset has {rows} row(s), fewer than a step's tasks_per_step="
                              f"{self.tasks_per_step}, so an epoch has no step (TRL's sampler plays whole batches "
                              "only): add rows, or lower tasks_per_step (TRL's per_device_train_batch_size).")
        return per_epoch

    def resolve_every_epoch(self, rows: int | None,
                            where: str = "the environment generates its tasks (no data_path or dataset)") -> str:
        """The fields of :attr:`every_epoch` set to :meth:`epoch_interval`, as the rows are known when the run
        starts (after :meth:`resolve_steps`); again on a config already resolved, with the same result. Returns
        a line that says when, for the run to print."""
        every = self.epoch_interval(rows, where)
        for name in self.every_epoch:
            setattr(self, name, every)
        named = " and ".join(f"{_EPOCH_STRATEGIES[name]}='epoch'" for name in self.every_epoch)
        return f"{named}: every {every} steps (an epoch) and at the run's end"

    def train_env_factory(self, env_factory: Callable[[], Any] | None = None) -> Callable[[], Any]:
        """The training episodes' environments: ``env_factory`` (default: ``make(env, **env_kwargs)``) with
        :attr:`malformed_ends_episode` and :attr:`malformed_penalty` set on those that are
        :class:`~treerl.envs.core.ToolEnv` instances, each unless ``env_kwargs`` sets it."""
        env_factory = env_factory or self.env_factory()
        settings = {k: getattr(self, k) for k in ("malformed_ends_episode", "malformed_penalty")
                    if k not in self.env_kwargs}
        return functools.partial(_on_malformed, env_factory, settings) if settings else env_factory

    def held_out_env_kwargs(self) -> dict[str, Any]:
        """The held-out evaluation's environment keyword arguments: ``env_kwargs`` updated with
        ``eval_env_kwargs``; a group's environment gets its own updated likewise, so that
        ``{"math": {"data_path": "test.jsonl"}}`` keeps math's other training arguments."""
        merged = {**self.env_kwargs, **self.eval_env_kwargs}
        for name in self._member_names():
            train, held = self.env_kwargs.get(name), self.eval_env_kwargs.get(name)
            if isinstance(train, Mapping) and isinstance(held, Mapping):
                merged[name] = {**train, **held}
        return merged

    def eval_reads_training_data(self) -> list[str]:
        """The training data the held-out evaluation would draw its tasks from: ``data_path``/``dataset``
        keyword arguments (``NAME.data_path`` for a group's environment) it keeps from training."""
        held = self.held_out_env_kwargs()
        scopes = [("", self.env_kwargs, held)]  # (label prefix, training's kwargs, the evaluation's)
        for name in self._member_names():
            train, kept = self.env_kwargs.get(name), held.get(name)
            if isinstance(train, Mapping) and isinstance(kept, Mapping):
                scopes.append((f"{name}.", train, kept))
        # A path compares by value; rows by identity (comparing a whole dataset could take long).
        return [prefix + key for prefix, train, kept in scopes for key in ("data_path", "dataset")
                if key in train and (kept.get(key) is train[key] or key == "data_path" and kept.get(key) == train[key])]

    def _member_names(self) -> list[str]:
        """The names of a group's environments (``--env a=...,b=...``); none for one environment."""
        return [name for name, _ in group_members(self.env)] if "," in self.env else []

    def eval_env_factory(self) -> Any:
        """The held-out evaluation's environment factory: ``make(env, **held_out_env_kwargs())``."""
        return EpisodeOptions(env=self.env, env_kwargs=self.held_out_env_kwargs()).env_factory()

    def group_source(self) -> Any:
        """The :class:`~treerl.rollout.sources.GroupSource` named by ``from_rollouts`` or ``from_server``, or None."""
        if self.from_rollouts:
            from treerl.rollout.sources import FileSource

            return FileSource(self.from_rollouts)
        if self.from_server:
            from treerl.serve.client import ServerSource

            # The token comes from the environment, never from the config (which is saved with the run).
            source = ServerSource(self.from_server, token=os.environ.get("TREERL_SERVE_TOKEN") or None,
                                  timeout_s=self.server_timeout_s)
            source.check()  # an unreachable URL is said now, in one line, not at the first step
            return source
        return None

    def packing_config(self) -> PackingConfig:
        return PackingConfig(max_tokens_per_row=self.max_tokens_per_row, mode=self.pack_mode)


_EPOCH_STRATEGIES = {"save_every": "save_strategy", "eval_every": "eval_strategy"}
"""The fields of :attr:`LearnerConfig.every_epoch`, each with the TRL option that sets it."""


def _fraction_of_run(named: str, trl_name: str, fraction: float, steps: int, per_step: int,
                     per_step_named: str = "") -> int:
    """TRL's ``fraction`` (below 1) of a run of ``steps`` steps, in optimizer steps, rounded up (as transformers'
    Trainer does): whole steps here, a multiple of ``per_step`` (:meth:`LearnerConfig.optimizer_steps_per_step`;
    ``per_step_named``: the options that make it, for the message)."""
    value = math.ceil(steps * per_step * fraction)
    if per_step > 1 and value % per_step:
        raise ValueError(f"{named} is {value} optimizer step(s) of max_steps={steps * per_step}, not a multiple of "
                         f"{per_step_named or per_step} (the optimizer steps of a step here): give {trl_name} in "
                         f"optimizer steps, a multiple of {per_step}.")
    return value


def _on_malformed(env_factory: Callable[[], Any], settings: dict[str, Any]) -> Any:
    """``env_factory()`` with ``settings`` (how malformed calls are treated) when it is a ToolEnv, or on an
    EnvGroup's ToolEnv members (a module-level function, so that the factory pickles for AsyncGRPO's
    generator processes)."""
    env = env_factory()
    # An EnvGroup's members each, unless the member's own keyword arguments set it.
    members = ([(m, env.member_kwargs[n]) for n, m in env.envs.items()] if isinstance(env, EnvGroup)
               else [(env, {})])
    for member, own in members:
        if isinstance(member, ToolEnv):
            for key, value in settings.items():
                if key not in own:
                    setattr(member, key, value)
    return env
