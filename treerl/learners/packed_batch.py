"""What tree packing produces: :class:`PackedBatch`, its :class:`PackingConfig`, and packing metrics.

See :mod:`treerl.learners.packing` for how groups become rows and what each field holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from treerl.errors import TreerlError
from treerl.kernels.tree_layout import TreeBatch

__all__ = ["PACK_MODES", "PackedBatch", "PackingConfig", "PackingError", "SamplerHead", "head_tensors",
           "packing_metrics"]

PACK_MODES: tuple[str, ...] = ("tree", "flat", "padded")


class PackingError(TreerlError, ValueError):
    """The groups cannot be packed as asked (an episode over the budget, a malformed tree)."""


@dataclass
class PackingConfig:
    """How groups become rows and micro-batches."""

    max_tokens_per_row: int = 4096
    """Most real tokens in one row. A group's tree stays in one row unless it alone is longer."""
    mode: str = "tree"
    """``tree`` (shared prefixes once), ``flat`` (each path its own segment, rows packed) or
    ``padded`` (one path per row, for models tree attention cannot serve)."""
    rows_per_batch: int = 1
    """Rows per micro-batch (padded to the longest of them). An episode is never split
    across micro-batches, so ``padded`` may exceed it for an episode with several paths."""
    pad_token_id: int = 0
    """Id written into padding slots; no real token attends to them, any valid id works."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens_per_row, int) or self.max_tokens_per_row < 1:
            raise ValueError(
                f"PackingConfig.max_tokens_per_row is {self.max_tokens_per_row!r}; it is the row budget in "
                "tokens and must be an int >= 1 (e.g. 4096, or the longest episode for mode='padded')."
            )
        if self.mode not in PACK_MODES:
            raise ValueError(
                f"PackingConfig.mode is {self.mode!r}; choose one of {PACK_MODES} ('tree' shares prefixes, "
                "'padded' serves models that tree attention cannot)."
            )
        if not isinstance(self.rows_per_batch, int) or self.rows_per_batch < 1:
            raise ValueError(
                f"PackingConfig.rows_per_batch is {self.rows_per_batch!r}; it counts rows per micro-batch "
                "and must be an int >= 1."
            )
        if not isinstance(self.pad_token_id, int) or self.pad_token_id < 0:
            raise ValueError(
                f"PackingConfig.pad_token_id is {self.pad_token_id!r}; use a valid token id >= 0 "
                "(the tokenizer's pad id, or 0)."
            )


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """One micro-batch of packed rows and its flat loss terms (see the module docstring).

    ``N`` counts loss positions (packed sampled tokens), ``M`` counts terms ((token,
    episode) pairs), ``E`` counts the episodes of the whole :func:`pack_groups` call.
    """

    mode: str
    """The :data:`PACK_MODES` entry these rows were packed with."""
    input_ids: Tensor
    """(B, T) long: the rows, padded with ``PackingConfig.pad_token_id``."""
    position_ids: Tensor
    """(B, T) long: each token's depth in its tree; 0 for padding."""
    token_num_paths: Tensor
    """(B, T) float32: the episodes' root-to-leaf paths through each token, the times the unpacked
    batch (one row per path) holds it (a prompt shared by ``k`` episodes: ``k``); 0 for padding.
    Weights that make a token average over the rows equal the unpacked batch's (the router's
    load-balancing loss, :func:`~treerl.learners.losses.load_balancing_loss`)."""
    layouts: TreeBatch
    """The rows' tree layouts, to pass to the model as ``tree_layout``."""
    loss_row: Tensor
    """(N,) long: row of the hidden state that predicts each loss position's target."""
    loss_pos: Tensor
    """(N,) long: offset of that hidden state in its row (the target's predecessor)."""
    loss_target_pos: Tensor
    """(N,) long: offset of the target token itself in the same row."""
    loss_target: Tensor
    """(N,) long: the sampled token id."""
    loss_sampler_logp: Tensor
    """(N,) float32: the sampler's log-prob of the target (after its truncation)."""
    loss_candidates: Tensor | None
    """(N, K) long: the sampler's candidate set, padded with -1; rows without one hold
    only the target (see ``loss_has_candidates``). None when no position has one."""
    loss_has_candidates: Tensor
    """(N,) bool: True where the sampler recorded a bounded candidate set."""
    term_loss: Tensor
    """(M,) long: the loss position of each term."""
    term_episode: Tensor
    """(M,) long: the episode of each term, in ``[0, num_episodes)`` over the whole pack call."""
    term_adv: Tensor
    """(M,) float: the advantage of the term's episode."""
    num_episodes: int
    """``E``: episodes of the whole pack call (groups in order, episodes in group order)."""
    episode_num_tokens: Tensor
    """(E,) long: each episode's number of terms over the whole pack call."""
    row_work: tuple[int, ...]
    """Attention work of each row (key-query pairs, see :func:`attention_work`)."""
    num_path_tokens: int
    """Tokens these episodes would take unpacked (sum of their root-to-leaf path lengths)."""
    term_old_logp: Tensor | None = None
    """(M,) detached log-prob under the policy that defines the trust region, once the
    learner has computed it (:meth:`with_old_logp`); None until then."""
    loss_head_ids: Tensor | None = None
    """(N, K) long: the sampler's recorded head at each loss position (the whole candidate set,
    or its most likely ids over the vocabulary), padded with -1; None when none was recorded."""
    loss_head_logp: Tensor | None = None
    """(N, K) float32: the sampler's log-probs of ``loss_head_ids``; -inf on padding."""
    loss_head_exact: Tensor | None = None
    """(N,) bool: True where the head is the sampler's whole support (a bounded candidate set)."""

    # -- sizes --------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens of the rows."""
        return sum(layout.num_tokens for layout in self.layouts.layouts)

    @property
    def num_terms(self) -> int:
        return self.term_loss.shape[0]

    # -- per-term views -----------------------------------------------------------------------
    @property
    def term_target(self) -> Tensor:
        """(M,) long: each term's target id."""
        return self.loss_target[self.term_loss]

    @property
    def term_sampler_logp(self) -> Tensor:
        """(M,) float32: each term's sampler log-prob."""
        return self.loss_sampler_logp[self.term_loss]

    @property
    def term_candidates(self) -> Tensor | None:
        """(M, K) long: each term's candidate set padded with -1 (see ``loss_has_candidates``), or None."""
        return None if self.loss_candidates is None else self.loss_candidates[self.term_loss]

    @property
    def term_row(self) -> Tensor:
        return self.loss_row[self.term_loss]

    @property
    def term_pos(self) -> Tensor:
        return self.loss_pos[self.term_loss]

    def with_old_logp(self, old_logp: Tensor) -> PackedBatch:
        """The same batch carrying ``old_logp`` (M,), detached, for every update on it.

        Compute it once before the first update, e.g.
        ``batch.with_old_logp(packed_logprobs(model, batch).logp)`` under ``torch.no_grad()``.
        """
        if tuple(old_logp.shape) != (self.num_terms,):
            raise ValueError(
                f"old_logp has shape {tuple(old_logp.shape)} but the batch has {self.num_terms} terms; pass one "
                "log-prob per term, as packed_logprobs(model, batch).logp returns them."
            )
        return replace(self, term_old_logp=old_logp.detach())

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with its tensors on ``device`` (the layouts build theirs per device)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **moved)


@dataclass(frozen=True)
class SamplerHead:
    """What the sampler recorded about its distribution at one sampled token (for score centering)."""

    ids: list[int]
    logprobs: list[float]
    exact: bool
    """True when ``ids`` is the whole support (top-k was on), False for the vocabulary's head."""


def head_tensors(heads: Sequence[SamplerHead | None]) -> dict[str, Tensor | None]:
    """The ``loss_head_*`` fields of a :class:`PackedBatch` from each loss position's head.

    >>> out = head_tensors([SamplerHead([4, 2], [-0.1, -2.4], exact=True), None])
    >>> out["loss_head_ids"].tolist(), out["loss_head_exact"].tolist()
    ([[4, 2], [-1, -1]], [True, False])
    """
    if all(h is None for h in heads):
        return {"loss_head_ids": None, "loss_head_logp": None, "loss_head_exact": None}
    width = max(len(h.ids) for h in heads if h is not None)
    ids = torch.full((len(heads), width), -1, dtype=torch.long)  # (N, K)
    logp = torch.full((len(heads), width), float("-inf"), dtype=torch.float32)  # (N, K)
    for n, head in enumerate(heads):
        if head is not None:
            ids[n, : len(head.ids)] = torch.tensor(head.ids, dtype=torch.long)
            logp[n, : len(head.ids)] = torch.tensor(head.logprobs, dtype=torch.float32)
    exact = torch.tensor([h is not None and h.exact for h in heads], dtype=torch.bool)  # (N,)
    return {"loss_head_ids": ids, "loss_head_logp": logp, "loss_head_exact": exact}


# -- pieces: the trees that go into rows ------------------------------------------------------


def packing_metrics(batches: Sequence[PackedBatch]) -> dict[str, float]:
    """Namespaced packing metrics of one window: ``tree/packing_ratio`` and friends.

    ``tree/packing_ratio`` is unpacked tokens over packed tokens; ``tree/fill`` is real
    tokens over row slots (padding wastes the rest); ``tree/work_imbalance`` is the most
    attention work of a row over the mean (1.0 is perfectly balanced). A window that packed
    nothing (every group skipped) has no ratios: only ``tree/rows`` 0, so that a step which
    trained nothing does not log a packing ratio, fill and balance of 1.0 it never measured.

    >>> packing_metrics([])
    {'tree/rows': 0.0}
    """
    real = sum(b.num_tokens for b in batches)
    slots = sum(b.batch_size * b.length for b in batches)
    works = [w for b in batches for w in b.row_work]
    if not real:
        return {"tree/rows": float(len(works))}
    return {
        "tree/packing_ratio": sum(b.num_path_tokens for b in batches) / real,
        "tree/fill": real / slots,
        "tree/rows": float(len(works)),
        "tree/work_imbalance": max(works) / (sum(works) / len(works)) if sum(works) else 1.0,
    }
