"""Weights from the trainer to a generator by a collective broadcast: NCCL on GPUs, gloo on CPU.

The trainer and each generator process form a process group of their own with
``torch.distributed`` (a ``TCPStore`` the trainer serves on loopback, one key prefix per
generator): rank 0 is the trainer, rank 1 the generator. The group is built from the store
directly, not through ``init_process_group``, so it lives beside any default group the trainer
already runs under torchrun or accelerate. One pair per generator rather than one group of all:
a generator that dies is replaced by a new process that forms a pair of its own, and the other
generators' groups are untouched (a group of every generator would have to be re-formed by all
of them at each restart).

One version travels in two parts:

1. over the generator's pipe, ``("weights_broadcast", version, layout, bucket_bytes)``: the
   names, shapes and dtypes of the state dict, in order (small);
2. over the group: a header ``[version, num_buckets, numel]`` (int64), then the buckets, each
   the flat concatenation of consecutive tensors of one dtype up to ``bucket_bytes``.

The receiver checks the header against the announced version and layout (a mismatch is a bug
and raises), and rebuilds the state dict as views of the buckets; the generator loads it
between its batches. With NCCL every tensor is on the group's GPU, so weights never pass
through host memory; the trainer and each generator need a GPU of their own (NCCL refuses two
ranks on one device: on one shared GPU use the file transport).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GroupAddress", "WeightGroup", "layout_of", "plan_buckets", "serve_store", "backend_for",
           "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 64 << 20
"""Bytes per broadcast: large enough that per-call overhead vanishes, small enough to bound the copy."""

Layout = list[tuple[str, tuple[int, ...], str]]


def backend_for(device: str) -> str:
    """``nccl`` for a CUDA device, else ``gloo``.

    >>> backend_for("cuda:1"), backend_for("cpu")
    ('nccl', 'gloo')
    """
    return "nccl" if device.startswith("cuda") else "gloo"


def layout_of(state: Mapping[str, Tensor]) -> Layout:
    """``(name, shape, dtype)`` of each tensor, in order: what the receiver allocates.

    >>> layout_of({"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)})
    [('w', (2, 3), 'float32'), ('b', (3,), 'bfloat16')]
    """
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()]


def plan_buckets(layout: Layout, bucket_bytes: int) -> list[list[int]]:
    """Indices of ``layout`` grouped into buckets: consecutive tensors of one dtype, each bucket
    at most ``bucket_bytes`` unless a single tensor is larger (then it is a bucket of its own).

    >>> lay = [("a", (4,), "float32"), ("b", (4,), "float32"), ("c", (2,), "bfloat16"), ("d", (8,), "float32")]
    >>> plan_buckets(lay, 32)
    [[0, 1], [2], [3]]
    >>> plan_buckets(lay, 16)
    [[0], [1], [2], [3]]
    """
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, shape, name) in enumerate(layout):
        nbytes = math.prod(shape) * _dtype(name).itemsize
        if not buckets or name != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, name
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight layout: {name!r} is not a torch dtype")
    return dtype


def serve_store(timeout_s: float) -> torch.distributed.TCPStore:
    """The trainer's store on loopback, on a free port (``store.port``); generators join it."""
    from torch import distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


@dataclass(frozen=True)
class GroupAddress:
    """Where a generator joins its pair: picklable, it travels to the generator's process."""

    port: int
    prefix: str
    backend: str
    timeout_s: float


class WeightGroup:
    """One trainer-generator pair (rank 0 sends, rank 1 receives); construction waits for both.

    Args:
        address: the store's port, this pair's prefix, the backend and the timeout.
        rank: 0 on the trainer, 1 on the generator.
        device: where buffers live (the group's GPU for NCCL, ``cpu`` for gloo).
        store: the trainer's own store (rank 0); rank 1 connects to ``address.port``.
    """

    def __init__(self, address: GroupAddress, rank: int, device: str, store: torch.distributed.Store | None = None):
        from torch import distributed as dist

        timeout = datetime.timedelta(seconds=address.timeout_s)
        if store is None:
            store = dist.TCPStore("127.0.0.1", address.port, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(address.prefix, store)
        self.device = torch.device(device)
        if address.backend == "nccl":
            torch.cuda.set_device(self.device)
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, 2)
        else:
            self._pg = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
        self.rank = rank

    def _broadcast(self, tensor: Tensor) -> None:
        from torch import distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._pg.broadcast([tensor], opts).wait()

    def send(self, state: Mapping[str, Tensor], version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Layout:
        """Broadcast ``state`` as ``version`` (rank 0); returns the layout that was sent.

        The caller announces ``(version, layout, bucket_bytes)`` to the receiver first, so that
        it is waiting in :meth:`receive`.
        """
        tensors = list(state.values())
        layout = layout_of(state)
        buckets = plan_buckets(layout, bucket_bytes)
        numel = sum(t.numel() for t in tensors)
        self._broadcast(torch.tensor([version, len(buckets), numel], dtype=torch.int64, device=self.device))
        for bucket in buckets:
            flat = torch.cat([tensors[i].detach().reshape(-1).to(self.device) for i in bucket])
            self._broadcast(flat)
        return layout

    def receive(self, layout: Layout, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, Tensor]:
        """The state dict rank 0 sends as ``version`` with ``layout`` (rank 1); views of the buckets."""
        buckets = plan_buckets(layout, bucket_bytes)
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._broadcast(header)
        expected = [version, len(buckets), sum(math.prod(shape) for _, shape, _ in layout)]
        if header.tolist() != expected:
            raise RuntimeError(f"weight broadcast: the header says (version, buckets, numel) = {header.tolist()}, "
                               f"the announcement {expected}: the trainer and this generator are out of step")
        state: dict[str, Tensor] = {}
        for bucket in buckets:
            shapes = [layout[i][1] for i in bucket]
            flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=_dtype(layout[bucket[0]][2]),
                               device=self.device)
            self._broadcast(flat)
            for i, piece in zip(bucket, flat.split([math.prod(s) for s in shapes]), strict=True):
                state[layout[i][0]] = piece.view(layout[i][1])
        return state

    def close(self) -> None:
        # A pair's group holds sockets (and, with NCCL, a communicator); dropping the object frees them.
        self._pg = None

