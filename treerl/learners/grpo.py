"""The GRPO learner: rollout trees -> rewards -> advantages -> tree packing -> loss -> step -> sync.

:func:`train` reads top to bottom, one stage per function::

    for step in range(start, cfg.steps):
        groups      = rollout(...)              # the engine, G generations per task
        rewards     = score(groups, ...)        # environment reward + TRL-style reward functions
        adv         = advantages(...)           # group baseline, scaled
        batches     = pack_groups(...)          # each unique token once, rows by attention work
        loss, stats = optimize(...)             # forward with tree attention, loss, backward, step
        policy.set_weights(...)                 # the sampler gets the new weights and version
        log(...); diagnose(...); checkpoint(...)

The policy that samples holds its own copy of the weights (generation runs the model with
ordinary attention, training with tree attention) and receives them after every step with a
new version. With ``lora_r > 0`` the trainer trains a peft LoRA adapter and the policy
receives the merged weights.

Under ``accelerate launch`` (or ``torchrun``) each process plays every ``R``-th task of the
step, the loss normalizers and the gradients are summed over the ``R`` processes, and every
process takes the single-process optimizer step; rank 0 logs, checkpoints, saves and
evaluates (:mod:`treerl.learners.distributed`)::

    accelerate launch --multi_gpu --num_processes 2 -m treerl.cli learn --env ID --output-dir runs/x
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from treerl.config import SamplingOptions, field_help
from treerl.learners.advantages import AdvantageConfig, compute_advantages
from treerl.learners.diagnostics import Diagnostics
from treerl.learners.distributed import Ranks, is_main_process
from treerl.learners.forward import loss_inputs, packed_logprobs
from treerl.learners.importance import ImportanceConfig, importance_weights
from treerl.learners.losses import POLICY_LOSSES, LossConfig, compute_loss
from treerl.learners.packing import PackingConfig, pack_groups, packing_metrics
from treerl.rollout.trajectory import Group

__all__ = ["GRPOConfig", "TrainResult", "train", "RewardFunc"]

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., Sequence[float | None]]
"""TRL's signature: ``f(prompts, completions, completion_ids, **kwargs) -> list[float | None]``."""


@dataclass
class GRPOConfig(SamplingOptions):
    """Options of ``treerl learn`` (GRPO and its loss variants on trajectory trees)."""

    env: str = field_help("treerl/Calculator-v0", "Registered environment id (see `treerl envs`).")
    output_dir: str | None = field_help(None, "Where metrics, checkpoints and the final model go (required).")
    model: str | None = field_help(None, "A local transformers model directory; default: the shipped tiny model.")
    steps: int = field_help(60, "Optimizer steps.")
    tasks_per_step: int = field_help(8, "Tasks per step; each is played group_size times.")
    group_size: int = field_help(8, "Generations per task (GRPO's group).")
    learning_rate: float = field_help(2e-4, "AdamW learning rate.")
    weight_decay: float = field_help(0.0, "AdamW weight decay.")
    warmup_steps: int = field_help(0, "Linear warm-up steps, then constant.")
    max_grad_norm: float = field_help(1.0, "Gradient clipping norm (0 disables).")
    loss: str = field_help("dapo", "Policy loss: grpo, dapo, dr_grpo, gspo, cispo, sapo, vespo, dppo.")
    epsilon_low: float = field_help(0.2, "Lower clip bound of the ratio.")
    epsilon_high: float = field_help(0.28, "Upper clip bound of the ratio.")
    beta: float = field_help(0.0, "KL coefficient to a reference model (k3); 0 loads no reference.")
    entropy_coef: float = field_help(0.0, "Entropy bonus coefficient.")
    max_completion_length: int | None = field_help(None, "dr_grpo's constant normalizer (default: max_episode_tokens).")
    advantage_estimator: str = field_help("grpo", "Baseline: grpo (group mean) or rloo (leave-one-out).")
    advantage_scale: str = field_help("group", "Divide advantages by the std of the group, the batch, or none.")
    is_level: str = field_help("token", "Importance sampling between sampler and trainer: token or sequence.")
    is_mode: str = field_help("truncate", "truncate, mask or off.")
    is_ratio_high: float = field_help(2.0, "Upper bound of the sampler/trainer ratio.")
    max_new_tokens: int = field_help(64, "Token limit of each assistant turn (shorter than eval's: faster steps).")
    max_episode_tokens: int = field_help(1024, "Context limit of one episode.")
    max_concurrency: int = field_help(64, "Episodes in flight during rollout.")
    branch_at_turn: int | None = field_help(None, "Fork episodes after this many turns (deeper trees).")
    branch_factor: int = field_help(1, "Continuations per fork.")
    max_tokens_per_row: int = field_help(4096, "Token budget of one packed row.")
    skip_zero_advantage: bool = field_help(True, "Leave groups whose advantages are all 0 out of the forward pass "
                                                 "(the same update when beta and entropy_coef are 0; one process).")
    pack_mode: str = field_help("tree", "tree (shared prefixes once), flat, or padded.")
    attention_impl: str = field_help("auto", "Tree attention backend: auto, segment, flex, triton, reference.")
    lora_r: int = field_help(0, "LoRA rank; 0 trains all weights.")
    lora_alpha: int = field_help(16, "LoRA alpha.")
    lora_dropout: float = field_help(0.0, "LoRA dropout.")
    eval_episodes: int = field_help(64, "Held-out episodes evaluated at the start and the end (0 skips).")
    eval_seed: int = field_help(10_000, "First seed of the held-out tasks (training uses seed + i).")
    eval_temperature: float = field_help(1.0, "Sampling temperature of the evaluation.")
    save_every: int = field_help(0, "Checkpoint every N steps (0: only at the end).")
    resume: bool = field_help(False, "Continue from the latest checkpoint in output_dir.")
    seed: int = field_help(0, "Seeds tasks, sampling and initialization.")
    device: str = field_help("cpu", "Torch device.")
    num_threads: int | None = field_help(None, "torch CPU threads (default: torch's choice).")
    progress: bool = field_help(True, "Show a progress bar.")
    report_to: str = field_help("none", "Also log to: none, tensorboard, wandb or trackio (when installed).")

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("output_dir is required: where metrics, checkpoints and the model go (--output-dir runs/x).")
        for name in ("steps", "tasks_per_step", "group_size", "max_new_tokens", "max_episode_tokens",
                     "max_concurrency", "branch_factor", "max_tokens_per_row"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.group_size < 2 and self.advantage_estimator == "grpo":
            raise ValueError("group_size must be >= 2: GRPO's baseline is the mean reward of a task's group.")
        if self.loss not in POLICY_LOSSES:
            raise ValueError(f"loss={self.loss!r} is not one of {sorted(POLICY_LOSSES)}.")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be > 0 (e.g. 2e-4).")
        if self.report_to not in ("none", "tensorboard", "wandb", "trackio"):
            raise ValueError(f"report_to={self.report_to!r}: use none, tensorboard, wandb or trackio.")
        if self.lora_r < 0:
            raise ValueError(f"lora_r={self.lora_r} must be >= 0 (0 trains all weights).")
        # Validate the pieces with their own messages.
        self.sampling()
        self.loss_config()
        self.advantage_config()
        self.importance_config()
        self.packing_config()


    def loss_config(self) -> LossConfig:
        return LossConfig(policy_loss=self.loss, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                          beta=self.beta, entropy_coef=self.entropy_coef,
                          max_completion_length=self.max_completion_length or self.max_episode_tokens)

    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(estimator=self.advantage_estimator, scale=self.advantage_scale)

    def importance_config(self) -> ImportanceConfig:
        return ImportanceConfig(level=self.is_level, mode=self.is_mode, ratio_high=self.is_ratio_high)

    def packing_config(self) -> PackingConfig:
        return PackingConfig(max_tokens_per_row=self.max_tokens_per_row, mode=self.pack_mode)


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    policy_version: int
    eval_start: dict[str, Any] | None
    eval_end: dict[str, Any] | None
    model_dir: Path


# -- setup ------------------------------------------------------------------------------------


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_model_and_tokenizer(path: str | None, device: str):
    from treerl.cli import load_model

    return load_model(path, device)


def apply_lora(model: torch.nn.Module, cfg: GRPOConfig) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def policy_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the sampler needs: the model's own, or LoRA merged into the base weights."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.merge_adapter()
    try:
        out = {}
        for key, value in model.get_base_model().state_dict().items():
            if "lora_" in key:
                continue
            out[key.replace(".base_layer.", ".")] = value.detach().clone()
        return out
    finally:
        model.unmerge_adapter()


# -- the stages -----------------------------------------------------------------------------------


def rollout(engine, cfg: GRPOConfig, step: int, ranks: Ranks = Ranks()) -> tuple[list[Group], Any]:
    import treerl

    first = step * cfg.tasks_per_step
    tasks = ranks.shard(range(first, first + cfg.tasks_per_step))  # this rank's share of the step
    return asyncio.run(engine.run(lambda: treerl.make(cfg.env), cfg.env, tasks, cfg.group_size))


def score(groups: Sequence[Group], reward_funcs: Sequence[RewardFunc], tokenizer,
          metrics: dict[str, float]) -> torch.Tensor:
    """Rewards (E, 1 + len(reward_funcs)): the environment's, then each reward function's.

    Reward functions get TRL's arguments: ``prompts`` (opening messages), ``completions``
    (every message after them), ``completion_ids`` (the sampled ids), the task's columns as
    keyword arguments (``answer``, ``task_id``, ...), and ``log_extra``/``log_metric``
    callbacks. ``None`` means "not applicable" and counts as 0.
    """
    episodes = [(g, e) for g in groups for e in g.episodes]
    columns = [[e.reward for _, e in episodes]]
    if reward_funcs:
        prompts, completions, completion_ids = [], [], []
        for g, e in episodes:
            n = g.info.get("num_prompt_messages", 2)
            prompts.append(e.messages[:n])
            completions.append(e.messages[n:])
            completion_ids.append([t for t, m in zip(e.token_ids, e.sampled_mask) if m])
        kwargs = {
            "answer": [g.info.get("answer") for g, _ in episodes],
            "task_id": [g.info.get("task_id") for g, _ in episodes],
            "termination": [e.termination for _, e in episodes],
            "env_reward": list(columns[0]),
        }

        def log_metric(name: str, value: float) -> None:
            metrics[f"reward_fn/{name}"] = float(value)

        def log_extra(name: str, values: Sequence[Any]) -> None:
            logger.debug("reward function extra %s: %s", name, list(values)[:4])

        for func in reward_funcs:
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids,
                          log_metric=log_metric, log_extra=log_extra, **kwargs)
            values = [0.0 if v is None else float(v) for v in values]
            if len(values) != len(episodes):
                raise ValueError(f"reward function {getattr(func, '__name__', func)!r} returned {len(values)} "
                                 f"rewards for {len(episodes)} completions; return one per completion.")
            name = getattr(func, "__name__", "reward_fn")
            metrics[f"reward_fn/{name}_mean"] = sum(values) / len(values)
            columns.append(values)
    return torch.tensor(columns, dtype=torch.float32).T  # (E, R)


def advantages(groups: Sequence[Group], rewards: torch.Tensor, weights: Sequence[float],
               cfg: GRPOConfig, metrics: dict[str, float], ranks: Ranks = Ranks()) -> torch.Tensor:
    group_ids = torch.tensor([g_idx for g_idx, g in enumerate(groups) for _ in g.episodes])
    # Every rank's rewards, so that scale="batch" and the metrics see the whole step.
    all_rewards, all_group_ids, own = ranks.gather_episodes(rewards, group_ids)
    out = compute_advantages(all_rewards, all_group_ids, cfg.advantage_config(), weights=torch.tensor(weights))
    metrics.update({k: float(v) for k, v in out.metrics.items()})
    return out.adv[own]


def reference_model(model: torch.nn.Module, cfg: GRPOConfig) -> torch.nn.Module:
    """A frozen copy of the starting weights with tree attention, for the k3 KL term."""
    from treerl.kernels.tree_attention import enable_tree_attention

    ref = copy.deepcopy(model).eval().requires_grad_(False)
    if cfg.pack_mode != "padded":
        enable_tree_attention(ref, impl=cfg.attention_impl)
    return ref


def skips_zero_advantage_groups(cfg: GRPOConfig, ranks: Ranks) -> bool:
    """Whether groups whose advantages are all exactly 0 can be left out of the forward pass.

    Every policy loss multiplies by the advantage, so such a group's gradient is exactly 0
    unless a KL or entropy term is on; the normalizer still counts its tokens, so the update
    is the same as training on it. (One process only: ranks must all run the same collectives.)
    """
    return cfg.skip_zero_advantage and cfg.beta == 0 and cfg.entropy_coef == 0 and not ranks.enabled


def without_zero_advantage_groups(groups: Sequence[Group], adv: torch.Tensor, batches, cfg: GRPOConfig,
                                  metrics: dict[str, float]):
    """The step's micro-batches repacked without the groups whose advantages are all exactly 0.

    Episode indices keep referring to the whole step, so the normalizer built from the full
    packing applies unchanged.
    """
    import dataclasses

    starts = np.cumsum([0] + [len(g.episodes) for g in groups])
    keep = [i for i in range(len(groups)) if bool((adv[starts[i]:starts[i + 1]] != 0).any())]
    metrics["train/skipped_groups_frac"] = 1.0 - len(keep) / max(len(groups), 1)
    if len(keep) == len(groups):
        return batches
    if not keep:
        return []
    full_index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in keep])  # kept -> whole-step episode
    kept_adv = torch.cat([adv[starts[i]:starts[i + 1]] for i in keep])
    sub = pack_groups([groups[i] for i in keep], kept_adv, cfg.packing_config())
    full = batches[0]
    return [dataclasses.replace(b, term_episode=full_index[b.term_episode], num_episodes=full.num_episodes,
                                episode_num_tokens=full.episode_num_tokens) for b in sub]


def optimize(model, optimizer, scheduler, batches, cfg: GRPOConfig, device: str,
             metrics: dict[str, float], ranks: Ranks = Ranks(), ref_model: torch.nn.Module | None = None,
             normalizer=None) -> None:
    """One optimizer step over all micro-batches of the step (one accumulation window).

    With several ranks the window is every rank's micro-batches: the normalizer counts them
    all, and the gradients are summed over ranks before clipping. ``normalizer`` defaults to
    the one of ``batches``; pass the full window's when some batches were left out.
    """
    loss_cfg, is_cfg = cfg.loss_config(), cfg.importance_config()
    if normalizer is None:
        normalizer = ranks.normalizer(batches)
    totals: dict[str, float] = {}
    model.train()
    for batch in batches:
        batch = batch.to(device)
        out = packed_logprobs(model, batch, temperature=cfg.temperature, impl="auto")
        # On-policy, one update per batch: the old policy is the current one (ratio 1); the
        # sampler/trainer gap is corrected by importance weights, detached.
        iw = importance_weights(out.logp.detach(), batch.term_sampler_logp.to(out.logp.device),
                                batch.term_episode.to(out.logp.device), batch.num_episodes, is_cfg,
                                adv=batch.term_adv.to(out.logp.device))
        ref_logp = None
        if ref_model is not None:
            with torch.no_grad():
                ref_logp = packed_logprobs(ref_model, batch, temperature=cfg.temperature, impl="auto").logp
        inputs = loss_inputs(batch, out, ref_logp=ref_logp, is_weight=iw.weight, is_mask=iw.mask)
        result = compute_loss(inputs, loss_cfg, normalizer)
        result.loss.backward()
        n = batch.num_terms
        for k, v in {**result.metrics, **iw.metrics}.items():
            totals[k] = totals.get(k, 0.0) + float(v) * (1.0 if k.startswith("loss/") else n)
        totals["_terms"] = totals.get("_terms", 0.0) + n
        totals["entropy/mean"] = totals.get("entropy/mean", 0.0) + float(out.entropy.detach().sum())
    totals = ranks.sum_dicts(totals)
    totals.setdefault("loss/policy", 0.0)  # a step that trained on nothing (every group skipped)
    terms = max(totals.pop("_terms", 1.0), 1.0)
    for k, v in totals.items():
        metrics[k] = v if k.startswith("loss/") else v / terms
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # nothing was trained on (all groups skipped): a zero gradient, as training would give
            p.grad = torch.zeros_like(p)
    ranks.all_reduce_gradients(params)  # each rank's loss is its share of the global one: sum them
    if cfg.max_grad_norm > 0:
        metrics["grad/norm"] = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    metrics["lr"] = scheduler.get_last_lr()[0]


# -- checkpoints ------------------------------------------------------------------------------------


def save_checkpoint(path: Path, model, optimizer, scheduler, step: int, version: int, next_task: int) -> None:
    from safetensors.torch import save_model

    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_model(model, str(tmp / "model.safetensors"))  # handles tied embeddings
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
               tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "policy_version": version,
                                                          "next_task": next_task}, indent=2))
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)  # a checkpoint directory either exists whole or not at all


def latest_checkpoint(output_dir: Path) -> Path | None:
    ckpts = sorted((output_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


def load_checkpoint(path: Path, model, optimizer, scheduler) -> tuple[int, int]:
    from safetensors.torch import load_model

    load_model(model, str(path / "model.safetensors"))
    opt = torch.load(path / "optimizer.pt", weights_only=False)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    state = json.loads((path / "trainer_state.json").read_text())
    return int(state["step"]), int(state["policy_version"])


# -- logging ------------------------------------------------------------------------------------------


class MetricsLogger:
    """JSON Lines in the output directory (flushed each step), plus an optional tracker."""

    def __init__(self, output_dir: Path, report_to: str, config: dict[str, Any]):
        self.file = open(output_dir / "metrics.jsonl", "a", encoding="utf-8")
        self.tracker = None
        if report_to == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise SystemExit(f"--report-to tensorboard needs `pip install tensorboard` ({exc}).") from None
            self.tracker = ("tensorboard", SummaryWriter(str(output_dir / "tensorboard")))
        elif report_to in ("wandb", "trackio"):
            try:
                module = __import__(report_to)
            except ImportError:
                raise SystemExit(f"--report-to {report_to} needs `pip install {report_to}`.") from None
            module.init(project="treerl", config=config)
            self.tracker = (report_to, module)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}, default=float) + "\n")
        self.file.flush()
        if self.tracker is not None:
            kind, t = self.tracker
            scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            if kind == "tensorboard":
                for k, v in scalars.items():
                    t.add_scalar(k, v, step)
            else:
                t.log(scalars, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tracker is not None and self.tracker[0] == "tensorboard":
            self.tracker[1].close()


# -- the loop -------------------------------------------------------------------------------------------


def evaluate_policy(policy, tokenizer, cfg: GRPOConfig) -> dict[str, Any]:
    from treerl.rollout.evaluate import evaluate

    params = cfg.sampling(temperature=cfg.eval_temperature)
    report = evaluate(cfg.env, policy, tokenizer, num_episodes=cfg.eval_episodes, seed=cfg.eval_seed,
                      params=params, max_concurrency=cfg.max_concurrency)
    return report.summary()


def train(cfg: GRPOConfig, *, reward_funcs: Sequence[RewardFunc] = (), reward_weights: Sequence[float] | None = None,
          model=None, tokenizer=None) -> TrainResult:
    """Train with GRPO on ``cfg.env``; see the module docstring for the loop.

    Under ``accelerate launch --multi_gpu --num_processes R -m treerl.cli learn ...`` (or
    ``torchrun``), or in processes that initialized a ``torch.distributed`` group, the ``R``
    processes split each step's tasks and take together the step one process would take on
    all of them; only rank 0 writes to ``output_dir`` and evaluates, and every rank returns
    once the model is saved.
    """
    from transformers import get_scheduler

    from treerl.agents.transformers_policy import TransformersPolicy
    from treerl.kernels.tree_attention import enable_tree_attention
    from treerl.rollout.engine import RolloutEngine

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    weights = list(reward_weights) if reward_weights is not None else [1.0] * (1 + len(reward_funcs))
    if len(weights) != 1 + len(reward_funcs):
        raise ValueError(f"reward_weights has {len(weights)} entries; pass one for the environment reward and one "
                         f"per reward function ({1 + len(reward_funcs)}).")
    ranks = Ranks.from_env(cfg.device)
    if cfg.tasks_per_step < ranks.world_size:
        raise ValueError(f"tasks_per_step={cfg.tasks_per_step} is fewer than the {ranks.world_size} processes, so "
                         f"some would have no task; use --tasks-per-step {ranks.world_size} or more, or fewer "
                         f"processes.")
    device = ranks.device(cfg.device)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    set_seed(cfg.seed)

    # Models: the trainer's (tree attention, maybe LoRA) and the sampler's own copy.
    if model is None:
        model, tokenizer = load_model_and_tokenizer(cfg.model, device)
    ranks.broadcast_parameters(model)  # every rank starts from rank 0's weights
    policy_model = copy.deepcopy(model).eval()
    # The KL term's reference is the starting policy, frozen; with beta == 0 none is kept.
    ref_model = reference_model(model, cfg) if cfg.beta > 0 else None
    if cfg.lora_r > 0:
        model = apply_lora(model, cfg)
        ranks.broadcast_parameters(model)
    choice = enable_tree_attention(model.get_base_model() if cfg.lora_r > 0 else model,
                                   impl=cfg.attention_impl) if cfg.pack_mode != "padded" else None
    policy = TransformersPolicy(policy_model, tokenizer, device=device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)
    scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=cfg.warmup_steps)
    engine = RolloutEngine(policy, tokenizer, params=cfg.sampling(), max_concurrency=cfg.max_concurrency,
                           max_episode_tokens=cfg.max_episode_tokens, branch_at_turn=cfg.branch_at_turn,
                           branch_factor=cfg.branch_factor, seed=cfg.seed)

    start_step, version = 0, 0
    if cfg.resume and (ckpt := latest_checkpoint(out_dir)) is not None:
        start_step, version = load_checkpoint(ckpt, model, optimizer, scheduler)
        policy.set_weights(policy_state_dict(model), version=version)
        if ranks.is_main:
            print(f"resumed from {ckpt} at step {start_step}", file=sys.stderr)
            _truncate_metrics(out_dir / "metrics.jsonl", start_step)
    log = diagnostics = None
    if ranks.is_main:  # the other ranks write nothing
        (out_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
        log = MetricsLogger(out_dir, cfg.report_to, asdict(cfg))
        diagnostics = Diagnostics(out_dir / "diagnostics.jsonl")
    if choice is not None:
        logger.info("tree attention: %s (%s)", choice.impl, choice.reason)

    eval_start = None
    summary_path = out_dir / "summary.json"
    # Only rank 0 evaluates; the others wait for it at the first step's collectives.
    if ranks.is_main and start_step == 0 and cfg.eval_episodes > 0:
        eval_start = evaluate_policy(policy, tokenizer, cfg)
        print(f"eval at start: success rate {eval_start['success_rate']:.1%} over {cfg.eval_episodes} held-out "
              f"episodes", file=sys.stderr)
        (out_dir / "eval_start.json").write_text(json.dumps(eval_start, indent=2))
    elif ranks.is_main and (out_dir / "eval_start.json").exists():
        eval_start = json.loads((out_dir / "eval_start.json").read_text())

    bar = None
    if cfg.progress and ranks.is_main:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, desc="learn", unit="step", file=sys.stderr, dynamic_ncols=True)
    try:
        for step in range(start_step, cfg.steps):
            t0 = time.perf_counter()
            metrics: dict[str, float] = {}
            groups, stats = rollout(engine, cfg, step, ranks)
            t_rollout = time.perf_counter() - t0
            rewards = score(groups, reward_funcs, tokenizer, metrics)
            adv = advantages(groups, rewards, weights, cfg, metrics, ranks)
            batches = pack_groups(groups, adv, cfg.packing_config())
            normalizer = ranks.normalizer(batches)  # counts every episode, trained or skipped
            if skips_zero_advantage_groups(cfg, ranks):
                batches = without_zero_advantage_groups(groups, adv, batches, cfg, metrics)
            optimize(model, optimizer, scheduler, batches, cfg, device, metrics, ranks, ref_model=ref_model,
                     normalizer=normalizer)
            version += 1
            policy.set_weights(policy_state_dict(model), version=version)
            step_time = time.perf_counter() - t0

            summary = ranks.merge_stats(stats).summary()
            tool_total = sum(summary["tool_calls"].values())
            local = {  # this rank's own: averaged over ranks by episodes (times: the slowest rank)
                **{k: v for k, v in metrics.items() if k.startswith("reward_fn/")},
                "episode/length_limit_frac": _length_limit_frac(groups),
                "perf/rollout_s": t_rollout,
                "perf/step_s": step_time,
                **{k: float(v) for k, v in packing_metrics(batches).items()},
            }
            metrics.update({
                "reward/mean": summary["reward/mean"],
                "reward/std": summary["reward/std"],
                "reward/success_rate": summary["success_rate"],
                "tools/invalid_rate": (tool_total - summary["tool_calls"].get("ok", 0)) / tool_total if tool_total else 0.0,
                "tree/packing_ratio": summary["tree/packing_ratio"],
                "perf/tokens_per_s": summary["perf/tokens_per_s"],
                "policy/version": version,
                **ranks.mean_metrics(local, weight=len(adv)),
            })
            if ranks.is_main:
                metrics.update(diagnostics.check(step + 1, metrics))
                log.log(step + 1, metrics)
            if bar is not None:
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{step_time:.1f}")
                bar.update(1)
            if ranks.is_main and cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
                save_checkpoint(out_dir / "checkpoints" / f"step-{step + 1}", model, optimizer, scheduler,
                                step + 1, version, next_task=(step + 1) * cfg.tasks_per_step)
    finally:
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()

    model_dir = out_dir / "model"
    eval_end = None
    if ranks.is_main:
        save_checkpoint(out_dir / "checkpoints" / f"step-{cfg.steps}", model, optimizer, scheduler, cfg.steps,
                        version, next_task=cfg.steps * cfg.tasks_per_step)
        final = policy_model
        final.load_state_dict(policy_state_dict(model))
        final.save_pretrained(model_dir, safe_serialization=True)
        tokenizer.save_pretrained(model_dir)
        eval_end = evaluate_policy(policy, tokenizer, cfg) if cfg.eval_episodes > 0 else None
        result = {"steps": cfg.steps, "policy_version": version, "eval_start": eval_start, "eval_end": eval_end,
                  "model_dir": str(model_dir)}
        summary_path.write_text(json.dumps(result, indent=2))
    ranks.barrier()  # every rank returns once the model is saved
    policy.close()
    return TrainResult(out_dir, cfg.steps, version, eval_start, eval_end, model_dir)


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metric lines past the checkpoint a run resumes from: those steps are replayed."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError):
            continue  # a torn last line from the killed run
    path.write_text("".join(f"{line}\n" for line in keep))


def _length_limit_frac(groups: Sequence[Group]) -> float:
    finals = [e.path()[-1] for g in groups for e in g.episodes]
    sampled = [s for s in finals if s.kind == "sampled"]
    return sum(s.finish_reason == "length" for s in sampled) / len(sampled) if sampled else 0.0


def cmd_learn(args) -> int:
    from treerl.cli import config_for_command

    cfg = config_for_command(GRPOConfig, args)
    result = train(cfg)
    if not is_main_process():  # under accelerate launch, rank 0 reports
        return 0
    start = result.eval_start["success_rate"] if result.eval_start else float("nan")
    end = result.eval_end["success_rate"] if result.eval_end else float("nan")
    print(f"held-out success rate: start {start:.1%} -> end {end:.1%} "
          f"({(end - start) * 100:+.1f} points) over {cfg.eval_episodes} episodes")
    print(f"model saved to {result.model_dir}; metrics in {result.output_dir / 'metrics.jsonl'}")
    return 0
