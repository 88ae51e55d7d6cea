"""AsyncGRPO: generation and training at the same time, in different processes.

Generator processes (:mod:`~treerl.learners.async_generator`) play episodes with their own
copy of the policy while the trainer trains; a bounded buffer with staleness control
(:mod:`~treerl.learners.async_buffer`) sits between them. The trainer's loop is GRPO's on the
learner core, with the rollout replaced by a take from the buffer::

    run = build(cfg, ...)                                 # as GRPO: model, optimizer, resume, eval at start
    pool.start(); publish(weights, version)               # generators load the current weights
    for step in run.steps():
        groups = buffer.take(tasks_per_step, trainer_version)   # admitted: oldest span <= max_staleness behind
        update(run, step, groups, ...)                    # GRPO's stages: score, advantages, pack, optimize,
                                                          # publish (to every generator), log, checkpoint
    finish(run)

Neither side waits for the other except through the buffer (generators run out of tickets
when it is full) and the staleness bound (a generator does not start a task it would play
with weights more than ``max_staleness`` versions older than the trainer's when it trains
it). With ``max_staleness=0`` and one generator every step trains on exactly the groups
synchronous GRPO would play, with the same weights, so it takes the same update.

The trainer corrects for the sampler always against the sampler's own per-token log-probs,
over its candidate set (:mod:`~treerl.learners.importance`). The default objective,
``score_centering``, adds the sampler-expected score of each token with the same truncated
importance weight (:mod:`~treerl.learners.centering`), so truncation adds no drift;
``clipped`` trains with the configured GRPO loss alone.

Generators on one machine are processes (:class:`~treerl.learners.async_pool.ProcessPool`);
on a Ray cluster they are Ray actors (``--backend ray``, the ``treerl[ray]`` extra,
:mod:`~treerl.learners.async_ray`)::

    treerl learn --learner async_grpo --env treerl/Calculator-v0 --output-dir runs/async
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from treerl.config import field_help
from treerl.envs.sandbox import usable_cpus
from treerl.learners.async_buffer import GroupBuffer
from treerl.learners.async_generator import GeneratorSpec
from treerl.learners.async_pool import WEIGHT_TRANSPORTS, ProcessPool
from treerl.learners.core import (Evaluator, OptimizerSpec, Run, StepCallback, TrainResult, build, finish,
                                  register_learner)
from treerl.learners.diagnostics import CHECKS, Check
from treerl.learners.grpo import GRPOConfig, update
from treerl.learners.importance import ImportanceConfig
from treerl.learners.metrics import tracker_for
from treerl.rollout.rewards import RewardFunc
from treerl.learners.weight_sync import policy_state_dict
from treerl.rollout.summary import RolloutStats
from treerl.rollout.trajectory import Group, GroupWriter, read_groups

__all__ = ["AsyncGRPOConfig", "OBJECTIVES", "BACKENDS", "train_async", "ASYNC_CHECKS"]

OBJECTIVES = ("score_centering", "clipped")
BACKENDS = ("process", "ray")

ASYNC_CHECKS: tuple[Check, ...] = (
    Check("trainer_starved", "async/starved_streak", 2.5, True,
          "The trainer waited for groups most of every step for 3 steps or more (the value: how many in a "
          "row): add generators (--num-generators), raise --max-staleness so generators may run further ahead, "
          "or give the generators more CPU threads."),
    Check("staleness_at_bound", "async/at_bound_streak", 2.5, True,
          "For 3 steps or more (the value: how many in a row) most trained spans were max_staleness versions "
          "old while generators sat idle at the bound: the generators outpace the trainer; use fewer "
          "generators, or raise --max-staleness if the objective tolerates older data."),
    Check("groups_dropped", "async/dropped_groups_step", 0.0, True,
          "Groups arrived too stale and were dropped (their work is lost): raise --max-staleness or lower "
          "--buffer-size so fewer groups wait."),
)
"""Checks run after every AsyncGRPO step besides GRPO's (:data:`~treerl.learners.diagnostics.CHECKS`)."""


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    """Options of ``treerl learn --learner async_grpo`` (GRPO's, plus the asynchronous pipeline's)."""

    # TRL's experimental AsyncGRPOConfig names where the meaning is the same (its max_staleness is this one's).
    # (Not GRPO's vllm_server_base_url and vllm_server_timeout: TRL's async trainer connects to a server, which
    # this one has not.)
    ALIASES: ClassVar[dict[str, str]] = {**{k: v for k, v in GRPOConfig.ALIASES.items()
                                            if k not in ("vllm_server_base_url", "vllm_server_timeout")},
                                         "heartbeat_stale_after_s": "heartbeat_timeout"}
    UNSUPPORTED: ClassVar[dict[str, str]] = {
        **GRPOConfig.UNSUPPORTED,
        **dict.fromkeys(("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
                         "request_timeout", "weight_sync_timeout"),
                        "there is no vLLM server to connect to: the generators are treerl's own processes "
                        "(--num-generators), each sampling with transformers or its own vLLM engine "
                        "(--generator-policy vllm), to which the trainer publishes each step's weights"),
        "queue_maxsize": "--buffer-size bounds the groups (not completions) in flight or waiting",
        "max_inflight_tasks": "--max-concurrency sets the episodes in flight in each generator, --buffer-size the "
                              "groups in flight or waiting",
        "fork_threshold_tokens": "the rollout engine records the tokens as they were sampled and never re-tokenizes "
                                 "a conversation, so there is no drift to reconcile; drop it",
    }
    TRANSLATED: ClassVar[dict[str, tuple[type, str]]] = {
        **{k: v for k, v in GRPOConfig.TRANSLATED.items() if k not in ("vllm_server_host", "vllm_server_port")},
        "token_budget": (int, "TRL's: the token budget of one packed row (shared prefixes counted once), "
                              "max_tokens_per_row here; unset: treerl's default; <= 0 (no budget) is refused."),
        "weight_sync_steps": (int, "TRL's: 1 only (the generators get the weights after every step)."),
    }
    TRANSLATED_INTO: ClassVar[dict[str, str]] = {**GRPOConfig.TRANSLATED_INTO, "token_budget": "max_tokens_per_row"}

    max_staleness: int = field_help(2, "Most policy versions a trained group's oldest span may lag the trainer; "
                                       "older groups are dropped whole. 0: synchronous GRPO's updates.")
    buffer_size: int | None = field_help(None, "Most groups in flight or waiting to be trained (the buffer bound; "
                                               "default (max_staleness + 1) x tasks_per_step).")
    stragglers: str = field_help("wait", "wait: a step waits for groups still being played that would be too stale "
                                         "by the next step (no bias against long episodes); drop: it trains on what "
                                         "has arrived and drops those later (faster with very uneven episodes).")
    max_concurrency: int = field_help(256, "Episodes in flight at once in each generator (several steps' worth, "
                                           "decoded as one batch).")
    num_generators: int = field_help(1, "Generator processes (or Ray actors) playing episodes.")
    lockstep: bool = field_help(False, "Generation in waves of every episode in play (GRPO's default). Off here: "
                                       "when tickets arrive and weights land depends on time anyway, so waves "
                                       "would only make generators wait.")
    generator_threads: int | None = field_help(None, "torch CPU threads of each generator (default: the cores "
                                                     "split evenly between the trainer and the generators; 1 on Ray).")
    heartbeat_timeout: float = field_help(60.0, "Seconds without a heartbeat before a generator is reported and "
                                                "replaced.")
    objective: str = field_help("score_centering", "score_centering (the sampler-expected score subtracted with "
                                                   "the same IS weight) or clipped (the --loss alone).")
    centering_top_k: int = field_help(20, "Sampler tokens recorded per position for score centering when the whole "
                                          "vocabulary is the support (with --top-k the candidate set is exact).")
    backend: str = field_help("process", "Where generators run: process (this machine) or ray (Ray actors, the "
                                         "treerl[ray] extra).")
    generator_policy: str = field_help("transformers", "What a generator samples with: transformers (CPU or GPU) or "
                                                       "vllm (a vLLM engine on --model, the treerl[vllm] extra).")
    weight_transport: str = field_help("file", "How weights reach generator processes: file (a safetensors file "
                                               "on shared memory) or broadcast (torch.distributed: NCCL on GPUs, "
                                               "gloo on CPU). Ray actors use Ray's object store.")
    ray_address: str | None = field_help(None, "Ray cluster to join (e.g. auto); default starts a local Ray "
                                               "instance.")
    save_groups: bool = field_help(False, "Append every trained group to output_dir/groups.jsonl, with the "
                                          "generator that played it and the version that trained it.")

    def __post_init__(self) -> None:
        # The objective first: GRPO's checks build the importance config, which depends on it.
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r}: use one of {', '.join(OBJECTIVES)}.")
        if self.objective == "score_centering" and self.is_level != "token":
            raise ValueError("objective=score_centering centers each token's score with its own importance weight, "
                             f"so it needs is_level=token (got {self.is_level!r}); use --is-level token, or "
                             "--objective clipped for sequence-level importance sampling.")
        if self.objective == "score_centering" and self.num_iterations != 1:
            raise ValueError(f"num_iterations={self.num_iterations}: score centering weighs each token by the "
                             "sampler's ratio to the current weights, one update per batch; use --objective "
                             "clipped for several updates on each step's episodes.")
        if self.objective == "score_centering" and self.num_minibatches != 1:
            raise ValueError(f"num_minibatches={self.num_minibatches} (TRL's steps_per_generation / "
                             "gradient_accumulation_steps): score centering weighs each token by the sampler's ratio "
                             "to the current weights, one update per batch; use --objective clipped to split each "
                             "step's episodes into several optimizer steps.")
        super().__post_init__()
        if self.from_rollouts or self.from_server:
            flag = "from_rollouts" if self.from_rollouts else "from_server"
            raise ValueError(f"{flag} is set, but AsyncGRPO trains on the groups its own generator processes play; "
                             "to train on recorded groups use --learner grpo or --learner sdpo with "
                             f"--{flag.replace('_', '-')} (`treerl serve`'s agents generate while the learner trains).")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness} must be >= 0 (0 trains only on groups sampled "
                             "with the trainer's current weights).")
        if self.buffer_size is not None and self.buffer_size < 1:
            raise ValueError(f"buffer_size={self.buffer_size} must be >= 1 (or unset for (max_staleness + 1) x "
                             f"tasks_per_step = {(self.max_staleness + 1) * self.tasks_per_step}).")
        if self.num_generators < 1:
            raise ValueError(f"num_generators={self.num_generators} must be >= 1.")
        if self.generator_threads is not None and self.generator_threads < 1:
            raise ValueError(f"generator_threads={self.generator_threads} must be >= 1 (or unset).")
        if not self.heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout={self.heartbeat_timeout} must be > 0 seconds (e.g. 60).")
        if self.centering_top_k < 1:
            raise ValueError(f"centering_top_k={self.centering_top_k} must be >= 1 (e.g. 20).")
        if self.stragglers not in ("wait", "drop"):
            raise ValueError(f"stragglers={self.stragglers!r}: use wait (unbiased) or drop (faster, biased against "
                             "long episodes).")
        if self.generator_policy not in ("transformers", "vllm"):
            raise ValueError(f"generator_policy={self.generator_policy!r}: use transformers or vllm.")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: use process (this machine) or ray (Ray actors).")
        if self.weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport={self.weight_transport!r}: use one of {', '.join(WEIGHT_TRANSPORTS)}.")
        if self.backend == "ray" and self.weight_transport != "file":
            raise ValueError(f"weight_transport={self.weight_transport!r} is for generator processes; Ray actors get "
                             "weights through Ray's object store: drop --weight-transport or use --backend process.")

    @classmethod
    def translate_options(cls, given: dict[str, Any]) -> dict[str, Any]:
        """GRPO's translations, and TRL's ``token_budget`` (``max_tokens_per_row``) and ``weight_sync_steps``.

        >>> AsyncGRPOConfig.translate_options({"token_budget": 2048, "weight_sync_steps": 1})
        {'max_tokens_per_row': 2048}
        """
        values = dict(given)
        if values.pop("weight_sync_steps", 1) != 1:
            raise TypeError(f"{cls.__name__}() has no option weight_sync_steps other than 1: the generators get the "
                            "trainer's weights after every step (--max-staleness bounds how old the weights of a "
                            "trained group may be).")
        if "token_budget" in values:
            budget = values.pop("token_budget")
            if "max_tokens_per_row" in values:
                raise TypeError(f"{cls.__name__}(): token_budget and max_tokens_per_row name the same option; keep "
                                "one.")
            if budget is not None and budget <= 0:
                raise TypeError(f"{cls.__name__}(): token_budget={budget} turns token budgeting off, which has no "
                                "counterpart here: rows are always packed to --max-tokens-per-row tokens.")
            if budget is not None:  # TRL's None is the server's context length; here treerl's default
                values["max_tokens_per_row"] = budget
        return super().translate_options(values)

    def steps_per_epoch(self, rows: int) -> float:
        """Steps of one pass over ``rows`` rows as TRL's AsyncGRPO counts them: groups trained over rows, every row
        (its prompt dataset is no batched sampler), so ``epoch`` is ``s x tasks_per_step / rows`` after step ``s``."""
        return rows / self.tasks_per_step

    def steps_for_epochs(self, rows: int) -> int:
        """TRL's AsyncGRPO stops once it has trained ``ceil(E x rows)`` groups (``num_train_epochs`` E): the first
        step at which that many are trained, ``tasks_per_step`` a step.

        >>> AsyncGRPOConfig(output_dir="x", num_train_epochs=1, tasks_per_step=4).steps_for_epochs(10)
        3
        """
        return -(-math.ceil(self.num_train_epochs * rows) // self.tasks_per_step)

    def epoch_interval(self, rows: int | None, where: str) -> int:
        """TRL's AsyncGRPO trains on a stream of groups (an iterable dataset, without a length), which transformers'
        Trainer plays as one epoch, the whole run: save_strategy and eval_strategy ``"epoch"`` act at its end only,
        with or without rows."""
        return self.steps

    @property
    def capacity(self) -> int:
        """The buffer bound: ``buffer_size``, or the groups of every step a generator may run ahead."""
        return self.buffer_size or (self.max_staleness + 1) * self.tasks_per_step

    def importance_config(self) -> ImportanceConfig:
        return dataclasses.replace(super().importance_config(), centering=self.objective == "score_centering")

    def sampling_overrides(self) -> dict[str, Any]:
        """What generators record beyond GRPO: the sampler's head for score centering."""
        return {"top_logprobs": self.centering_top_k} if self.objective == "score_centering" else {}


# -- the step -------------------------------------------------------------------------------------


TOTALS = ("dropped_groups", "lost_groups", "ignored_groups", "generator_restarts", "heartbeat_timeouts")
"""The counts of summary.json's ``async`` totals, besides ``group_staleness`` and ``counted_from_step``."""


def async_totals(buffer: GroupBuffer, pool: Any, earlier: dict[str, Any]) -> dict[str, Any]:
    """The run's totals: ``earlier`` (what a resumed run's checkpoint counted) plus this process's counts.

    >>> class Pool: restarts, heartbeat_timeouts = 1, 0
    >>> buf = GroupBuffer(tasks_per_step=1, max_staleness=0, capacity=1, next_task=0, version=0)
    >>> buf.staleness[0] += 2
    >>> earlier = {"counted_from_step": 0, "lost_groups": 3, "group_staleness": {"0": 4, "1": 1}}
    >>> totals = async_totals(buf, Pool(), earlier)
    >>> totals["lost_groups"], totals["generator_restarts"], totals["group_staleness"]
    (3, 1, {'0': 6, '1': 1})
    """
    now = {"dropped_groups": buffer.dropped, "lost_groups": buffer.lost, "ignored_groups": buffer.ignored,
           "generator_restarts": pool.restarts, "heartbeat_timeouts": pool.heartbeat_timeouts}
    staleness = Counter({int(k): v for k, v in earlier.get("group_staleness", {}).items()}) + buffer.staleness
    return {"counted_from_step": earlier["counted_from_step"], **{k: earlier.get(k, 0) + now[k] for k in TOTALS},
            "group_staleness": {str(k): v for k, v in sorted(staleness.items())}}


class _Clock:
    """What the step metrics carry from one step to the next: the last take, generator figures, streaks,
    and the totals counted before this process (a resumed run's, from its checkpoint)."""

    def __init__(self, writer: GroupWriter | None = None, earlier: dict[str, Any] | None = None) -> None:
        self.writer = writer
        self.earlier = earlier if earlier is not None else {"counted_from_step": 0}
        self.last_take: float | None = None
        self.generator_stats: dict[int, dict[str, float]] = {}
        self.starved = 0
        self.at_bound = 0
        self.dropped = 0
        self.lost = 0


def async_step(run: Run, buffer: GroupBuffer | None, pool: Any, clock: _Clock, step: int) -> dict[str, float]:
    """One AsyncGRPO step: take admitted groups from the buffer, then GRPO's update; returns the metrics.

    With several trainer processes, rank 0 owns the buffer and the generators: it takes the
    step's groups and hands them to every rank, and each trains on its share as in GRPO.
    """
    cfg, metrics = run.cfg, {}
    version = run.sync.version
    payloads, next_task = [], None
    start = time.perf_counter()
    if buffer is not None:
        arrivals = buffer.take(cfg.tasks_per_step, trainer_version=version, on_wait=pool.check)
        payloads, next_task = [a.payload for a in arrivals], buffer.next_task
    if run.ranks.enabled:
        payloads, next_task = run.ranks.gather((payloads, next_task))[0]
    now = time.perf_counter()
    groups = sorted((Group.from_json(p) for p in payloads), key=lambda g: g.info["task_seed"])
    stats = RolloutStats()
    for group in groups:
        stats.add(group)
        if clock.writer is not None:
            group.info["trained_version"] = version
            clock.writer.write(group)
    # One cycle of the pipeline: from the last take to this one (the first step's is its own wait,
    # which is all warm-up, so its idle fraction is not reported).
    cycle = now - (clock.last_take if clock.last_take is not None else start)
    stats.wall_s = cycle
    metrics["perf/rollout_s"] = now - start  # the wait for groups: what generation costs the trainer
    if buffer is not None:
        metrics.update(_async_metrics(groups, version, buffer, pool, clock, stats, cfg.max_staleness))
        metrics.update({
            "async/trainer_wait_s": now - start,
            "async/weight_publish_s": pool.last_publish_s,  # the latest publish to the generators (last step's)
            # Since the last step's take (a generator may die between steps).
            "async/dropped_groups_step": float(buffer.dropped - clock.dropped),
            "async/lost_groups_step": float(buffer.lost - clock.lost),
        })
        clock.dropped, clock.lost = buffer.dropped, buffer.lost
        # The totals as of this step's take, which its checkpoint keeps for a resumed run to continue from.
        run.state.extra["async"] = async_totals(buffer, pool, clock.earlier)
        if clock.last_take is not None:
            metrics["async/trainer_idle_frac"] = (now - start) / cycle if cycle > 0 else 0.0
        count_streaks(clock, metrics)
    clock.last_take = now
    mine = groups[run.ranks.rank::run.ranks.world_size]
    if run.ranks.enabled:
        stats = RolloutStats()
        for group in mine:
            stats.add(group)
        stats.wall_s = cycle
    return update(run, step, mine, stats, metrics, next_task=next_task)


def count_streaks(clock: _Clock, metrics: dict[str, float]) -> None:
    """Steps in a row the trainer starved, or generators idled at the staleness bound (what
    :data:`ASYNC_CHECKS` fire on: one such step is noise, three in a row are a pattern)."""
    if "async/trainer_idle_frac" in metrics:  # the first step's wait is warm-up
        clock.starved = clock.starved + 1 if metrics["async/trainer_idle_frac"] > 0.5 else 0
    clock.at_bound = (clock.at_bound + 1 if metrics["async/at_bound_frac"] > 0.5
                      and metrics["async/generator_idle_frac"] > 0.25 else 0)
    metrics["async/starved_streak"] = float(clock.starved)
    metrics["async/at_bound_streak"] = float(clock.at_bound)


def _async_metrics(groups: Sequence[Group], version: int, buffer: GroupBuffer, pool: Any, clock: _Clock,
                   stats: RolloutStats, max_staleness: int) -> dict[str, float]:
    """Staleness of the trained spans, buffer, losses and idle fractions."""
    lags: Counter = Counter()
    for group in groups:
        for segment in group.segments:
            if segment.kind == "sampled" and segment.policy_version is not None:
                lags[version - segment.policy_version] += 1
    spans = max(sum(lags.values()), 1)
    out = {f"async/staleness_{lag}_frac": count / spans for lag, count in sorted(lags.items())}
    gen_stats = pool.stats()
    d_alive = sum(s["alive_s"] - clock.generator_stats.get(g, {}).get("alive_s", 0.0) for g, s in gen_stats.items())
    d_idle = sum(s["idle_s"] - clock.generator_stats.get(g, {}).get("idle_s", 0.0) for g, s in gen_stats.items())
    clock.generator_stats = gen_stats
    totals = async_totals(buffer, pool, clock.earlier)
    out.update({
        "async/staleness_mean": sum(lag * c for lag, c in lags.items()) / spans,
        "async/staleness_max": float(max(lags, default=0)),
        "async/at_bound_frac": lags.get(max_staleness, 0) / spans if max_staleness > 0 else 0.0,
        "async/span_version_min": float(version - max(lags, default=0)),
        "async/buffer_occupancy": float(buffer.occupancy),
        "async/tickets_out": float(buffer.outstanding),
        "async/dropped_groups": float(totals["dropped_groups"]),  # the whole run's, a resumed one's too
        "async/lost_groups": float(totals["lost_groups"]),
        "async/ignored_groups": float(totals["ignored_groups"]),
        "async/generator_restarts": float(totals["generator_restarts"]),
        "async/heartbeat_timeouts": float(totals["heartbeat_timeouts"]),
        "async/generator_idle_frac": min(max(d_idle / d_alive, 0.0), 1.0) if d_alive > 0 else 0.0,
        "async/episodes_per_s": stats.num_episodes / stats.wall_s if stats.wall_s > 0 else 0.0,
    })
    return out


# -- train ----------------------------------------------------------------------------------------


def train_async(cfg: AsyncGRPOConfig, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
                env_factory: Callable[[], Any] | None = None, reward_funcs: Sequence[RewardFunc] = (),
                reward_weights: Sequence[float] | None = None, optimizer: OptimizerSpec | None = None,
                on_step: Callable[[int, dict[str, float], Any], None] | None = None,
                callbacks: Sequence[StepCallback] = (), evaluate: Evaluator | None = None) -> TrainResult:
    """Train with AsyncGRPO on ``cfg.env``; the arguments are :func:`~treerl.learners.grpo.train`'s.

    ``model`` (a copy of it, made before training changes it) and ``env_factory`` travel to
    the generator processes, so they must pickle: a module-level function or a
    ``functools.partial`` rather than a lambda. ``reward_funcs`` run in the trainer.
    ``on_step(step, metrics, pool)`` is called after each step (tests use it to inject faults).
    The generators are stopped when training ends, however it ends.

    Under ``accelerate launch``/``torchrun`` rank 0 runs the generators and takes each step's
    groups; every rank trains on its share and gradients are summed as in GRPO.
    """
    if env_factory is not None:
        _require_picklable(env_factory, "env_factory")
    if cfg.generator_policy == "vllm" or cfg.use_vllm:
        from treerl.agents.vllm_policy import import_vllm

        import_vllm()  # here, not in each generator process (which would fail, be restarted and fail again)
    tracker_for(cfg.report_to)  # before the generators load their model, as build() does before the trainer's
    threads = _split_threads(cfg)
    # The evaluations at the start and the end run while the generators load their model or after
    # they stopped: they get every core (or the user's --num-threads), training gets the trainer's share.
    whole = cfg.num_threads or (usable_cpus() if cfg.device.startswith("cpu") else None)
    spec = GeneratorSpec(cfg=dataclasses.replace(cfg, num_threads=threads[1]), max_staleness=cfg.max_staleness,
                         heartbeat_s=min(1.0, cfg.heartbeat_timeout / 4), sampling=cfg.sampling_overrides(),
                         model=model, tokenizer=tokenizer, env_factory=env_factory, policy=cfg.generator_policy,
                         sandbox_runs=_sandbox_runs(cfg))
    # Under accelerate/torchrun only rank 0 runs generators; the others train on their share of its groups.
    pool = _make_pool(cfg, spec) if int(os.environ.get("RANK", "0")) == 0 else None
    if pool is not None:
        pool.launch()  # generators load their model while the trainer builds and evaluates
    buffer, totals = None, {}
    try:
        _set_threads(whole)
        run = build(cfg, model=model, tokenizer=tokenizer, env_factory=env_factory, reward_funcs=reward_funcs,
                    reward_weights=reward_weights, optimizer=optimizer, reference=cfg.beta > 0, callbacks=callbacks,
                    evaluate=evaluate)
        _set_threads(threads[0])
        # A resumed run continues its checkpoint's totals; one written without them, from where it resumed.
        earlier = run.state.extra.get("async") or {"counted_from_step": run.state.step}
        with run:
            if pool is not None:
                buffer = GroupBuffer(tasks_per_step=cfg.tasks_per_step, max_staleness=cfg.max_staleness,
                                     capacity=cfg.capacity, next_task=run.state.next_task, version=run.sync.version,
                                     wait_for_due=cfg.stragglers == "wait")
                run.diagnostics.checks = CHECKS + ASYNC_CHECKS
                pool.on_report = lambda kind, text: run.diagnostics.report(run.state.step, kind, 1.0, 0.0, text)
                pool.set_weights(policy_state_dict(run.model), run.sync.version)
                run.sync.targets.append(pool)
                pool.attach(buffer)
            clock = _Clock(_group_writer(run) if cfg.save_groups and pool is not None else None, earlier)
            for step in run.steps():
                metrics = async_step(run, buffer, pool, clock, step)
                if on_step is not None:
                    on_step(step, metrics, pool)
            if clock.writer is not None:
                clock.writer.close()
            if buffer is not None:
                totals = async_totals(buffer, pool, earlier)
    finally:
        if pool is not None:
            pool.close()
    _set_threads(whole)
    result = finish(run)
    if run.ranks.is_main:
        summary_path = run.out_dir / "summary.json"
        summary = json.loads(summary_path.read_text())
        summary["async"] = totals
        summary_path.write_text(json.dumps(summary, indent=2))
    return result


def _group_writer(run: Run) -> GroupWriter:
    """``groups.jsonl``, without the groups of steps a resumed run replays (as the metrics log drops them)."""
    path = run.out_dir / "groups.jsonl"
    if path.exists():
        kept = [g.to_json() for g in read_groups(path) if g.info.get("trained_version", 0) < run.sync.version]
        path.write_text("".join(line + "\n" for line in kept))
    return GroupWriter(path)


def _split_threads(cfg: AsyncGRPOConfig) -> tuple[int | None, int | None]:
    """torch threads of the trainer and of each generator: the cores split between them unless set."""
    if not cfg.device.startswith("cpu"):
        return cfg.num_threads, cfg.generator_threads or cfg.num_threads
    cores = usable_cpus()
    if cfg.backend == "ray":  # generators live on other machines' cores: one each unless told
        return cfg.num_threads or cores, cfg.generator_threads or 1
    share = max(1, cores // (1 + cfg.num_generators))
    return cfg.num_threads or share, cfg.generator_threads or cfg.num_threads or share


def _sandbox_runs(cfg: AsyncGRPOConfig) -> int | None:
    """Sandboxed runs each generator lets go at once: the machine's CPUs split between the generators
    (a per-process bound each, so together they would run one per CPU each), unless the user set
    ``TREERL_SANDBOX_MAX_CONCURRENT`` or the generators are Ray actors on other machines.

    >>> _sandbox_runs(AsyncGRPOConfig(output_dir="x", num_generators=2)) == max(1, usable_cpus() // 2)
    True
    """
    if cfg.backend == "ray" or os.environ.get("TREERL_SANDBOX_MAX_CONCURRENT"):
        return None
    return max(1, usable_cpus() // cfg.num_generators)


def _set_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)


def _require_picklable(obj: Any, name: str) -> None:
    try:
        pickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - any pickling failure has the same fix
        raise ValueError(f"{name}={obj!r} cannot be pickled ({exc}), so it cannot reach the generator processes; "
                         "pass a module-level function or a functools.partial of one.") from None


def _make_pool(cfg: AsyncGRPOConfig, spec: GeneratorSpec) -> Any:
    if cfg.backend == "ray":
        from treerl.learners.async_ray import RayPool

        return RayPool(spec, num_generators=cfg.num_generators, heartbeat_timeout=cfg.heartbeat_timeout,
                       address=cfg.ray_address)
    return ProcessPool(spec, num_generators=cfg.num_generators, heartbeat_timeout=cfg.heartbeat_timeout,
                       weight_transport=cfg.weight_transport)


register_learner("async_grpo", AsyncGRPOConfig, train_async,
                 "GRPO with generation and training in separate processes: bounded buffer, staleness control, "
                 "score centering.")
