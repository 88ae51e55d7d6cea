"""The load-balancing loss of a Mixture-of-Experts router (Switch Transformer's), on packed rows.

transformers' ``load_balancing_loss_func`` takes each MoE layer's router logits over a padded
batch and returns ``num_experts * sum_e f_e * P_e``: ``f_e`` is the share of top-k assignments
that go to expert ``e`` and ``P_e`` its mean router probability, both means over the batch's
real tokens and every layer. TRL adds ``router_aux_loss_coef`` times it to the loss.

Tree packing forwards a token shared by ``k`` episodes once, where the unpacked batch holds it
``k`` times. Both means are linear in the tokens, so weighting each packed token by the number
of episode paths through it (``PackedBatch.token_num_paths``; 0 on padding) gives the unpacked
batch's ``f_e`` and ``P_e``, hence its loss and gradient, exactly.

>>> import torch
>>> logits = (torch.tensor([[2.0, 0.0], [0.0, 2.0]]),)  # one layer, two tokens, two experts
>>> round(load_balancing_loss(logits, top_k=1, weights=torch.tensor([1.0, 1.0])).item(), 4)  # balanced: 1
1.0
>>> # the first token on 3 paths: f = (3/4, 1/4), P = (0.69, 0.31) (softmax(2, 0) = (0.88, 0.12))
>>> round(load_balancing_loss(logits, top_k=1, weights=torch.tensor([3.0, 1.0])).item(), 4)
1.1904
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["load_balancing_loss"]


def load_balancing_loss(router_logits: Sequence[Tensor], top_k: int, weights: Tensor) -> Tensor:
    """``num_experts * sum_e f_e * P_e`` with token means weighted by ``weights``: () float32.

    Args:
        router_logits: one ``(N, E)`` tensor per MoE layer (or ``(B, T, E)``), the rows of every
            layer the same ``N = B * T`` tokens, as transformers' MoE decoders return them.
        top_k: experts each token is routed to (the config's ``num_experts_per_tok``).
        weights: ``(N,)`` or ``(B, T)`` the times each token counts (an attention mask counts real
            tokens once, as transformers' function does; ``token_num_paths`` counts them as unpacked).

    Computed as transformers' ``load_balancing_loss_func`` computes it: the softmax in the logits'
    dtype, its top-k, then float32 sums; the gradient flows through the probabilities only.
    """
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one MoE layer.")
    num_experts = router_logits[0].shape[-1]
    device = router_logits[0].device
    w = weights.reshape(-1).to(device=device, dtype=torch.float32)  # (N,)
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=device)  # (E,) weighted assignments
    prob_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=device)  # (E,) weighted probabilities
    for layer in router_logits:
        logits = layer.reshape(-1, num_experts)  # (N, E)
        if logits.shape[0] != w.shape[0]:
            raise ValueError(f"router logits of {logits.shape[0]} tokens but {w.shape[0]} weights; pass one weight "
                             "per token of the forward (padding included, weighted 0).")
        probs = torch.softmax(logits, dim=-1)  # (N, E)
        _, chosen = torch.topk(probs, top_k, dim=-1)  # (N, k)
        tokens_per_expert = tokens_per_expert.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob_per_expert = prob_per_expert + (probs.float() * w.unsqueeze(-1)).sum(0)
    total = w.sum() * len(router_logits)  # every layer routes the same tokens
    return num_experts * torch.sum(tokens_per_expert / total * (prob_per_expert / total))
