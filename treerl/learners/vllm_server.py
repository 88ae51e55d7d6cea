"""``treerl learn --use-vllm --vllm-mode server``: the sampler is a vLLM OpenAI server started separately.

The user starts the server on the same checkpoint as ``--model``::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs --max-logprobs 64

and the learner samples through it (:class:`~treerl.agents.vllm_server_policy.VLLMServerPolicy`),
recording processed log-probs and candidate sets as the transformers backend does. After every
step :class:`~treerl.learners.weight_sync.WeightSync` pushes the new weights with their version
(``--vllm-weight-sync disk`` or ``nccl``), and the server labels later tokens with it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from treerl.agents.transformers_policy import end_of_turn_ids
from treerl.agents.vllm_server_policy import VLLMServerPolicy
from treerl.learners.config import LearnerConfig
from treerl.learners.weight_sync import policy_state_dict
from treerl.models import model_directory

__all__ = ["server_vllm_policy"]


def server_vllm_policy(cfg: LearnerConfig, model: torch.nn.Module, tokenizer: Any) -> VLLMServerPolicy:
    """A policy on the server at ``cfg.vllm_server_url``, checked (reachable, the right model, processed
    log-probs, development mode) and holding the trainer's starting weights."""
    weights_dir = Path(cfg.vllm_weights_dir or Path(cfg.output_dir) / "vllm_weights")
    # `vllm serve MODEL` serves it under the name MODEL: the Hub id or the path as given (the shipped model's path).
    name = cfg.vllm_server_model or cfg.model or model_directory(None)
    policy = VLLMServerPolicy(
        cfg.vllm_server_url, name, stop_token_ids=end_of_turn_ids(model, tokenizer),
        weight_sync=cfg.vllm_weight_sync, weights_dir=weights_dir, trainer_model=model,
        timeout_s=cfg.vllm_server_timeout_s, max_concurrency=cfg.max_concurrency, wait_s=cfg.vllm_server_wait_s)
    print(f"sampler: the vLLM server at {policy.url} ({name}); weights pushed after each step by "
          f"{cfg.vllm_weight_sync}" + (f" through {weights_dir}" if cfg.vllm_weight_sync == "disk" else ""),
          file=sys.stderr)
    if policy.server_weight_version != "default":
        # An earlier run pushed its weights there; sampling must start from this run's.
        print(f"the vLLM server at {policy.url} holds pushed weights (version {policy.server_weight_version}); "
              "pushing this run's starting weights as version 0", file=sys.stderr)
        policy.set_weights(policy_state_dict(model), version=0)
    return policy
