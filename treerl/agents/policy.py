"""The policy interface: what the rollout engine asks of any generation backend.

A policy turns token contexts into sampled continuations and reports, per sampled token,
exactly what the learner needs to stay unbiased: the token id, the log-prob under the
distribution it was actually drawn from (after the repetition penalty, temperature, top-k,
top-p and min-p), the
candidate set of that distribution, and the weights version that produced it.

Backends: :class:`treerl.agents.transformers_policy.TransformersPolicy` (CPU and GPU,
in-process) and :class:`treerl.agents.vllm_policy.VLLMPolicy` (the ``vllm`` extra).

>>> params = SamplingParams(temperature=0.7, top_k=50, top_p=0.95, max_new_tokens=64)
>>> request = GenerationRequest(prompt_ids=[1, 2, 3], params=params, seed=0, group="task-7")
>>> request.params.top_k
50
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from torch import Tensor

from treerl.config import field_help

__all__ = ["SamplingParams", "SamplingOptions", "GenerationRequest", "Generation", "StreamedToken", "FinishReason",
           "Policy", "AsyncBatcher"]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to draw the next token from the model's logits.

    The processing order is fixed and shared by every backend (it is vLLM's): the repetition
    penalty, then logits / temperature, then top-k, then min-p, then top-p on the renormalized
    survivors.
    For greedy decoding use ``top_k=1`` (its log-probs are then 0, which is exact).

    >>> SamplingParams(top_p=0.9)
    Traceback (most recent call last):
    ...
    ValueError: SamplingParams.top_p=0.9 needs top_k: ...
    """

    temperature: float = 1.0
    """Divides the logits before anything else; must be > 0 (greedy is ``top_k=1``)."""
    top_k: int | None = None
    """Keep the k most likely tokens; ``None`` keeps the whole vocabulary."""
    top_p: float = 1.0
    """Keep the smallest most-likely set whose probability mass reaches top_p (1.0: off)."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one (0.0: off)."""
    repetition_penalty: float = 1.0
    """Before the temperature, the logit z of every token in the context (the request's whole
    ``prompt_ids`` and what it sampled so far) becomes z / penalty if z > 0 else z * penalty
    (transformers' and vLLM's repetition penalty; 1.0: off, > 1 discourages repeating)."""
    max_new_tokens: int = 256
    """Stop with finish_reason "length" after this many sampled tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop ids, added to the model's own end-of-turn ids."""
    top_logprobs: int = 0
    """Also record, per sampled token, the sampler's log-probs over the head of its support:
    the whole candidate set when ``top_k`` bounds it, else the ``top_logprobs`` most likely
    tokens (0: record nothing more). Score centering reads them."""

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(
                f"SamplingParams.temperature={self.temperature!r} must be a finite number > 0: it divides "
                "the logits. For greedy decoding set top_k=1 (with any temperature, e.g. 1.0)."
            )
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(
                f"SamplingParams.top_k={self.top_k!r} must be a positive int or None (the whole "
                "vocabulary); set e.g. top_k=50, or top_k=None to turn it off."
            )
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(
                f"SamplingParams.top_p={self.top_p!r} must be in (0, 1]; 1.0 turns top-p off."
            )
        if not (0.0 <= self.min_p < 1.0):
            raise ValueError(
                f"SamplingParams.min_p={self.min_p!r} must be in [0, 1); 0.0 turns min-p off."
            )
        if not (isinstance(self.repetition_penalty, (int, float)) and not isinstance(self.repetition_penalty, bool)
                and math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                f"SamplingParams.repetition_penalty={self.repetition_penalty!r} must be a finite number > 0 (it "
                "divides positive logits and multiplies negative ones); 1.0 turns it off, e.g. 1.1 discourages "
                "repeating a token of the context."
            )
        if self.top_k is None and (self.top_p < 1.0 or self.min_p > 0.0):
            field = "top_p" if self.top_p < 1.0 else "min_p"
            raise ValueError(
                f"SamplingParams.{field}={getattr(self, field)!r} needs top_k: the candidate set of every "
                "sampled token is recorded exactly so the learner can renormalize over it, and a top-p or "
                "min-p set over the whole vocabulary is unbounded. Set a bound, e.g. top_k=50."
            )
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens={self.max_new_tokens!r} must be an int >= 1; "
                "it bounds the length of one turn, e.g. max_new_tokens=256."
            )
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or self.top_logprobs < 0:
            raise ValueError(
                f"SamplingParams.top_logprobs={self.top_logprobs!r} must be an int >= 0 (0 records no more than "
                "the sampled token's log-prob), e.g. top_logprobs=20."
            )
        # A list would make the dataclass unhashable, and backends key batches by params.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids={self.stop_token_ids!r} must be non-negative token ids."
            )


@dataclass
class SamplingOptions:
    """The sampling options of every command that generates (a base of its config dataclass).

    >>> SamplingOptions(temperature=0.7, top_k=20).sampling(max_new_tokens=8)
    SamplingParams(temperature=0.7, top_k=20, top_p=1.0, min_p=0.0, repetition_penalty=1.0, max_new_tokens=8, stop_token_ids=(), top_logprobs=0)
    """

    temperature: float = field_help(1.0, "Sampling temperature (a trainer applies the same).")
    top_k: int | None = field_help(None, "Sample from the k most likely tokens (required with top_p < 1 or min_p > 0).")
    top_p: float = field_help(1.0, "Nucleus sampling mass (needs top_k).")
    min_p: float = field_help(0.0, "Min-p threshold (needs top_k).")
    repetition_penalty: float = field_help(1.0, "Penalize every token already in the context (prompt, earlier "
                                                "turns, tool results, this turn): a positive logit is divided by "
                                                "it, a negative one multiplied, before the temperature (TRL's, "
                                                "transformers' and vLLM's; 1.0: off). The recorded log-probs are "
                                                "the penalized distribution's, so the learner's importance weights "
                                                "correct for it.")
    max_new_tokens: int = field_help(96, "Token limit of each assistant turn.")

    def sampling(self, **overrides) -> SamplingParams:
        """These options as :class:`SamplingParams` (which validates them)."""
        values = {f: getattr(self, f) for f in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                                   "max_new_tokens")}
        return SamplingParams(**{**values, **overrides})


@dataclass(frozen=True)
class StreamedToken:
    """One sampled token as a streamed request's ``on_token`` gets it: the values its
    :class:`Generation` records at the same position."""

    token_id: int
    logprob: float
    """The sampler's log-prob (:attr:`Generation.logprobs`)."""
    top_ids: list[int] | None = None
    """With ``top_logprobs``: the head's ids (:attr:`Generation.top_ids`, or the candidates when
    top-k bounds the support); else None."""
    top_logprobs: list[float] | None = None
    """With ``top_logprobs``: the head's log-probs (:attr:`Generation.top_logprobs`); else None."""


@dataclass
class GenerationRequest:
    """One continuation to sample.

    ``prompt_ids`` is the full token context (prompt and everything so far), never a delta:
    backends that keep a cache find what is new themselves, so a caller cannot get it wrong.
    """

    prompt_ids: list[int]
    """The full token context: prompt plus everything generated and observed so far."""
    params: SamplingParams
    """How to sample."""
    seed: int | None = None
    """Same seed and same context give the same tokens, whatever else is in the batch."""
    group: str | None = None
    """Requests of one group share a prompt (a GRPO group); backends prefill it once."""
    session: str | None = None
    """A multi-turn episode: continue from its cache when ``prompt_ids`` extends what it saw."""
    on_token: Callable[[StreamedToken], None] | None = field(default=None, compare=False, repr=False)
    """Called with each token (a :class:`StreamedToken`) as soon as it is sampled (streaming), from
    the backend's decode thread: it must return at once and never raise (hand it to an event loop,
    e.g. with ``loop.call_soon_threadsafe``). Backends that cannot report tokens early ignore it;
    the :class:`Generation` is the same either way."""

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError(
                "GenerationRequest.prompt_ids is empty: the model needs at least one token of context; "
                "render the prompt (e.g. with a chat template) first."
            )


@dataclass
class Generation:
    """What a policy sampled for one request, token for token."""

    token_ids: list[int]
    """The sampled ids, including the stop token when finish_reason is "stop"."""
    logprobs: list[float]
    """Per token, its log-prob under the distribution it was drawn from (after all processing)."""
    candidates: list[list[int]] | None
    """Per token, the exact ids of that distribution's support; None: the whole vocabulary."""
    finish_reason: FinishReason
    """"stop" (an end-of-turn or stop id was sampled) or "length" (max_new_tokens reached)."""
    policy_version: int
    """The weights version that produced every token of this generation."""
    num_prompt_tokens_processed: int
    """Prompt tokens the model actually ran for this request (0 when shared or cached)."""
    top_ids: list[list[int]] | None = None
    """With ``SamplingParams.top_logprobs`` and no bounded candidate set: per token, the ids
    of the sampler's most likely tokens (most likely first); None otherwise."""
    top_logprobs: list[list[float]] | None = None
    """With ``SamplingParams.top_logprobs``: per token, the sampler's log-probs of ``top_ids``,
    or of ``candidates`` (in that order) when a candidate set was recorded; None otherwise."""


@runtime_checkable
class Policy(Protocol):
    """A generation backend. ``version`` is the weights version stamped on generations."""

    version: int

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Sample every request; results are in request order."""
        ...

    async def agenerate(self, request: GenerationRequest) -> Generation:
        """Sample one request; concurrent awaiters are batched together."""
        ...

    def set_weights(self, weights: Mapping[str, Tensor] | str | os.PathLike, version: int) -> None:
        """Load new weights (a state dict or a checkpoint path) and stamp ``version``."""
        ...

    def end_session(self, session: str) -> None:
        """Forget a session's cache (a no-op for an unknown session)."""
        ...

    def close(self) -> None:
        """Release what the policy holds (worker threads, engines); a later call may start them anew."""
        ...


class AsyncBatcher:
    """Turns a blocking batched ``generate`` into an awaitable per-request call.

    Requests awaited concurrently are collected into one batch (up to ``max_batch_size``),
    and ``generate`` runs in a single worker thread, so the event loop keeps serving tool
    calls while the model decodes. Requests arriving during a batch form the next one.

    >>> batcher = AsyncBatcher(lambda requests: [r * 10 for r in requests], max_batch_size=8)
    >>> async def main():
    ...     return await asyncio.gather(*(batcher.submit(i) for i in range(3)))
    >>> asyncio.run(main())
    [0, 10, 20]
    >>> batcher.close()
    """

    def __init__(self, generate: Callable[[list], list], *, max_batch_size: int, wait_s: float = 0.0):
        self.generate = generate
        self.max_batch_size = max_batch_size
        self.wait_s = wait_s
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[object, asyncio.Future]] = []
        self._task: asyncio.Task | None = None

    async def submit(self, request):
        """The result of ``generate`` for ``request``, computed in a batch with its neighbours."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (e.g. a second asyncio.run): start afresh
            self._loop, self._pending, self._task = loop, [], None
        future = loop.create_future()
        self._pending.append((request, future))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain(loop, self._pending))
        return await future

    async def _drain(self, loop: asyncio.AbstractEventLoop, pending: list) -> None:
        # The task exits when nothing is pending, so no task outlives its event loop.
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treerl-policy")
        while pending:
            # Let requests started in the same tick (or within wait_s) join this batch.
            await asyncio.sleep(self.wait_s)
            batch = [(r, f) for r, f in pending[: self.max_batch_size] if not f.done()]
            del pending[: self.max_batch_size]
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self._executor, self.generate, [r for r, _ in batch])
            except Exception as error:  # noqa: BLE001 - handed to every awaiter, not swallowed
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)

    def close(self) -> None:
        """Stop the worker thread (a later ``submit`` starts a new one)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
