"""The sampler: logits -> (token, log-prob, candidate set), pure functions shared by backends.

The processing order is vLLM's, so that log-probs from either backend mean the same thing:
the repetition penalty -> ``logits / temperature`` -> top-k -> min-p -> top-p (on the
renormalized survivors). The penalty reads which ids the row's context holds (``seen``, see
:func:`context_mask`): the whole context, prompt included, as transformers and vLLM read it. Every
filter keeps a prefix of the tokens sorted by probability, so the support of the final
distribution is "the first ``num_candidates`` of the top-k ids": cheap to store, exact to
rebuild, and what the learner renormalizes over.

Sampling is inverse-CDF with one uniform per row. The uniform comes from the request's own
``torch.Generator``, so a row's tokens depend only on its seed and its context, never on
which other rows share the batch.

>>> import torch
>>> from treerl.agents.policy import SamplingParams
>>> logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
>>> processed = process_logits(logits, SamplingParams(top_k=2))
>>> processed.candidate_ids.tolist(), processed.num_candidates.tolist()
([[0, 1]], [2])
>>> token_ids, logprobs = sample_processed(processed, torch.tensor([0.7]))
>>> token_ids.tolist(), round(logprobs.item(), 4)  # 0.7 > 0.5/0.8 = 0.625: the second candidate
([1], -0.9808)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from treerl.agents.policy import SamplingParams

__all__ = [
    "ProcessedLogits",
    "SampledTokens",
    "context_mask",
    "penalize_repetitions",
    "process_logits",
    "sample_processed",
    "candidate_lists",
    "head_lists",
    "draw_uniforms",
    "sample",
]


@dataclass(frozen=True)
class ProcessedLogits:
    """The distribution a token is drawn from, for a batch of rows."""

    logprobs: Tensor
    """(B, K) float32 log-probs; -inf outside the support."""
    candidate_ids: Tensor | None
    """(B, K) int64 vocabulary ids, most likely first; None: column j is token j (K = V)."""
    num_candidates: Tensor | None
    """(B,) int64 support size: the first ``num_candidates`` columns; None: the whole vocab."""


@dataclass(frozen=True)
class SampledTokens:
    """One sampled token per row, with what the learner needs about its distribution."""

    token_ids: Tensor
    """(B,) int64."""
    logprobs: Tensor
    """(B,) float32, under the processed distribution."""
    candidates: list[list[int]] | None
    """Per row, the support's ids (most likely first); None: the whole vocabulary."""


def context_mask(contexts: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """(B, V) bool: whether id v occurs in context b, what :func:`penalize_repetitions` reads.

    >>> context_mask([[0, 2, 2], [1]], 4).int().tolist()
    [[1, 0, 1, 0], [0, 1, 0, 0]]
    """
    seen = torch.zeros(len(contexts), vocab_size, dtype=torch.bool, device=device)  # (B, V)
    for b, ids in enumerate(contexts):
        seen[b, torch.as_tensor(list(ids), dtype=torch.long, device=device)] = True
    return seen


def penalize_repetitions(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """The repetition penalty of transformers' ``RepetitionPenaltyLogitsProcessor`` and vLLM's sampler:
    the logit z of every id ``seen`` (B, V) in the context becomes z / penalty if z > 0, else z * penalty.

    >>> penalize_repetitions(torch.tensor([[2.0, -2.0, 2.0]]), torch.tensor([[True, True, False]]), 2.0).tolist()
    [[1.0, -4.0, 2.0]]
    """
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def process_logits(logits: Tensor, params: SamplingParams, seen: Tensor | None = None) -> ProcessedLogits:
    """Apply the repetition penalty, temperature, top-k, min-p and top-p to ``logits`` (B, V); pure, float32.

    ``seen`` (B, V) bool marks the ids of each row's context (:func:`context_mask`); it is needed
    when ``params.repetition_penalty`` is not 1.

    >>> logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    >>> p = process_logits(logits, SamplingParams(top_k=3, top_p=0.7))
    >>> p.candidate_ids.tolist(), p.num_candidates.tolist()  # 0.6 < 0.7 <= 0.6 + 0.3
    ([[1, 2, 0]], [2])
    >>> [round(x, 4) for x in p.logprobs.exp().tolist()[0]]
    [0.6667, 0.3333, 0.0]
    """
    if params.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError(f"process_logits: repetition_penalty={params.repetition_penalty} needs `seen`, the "
                             "(B, V) mask of each row's context ids (treerl.agents.sampling.context_mask).")
        logits = penalize_repetitions(logits.float(), seen, params.repetition_penalty)
    if params.top_k is None:
        # SamplingParams guarantees top_p == 1 and min_p == 0 here.
        return ProcessedLogits(torch.log_softmax(logits.float() / params.temperature, dim=-1), None, None)

    k = min(params.top_k, logits.shape[-1])
    # Dividing by a temperature > 0 keeps the order, so only the k survivors are divided (the
    # same values as dividing all V first).
    z_k, candidate_ids = torch.topk(logits.float(), k, dim=-1, sorted=True)  # (B, K) each, descending
    z_k = z_k / params.temperature
    keep = torch.ones_like(z_k, dtype=torch.bool)  # (B, K)
    if params.min_p > 0.0:
        # p_j >= min_p * p_max  <=>  z_j - z_max >= log(min_p): no softmax needed.
        keep &= (z_k - z_k[:, :1]) >= math.log(params.min_p)
    if params.top_p < 1.0:
        probs = torch.softmax(z_k.masked_fill(~keep, -math.inf), dim=-1)  # (B, K)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; the first token always survives.
        keep &= mass_before < params.top_p
        keep[:, 0] = True
    logprobs = torch.log_softmax(z_k.masked_fill(~keep, -math.inf), dim=-1)  # (B, K)
    return ProcessedLogits(logprobs, candidate_ids, keep.sum(dim=-1))


def sample_processed(processed: ProcessedLogits, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse-CDF sample one token per row with ``uniforms`` (B,) in [0, 1).

    Returns ``(token_ids (B,) int64, logprobs (B,) float32)``. A token outside the support
    (probability 0) can never be drawn, whatever the rounding of the cumulative sum.
    """
    probs = processed.logprobs.exp()  # (B, K)
    cdf = torch.cumsum(probs, dim=-1)  # (B, K)
    total = cdf[:, -1:]  # (B, 1)
    # Scaling by the total absorbs float32 error in the cumsum; capping just below it keeps a
    # uniform that rounds up to the total from landing past the last positive-probability column.
    target = torch.minimum(
        uniforms.to(device=cdf.device, dtype=cdf.dtype).unsqueeze(-1) * total,
        torch.nextafter(total, torch.zeros_like(total)),
    )  # (B, 1)
    columns = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)  # (B, 1)
    logprobs = processed.logprobs.gather(-1, columns).squeeze(-1)  # (B,)
    if processed.candidate_ids is None:
        return columns.squeeze(-1), logprobs
    return processed.candidate_ids.gather(-1, columns).squeeze(-1), logprobs


def candidate_lists(processed: ProcessedLogits) -> list[list[int]] | None:
    """The support of each row as a list of ids, most likely first; None for the whole vocab."""
    if processed.candidate_ids is None:
        return None
    ids = processed.candidate_ids.tolist()
    return [row[:n] for row, n in zip(ids, processed.num_candidates.tolist())]


def head_lists(processed: ProcessedLogits, num: int) -> tuple[list[list[int]] | None, list[list[float]]]:
    """Per row, the sampler's log-probs over the head of its support, for the learner's score centering.

    A bounded support (top-k) is recorded whole and its ids are the candidates, so only the
    log-probs are returned (ids None); over the whole vocabulary, the ``num`` most likely ids
    and their log-probs.

    >>> p = process_logits(torch.log(torch.tensor([[0.5, 0.3, 0.2]])), SamplingParams())
    >>> ids, logps = head_lists(p, 2)
    >>> ids, [round(x, 4) for x in logps[0]]
    ([[0, 1]], [-0.6931, -1.204])
    """
    if processed.candidate_ids is not None:
        rows = processed.logprobs.tolist()
        return None, [row[:n] for row, n in zip(rows, processed.num_candidates.tolist())]
    values, ids = torch.topk(processed.logprobs, min(num, processed.logprobs.shape[-1]), dim=-1)  # (B, num)
    return ids.tolist(), values.tolist()


def draw_uniforms(generators: Sequence[torch.Generator], num: int = 1) -> Tensor:
    """(B, num) float32 uniforms, row b from ``generators[b]`` (CPU generators).

    Drawing on the CPU keeps a seed's stream identical on every device.
    """
    return torch.stack([torch.rand(num, generator=g, dtype=torch.float64) for g in generators]).float()


def sample(logits: Tensor, params: SamplingParams, generators: Sequence[torch.Generator],
           seen: Tensor | None = None) -> SampledTokens:
    """Sample one token per row of ``logits`` (B, V), row b with ``generators[b]`` (``seen``: see
    :func:`process_logits`).

    >>> g = torch.Generator().manual_seed(0)
    >>> out = sample(torch.tensor([[0.0, 5.0, 0.0]]), SamplingParams(top_k=1), [g])
    >>> out.token_ids.tolist(), out.logprobs.tolist(), out.candidates
    ([1], [0.0], [[1]])
    """
    if len(generators) != logits.shape[0]:
        raise ValueError(
            f"sample got {logits.shape[0]} rows of logits but {len(generators)} generators; "
            "pass one generator per row."
        )
    processed = process_logits(logits, params, seen)
    token_ids, logprobs = sample_processed(processed, draw_uniforms(generators)[:, 0])
    return SampledTokens(token_ids, logprobs, candidate_lists(processed))
