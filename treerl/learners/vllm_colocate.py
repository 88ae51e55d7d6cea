"""``treerl learn --use-vllm``: the sampler is a vLLM engine in the learner's own process.

The engine (:class:`~treerl.agents.vllm_policy.VLLMPolicy`) loads the model from its
directory (a Hub id is resolved in the local cache, the shipped tiny model from the package)
in the sampler's precision (:mod:`~treerl.learners.precision`), with processed log-probs, so
the log-probs and candidate sets it records are those of the distribution each token was drawn
from, as with the transformers backend. After every step
:class:`~treerl.learners.weight_sync.WeightSync` loads the new weights into the engine's workers
in place (``LLM.collective_rpc``) and drops its prefix cache.

The engine shares the GPU with training: ``vllm_gpu_memory_utilization`` is the share of GPU
memory vLLM takes for weights and KV cache (TRL's colocate mode defaults to 0.3 as well).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from treerl.agents.vllm_policy import VLLMPolicy
from treerl.learners.config import LearnerConfig
from treerl.learners.precision import Precision, checkpoint_dtype
from treerl.models import model_directory

__all__ = ["colocated_vllm_policy", "vllm_engine_kwargs", "vllm_policy"]


def vllm_engine_kwargs(cfg: LearnerConfig, dtype: torch.dtype, max_positions: int | None = None) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for this run (``cfg.vllm_kwargs`` override them).

    >>> cfg = LearnerConfig(output_dir="x", use_vllm=True, vllm_kwargs={"enforce_eager": True})
    >>> sorted(vllm_engine_kwargs(cfg, torch.bfloat16).items())  # doctest: +NORMALIZE_WHITESPACE
    [('dtype', 'bfloat16'), ('enforce_eager', True), ('gpu_memory_utilization', 0.3), ('max_model_len', 1088),
     ('seed', 0)]
    >>> vllm_engine_kwargs(cfg, torch.bfloat16, max_positions=1024)["max_model_len"]
    1024
    """
    # An episode is cut at max_episode_tokens; its last turn may start just below and add a turn's tokens. vLLM
    # refuses a max_model_len beyond the model's positions (the shipped model has 1024), so it is capped there.
    max_model_len = cfg.max_episode_tokens + cfg.max_new_tokens
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
        "max_model_len": min(max_model_len, max_positions) if max_positions else max_model_len,
        "seed": cfg.seed,
        **cfg.vllm_kwargs,
    }


def colocated_vllm_policy(cfg: LearnerConfig, precision: Precision, model: torch.nn.Module) -> VLLMPolicy:
    """A vLLM engine on ``cfg.model`` in the sampler's precision, in this process."""
    # set_weights ships a function to the engine's workers; recent vLLM refuses that unless allowed.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    dtype = precision.sampler_dtype(checkpoint_dtype(model))
    max_candidates = max(64, cfg.top_k or 0, getattr(cfg, "top_logprobs", 0) or 0)
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return VLLMPolicy(model_directory(cfg.model), max_candidates=max_candidates,
                      **vllm_engine_kwargs(cfg, dtype, max_positions))


def vllm_policy(cfg: LearnerConfig, precision: Precision, model: torch.nn.Module, tokenizer: Any) -> Any:
    """The sampler of ``--use-vllm``: a colocated engine, or the server of ``--vllm-mode server``."""
    if cfg.vllm_mode == "server":
        from treerl.learners.vllm_server import server_vllm_policy

        return server_vllm_policy(cfg, model, tokenizer)
    return colocated_vllm_policy(cfg, precision, model)
