"""A generation backend on vLLM (the ``vllm`` extra): ``pip install 'treerl[vllm]'``.

The engine is created with ``logprobs_mode="processed_logprobs"``, so the log-probs it
returns are those of the distribution each token was drawn from: after the repetition
penalty (over the prompt, the request's whole context, and the tokens sampled so far),
temperature, min-p, top-k and top-p, in the same order as :mod:`treerl.agents.sampling`. With ``top_k`` set,
each step asks for ``top_k`` log-probs; the ids whose processed log-prob is finite are
exactly the candidate set (the rest were cut by min-p or top-p).

Groups and sessions need no bookkeeping here: vLLM's automatic prefix caching reuses the
shared prompt of a group and the history of a session; ``num_prompt_tokens_processed`` is
read from vLLM's ``num_cached_tokens`` when it reports it.

vllm is imported lazily, so ``import treerl`` never needs it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from torch import Tensor

from treerl.agents.policy import AsyncBatcher, Generation, GenerationRequest, SamplingParams
from treerl.errors import MissingExtraError

__all__ = ["VLLMPolicy", "import_vllm", "to_vllm_sampling_kwargs", "to_generation"]


def import_vllm():
    """The ``vllm`` module, or an ImportError that says which extra to install."""
    try:
        import vllm
    except ImportError as error:
        raise MissingExtraError(
            "VLLMPolicy needs vLLM, which is an optional dependency: pip install 'treerl[vllm]' "
            "(or use TransformersPolicy, which needs nothing extra)."
        ) from error
    return vllm


def to_vllm_sampling_kwargs(request: GenerationRequest, stop_token_ids: frozenset[int]) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request.

    >>> kwargs = to_vllm_sampling_kwargs(
    ...     GenerationRequest([1, 2], SamplingParams(top_k=4, top_p=0.9, max_new_tokens=8), seed=3), frozenset({7}))
    >>> kwargs["top_k"], kwargs["logprobs"], kwargs["max_tokens"], kwargs["stop_token_ids"], kwargs["seed"]
    (4, 4, 8, [7], 3)
    """
    params = request.params
    return {
        "n": 1,
        "temperature": params.temperature,
        # -1 disables top-k in every vLLM release (newer ones also accept 0).
        "top_k": params.top_k if params.top_k is not None else -1,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "max_tokens": params.max_new_tokens,
        "seed": request.seed,
        "stop_token_ids": sorted(stop_token_ids | set(params.stop_token_ids)),
        # top_k processed log-probs per step reveal the whole candidate set; else the head score
        # centering asks for (top_logprobs), or 0: the sampled token only.
        "logprobs": params.top_k if params.top_k is not None else params.top_logprobs,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def to_generation(
    completion, params: SamplingParams, *, num_prompt_tokens: int, num_cached_tokens: int | None, version: int
) -> Generation:
    """A :class:`Generation` from one vLLM ``CompletionOutput`` (``token_ids``, ``logprobs``:
    per step a mapping from token id to an object with ``.logprob``, ``finish_reason``).

    >>> from types import SimpleNamespace as NS
    >>> steps = [{5: NS(logprob=-0.1), 6: NS(logprob=-2.4), 9: NS(logprob=float("-inf"))}]
    >>> out = NS(token_ids=[5], logprobs=steps, finish_reason="length")
    >>> g = to_generation(out, SamplingParams(top_k=3), num_prompt_tokens=4, num_cached_tokens=None, version=2)
    >>> g.token_ids, g.logprobs, g.candidates, g.num_prompt_tokens_processed
    ([5], [-0.1], [[5, 6]], 4)
    >>> g = to_generation(out, SamplingParams(top_logprobs=1), num_prompt_tokens=4, num_cached_tokens=0, version=2)
    >>> g.candidates, g.top_ids, g.top_logprobs
    (None, [[5]], [[-0.1]])
    """
    token_ids = [int(t) for t in completion.token_ids]
    steps = completion.logprobs
    if steps is None or len(steps) != len(token_ids):
        raise RuntimeError(
            "vLLM returned no per-token log-probs; VLLMPolicy asks for them in every request, so the engine "
            "was probably built without logprobs support (check max_logprobs)."
        )
    logprobs = [float(step[token].logprob) for step, token in zip(steps, token_ids)]
    candidates = None
    if params.top_k is not None:
        candidates = [
            [int(t) for t, lp in sorted(step.items(), key=lambda item: (-item[1].logprob, item[0]))
             if math.isfinite(lp.logprob)]
            for step in steps
        ]
    top_ids = top_logprobs = None
    if params.top_logprobs > 0:
        ranked = [sorted(((int(t), float(lp.logprob)) for t, lp in step.items() if math.isfinite(lp.logprob)),
                         key=lambda item: (-item[1], item[0])) for step in steps]
        if candidates is None:  # the whole vocabulary: its head (vLLM adds the sampled token beyond it)
            ranked = [pairs[:params.top_logprobs] for pairs in ranked]
            top_ids = [[t for t, _ in pairs] for pairs in ranked]
        top_logprobs = [[lp for _, lp in pairs] for pairs in ranked]
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {completion.finish_reason!r} (aborted?).")
    return Generation(
        token_ids=token_ids,
        logprobs=logprobs,
        candidates=candidates,
        finish_reason=completion.finish_reason,
        policy_version=version,
        num_prompt_tokens_processed=num_prompt_tokens - (num_cached_tokens or 0),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def _load_weights_on_worker(worker, weights: list[tuple[str, Tensor]]) -> None:
    """Runs inside each vLLM worker (through ``LLM.collective_rpc``)."""
    worker.model_runner.model.load_weights(weights=weights)


class VLLMPolicy:
    """A :class:`~treerl.agents.policy.Policy` on an in-process ``vllm.LLM``.

    Args:
        model: a model path (or hub id available offline) for a new engine, or an existing
            ``vllm.LLM`` built with ``logprobs_mode="processed_logprobs"``.
        version: the weights version stamped on generations.
        max_candidates: the engine's ``max_logprobs``: the largest ``top_k`` a request may use.
        max_batch_size: most requests ``agenerate`` hands to the engine at once.
        **llm_kwargs: passed to ``vllm.LLM`` (e.g. ``gpu_memory_utilization``, ``dtype``).

    ``set_weights`` sends the tensors to the workers with ``LLM.collective_rpc``; recent vLLM
    releases refuse to ship a Python function to worker processes unless
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` is set (or multiprocessing is off,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    """

    def __init__(
        self,
        model,
        *,
        version: int = 0,
        max_candidates: int = 64,
        max_batch_size: int = 256,
        **llm_kwargs,
    ):
        vllm = import_vllm()
        self._vllm = vllm
        if isinstance(model, (str, os.PathLike)):
            llm_kwargs.setdefault("enable_prefix_caching", True)
            self.llm = vllm.LLM(
                model=str(model), logprobs_mode="processed_logprobs", max_logprobs=max_candidates, **llm_kwargs
            )
        else:
            self.llm = model
            mode = getattr(getattr(getattr(model, "llm_engine", None), "model_config", None), "logprobs_mode", None)
            if mode is not None and str(getattr(mode, "value", mode)) != "processed_logprobs":
                raise ValueError(
                    f"VLLMPolicy needs an engine with logprobs_mode='processed_logprobs' (got {mode!r}): the "
                    "learner must see the log-probs of the distribution tokens were drawn from. Build it with "
                    "vllm.LLM(..., logprobs_mode='processed_logprobs') or pass the model path instead."
                )
        self.version = version
        self.max_candidates = max_candidates
        from treerl.agents.transformers_policy import end_of_turn_ids

        # vLLM already stops on the generation config's eos; add the template's end-of-turn tokens.
        skip_tokenizer = llm_kwargs.get("skip_tokenizer_init", False) or not hasattr(self.llm, "get_tokenizer")
        tokenizer = None if skip_tokenizer else self.llm.get_tokenizer()
        self.stop_token_ids = end_of_turn_ids(SimpleNamespace(generation_config=None, config=None), tokenizer)
        self._batcher = AsyncBatcher(lambda requests: self.generate(requests), max_batch_size=max_batch_size)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Sample every request in one engine call; results are in request order."""
        for request in requests:
            top_k = request.params.top_k
            if top_k is not None and top_k > self.max_candidates:
                raise ValueError(
                    f"SamplingParams.top_k={top_k} exceeds VLLMPolicy.max_candidates={self.max_candidates}: vLLM "
                    f"returns at most max_logprobs ids per step, and all top_k are needed to record the candidate "
                    f"set. Build the policy with max_candidates>={top_k} or lower top_k."
                )
        version = self.version
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        sampling = [self._vllm.SamplingParams(**to_vllm_sampling_kwargs(r, self.stop_token_ids)) for r in requests]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        return [
            to_generation(
                output.outputs[0],
                request.params,
                num_prompt_tokens=len(request.prompt_ids),
                num_cached_tokens=getattr(output, "num_cached_tokens", None),
                version=version,
            )
            for request, output in zip(requests, outputs)
        ]

    async def agenerate(self, request: GenerationRequest) -> Generation:
        """Sample one request; concurrent awaiters go to the engine together."""
        return await self._batcher.submit(request)

    def set_weights(self, weights: Mapping[str, Tensor] | str | os.PathLike, version: int) -> None:
        """Load new weights into every worker, drop the prefix cache, set ``version``."""
        from treerl.agents.transformers_policy import load_state_dict

        state_dict = weights if isinstance(weights, Mapping) else load_state_dict(weights)
        self.llm.collective_rpc(_load_weights_on_worker, args=(list(state_dict.items()),))
        # Cached prefixes hold keys and values of the old weights.
        self.llm.reset_prefix_cache()
        self.version = int(version)

    def end_session(self, session: str) -> None:
        """Nothing to free: the prefix cache evicts a finished session's blocks by itself."""

    def close(self) -> None:
        """Stop the worker thread used by ``agenerate``."""
        self._batcher.close()
