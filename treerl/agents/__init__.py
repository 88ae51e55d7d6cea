"""Policies that act in environments: the policy interface, sampling, backends, chat rendering."""

from treerl.agents.chat import Bridge, ChatRenderer, assistant_message
from treerl.agents.policy import (
    AsyncBatcher,
    Generation,
    GenerationRequest,
    Policy,
    SamplingOptions,
    SamplingParams,
    StreamedToken,
)
from treerl.agents.sampling import ProcessedLogits, SampledTokens, candidate_lists, process_logits, sample, sample_processed
from treerl.agents.transformers_policy import TransformersPolicy, end_of_turn_ids
from treerl.agents.vllm_policy import VLLMPolicy
from treerl.agents.vllm_server_policy import VLLMServerPolicy

__all__ = [
    "SamplingParams", "SamplingOptions", "GenerationRequest", "Generation", "StreamedToken", "Policy", "AsyncBatcher",
    "TransformersPolicy", "VLLMPolicy", "VLLMServerPolicy", "end_of_turn_ids",
    "ProcessedLogits", "SampledTokens", "process_logits", "sample_processed", "candidate_lists", "sample",
    "ChatRenderer", "Bridge", "assistant_message",
]
