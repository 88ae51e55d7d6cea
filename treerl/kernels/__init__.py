"""Kernels: tree attention and LM-head log-probs, each with a torch reference."""

from treerl.kernels.logprobs import (
    IMPLS,
    ImplChoice,
    TokenLogprobs,
    reference_token_logprobs,
    select_impl,
    token_logprobs,
)
from treerl.kernels.tree_attention import (
    TREE_KWARG,
    TreeAttentionChoice,
    TreeAttentionError,
    enable_tree_attention,
)
from treerl.kernels.tree_layout import TreeBatch, TreeLayout

__all__ = [
    "TreeLayout", "TreeBatch", "enable_tree_attention", "TreeAttentionChoice", "TreeAttentionError", "TREE_KWARG",
    "token_logprobs", "reference_token_logprobs", "TokenLogprobs", "ImplChoice", "select_impl", "IMPLS",
]
