"""What the kernels return and raise, on the lowest floor of :mod:`treerl.kernels`.

Both halves of each kernel pair need these: the Triton modules build and raise them, and
the dispatching modules (:mod:`treerl.kernels.logprobs`, :mod:`treerl.kernels.tree_attention`)
pick a backend and hand the result on. Living here, below both, they let imports flow one
way only::

    types -> triton_logprobs -> logprobs -> treerl.kernels
    types -> triton_tree_attention -> tree_attention -> treerl.kernels

This module imports nothing of treerl but :mod:`treerl.errors`. Users reach every name
here where they always have: :mod:`treerl.kernels`, :mod:`treerl.kernels.logprobs` and
:mod:`treerl.kernels.tree_attention` re-export them.

>>> import torch
>>> out = TokenLogprobs(torch.zeros(2), torch.ones(2), None, ImplChoice("chunked", "hidden is on cpu"))
>>> out.logp.shape, out.choice.name
(torch.Size([2]), 'chunked')
>>> issubclass(TreeAttentionError, TreerlError) and issubclass(TreeAttentionError, ValueError)
True
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from treerl.errors import TreerlError

__all__ = ["ImplChoice", "TokenLogprobs", "TreeAttentionError"]


@dataclass(frozen=True)
class ImplChoice:
    """Which log-prob implementation ran, and why (for logs and for parity-test skips)."""

    name: str
    """A key of :data:`treerl.kernels.logprobs.IMPLS`."""
    reason: str
    """One line a person can act on, e.g. why a faster kernel was not used."""


@dataclass
class TokenLogprobs:
    """Per-position outputs of :func:`~treerl.kernels.logprobs.token_logprobs`: float32 (float64 for float64 inputs)."""

    logp: Tensor
    """(N,) ``log p(target)`` under ``softmax(logits / temperature)`` over the full vocabulary."""
    entropy: Tensor
    """(N,) entropy of that full tempered distribution, in nats."""
    logp_candidates: Tensor | None
    """(N,) ``z_y - logsumexp_{c in C} z_c`` with ``z = logits / temperature``; None without candidates."""
    choice: ImplChoice | None = None
    """The implementation that produced these values and the reason it was picked."""


class TreeAttentionError(TreerlError, ValueError):
    """Tree attention was asked to do something it cannot do correctly."""
