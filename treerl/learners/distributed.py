"""Data parallelism for the learners: several processes, one optimizer step.

Launched with ``accelerate launch`` (or ``torchrun``), every process runs the same loop on
its share of the step's tasks::

    accelerate launch --multi_gpu --num_processes 2 -m treerl.cli learn --env ID --output-dir runs/x

(``--multi_gpu`` asks for torchrun-style processes; on a machine without GPUs they train on
the CPU and talk over gloo, on GPUs over NCCL, one GPU each.) What each stage does with
``R`` ranks:

- **rollout**: rank ``r`` plays tasks ``r, r + R, ...`` of the step, so the union is the
  single-process step. Sampling is seeded per (seed, task, generation, turn), so a task
  gives the same trajectory whichever rank plays it.
- **advantages**: a group lives on one rank; the rewards of all ranks are gathered anyway
  (a few floats per episode) so that a batch-wide scale and the reward metrics see the
  whole step.
- **loss**: the normalizer's window counts (``num_tokens``, ``num_sequences``) are summed
  over ranks, so each rank's loss is its share of the global loss
  (:class:`treerl.learners.losses.LossNormalizer`). Per-episode counts stay rank-local:
  a rank's episodes are whole and indexed locally.
- **step**: gradients are summed over ranks (``all_reduce``), so every rank holds the
  single-process gradient and takes the same optimizer step; no DDP wrapper is needed.
- **logging**: metrics are combined over ranks; only rank 0 writes metrics, checkpoints
  and the model, and evaluates.

With one process nothing here communicates and no process group is created.

>>> ranks = Ranks()
>>> ranks.enabled, ranks.is_main, ranks.shard(range(8, 16))
(False, True, range(8, 16))
>>> Ranks(rank=1, world_size=3).shard(range(8, 16))
range(9, 16, 3)
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from treerl.learners.forward import window_normalizer
from treerl.learners.losses import LossNormalizer
from treerl.learners.packing import PackedBatch

__all__ = ["Ranks", "is_main_process"]

# Gradients are all-reduced in flat buckets of at most this many elements: one collective
# per bucket instead of one per parameter, without a second copy of every gradient at once.
_BUCKET_NUMEL = 1 << 22


def is_main_process() -> bool:
    """Whether this process is rank 0 (or the only one)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@dataclass(frozen=True)
class Ranks:
    """This process's place in a data-parallel run; ``Ranks()`` is the single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    """The process group's backend (``gloo``, ``nccl``); ``None`` on one process."""

    @classmethod
    def from_env(cls, device: str, timeout_s: float = 1800.0) -> Ranks:
        """The ranks ``accelerate launch``/``torchrun`` set up (``WORLD_SIZE``, ``RANK``, ...).

        Uses a process group that is already initialized; else initializes one from the
        environment: NCCL for CUDA devices, gloo otherwise, whose collectives wait up to
        ``timeout_s`` (NCCL's own default, 10 minutes, is shorter than a held-out evaluation
        of a large model that the other ranks wait through). Without ``WORLD_SIZE > 1``
        returns the single process.
        """
        initialized = dist.is_available() and dist.is_initialized()
        if not initialized and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls()
        if not initialized:
            if device.startswith("cuda"):
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        world_size = dist.get_world_size()
        if world_size == 1:
            return cls()
        rank = dist.get_rank()
        return cls(rank=rank, world_size=world_size, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                   backend=str(dist.get_backend()))

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, device: str) -> str:
        """Each rank's own GPU for a bare ``cuda``; any other device as given."""
        return f"cuda:{self.local_rank}" if self.enabled and device == "cuda" else device

    @property
    def _comm_device(self) -> torch.device:
        # NCCL only moves CUDA tensors; gloo moves CPU ones.
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def shard(self, tasks: range) -> range:
        """This rank's tasks: every ``world_size``-th one, starting at ``rank``."""
        return tasks[self.rank::self.world_size]

    # -- collectives (identity on one process) ---------------------------------------------

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks, in float64."""
        if not self.enabled:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    # -- the stages ------------------------------------------------------------------------

    def normalizer(self, batches: Sequence[PackedBatch]) -> LossNormalizer:
        """:func:`window_normalizer` with ``num_tokens`` and ``num_sequences`` summed over ranks."""
        local = window_normalizer(batches)
        if not self.enabled:
            return local
        num_tokens, num_sequences = self.sum([local.num_tokens, local.num_sequences])
        return LossNormalizer(num_tokens=num_tokens, num_sequences=num_sequences,
                              episode_num_tokens=local.episode_num_tokens)

    def gather_episodes(self, rewards: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, slice]:
        """All ranks' rewards ``(E_all, R)`` and group labels ``(E_all,)``, and this rank's rows.

        Labels are made distinct across ranks (each rank's are shifted past the ones before).
        """
        if not self.enabled:
            return rewards, group, slice(0, rewards.shape[0])
        parts = self.gather((rewards.cpu(), group.cpu()))
        first = sum(rew.shape[0] for rew, _ in parts[:self.rank])
        all_groups, shift = [], 0
        for _, grp in parts:
            all_groups.append(grp + shift)
            shift += int(grp.max()) + 1 if grp.numel() else 0
        all_rewards = torch.cat([rew for rew, _ in parts])
        return all_rewards, torch.cat(all_groups), slice(first, first + rewards.shape[0])

    def gather_episode_values(self, values: dict[str, list[Any]], group_sizes: Sequence[int]) -> dict[str, list[Any]]:
        """Every rank's per-episode lists ``name -> (E,)`` as one step's, in task order.

        ``group_sizes`` are this rank's groups' episode counts. Rank ``r``'s ``j``-th group is
        the step's task ``r + j * R`` (:meth:`shard`), so the groups are interleaved back; a
        name a rank did not log is ``None`` for its episodes, and a list that is not one value
        per episode is appended whole, in rank order.
        """
        if not self.enabled:
            return dict(values)
        parts = self.gather((values, list(group_sizes)))
        names = list(dict.fromkeys(name for part, _ in parts for name in part))
        out: dict[str, list[Any]] = {name: [] for name in names}
        for name in names:
            per_episode = all(len(part.get(name, ())) in (0, sum(sizes)) for part, sizes in parts)
            if not per_episode:
                out[name] = [v for part, _ in parts for v in part.get(name, [])]
                continue
            starts = [[sum(sizes[:j]) for j in range(len(sizes) + 1)] for _, sizes in parts]
            for j in range(max(len(sizes) for _, sizes in parts)):
                for (part, sizes), start in zip(parts, starts):
                    if j < len(sizes):
                        got = part.get(name)
                        out[name] += got[start[j]:start[j + 1]] if got is not None else [None] * sizes[j]
        return out

    def sum_dicts(self, totals: dict[str, float]) -> dict[str, float]:
        """Key-wise sums of every rank's ``totals`` (keys missing on a rank count 0)."""
        if not self.enabled:
            return dict(totals)
        out: dict[str, float] = {}
        for part in self.gather(totals):
            for k, v in part.items():
                out[k] = out.get(k, 0.0) + float(v)
        return out

    def mean_metrics(self, metrics: dict[str, float], weight: float) -> dict[str, float]:
        """Rank-local metrics combined for logging: means weighted by ``weight`` (e.g. the
        rank's episodes), except times (``perf/*_s``: the slowest rank) and ``tree/rows`` (summed)."""
        if not self.enabled:
            return dict(metrics)
        parts = self.gather((metrics, float(weight)))
        out: dict[str, float] = {}
        for key in dict.fromkeys(k for m, _ in parts for k in m):
            have = [(float(m[key]), w) for m, w in parts if key in m]
            if key.startswith("perf/") and key.endswith("_s"):
                out[key] = max(v for v, _ in have)
            elif key == "tree/rows":
                out[key] = sum(v for v, _ in have)
            else:
                total = sum(w for _, w in have)
                out[key] = sum(v * w for v, w in have) / total if total else sum(v for v, _ in have) / len(have)
        return out

    @torch.no_grad()
    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over ranks, in place.

        A parameter that got a gradient on some rank but not on this one takes part with
        zeros; one that got none anywhere keeps ``grad=None`` (the optimizer skips it), as on
        one process.
        """
        if not self.enabled:
            return
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self._comm_device)
        dist.all_reduce(has)
        grads = []
        for p, any_rank in zip(params, has.tolist()):
            if any_rank:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        bucket: list[torch.Tensor] = []
        for g in grads:
            if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device
                           or sum(b.numel() for b in bucket) + g.numel() > _BUCKET_NUMEL):
                self._all_reduce_flat(bucket)
                bucket = []
            bucket.append(g)
        if bucket:
            self._all_reduce_flat(bucket)

    def _all_reduce_flat(self, tensors: list[torch.Tensor]) -> None:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if self.backend == "gloo" and flat.device.type != "cpu":
            host = flat.cpu()
            dist.all_reduce(host)
            flat = host.to(flat.device)
        else:
            dist.all_reduce(flat)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    @torch.no_grad()
    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Rank 0's weights and buffers to every rank, so all start from the same model."""
        if not self.enabled:
            return
        for t in model.state_dict().values():
            if self.backend == "gloo" and t.device.type != "cpu":
                host = t.cpu()
                dist.broadcast(host, src=0)
                t.copy_(host)
            else:
                dist.broadcast(t, src=0)
