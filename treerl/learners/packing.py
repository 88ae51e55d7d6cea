"""Tree packing: groups of trajectory trees laid into rows, and the flat list of loss terms.

A group's episodes share their prompt, and branched rollouts share more. Packing lays the
**unique** tokens of each group's tree into a row, depth first, so the forward pass runs
each shared token once (:mod:`treerl.kernels.tree_layout` says who attends to whom). The
loss is never deduplicated (DESIGN.md, principle 3): every (sampled token, episode) pair
is one **loss term**, exactly as in an unpacked batch with one row per episode.

What a :class:`PackedBatch` holds
---------------------------------
- ``input_ids`` and ``position_ids`` ``(B, T)``: the rows; a token's position id is its
  depth, the index it has in every root-to-leaf path that contains it, so RoPE sees what
  the sampler saw.
- ``layouts``: the :class:`~treerl.kernels.tree_layout.TreeBatch` for tree attention.
- **Loss positions** ``(N,)``, one per packed sampled token: ``loss_row``/``loss_pos``
  locate the hidden state that predicts it (the token before it on its path; for the
  first token of a segment, the last token of its parent), ``loss_target`` is its id,
  with its sampler log-prob and candidate set. A parent's last position predicts the first
  token of each of its children, so one position may appear several times with different
  targets.
- **Terms** ``(M,)``: ``term_loss`` indexes the loss positions, ``term_episode`` and
  ``term_adv`` say whose term it is. A sampled token shared by ``k`` episodes (a nested
  fork) is one loss position and ``k`` terms; the LM head runs once for it and the
  gradient of the gather sums the ``k`` terms, which is the gradient of the unpacked batch.
- ``episode_num_tokens`` ``(E,)``: each episode's term count over everything packed in
  one call, for :class:`~treerl.learners.losses.LossNormalizer`.
- ``token_num_paths`` ``(B, T)``: how many episode paths hold each token (a prompt shared by
  ``k`` episodes: ``k``), so that a mean over tokens weighted by it is the unpacked batch's
  (the router's load-balancing loss of a Mixture-of-Experts model).

Modes
-----
- ``tree``: each group's tree once (chains of single-child segments become one layout
  segment). A group stays in one row; a group larger than the row budget alone is split
  by episodes (shared prefixes then appear once per piece); an episode larger than the
  budget raises :class:`PackingError`.
- ``flat``: each root-to-leaf path its own root segment, no sharing; rows packed the same
  way. For comparison (benchmarks), and to check the tree path.
- ``padded``: one path per row, the classic padded batch. Rows are plain causal
  sequences, so any causal LM runs them with its own attention: the mode for models tree
  attention cannot serve (linear-attention hybrids, soft-capping).

Token-identical sibling segments (two samples with the same text) are packed twice, not
merged into a trie: merging would save little and each keeps its own sampler log-probs.

Rows are balanced by attention work
-----------------------------------
A query token attends to its ancestors' tokens and to the earlier tokens of its segment,
so a piece's attention work is ``sum_s len_s * depth_s + len_s * (len_s + 1) / 2`` key-query
pairs over its layout segments (``depth_s`` = tokens of the segment's ancestors). A shallow
bushy tree costs less than a chain of the same length. The packer opens as many rows as
first-fit-decreasing by tokens needs, then places pieces largest work first into the row
with the least work that still has room (opening a row only when none has), so rows carry
similar attention work, not merely similar lengths.

Example:
    >>> from treerl.rollout.trajectory import Group
    >>> g = Group(task_key="t", env_id="demo")
    >>> root = g.add_segment("prompt", [5, 6, 7])
    >>> a = g.add_segment("sampled", [8, 9], parent=root, logprobs=[-0.1, -0.2])
    >>> b = g.add_segment("sampled", [10], parent=root, logprobs=[-0.3])
    >>> _ = g.add_episode(leaf=a, reward=1.0); _ = g.add_episode(leaf=b, reward=0.0)
    >>> [batch] = pack_groups([g], [0.5, -0.5], PackingConfig(max_tokens_per_row=16))
    >>> batch.input_ids.tolist(), batch.position_ids.tolist()
    ([[5, 6, 7, 8, 9, 10]], [[0, 1, 2, 3, 4, 3]])
    >>> batch.loss_pos.tolist(), batch.loss_target.tolist()   # position 2 predicts 8 and 10
    ([2, 3, 2], [8, 9, 10])
    >>> batch.term_episode.tolist(), batch.term_adv.tolist()
    ([0, 0, 1], [0.5, 0.5, -0.5])
    >>> batch.token_num_paths.tolist()   # the prompt is on both episodes' paths
    [[2.0, 2.0, 2.0, 1.0, 1.0, 1.0]]
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from treerl.kernels.tree_layout import TreeBatch, TreeLayout
from treerl.learners.packed_batch import (
    PACK_MODES,
    PackedBatch,
    PackingConfig,
    PackingError,
    SamplerHead,
    head_tensors,
    packing_metrics,
)
from treerl.rollout.trajectory import Group, Segment

__all__ = [
    "PACK_MODES",
    "PackedBatch",
    "PackingConfig",
    "PackingError",
    "attention_work",
    "pack_groups",
    "packing_metrics",
]

@dataclass
class _Piece:
    """Tokens that must sit whole in one row: one tree, or a forest of root segments."""

    token_ids: list[int]
    seg_len: list[int]
    """Layout segments (chains of single-child tree segments merged)."""
    seg_parent: list[int]
    pred: list[int]
    """Per token, the index of the token whose hidden state predicts it; -1 for a root's first."""
    depth: list[int]
    """Per token, its position in every path that contains it (its position id)."""
    work: int = 0
    num_paths: list[int] | None = None
    """Per token, the episode paths through it (set by :func:`_unit`)."""


@dataclass
class _Unit:
    """Episodes that stay together (one micro-batch), their pieces and their loss terms."""

    pieces: list[_Piece]
    targets: list[tuple[int, int, float, list[int] | None, SamplerHead | None]]
    """Loss positions: (piece, token index, sampler log-prob, candidate set or None)."""
    terms: list[tuple[int, int]]
    """(index into ``targets``, global episode)."""
    num_path_tokens: int

    @property
    def num_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.pieces)


def attention_work(seg_len: Sequence[int], seg_parent: Sequence[int]) -> int:
    """Key-query pairs of tree attention over a depth-first layout.

    Each token of segment ``s`` sees the ``depth_s`` tokens of its ancestors and the tokens
    of ``s`` up to itself.

    >>> attention_work([4], [-1])          # a chain of 4: 1 + 2 + 3 + 4
    10
    >>> attention_work([2, 1, 1], [-1, 0, 0])   # 3 pairs, then 3 for each child
    9
    """
    depth: list[int] = []
    work = 0
    for length, parent in zip(seg_len, seg_parent):
        d = 0 if parent == -1 else depth[parent] + seg_len[parent]
        depth.append(d)
        work += length * d + length * (length + 1) // 2
    return work


def _check_group(group: Group, g: int) -> None:
    num = len(group.segments)
    for s, seg in enumerate(group.segments):
        if seg.parent is not None and not 0 <= seg.parent < s:
            raise PackingError(
                f"group {g} ({group.task_key!r}) segment {s} has parent {seg.parent}; parents must be earlier "
                "segments. Build groups with Group.add_segment, which enforces it."
            )
        if seg.kind == "sampled":
            if seg.logprobs is None or len(seg.logprobs) != len(seg.token_ids):
                raise PackingError(
                    f"group {g} ({group.task_key!r}) sampled segment {s} has no sampler log-prob per token; "
                    "the rollout must record them (Group.add_segment(..., logprobs=...))."
                )
            if seg.candidates is not None and len(seg.candidates) != len(seg.token_ids):
                raise PackingError(
                    f"group {g} ({group.task_key!r}) sampled segment {s} has {len(seg.candidates)} candidate "
                    f"sets for {len(seg.token_ids)} tokens; record one per token, or None for the full vocab."
                )
    for i, episode in enumerate(group.episodes):
        for leaf in (episode.leaf, *episode.extra_leaves):
            if not 0 <= leaf < num:
                raise PackingError(
                    f"group {g} ({group.task_key!r}) episode {i} names leaf {leaf}, but the group has {num} "
                    "segments."
                )


def _tree_piece(group: Group, leaves: Sequence[int]) -> tuple[_Piece, dict[tuple[int, int], int]]:
    """The union of the paths to ``leaves`` as one depth-first tree; and where each source token went."""
    needed: set[int] = set()
    for leaf in leaves:
        needed.update(group.path_indices(leaf))
    children: dict[int, list[int]] = {s: [] for s in needed}
    roots: list[int] = []
    for s in sorted(needed):
        parent = group.segments[s].parent
        (roots if parent is None else children[parent]).append(s)
    order: list[int] = []
    stack = roots[::-1]
    while stack:
        s = stack.pop()
        order.append(s)
        stack.extend(reversed(children[s]))

    # Empty segments are skipped: their children hang from the nearest non-empty ancestor.
    def effective_parent(s: int) -> int | None:
        parent = group.segments[s].parent
        while parent is not None and not group.segments[parent].token_ids:
            parent = group.segments[parent].parent
        return parent

    nonempty = [s for s in order if group.segments[s].token_ids]
    parent_of = {s: effective_parent(s) for s in nonempty}
    num_children = Counter(p for p in parent_of.values() if p is not None)

    piece = _Piece(token_ids=[], seg_len=[], seg_parent=[], pred=[], depth=[])
    start: dict[int, int] = {}
    layout_seg: dict[int, int] = {}
    for s in nonempty:
        tokens = group.segments[s].token_ids
        parent = parent_of[s]
        begin = start[s] = len(piece.token_ids)
        piece.token_ids.extend(tokens)
        first_pred = -1 if parent is None else start[parent] + len(group.segments[parent].token_ids) - 1
        piece.pred.extend([first_pred, *range(begin, begin + len(tokens) - 1)])
        first_depth = 0 if parent is None else piece.depth[first_pred] + 1
        piece.depth.extend(range(first_depth, first_depth + len(tokens)))
        if parent is not None and num_children[parent] == 1:
            # The only child follows its parent's tokens in depth-first order: one longer segment.
            layout_seg[s] = layout_seg[parent]
            piece.seg_len[layout_seg[s]] += len(tokens)
        else:
            layout_seg[s] = len(piece.seg_len)
            piece.seg_len.append(len(tokens))
            piece.seg_parent.append(-1 if parent is None else layout_seg[parent])
    piece.work = attention_work(piece.seg_len, piece.seg_parent)
    where = {(s, off): start[s] + off for s in nonempty for off in range(len(group.segments[s].token_ids))}
    return piece, where


def _flat_pieces(
    group: Group, leaves: Sequence[int], one_per_row: bool
) -> tuple[list[_Piece], dict[tuple[int, int], tuple[int, int]]]:
    """Each non-empty path to a leaf as its own root segment; ``one_per_row``: one piece per path."""
    pieces: list[_Piece] = []
    where: dict[tuple[int, int], tuple[int, int]] = {}
    for leaf in leaves:
        sources = [(s, off) for s in group.path_indices(leaf) for off in range(len(group.segments[s].token_ids))]
        if not sources:
            continue
        if one_per_row or not pieces:
            pieces.append(_Piece(token_ids=[], seg_len=[], seg_parent=[], pred=[], depth=[]))
        piece = pieces[-1]
        begin = len(piece.token_ids)
        for s, off in sources:
            # An episode's extra leaves may share tokens with its main path: the first copy is the loss position.
            where.setdefault((s, off), (len(pieces) - 1, len(piece.token_ids)))
            piece.token_ids.append(group.segments[s].token_ids[off])
        piece.pred.extend([-1, *range(begin, begin + len(sources) - 1)])
        piece.depth.extend(range(len(sources)))
        piece.seg_len.append(len(sources))
        piece.seg_parent.append(-1)
    for piece in pieces:
        piece.work = attention_work(piece.seg_len, piece.seg_parent)
    return pieces, where


def _episode_leaves(group: Group, episodes: Sequence[int]) -> list[int]:
    leaves: list[int] = []
    for i in episodes:
        for leaf in (group.episodes[i].leaf, *group.episodes[i].extra_leaves):
            if leaf not in leaves:
                leaves.append(leaf)
    return leaves


def _unit(
    group: Group,
    episodes: Sequence[int],
    first_episode: int,
    mode: str,
) -> _Unit:
    """Pack ``episodes`` (local indices) of ``group`` and list their loss terms."""
    leaves = _episode_leaves(group, episodes)
    if mode == "tree":
        piece, where_tree = _tree_piece(group, leaves)
        pieces = [piece]
        where = {key: (0, index) for key, index in where_tree.items()}
        _count_paths(group, episodes, pieces, where_tree)
    else:
        pieces, where = _flat_pieces(group, leaves, one_per_row=mode == "padded")
        _count_paths(group, episodes, pieces, None)
    unit = _Unit(pieces=pieces, targets=[], terms=[], num_path_tokens=0)
    target_of: dict[tuple[int, int], int] = {}
    for i in episodes:
        seen: set[tuple[int, int]] = set()
        for leaf in _episode_leaves(group, [i]):
            path = group.path_indices(leaf)
            unit.num_path_tokens += sum(len(group.segments[s].token_ids) for s in path)
            for s in path:
                seg = group.segments[s]
                if seg.kind != "sampled":
                    continue
                for off in range(len(seg.token_ids)):
                    # A token on several of one episode's paths is one term of that episode.
                    if (s, off) in seen:
                        continue
                    seen.add((s, off))
                    p, index = where[(s, off)]
                    if unit.pieces[p].pred[index] == -1:
                        continue  # the first token of a tree has no context that predicts it
                    if (p, index) not in target_of:
                        target_of[(p, index)] = len(unit.targets)
                        candidates = None if seg.candidates is None else seg.candidates[off]
                        unit.targets.append((p, index, float(seg.logprobs[off]), candidates, _head(seg, off)))
                    unit.terms.append((target_of[(p, index)], first_episode + i))
    return unit


def _count_paths(group: Group, episodes: Sequence[int], pieces: list[_Piece],
                 where_tree: dict[tuple[int, int], int] | None) -> None:
    """Each piece's ``num_paths``: how many of the episodes' root-to-leaf paths hold each token, i.e. how many
    times the unpacked batch (one row per episode's path, as ``padded`` lays them) holds it. A path of ``flat``
    and ``padded`` pieces is laid out on its own, so each of their tokens is one path's (``where_tree`` None);
    a ``tree`` piece (:func:`_tree_piece`, ``where_tree`` its token positions) holds each segment once, its
    tokens side by side, all on the same paths: one count per segment, set on its span."""
    for piece in pieces:
        piece.num_paths = [1 if where_tree is None else 0] * len(piece.token_ids)
    if where_tree is None:
        return
    (piece,) = pieces
    paths = Counter(s for i in episodes for leaf in _episode_leaves(group, [i]) for s in group.path_indices(leaf))
    for s, count in paths.items():
        if num_tokens := len(group.segments[s].token_ids):
            first = where_tree[(s, 0)]
            piece.num_paths[first:first + num_tokens] = [count] * num_tokens


def _head(seg: Segment, off: int) -> SamplerHead | None:
    """The sampler's recorded head at token ``off`` of a sampled segment, if it recorded one."""
    if seg.top_logprobs is None:
        return None
    if seg.candidates is not None:  # the whole support, exactly
        return SamplerHead(seg.candidates[off], seg.top_logprobs[off], exact=True)
    return SamplerHead(seg.top_ids[off], seg.top_logprobs[off], exact=False)


def _group_units(group: Group, g: int, first_episode: int, cfg: PackingConfig, episodes: Sequence[int]) -> list[_Unit]:
    """The units of ``episodes`` (local indices) of one group: their whole tree, or (tree mode, too big) episode
    chunks; one per episode otherwise."""
    budget = cfg.max_tokens_per_row
    if not episodes:
        return []
    if cfg.mode != "tree":
        units = [_unit(group, [i], first_episode, cfg.mode) for i in episodes]
        for i, unit in zip(episodes, units):
            longest = max((len(p.token_ids) for p in unit.pieces), default=0)
            if longest > budget:
                raise PackingError(
                    f"group {g} ({group.task_key!r}) episode {i} needs {longest} tokens in one row but "
                    f"PackingConfig.max_tokens_per_row is {budget}; raise max_tokens_per_row to at least {longest}."
                )
        return units
    everything = _unit(group, episodes, first_episode, "tree")
    if everything.num_tokens <= budget:
        return [everything]
    # Too big for one row: split by episodes, in depth-first order of their leaves so that
    # neighbours share prefixes; each chunk repeats the prefixes it needs.
    _, where = _tree_piece(group, _episode_leaves(group, episodes))
    order = sorted(episodes, key=lambda i: _leaf_rank(group, i, where))
    chunks: list[list[int]] = []
    needed: set[int] = set()
    for i in order:
        own = {s for leaf in _episode_leaves(group, [i]) for s in group.path_indices(leaf)}
        own_tokens = sum(len(group.segments[s].token_ids) for s in own)
        if own_tokens > budget:
            raise PackingError(
                f"group {g} ({group.task_key!r}) episode {i} alone has {own_tokens} tokens but "
                f"PackingConfig.max_tokens_per_row is {budget}; an episode must fit in one row. Raise "
                f"max_tokens_per_row to at least {own_tokens}."
            )
        merged = needed | own
        if chunks and sum(len(group.segments[s].token_ids) for s in merged) <= budget:
            chunks[-1].append(i)
            needed = merged
        else:
            chunks.append([i])
            needed = own
    return [_unit(group, chunk, first_episode, "tree") for chunk in chunks]


def _leaf_rank(group: Group, i: int, where: dict[tuple[int, int], int]) -> int:
    """Depth-first rank of an episode's main leaf (its last token, or its nearest non-empty ancestor's)."""
    for s in reversed(group.path_indices(group.episodes[i].leaf)):
        if group.segments[s].token_ids:
            return where[(s, 0)]
    return -1


# -- rows and micro-batches -------------------------------------------------------------------


def _fill_rows(sizes: list[tuple[int, int]], budget: int) -> list[list[int]]:
    """Place items of ``(tokens, work)`` into rows of at most ``budget`` tokens, balancing work.

    First-fit decreasing by tokens gives a number of rows; then items go largest work first
    into the fitting row with the least work, opening a row only when none fits.
    """
    free: list[int] = []
    for tokens, _ in sorted(sizes, key=lambda size: -size[0]):
        for r, room in enumerate(free):
            if tokens <= room:
                free[r] -= tokens
                break
        else:
            free.append(budget - tokens)
    rows: list[list[int]] = [[] for _ in free]
    row_tokens = [0] * len(rows)
    row_work = [0] * len(rows)
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], -sizes[i][0], i)):
        tokens, work = sizes[item]
        fitting = [r for r in range(len(rows)) if row_tokens[r] + tokens <= budget]
        if fitting:
            r = min(fitting, key=lambda r: (row_work[r], row_tokens[r], r))
        else:
            rows.append([])
            row_tokens.append(0)
            row_work.append(0)
            r = len(rows) - 1
        rows[r].append(item)
        row_tokens[r] += tokens
        row_work[r] += work
    return [row for row in rows if row]


def pack_groups(
    groups: Sequence[Group],
    advantages: Tensor | Sequence[float],
    cfg: PackingConfig,
    *,
    skip: Collection[int] = (),
    mask: Collection[int] = (),
) -> list[PackedBatch]:
    """Pack groups into micro-batches of rows, with their loss terms.

    Args:
        groups: the groups of one optimizer step (or accumulation window).
        advantages: (E,) one advantage per episode, groups in order and episodes in group
            order (the order of ``compute_advantages`` over ``[e for g in groups for e in
            g.episodes]``).
        cfg: the row budget, the mode and the rows per micro-batch.
        skip: indices of groups left out of the rows (GRPO leaves out those whose
            advantages are all 0). Their episodes still count in ``num_episodes`` and
            ``episode_num_tokens``, so a normalizer built from those is the whole call's.
        mask: indices of episodes (in ``advantages``' order) left out of the rows and the terms,
            so out of ``episode_num_tokens`` too (``mask_truncated_completions``); they still
            count in ``num_episodes``.

    Returns:
        Micro-batches, longest rows first. Every episode's terms are in one micro-batch,
        and ``term_episode`` indexes the episodes of the whole call, so
        :func:`treerl.learners.forward.window_normalizer` over the list normalizes exactly
        as the unpacked batch would (without ``skip``).
    """
    num_episodes = sum(len(g.episodes) for g in groups)
    adv = torch.as_tensor(advantages)
    if not adv.is_floating_point():
        adv = adv.float()
    if tuple(adv.shape) != (num_episodes,):
        raise ValueError(
            f"advantages has shape {tuple(adv.shape)} but the groups hold {num_episodes} episodes; pass one "
            "advantage per episode, groups in order and episodes in group order."
        )
    units: list[_Unit] = []
    skipped: list[_Unit] = []  # counted in episode_num_tokens, laid in no row
    skip_set, mask_set = set(skip), set(mask)
    first = 0
    for g, group in enumerate(groups):
        _check_group(group, g)
        kept = [i for i in range(len(group.episodes)) if first + i not in mask_set]
        (skipped if g in skip_set else units).extend(_group_units(group, g, first, cfg, kept))
        first += len(group.episodes)
    units = [u for u in units if u.num_tokens > 0]

    # Rows are lists of (unit, piece); a bundle is rows that must share a micro-batch.
    bundles: list[list[list[tuple[int, int]]]]
    if cfg.mode == "padded":
        bundles = [[[(u, p)] for p in range(len(unit.pieces))] for u, unit in enumerate(units)]
    else:
        sizes = [(unit.num_tokens, unit.pieces[0].work) for unit in units]
        bundles = [[[(u, 0) for u in row]] for row in _fill_rows(sizes, cfg.max_tokens_per_row)]

    def row_tokens(row: list[tuple[int, int]]) -> int:
        return sum(len(units[u].pieces[p].token_ids) for u, p in row)

    bundles.sort(key=lambda bundle: -max(row_tokens(row) for row in bundle))
    batches_rows: list[list[list[tuple[int, int]]]] = []
    for bundle in bundles:
        if batches_rows and len(batches_rows[-1]) + len(bundle) <= cfg.rows_per_batch:
            batches_rows[-1].extend(bundle)
        else:
            batches_rows.append(list(bundle))

    all_episodes = [episode for unit in (*units, *skipped) for _, episode in unit.terms]
    episode_num_tokens = torch.bincount(torch.tensor(all_episodes, dtype=torch.long), minlength=num_episodes)
    return [_assemble(rows, units, adv, num_episodes, episode_num_tokens, cfg) for rows in batches_rows]


def _assemble(
    rows: list[list[tuple[int, int]]],
    units: list[_Unit],
    adv: Tensor,
    num_episodes: int,
    episode_num_tokens: Tensor,
    cfg: PackingConfig,
) -> PackedBatch:
    layouts: list[TreeLayout] = []
    row_ids: list[list[int]] = []
    row_depth: list[list[int]] = []
    row_paths: list[list[int]] = []
    row_work: list[int] = []
    base: dict[tuple[int, int], tuple[int, int]] = {}  # (unit, piece) -> (row, token offset)
    unit_order: list[int] = []
    for r, row in enumerate(rows):
        ids: list[int] = []
        depth: list[int] = []
        paths: list[int] = []
        seg_len: list[int] = []
        seg_parent: list[int] = []
        for u, p in row:
            piece = units[u].pieces[p]
            base[(u, p)] = (r, len(ids))
            shift = len(seg_len)
            ids.extend(piece.token_ids)
            depth.extend(piece.depth)
            paths.extend(piece.num_paths)
            seg_len.extend(piece.seg_len)
            seg_parent.extend(-1 if parent == -1 else parent + shift for parent in piece.seg_parent)
            if u not in unit_order:
                unit_order.append(u)
        layouts.append(TreeLayout.from_parents(seg_len, seg_parent))
        row_ids.append(ids)
        row_depth.append(depth)
        row_paths.append(paths)
        row_work.append(sum(units[u].pieces[p].work for u, p in row))
    tree_batch = TreeBatch(layouts)
    input_ids = torch.full((len(rows), tree_batch.length), cfg.pad_token_id, dtype=torch.long)  # (B, T)
    position_ids = torch.zeros((len(rows), tree_batch.length), dtype=torch.long)  # (B, T)
    num_paths = torch.zeros((len(rows), tree_batch.length), dtype=torch.float32)  # (B, T)
    for r, (ids, depth, paths) in enumerate(zip(row_ids, row_depth, row_paths)):
        input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        position_ids[r, : len(depth)] = torch.tensor(depth, dtype=torch.long)
        num_paths[r, : len(paths)] = torch.tensor(paths, dtype=torch.float32)

    loss_row, loss_pos, loss_target_pos, loss_target, sampler_logp = [], [], [], [], []
    candidates: list[list[int] | None] = []
    heads: list[SamplerHead | None] = []
    term_loss, term_episode = [], []
    num_path_tokens = 0
    for u in unit_order:
        unit = units[u]
        offset = len(loss_row)
        for p, index, logp, cands, head in unit.targets:
            r, start = base[(u, p)]
            piece = unit.pieces[p]
            loss_row.append(r)
            loss_pos.append(start + piece.pred[index])
            loss_target_pos.append(start + index)
            loss_target.append(piece.token_ids[index])
            sampler_logp.append(logp)
            candidates.append(cands)
            heads.append(head)
        for target, episode in unit.terms:
            term_loss.append(offset + target)
            term_episode.append(episode)
        num_path_tokens += unit.num_path_tokens

    target_t = torch.tensor(loss_target, dtype=torch.long)
    has_candidates = torch.tensor([c is not None for c in candidates], dtype=torch.bool)
    candidates_t = None
    if any(c is not None for c in candidates):
        width = max(len(c) for c in candidates if c is not None)
        rows = [cands if cands is not None else [target] for cands, target in zip(candidates, loss_target)]
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        # Filled in one assignment, row-major: a tensor per loss position cost seconds per step.
        padded = np.full((len(rows), width), -1, dtype=np.int64)  # (N, K)
        padded[np.arange(width) < lengths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
        candidates_t = torch.from_numpy(padded)
    episode_t = torch.tensor(term_episode, dtype=torch.long)
    return PackedBatch(
        mode=cfg.mode,
        input_ids=input_ids,
        position_ids=position_ids,
        token_num_paths=num_paths,
        layouts=tree_batch,
        loss_row=torch.tensor(loss_row, dtype=torch.long),
        loss_pos=torch.tensor(loss_pos, dtype=torch.long),
        loss_target_pos=torch.tensor(loss_target_pos, dtype=torch.long),
        loss_target=target_t,
        loss_sampler_logp=torch.tensor(sampler_logp, dtype=torch.float32),
        loss_candidates=candidates_t,
        loss_has_candidates=has_candidates,
        term_loss=torch.tensor(term_loss, dtype=torch.long),
        term_episode=episode_t,
        term_adv=adv[episode_t],
        num_episodes=num_episodes,
        episode_num_tokens=episode_num_tokens,
        row_work=tuple(row_work),
        num_path_tokens=num_path_tokens,
        **head_tensors(heads),
    )
