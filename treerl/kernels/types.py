"""What the kernels return, on the lowest floor of :mod:`treerl.kernels`.

Both halves of each kernel pair need these: the Triton module builds them, and the
dispatching module (:mod:`treerl.kernels.logprobs`) picks a backend and hands the result
on. Living here, below both, they let imports flow one way only::

    types -> triton_logprobs -> logprobs -> treerl.kernels

Users reach every name here where they always have: :mod:`treerl.kernels` and
:mod:`treerl.kernels.logprobs` re-export them.

>>> import torch
>>> out = TokenLogprobs(torch.zeros(2), torch.ones(2), None, ImplChoice("chunked", "hidden is on cpu"))
>>> out.logp.shape, out.choice.name
(torch.Size([2]), 'chunked')
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["ImplChoice", "TokenLogprobs"]


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
