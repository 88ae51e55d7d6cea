"""Which key blocks each query block of a tree-packed row needs: the host pre-pass of the Triton kernels.

A tree-packed row (see :mod:`treerl.kernels.tree_layout`) lets query ``q`` see key ``k``
iff ``k <= q and q < subtree_end_of_token[k]``. Cut the row into query blocks of
``block_m`` tokens and key blocks of ``block_n``: a query block needs only the key blocks
of its root-to-segment paths plus its own causal diagonal, which for a group of siblings
is a small fraction of the row. :func:`tree_block_sparsity` lists, per query block, the
key blocks with at least one visible key, and per key block the query blocks that see
it; the kernels of :mod:`treerl.kernels.triton_tree_attention_kernels` walk those lists
only.

Invariants: a listed pair holds at least one visible (query, key) pair (exactly so
without a sliding window; with one the lists may hold a few extra pairs, never miss one);
lists are ascending; only the first ``num_*`` entries of a row are real. Everything here
is a few torch ops on ``(B, T)`` tensors, with no Triton, and is cached on the
:class:`TreeBatch` so every layer of a forward reuses it.

A 32-token prompt whose two 16-token answers each see the prompt and themselves, not
each other, in blocks of 16 tokens::

    >>> from treerl.kernels.tree_layout import TreeBatch, TreeLayout
    >>> batch = TreeBatch([TreeLayout.from_parents([32, 16, 16], [-1, 0, 0])])
    >>> sparsity = tree_block_sparsity(batch, 16, 16, "cpu")
    >>> sparsity.kv_blocks[0, 3, : sparsity.num_kv_blocks[0, 3]].tolist()   # the second answer's key blocks
    [0, 1, 3]
    >>> sparsity.density()   # 9 of the 16 block pairs; causal attention would visit 10
    0.5625
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from treerl.kernels.tree_layout import TreeBatch

__all__ = ["TreeBlockSparsity", "cached_depth", "tree_block_mask", "tree_block_sparsity"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class TreeBlockSparsity:
    """Block lists of one :class:`TreeBatch`: what each kernel program visits.

    Rows of ``kv_blocks`` (``q_blocks``) hold ascending block indices; only the first
    ``num_kv_blocks`` (``num_q_blocks``) entries of a row are meaningful, the rest is filler
    that no kernel reads.
    """

    block_m: int
    """Query tokens per block."""
    block_n: int
    """Key tokens per block."""
    kv_blocks: Tensor
    """(B, NQB, W) int32: key blocks with a key visible from the query block, ascending."""
    num_kv_blocks: Tensor
    """(B, NQB) int32: how many entries of each row of ``kv_blocks`` are real."""
    q_blocks: Tensor
    """(B, NKB, W') int32: query blocks with a query that sees the key block, ascending."""
    num_q_blocks: Tensor
    """(B, NKB) int32: how many entries of each row of ``q_blocks`` are real."""

    @property
    def num_query_blocks(self) -> int:
        return self.num_kv_blocks.shape[1]

    @property
    def num_key_blocks(self) -> int:
        return self.num_q_blocks.shape[1]

    def density(self) -> float:
        """Fraction of (query block, key block) pairs visited; 1.0 would be dense attention."""
        visited = float(self.num_kv_blocks.sum())
        return visited / (self.num_kv_blocks.shape[0] * self.num_query_blocks * self.num_key_blocks)


def tree_block_mask(
    batch: TreeBatch,
    block_m: int,
    block_n: int,
    device: torch.device | str,
    sliding_window: int | None = None,
) -> Tensor:
    """(B, NQB, NKB) bool: True where a query block has at least one visible key in a key block.

    Exact without a sliding window. Each key ``k`` is seen by the query interval
    ``[k, subtree_end[k])``, so for a key block wholly before the query block it is enough
    that the block's largest ``subtree_end`` passes the query block's first token; a key
    block overlapping the query block always holds a token that sees itself; a key block
    after it is never needed. With a window it stays a superset: a pair of blocks is
    dropped only if even the shallowest query is ``sliding_window`` deeper than the
    deepest key, and the per-token window test in the kernel does the rest.
    """
    length = batch.length
    num_q_blocks, num_k_blocks = _cdiv(length, block_m), _cdiv(length, block_n)
    subtree_end = batch.subtree_end_of_token(device)  # (B, T)
    # Keys past the row end get subtree_end 0: they are seen by nobody.
    padded = torch.nn.functional.pad(subtree_end, (0, num_k_blocks * block_n - length))  # (B, NKB * BN)
    max_end = padded.view(batch.batch_size, num_k_blocks, block_n).amax(-1)  # (B, NKB)
    q_first = torch.arange(num_q_blocks, device=device) * block_m  # (NQB,)
    q_end = (q_first + block_m).clamp(max=length)
    k_first = torch.arange(num_k_blocks, device=device) * block_n  # (NKB,)
    k_end = (k_first + block_n).clamp(max=length)
    not_after = k_first[None, :] < q_end[:, None]  # (NQB, NKB)
    overlaps = not_after & (k_end[None, :] > q_first[:, None])  # (NQB, NKB)
    mask = not_after[None] & (overlaps[None] | (max_end[:, None, :] > q_first[None, :, None]))  # (B, NQB, NKB)
    if sliding_window is not None:
        depth = cached_depth(batch, device)  # (B, T)
        # Pad with depths no real token has (all are in [0, length)), so padding never wins a min or max.
        q_min = torch.nn.functional.pad(depth, (0, num_q_blocks * block_m - length), value=length)
        q_min = q_min.view(batch.batch_size, num_q_blocks, block_m).amin(-1)  # (B, NQB)
        k_max = torch.nn.functional.pad(depth, (0, num_k_blocks * block_n - length), value=-1)
        k_max = k_max.view(batch.batch_size, num_k_blocks, block_n).amax(-1)  # (B, NKB)
        mask &= q_min[:, :, None] - k_max[:, None, :] < sliding_window
    return mask


def tree_block_sparsity(
    batch: TreeBatch,
    block_m: int,
    block_n: int,
    device: torch.device | str,
    sliding_window: int | None = None,
) -> TreeBlockSparsity:
    """The block lists the kernels walk, from :func:`tree_block_mask` (see :class:`TreeBlockSparsity`)."""
    mask = tree_block_mask(batch, block_m, block_n, device, sliding_window)  # (B, NQB, NKB)
    kv_blocks, num_kv_blocks = _lists(mask)
    q_blocks, num_q_blocks = _lists(mask.transpose(1, 2))
    sparsity = TreeBlockSparsity(block_m, block_n, kv_blocks, num_kv_blocks, q_blocks, num_q_blocks)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "tree attention: %d x %d tiles, %.1f%% of block pairs visited", block_m, block_n, 100 * sparsity.density()
        )
    return sparsity


def _lists(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(B, R, C) bool -> ((B, R, W) int32 column indices of the True entries first, ascending; (B, R) counts)."""
    num_cols = mask.shape[-1]
    counts = mask.sum(-1)  # (B, R)
    width = max(int(counts.max()), 1)  # one host sync per batch, not per layer (the result is cached)
    cols = torch.arange(num_cols, device=mask.device)
    # True entries sort by their column; False ones after all of them.
    order = torch.where(mask, cols, cols + num_cols).sort(-1).values[..., :width] % num_cols
    return order.to(torch.int32).contiguous(), counts.to(torch.int32).contiguous()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cached_depth(batch: TreeBatch, device: torch.device | str) -> Tensor:
    """(B, T) long position ids (depths), cached on the batch for every layer (the kernels' window test reads them)."""
    return batch.cached(("depth", str(device)), lambda: batch.position_ids(device))
