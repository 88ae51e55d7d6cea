"""Kernels: tree attention and LM-head log-probs, each with a torch reference."""

from treerl.kernels.logprobs import (
    IMPLS,
    ImplChoice,
    TokenLogprobs,
    reference_token_logprobs,
    select_impl,
    token_logprobs,
)

__all__ = ["token_logprobs", "reference_token_logprobs", "TokenLogprobs", "ImplChoice", "select_impl", "IMPLS"]
