"""Kernels: tree attention and LM-head log-probs, each with a torch reference.

Modules, bottom up; each imports only from those above it in this list (and from
:mod:`treerl.errors`), never back up, and never from another floor of treerl:

- ``types``: what the kernels return and raise (``TokenLogprobs``, ``ImplChoice``,
  ``TreeAttentionError``); ``tree_layout``: the depth-first tree layout of a packed row;
- ``block_sparsity``: which key blocks each query block needs (pure torch); ``triton_support``:
  Triton if it imports, why not otherwise, and whether kernels are interpreted;
- ``triton_logprobs``, ``triton_tree_attention_kernels``, then ``triton_tree_attention``: the
  Triton paths; each imports without triton and says why it cannot run;
- ``logprobs``, ``tree_attention``: the dispatching modules users call, with the torch paths.
"""

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
