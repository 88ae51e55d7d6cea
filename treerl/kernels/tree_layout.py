"""Where the tokens of a packed prefix tree sit in a row, and who may attend to whom.

Tree packing lays the unique tokens of a group's prefix tree into one row, depth first.
The row is a run of **segments**; each segment has a parent segment (or none). A token at
offset ``i`` of segment ``s`` attends to every token of every ancestor of ``s`` and to the
tokens of ``s`` at offsets ``<= i``. Its position id is its depth: the index it has in
every root-to-leaf path that contains it, so RoPE sees what the sampler saw.

Because the layout is depth first, the subtree of a segment is one contiguous token range
``[seg_start[s], subtree_end[s])``. That gives a one-line test of visibility that every
attention backend shares::

    key k is visible from query q  <=>  k <= q  and  q < subtree_end_of_token[k]

A :class:`TreeBatch` holds one :class:`TreeLayout` per row of a forward pass, rows padded
to a common length. Padding tokens become single-token root segments: each attends only
to itself, no real token attends to it, and it is never a loss position.

Example::

    >>> # a prompt of 3 tokens with two completions of 2 and 1 tokens
    >>> layout = TreeLayout.from_parents(seg_len=[3, 2, 1], seg_parent=[-1, 0, 0])
    >>> layout.position_ids().tolist()
    [0, 1, 2, 3, 4, 3]
    >>> layout.leaf_paths()
    [[0, 1], [0, 2]]
    >>> layout.path_token_index(2).tolist()
    [0, 1, 2, 5]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import torch
from torch import Tensor

__all__ = ["TreeLayout", "TreeBatch", "SegmentBucket", "SegmentPlan"]

T_ = TypeVar("T_")


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """The segments of one packed row, in depth-first order.

    Build it with :meth:`from_parents`; the constructor checks that the three tensors agree.
    """

    seg_start: Tensor
    """(S,) long: offset of each segment's first token; segments are contiguous from 0."""
    seg_len: Tensor
    """(S,) long: number of tokens of each segment, at least 1."""
    seg_parent: Tensor
    """(S,) long: index of the parent segment, or -1 for a root; parents come before children."""

    def __post_init__(self) -> None:
        for name in ("seg_start", "seg_len", "seg_parent"):
            value = getattr(self, name)
            if not isinstance(value, Tensor) or value.dim() != 1 or value.dtype != torch.long:
                raise ValueError(
                    f"TreeLayout.{name} must be a 1-D torch.long tensor, got {_describe(value)}; "
                    "build layouts with TreeLayout.from_parents(seg_len, seg_parent)."
                )
        num_segments = self.seg_len.numel()
        if self.seg_start.numel() != num_segments or self.seg_parent.numel() != num_segments:
            raise ValueError(
                "TreeLayout.seg_start, seg_len and seg_parent must have one entry per segment, got "
                f"{self.seg_start.numel()}, {num_segments} and {self.seg_parent.numel()}; "
                "build layouts with TreeLayout.from_parents(seg_len, seg_parent)."
            )
        if num_segments == 0:
            raise ValueError("TreeLayout needs at least one segment; a row with no tokens is all padding.")
        lens = self.seg_len.tolist()
        if min(lens) < 1:
            raise ValueError(
                f"TreeLayout.seg_len must be >= 1 for every segment, got {lens}; "
                "drop empty segments and attach their children to their parent."
            )
        starts = self.seg_start.tolist()
        expected = 0
        for s, (start, length) in enumerate(zip(starts, lens)):
            if start != expected:
                raise ValueError(
                    f"TreeLayout.seg_start[{s}] is {start} but segments must be contiguous from 0, so it should be "
                    f"{expected}; use TreeLayout.from_parents, which derives the starts from the lengths."
                )
            expected += length
        # Depth-first order is what makes a subtree one contiguous token range (see the module
        # docstring). Walk the segments with a stack of open ancestors: a segment's parent must
        # be on the stack, and everything above the parent is a finished subtree.
        stack: list[int] = []
        for s, parent in enumerate(self.seg_parent.tolist()):
            if parent >= s or parent < -1:
                raise ValueError(
                    f"TreeLayout.seg_parent[{s}] is {parent}; a parent must be -1 or an earlier segment "
                    "(parents come before their children)."
                )
            while stack and stack[-1] != parent:
                stack.pop()
            if parent != -1 and not stack:
                raise ValueError(
                    f"TreeLayout segment {s} has parent {parent}, whose subtree was already closed by a later "
                    "sibling branch; segments must be in depth-first order (each segment's whole subtree "
                    "before the next sibling of that segment)."
                )
            stack.append(s)

    @classmethod
    def from_parents(cls, seg_len: Sequence[int], seg_parent: Sequence[int]) -> TreeLayout:
        """Build a layout from segment lengths and parent indices (depth-first order).

        >>> TreeLayout.from_parents([2, 1, 1], [-1, 0, 1]).seg_start.tolist()
        [0, 2, 3]
        """
        lens = torch.as_tensor(list(seg_len), dtype=torch.long)
        starts = torch.zeros_like(lens)
        if lens.numel() > 1:
            starts[1:] = torch.cumsum(lens, 0)[:-1]
        return cls(seg_start=starts, seg_len=lens, seg_parent=torch.as_tensor(list(seg_parent), dtype=torch.long))

    # -- sizes --------------------------------------------------------------------------------

    @property
    def num_segments(self) -> int:
        return self.seg_len.numel()

    @cached_property
    def num_tokens(self) -> int:
        """Number of real (non-padding) tokens of the row."""
        return int(self.seg_len.sum())

    # -- per segment (python lists: S is small and these drive indexing) -----------------------

    @cached_property
    def _lens(self) -> list[int]:
        return self.seg_len.tolist()

    @cached_property
    def _starts(self) -> list[int]:
        return self.seg_start.tolist()

    @cached_property
    def _parents(self) -> list[int]:
        return self.seg_parent.tolist()

    @cached_property
    def seg_depth(self) -> list[int]:
        """Depth of each segment's first token: the number of tokens of its ancestors."""
        depth: list[int] = []
        for parent in self._parents:
            depth.append(0 if parent == -1 else depth[parent] + self._lens[parent])
        return depth

    @cached_property
    def subtree_end(self) -> list[int]:
        """Token offset one past the last token of each segment's subtree."""
        end = [start + length for start, length in zip(self._starts, self._lens)]
        # Children come after parents, so a reverse sweep sees every descendant first.
        for s in range(self.num_segments - 1, -1, -1):
            parent = self._parents[s]
            if parent != -1:
                end[parent] = max(end[parent], end[s])
        return end

    def seg_path(self, seg: int) -> list[int]:
        """Segments from the root down to ``seg``, inclusive."""
        path = [seg]
        while self._parents[path[-1]] != -1:
            path.append(self._parents[path[-1]])
        return path[::-1]

    def leaf_paths(self) -> list[list[int]]:
        """The root-to-leaf segment paths, one per leaf, in row order."""
        has_child = [False] * self.num_segments
        for parent in self._parents:
            if parent != -1:
                has_child[parent] = True
        return [self.seg_path(s) for s in range(self.num_segments) if not has_child[s]]

    def path_token_index(self, seg: int) -> Tensor:
        """(P,) long: row offsets of the tokens of the root-to-``seg`` path, in path order.

        Gathering a packed row with it gives back the unpacked sequence that ends with ``seg``.
        """
        ranges = [torch.arange(self._starts[s], self._starts[s] + self._lens[s]) for s in self.seg_path(seg)]
        return torch.cat(ranges)

    # -- per token ----------------------------------------------------------------------------

    def token_seg(self) -> Tensor:
        """(T,) long: the segment of each token."""
        return torch.repeat_interleave(torch.arange(self.num_segments), self.seg_len)

    def position_ids(self) -> Tensor:
        """(T,) long: each token's depth, the position it has in every path that contains it."""
        seg = self.token_seg()
        offset = torch.arange(self.num_tokens) - self.seg_start[seg]
        return torch.as_tensor(self.seg_depth, dtype=torch.long)[seg] + offset

    def subtree_end_of_token(self) -> Tensor:
        """(T,) long: for each token, the end of its segment's subtree (see the module docstring)."""
        return torch.as_tensor(self.subtree_end, dtype=torch.long)[self.token_seg()]

    def dense_mask(self) -> Tensor:
        """(T, T) bool, True where query row attends to key column. Reference and tests only: O(T^2).

        Built from ancestor paths, independently of the ``subtree_end`` shortcut the fast
        backends use, so that tests compare two derivations.
        """
        mask = torch.zeros(self.num_tokens, self.num_tokens, dtype=torch.bool)
        for s in range(self.num_segments):
            start, length = self._starts[s], self._lens[s]
            rows = slice(start, start + length)
            for ancestor in self.seg_path(s)[:-1]:
                a_start = self._starts[ancestor]
                mask[rows, a_start : a_start + self._lens[ancestor]] = True
            mask[rows, rows] = torch.ones(length, length, dtype=torch.bool).tril()
        return mask


@dataclass(frozen=True, eq=False)
class SegmentBucket:
    """Segments of similar (query length, path length), attended in one batched call.

    ``num`` segments, queries padded to ``q_len``, gathered path keys padded to ``k_len``.
    Tokens are flat indices into the ``(B * T)`` tokens of the batch.
    """

    q_index: Tensor
    """(N * Lq,) long: flat token of each query slot; padded slots repeat the segment's first token."""
    k_index: Tensor
    """(N * Lk,) long: flat token of each key slot (root-to-segment path order); padded slots repeat the first."""
    num_ancestor_tokens: Tensor
    """(N,) long: tokens of the segment's ancestors; key j is visible from query i iff j <= this + i."""
    q_valid: Tensor
    """(N * Lq,) bool: query slots that hold a real query token of the segment."""
    q_valid_rows: Tensor
    """(V,) long: positions of the True entries of ``q_valid``, in order."""
    num: int
    q_len: int
    k_len: int
    roots_only: bool = False
    """Every segment of the bucket is a root (no ancestors): its mask is plain causal, so the
    backend may use the causal kernel, which skips the masked half of the work."""
    q_start: int | None = None
    """Set when the query slots are the consecutive flat tokens ``[q_start, q_start + num * q_len)``
    (every segment exactly ``q_len`` tokens, one after the other, as packed episodes of equal
    length or equally long siblings are): a view of the row then replaces the gather, and for a
    root bucket, whose keys are its queries, the key gather too."""

    def mask(self, sliding_window: int | None = None) -> Tensor:
        """(N, Lq, Lk) bool: causal-on-path visibility, plus the sliding window if given.

        Key slot ``j`` of a path holds depth ``j`` and query slot ``i`` holds depth
        ``num_ancestor_tokens + i``, so depth arithmetic needs no per-token tables. Padded
        query slots see key 0 only, so no softmax row is empty (an empty row is NaN in the
        backward pass even where its output is dropped).
        """
        device = self.q_index.device
        q_depth = self.num_ancestor_tokens[:, None] + torch.arange(self.q_len, device=device)  # (N, Lq)
        k_depth = torch.arange(self.k_len, device=device)  # (Lk,)
        mask = k_depth[None, None, :] <= q_depth[:, :, None]  # (N, Lq, Lk)
        if sliding_window is not None:
            mask &= q_depth[:, :, None] - k_depth[None, None, :] < sliding_window
        padded = ~self.q_valid.view(self.num, self.q_len)  # (N, Lq)
        mask[padded] = False
        mask[..., 0] |= padded
        return mask


@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """How the ``segment`` backend walks a batch: buckets, and the order that undoes them."""

    buckets: tuple[SegmentBucket, ...]
    inverse_order: Tensor
    """(B * T,) long: where each flat token's output sits in the concatenation of bucket outputs."""
    in_order: bool = False
    """The concatenation of bucket outputs is already in flat token order (``inverse_order`` is
    the identity), as when a row's buckets follow each other depth first: no final gather."""


def _bucket_size(n: int) -> int:
    """Smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... that is >= n: padding wastes at most 50%."""
    size = 1
    while True:
        if size >= n:
            return size
        if size >= 2 and size + size // 2 >= n:
            return size + size // 2
        size *= 2


class TreeBatch:
    """The packing metadata of one forward pass: one :class:`TreeLayout` per row.

    Pass it to the model as ``model(input_ids, position_ids=batch.position_ids(), tree_layout=batch)``
    after :func:`treerl.kernels.tree_attention.enable_tree_attention`. It caches what the
    attention backends derive from it (per device), so every layer of one forward reuses the
    same index tensors; build a new one per forward.

    >>> batch = TreeBatch([TreeLayout.from_parents([2, 1], [-1, 0])], length=4)
    >>> batch.position_ids().tolist()
    [[0, 1, 2, 0]]
    >>> batch.is_real().tolist()
    [[True, True, True, False]]
    """

    def __init__(self, layouts: Sequence[TreeLayout], length: int | None = None):
        layouts = list(layouts)
        if not layouts or not all(isinstance(layout, TreeLayout) for layout in layouts):
            raise ValueError(
                "TreeBatch needs a non-empty sequence of TreeLayout, one per row, got "
                f"{[type(layout).__name__ for layout in layouts]}."
            )
        longest = max(layout.num_tokens for layout in layouts)
        if length is None:
            length = longest
        if length < longest:
            raise ValueError(
                f"TreeBatch length={length} is shorter than the longest row ({longest} tokens); "
                f"pass length >= {longest} or leave it None."
            )
        self.layouts: tuple[TreeLayout, ...] = tuple(layouts)
        self.length: int = int(length)
        self._cache: dict[tuple, object] = {}

    @property
    def batch_size(self) -> int:
        return len(self.layouts)

    def __len__(self) -> int:
        return len(self.layouts)

    def _padded(self, row: Tensor, fill: Tensor | int) -> Tensor:
        pad = self.length - row.numel()
        if isinstance(fill, Tensor):
            return torch.cat([row, fill[row.numel() :]])
        return torch.cat([row, torch.full((pad,), fill, dtype=row.dtype)])

    def position_ids(self, device: torch.device | str | None = None) -> Tensor:
        """(B, T) long: token depths; padding gets 0."""
        rows = [self._padded(layout.position_ids(), 0) for layout in self.layouts]
        return torch.stack(rows).to(device)

    def is_real(self, device: torch.device | str | None = None) -> Tensor:
        """(B, T) bool: True for tokens of the tree, False for padding."""
        positions = torch.arange(self.length)
        return torch.stack([positions < layout.num_tokens for layout in self.layouts]).to(device)

    def cached(self, key: tuple, build: Callable[[], T_]) -> T_:
        """``build()`` once per ``key`` for the life of this batch (e.g. per device, per backend).

        Every attention layer of one forward sees the same batch, so what a backend derives
        from the layouts (index tensors, a block mask) is built by the first layer only.
        """
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]  # type: ignore[return-value]

    def subtree_end_of_token(self, device: torch.device | str) -> Tensor:
        """(B, T) long: see the module docstring; a padding token's subtree is itself."""

        def build() -> Tensor:
            own_end = torch.arange(1, self.length + 1)
            rows = [self._padded(layout.subtree_end_of_token(), own_end) for layout in self.layouts]
            return torch.stack(rows).to(device)

        return self.cached(("subtree_end", str(device)), build)

    def dense_mask(self, device: torch.device | str | None = None) -> Tensor:
        """(B, T, T) bool: the tree mask of each row; padding attends to itself only."""
        masks = []
        for layout in self.layouts:
            mask = torch.eye(self.length, dtype=torch.bool)
            n = layout.num_tokens
            mask[:n, :n] = layout.dense_mask()
            masks.append(mask)
        return torch.stack(masks).to(device)

    def segment_plan(self, device: torch.device | str) -> SegmentPlan:
        """The buckets of the ``segment`` backend (built once per device, then reused)."""
        return self.cached(("segment_plan", str(device)), lambda: self._build_segment_plan(torch.device(device)))

    def _build_segment_plan(self, device: torch.device) -> SegmentPlan:
        # One entry per segment of the whole batch, padding tokens as single-token roots:
        # (flat query tokens, flat path key tokens, number of ancestor tokens).
        entries: list[tuple[list[int], list[int], int]] = []
        for row, layout in enumerate(self.layouts):
            base = row * self.length
            token_ranges = [
                list(range(base + start, base + start + length)) for start, length in zip(layout._starts, layout._lens)
            ]
            for s in range(layout.num_segments):
                path = layout.seg_path(s)
                keys = [token for seg in path for token in token_ranges[seg]]
                entries.append((token_ranges[s], keys, len(keys) - layout._lens[s]))
            for token in range(base + layout.num_tokens, base + self.length):
                entries.append(([token], [token], 0))

        # Roots apart from the rest, so that buckets of roots can take the causal kernel.
        groups: dict[tuple[int, int, bool], list[int]] = {}
        for e, (queries, keys, num_ancestor_tokens) in enumerate(entries):
            key = (_bucket_size(len(queries)), _bucket_size(len(keys)), num_ancestor_tokens == 0)
            groups.setdefault(key, []).append(e)

        buckets = []
        order: list[int] = []  # flat token of each row of the concatenated bucket outputs
        for (_, _, roots_only), group in groups.items():
            q_len = max(len(entries[e][0]) for e in group)
            k_len = max(len(entries[e][1]) for e in group)
            q_index, k_index, q_valid, ancestors = [], [], [], []
            for e in group:
                queries, keys, num_ancestor_tokens = entries[e]
                q_index += queries + [queries[0]] * (q_len - len(queries))
                q_valid += [True] * len(queries) + [False] * (q_len - len(queries))
                k_index += keys + [keys[0]] * (k_len - len(keys))
                ancestors.append(num_ancestor_tokens)
                order += queries
            valid = torch.tensor(q_valid, dtype=torch.bool)
            first = q_index[0]
            # The lists, not the tensor: iterating a tensor makes a 0-d tensor and a .item() per token.
            contiguous = all(q_valid) and q_index == list(range(first, first + len(q_index)))
            buckets.append(
                SegmentBucket(
                    q_index=torch.tensor(q_index, dtype=torch.long, device=device),
                    k_index=torch.tensor(k_index, dtype=torch.long, device=device),
                    num_ancestor_tokens=torch.tensor(ancestors, dtype=torch.long, device=device),
                    q_valid=valid.to(device),
                    q_valid_rows=valid.nonzero().squeeze(1).to(device),
                    num=len(group),
                    q_len=q_len,
                    k_len=k_len,
                    roots_only=roots_only,
                    q_start=first if contiguous else None,
                )
            )
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        in_order = order == list(range(len(order)))
        return SegmentPlan(buckets=tuple(buckets), inverse_order=inverse.to(device), in_order=in_order)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor"
    return type(value).__name__
