"""Log-probs at loss positions without materializing ``[tokens x vocab]`` logits.

The learner needs three numbers per loss position: the log-prob of the sampled token
under the trainer's tempered policy, the entropy of that distribution, and the log-prob
renormalized over the candidate set the sampler actually drew from. With a 150k
vocabulary the full logits tensor (and its softmax, and its gradient) is the memory peak
of RL training, so the default path never builds it: it walks over tiles of
``chunk_tokens x chunk_vocab`` logits with an online log-sum-exp, and its backward
recomputes the same tiles instead of saving them.

Why renormalize over the candidate set
--------------------------------------
The sampler draws from a truncated support ``C`` (top-k, top-p, min-p), so the
probability it actually used is ``p_S(y) = exp(z_y) / sum_{c in C} exp(z_c)``, not the
full-vocabulary ``p(y) = exp(z_y) / sum_v exp(z_v)``. The two differ by the kept mass
``M = sum_{c in C} p(c)``: ``log p(y) = log p_S(y) + log M``. An importance ratio built
from the trainer's full-vocabulary log-prob against the sampler's truncated one is thus
off by ``M`` at every token, even when the weights are identical, and ``M`` varies from
token to token (it is small exactly where the distribution is flat), so the bias does
not cancel in a normalized estimator. Computing the trainer's log-prob over the same
``C`` makes the ratio exactly 1 for identical weights, and an unbiased correction for
the policy lag otherwise.

The candidate logits are read out of the vocabulary tiles already computed for the
full log-sum-exp (a ``gather`` of at most ``K`` columns per tile), so the candidate path
costs no extra matmul and no ``(N, K, H)`` gather of weight rows; its gradient is
scattered back into the same tiles in backward.

Example::

    >>> import torch
    >>> hidden, weight = torch.randn(5, 16), torch.randn(100, 16)
    >>> targets = torch.tensor([3, 7, 0, 99, 42])
    >>> candidates = torch.stack([targets, torch.full((5,), -1), torch.arange(10, 15)], 1)
    >>> out = token_logprobs(hidden, weight, targets, candidates=candidates, chunk_vocab=32)
    >>> ref = reference_token_logprobs(hidden, weight, targets, candidates=candidates)
    >>> bool(torch.allclose(out.logp, ref.logp, atol=1e-5))
    True
    >>> bool((out.logp_candidates >= out.logp).all())   # the kept mass is at most 1
    True
    >>> out.choice.name
    'chunked'
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from torch import Tensor

from treerl.kernels.triton_logprobs import triton_logprobs_unavailable, triton_token_logprobs
from treerl.kernels.types import ImplChoice, TokenLogprobs  # defined below the Triton path, which returns them too

__all__ = [
    "TokenLogprobs",
    "ImplChoice",
    "token_logprobs",
    "reference_token_logprobs",
    "chunked_token_logprobs",
    "select_impl",
    "IMPLS",
    "CPU_CHUNK_VOCAB",
    "GPU_CHUNK_VOCAB",
    "default_chunk_vocab",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- checks


def _check_inputs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    temperature: float,
    candidates: Tensor | None,
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the argument, the problem and the fix."""
    if hidden.dim() != 2:
        raise ValueError(
            f"hidden must be (N, H) hidden states at the loss positions, got shape {tuple(hidden.shape)}; "
            "gather the loss positions first, e.g. hidden[mask] for a (B, T, H) tensor"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be the (V, H) LM-head weight with H={hidden.shape[1]} matching hidden, "
            f"got shape {tuple(weight.shape)}; pass lm_head.weight (not its transpose)"
        )
    num_tokens, vocab = hidden.shape[0], weight.shape[0]
    if not hidden.is_floating_point() or weight.dtype != hidden.dtype:
        raise TypeError(
            f"hidden and weight must share one floating dtype, got {hidden.dtype} and {weight.dtype}; "
            "cast the hidden states to the LM head's dtype"
        )
    if weight.device != hidden.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}; move both to one device")
    if targets.shape != (num_tokens,) or targets.dtype != torch.long:
        raise ValueError(
            f"targets must be a (N,) = ({num_tokens},) long tensor of token ids, "
            f"got shape {tuple(targets.shape)} and dtype {targets.dtype}"
        )
    if bias is not None and (bias.shape != (vocab,) or bias.dtype != hidden.dtype):
        raise ValueError(
            f"bias must be (V,) = ({vocab},) in {hidden.dtype}, got shape {tuple(bias.shape)} and dtype "
            f"{bias.dtype}; pass lm_head.bias, or None for a head without bias"
        )
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature must be a finite number > 0, got {temperature!r}; use the sampler's temperature "
            "(greedy decoding has no log-probs to match: sample with a small temperature instead)"
        )
    if candidates is not None and (
        candidates.dim() != 2 or candidates.shape[0] != num_tokens or candidates.dtype != torch.long
    ):
        raise ValueError(
            f"candidates must be a (N, K) long tensor with N={num_tokens}, padded with -1, "
            f"got shape {tuple(candidates.shape)} and dtype {candidates.dtype}"
        )
    if num_tokens == 0:
        return
    # The value checks read their results back in one transfer: on an accelerator each read
    # waits for the forward queued before it, once per micro-batch.
    checks = [*torch.aminmax(targets)]
    if candidates is not None:
        is_member = (candidates == targets[:, None]).any(dim=1)  # (N,)
        ordered = candidates.sort(dim=1).values  # (N, K)
        repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)  # (N, K-1)
        checks += [*torch.aminmax(candidates), is_member.all(), repeated.any()]
    values = torch.stack([check.long() for check in checks]).tolist()
    if values[0] < 0 or values[1] >= vocab:
        raise ValueError(
            f"targets must be token ids in [0, {vocab}), got values in [{values[0]}, {values[1]}]; mask padding "
            "out before gathering the loss positions"
        )
    if candidates is None:
        return
    low, high, all_members, any_repeated = values[2:]
    if low < -1 or high >= vocab:
        raise ValueError(
            f"candidates must be token ids in [0, {vocab}) or -1 for padding, got values in [{low}, {high}]"
        )
    if not all_members:
        row = int((~is_member).nonzero()[0])
        raise ValueError(
            f"candidates row {row} does not contain its target {int(targets[row])}: the sampler drew the "
            "target from its candidate set, so it must be a member; record the set the sampler used"
        )
    if any_repeated:
        row = int(repeated.any(dim=1).nonzero()[0])
        raise ValueError(
            f"candidates row {row} lists a token id twice, which would count its probability twice in the "
            "renormalization; deduplicate the candidate sets (pad with -1)"
        )


CPU_CHUNK_VOCAB = 1024
"""The chunked path's vocabulary tile on CPU: a 1024 x 1024 float32 tile (4 MiB) stays in cache
through the half-dozen elementwise passes each tile takes, where 1024 x 8192 (32 MiB) streams
them through memory; with a 32k vocabulary the forward + backward took 0.75x the CPU time
(``benchmarks/bench_logprobs.py``, 2,048 tokens)."""

GPU_CHUNK_VOCAB = 8192
"""The vocabulary tile (chunked) or span of one program (Triton) on GPUs."""


HALF_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes whose head ``fp32_head`` computes in float32 (float32 and float64 heads already are)."""


def default_chunk_vocab(impl: str, device: torch.device) -> int:
    """The vocabulary tile ``token_logprobs`` uses when ``chunk_vocab`` is None.

    >>> default_chunk_vocab("chunked", torch.device("cpu")), default_chunk_vocab("triton", torch.device("cuda"))
    (1024, 8192)
    """
    return CPU_CHUNK_VOCAB if impl == "chunked" and device.type == "cpu" else GPU_CHUNK_VOCAB


def _check_chunks(chunk_tokens: int, chunk_vocab: int | None) -> None:
    for name, value in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if name == "chunk_vocab" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"{name} must be an int >= 1, got {value!r}; the defaults (1024 tokens x 1024 vocab on CPU, "
                "x 8192 on GPUs) bound one logits tile at 4 or 32 MiB in float32"
            )


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision inputs accumulate in float32; float64 stays float64 for gradcheck.
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- reference


def reference_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    candidates: Tensor | None = None,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
    impl: str = "reference",
) -> TokenLogprobs:
    """The same outputs as :func:`token_logprobs` from the full ``(N, V)`` logits.

    Plain autograd, for tests and small inputs. ``chunk_tokens``, ``chunk_vocab`` and
    ``impl`` are accepted (and ignored) so the two functions are interchangeable.

    >>> out = reference_token_logprobs(torch.zeros(2, 4), torch.zeros(8, 4), torch.tensor([1, 2]))
    >>> [round(v, 4) for v in out.logp.tolist()], round(float(out.entropy[0]), 4) == round(math.log(8), 4)
    ([-2.0794, -2.0794], True)
    """
    _check_inputs(hidden, weight, targets, bias, temperature, candidates)
    _check_chunks(chunk_tokens, chunk_vocab)
    logits = hidden @ weight.T  # (N, V)
    if bias is not None:
        logits = logits + bias
    z = logits.to(_acc_dtype(hidden.dtype)) / temperature  # (N, V)
    logp_all = z.log_softmax(dim=-1)  # (N, V)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)  # (N,)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)  # (N,)
    logp_candidates = None
    if candidates is not None:
        z_cand = z.gather(1, candidates.clamp(min=0))  # (N, K)
        z_cand = z_cand.masked_fill(candidates < 0, float("-inf"))
        z_target = z.gather(1, targets[:, None]).squeeze(1)  # (N,)
        logp_candidates = z_target - z_cand.logsumexp(dim=-1)
    return TokenLogprobs(logp, entropy, logp_candidates, ImplChoice("reference", "requested"))


# --------------------------------------------------------------------------- chunked


def _logits_tile(h: Tensor, w: Tensor, b: Tensor | None, temperature: float, acc: torch.dtype,
                 compute: torch.dtype | None = None) -> Tensor:
    """(n, H) x (v, H) -> (n, v) tempered logits in ``acc``.

    The matmul runs in the input dtype (tensor cores for bfloat16), or in ``compute`` (float32 for
    ``fp32_head``: the weight tile is upcast, never the whole head), and only the tile is upcast;
    everything computed from it is float32.
    """
    if compute is not None:
        h, w, b = h.to(compute), w.to(compute), None if b is None else b.to(compute)
    tile = h @ w.T if b is None else torch.addmm(b, h, w.T)  # (n, v)
    tile = tile.to(acc)
    return tile.div_(temperature)


def _gather_in_tile(tile: Tensor, ids: Tensor, start: int, out: Tensor) -> None:
    """Copy ``tile[i, ids[i, j] - start]`` into ``out[i, j]`` where that id lies in the tile.

    tile: (n, v); ids, out: (n, K). Padding (-1) and ids outside the tile leave ``out`` as is.
    """
    local = ids - start  # (n, K)
    inside = (local >= 0) & (local < tile.shape[1])
    values = tile.gather(1, local.clamp(0, tile.shape[1] - 1))  # (n, K)
    torch.where(inside, values, out, out=out)


def _scatter_in_tile(tile: Tensor, ids: Tensor, start: int, values: Tensor) -> None:
    """``tile[i, ids[i, j] - start] += values[i, j]`` for ids inside the tile. ids, values: (n, K)."""
    local = ids - start
    inside = (local >= 0) & (local < tile.shape[1])
    tile.scatter_add_(1, local.clamp(0, tile.shape[1] - 1), values.masked_fill(~inside, 0))


class _ChunkedLogprobs(torch.autograd.Function):
    """Tiled forward with an online log-sum-exp; backward recomputes the tiles.

    Saved for backward: the inputs, and per token only ``lse``, the entropy and the
    candidate softmax ``(N, K)``. The gradient of the outputs wrt ``z_v`` is

    * ``logp``:            ``1[v = y] - p_v``
    * ``entropy``:         ``-p_v (z_v - E_p[z])``
    * ``logp_candidates``: ``1[v = y] - q_v 1[v in C]`` with ``q = softmax over C``

    so one pass over the tiles with the upstream gradients folded in gives all three.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, candidates, temperature, chunk_tokens, chunk_vocab, compute):
        acc = _acc_dtype(hidden.dtype)
        num_tokens, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        lse = torch.empty(num_tokens, dtype=acc, device=device)  # (N,)
        entropy = torch.empty(num_tokens, dtype=acc, device=device)  # (N,)
        z_target = torch.zeros(num_tokens, dtype=acc, device=device)  # (N,)
        has_cand = candidates is not None
        if has_cand:
            z_cand = torch.full(candidates.shape, float("-inf"), dtype=acc, device=device)  # (N, K)
        with torch.no_grad():
            for t0 in range(0, num_tokens, chunk_tokens):
                t1 = min(t0 + chunk_tokens, num_tokens)
                h = hidden[t0:t1]  # (n, H)
                y = targets[t0:t1, None]  # (n, 1)
                # Running stats relative to the running max m: s = sum e^(z-m), a = sum e^(z-m) (z-m).
                # Keeping a relative to m (not sum p*z) avoids cancellation when logits are large.
                m = s = a = None
                for v0 in range(0, vocab, chunk_vocab):
                    v1 = min(v0 + chunk_vocab, vocab)
                    z = _logits_tile(h, weight[v0:v1], None if bias is None else bias[v0:v1], temperature, acc,
                                     compute)
                    _gather_in_tile(z, y, v0, z_target[t0:t1, None])
                    if has_cand:
                        _gather_in_tile(z, candidates[t0:t1], v0, z_cand[t0:t1])
                    m_tile = z.max(dim=1).values  # (n,)
                    z.sub_(m_tile[:, None])
                    e = z.exp()  # (n, v)
                    s_tile = e.sum(dim=1)
                    a_tile = (e.mul_(z)).sum(dim=1)
                    if m is None:
                        m, s, a = m_tile, s_tile, a_tile
                        continue
                    m_new = torch.maximum(m, m_tile)
                    d_old, d_tile = m - m_new, m_tile - m_new  # (n,) both <= 0
                    a = d_old.exp() * (a + d_old * s) + d_tile.exp() * (a_tile + d_tile * s_tile)
                    s = d_old.exp() * s + d_tile.exp() * s_tile
                    m = m_new
                lse[t0:t1] = m + s.log()
                # H = lse - E[z] = log s - a / s
                entropy[t0:t1] = s.log() - a / s
        logp = z_target - lse
        if has_cand:
            lse_cand = z_cand.logsumexp(dim=1)  # (N,)
            logp_cand = z_target - lse_cand
            q_cand = (z_cand - lse_cand[:, None]).exp()  # (N, K), 0 at padding
        else:
            logp_cand = torch.zeros_like(logp)
            q_cand = None
        ctx.save_for_backward(hidden, weight, bias, targets, candidates, lse, entropy, q_cand)
        ctx.config = (temperature, chunk_tokens, chunk_vocab, compute)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(() if has_cand else (logp_cand,)))
        return logp, entropy, logp_cand

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_entropy, g_cand):
        hidden, weight, bias, targets, candidates, lse, entropy, q_cand = ctx.saved_tensors
        temperature, chunk_tokens, chunk_vocab, compute = ctx.config
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 9
        if candidates is None:
            g_cand = None
        if (g_logp is None and g_entropy is None and g_cand is None) or not (need_h or need_w or need_b):
            return none
        acc = lse.dtype
        num_tokens, vocab = hidden.shape[0], weight.shape[0]
        zeros = torch.zeros(num_tokens, dtype=acc, device=hidden.device)
        g_logp = zeros if g_logp is None else g_logp.to(acc)  # (N,)
        g_entropy = zeros if g_entropy is None else g_entropy.to(acc)  # (N,)
        g_target = g_logp if g_cand is None else g_logp + g_cand.to(acc)  # (N,) coefficient of 1[v = y]
        g_members = None if g_cand is None else -g_cand.to(acc)[:, None] * q_cand  # (N, K)
        expected_z = lse - entropy  # (N,) E_p[z]

        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if need_b else None
        # Vocabulary outer, tokens inner: each weight tile's gradient is accumulated in
        # float32 over all tokens and written once, so bfloat16 weights see one rounding.
        for v0 in range(0, vocab, chunk_vocab):
            v1 = min(v0 + chunk_vocab, vocab)
            w = weight[v0:v1] if compute is None else weight[v0:v1].to(compute)  # (v, H)
            b = None if bias is None else bias[v0:v1]
            gw_tile = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
            gb_tile = torch.zeros(v1 - v0, dtype=acc, device=w.device) if need_b else None
            for t0 in range(0, num_tokens, chunk_tokens):
                t1 = min(t0 + chunk_tokens, num_tokens)
                h = hidden[t0:t1] if compute is None else hidden[t0:t1].to(compute)
                dz = _logits_tile(h, w, b, temperature, acc, compute)  # (n, v) holds z for now
                dz.sub_(expected_z[t0:t1, None])  # z - E[z]
                # p = exp(z - lse) = exp((z - E[z]) - H)
                p = (dz - entropy[t0:t1, None]).exp_()  # (n, v)
                # dz = -p * (g_logp + g_entropy * (z - E[z]))
                dz.mul_(g_entropy[t0:t1, None]).add_(g_logp[t0:t1, None]).mul_(p).neg_()
                del p
                _scatter_in_tile(dz, targets[t0:t1, None], v0, g_target[t0:t1, None])
                if g_members is not None:
                    _scatter_in_tile(dz, candidates[t0:t1], v0, g_members[t0:t1])
                dz.div_(temperature)  # d/d logits = d/dz / T
                d_logits = dz.to(h.dtype)  # (n, v)
                if need_h:
                    grad_h[t0:t1] += (d_logits @ w).to(acc)
                if need_w:
                    gw_tile += (d_logits.T @ h).to(acc)
                if need_b:
                    gb_tile += dz.sum(dim=0)
            if need_w:
                grad_w[v0:v1] = gw_tile
            if need_b:
                grad_b[v0:v1] = gb_tile
        if need_h:
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    candidates: Tensor | None = None,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
    fp32_head: bool = False,
) -> TokenLogprobs:
    """The tiled torch path: no tensor larger than ``chunk_tokens x chunk_vocab`` logits.

    Inputs are assumed checked (see :func:`token_logprobs`). Peak extra memory is a
    few tiles plus, in backward, float32 gradients of one ``(chunk_vocab, H)`` weight
    tile and of ``hidden``. ``fp32_head`` runs the matmuls in float32, upcasting one tile of
    the head's weight at a time.
    """
    if chunk_vocab is None:
        chunk_vocab = default_chunk_vocab("chunked", hidden.device)
    logp, entropy, logp_cand = _ChunkedLogprobs.apply(
        hidden, weight, bias, targets, candidates, float(temperature), chunk_tokens, chunk_vocab,
        torch.float32 if fp32_head and hidden.dtype in HALF_DTYPES else None,
    )
    return TokenLogprobs(logp, entropy, logp_cand if candidates is not None else None)


# --------------------------------------------------------------------------- dispatch

IMPLS: dict[str, Callable[..., TokenLogprobs]] = {
    "triton": triton_token_logprobs,
    "chunked": chunked_token_logprobs,
    "reference": reference_token_logprobs,
}
"""Implementations by name; every entry takes the arguments of :func:`token_logprobs` (less ``impl``)."""


def select_impl(impl: str, hidden: Tensor) -> ImplChoice:
    """Resolve ``impl`` ("auto" or a key of :data:`IMPLS`) to a concrete choice with a reason.

    >>> select_impl("auto", torch.zeros(1, 1)).name
    'chunked'
    """
    if impl != "auto":
        if impl not in IMPLS:
            raise ValueError(
                f"impl must be 'auto' or one of {sorted(IMPLS)}, got {impl!r}; 'auto' picks the fastest available"
            )
        return ImplChoice(impl, "requested")
    if hidden.device.type != "cuda":
        return ImplChoice("chunked", f"hidden is on {hidden.device.type}; the tiled torch path is the CPU path")
    why_not = triton_logprobs_unavailable(hidden.device, hidden.dtype)
    if why_not is not None:
        return ImplChoice("chunked", f"not triton: {why_not}")
    return ImplChoice("triton", "CUDA tensors and the Triton kernel can run")


_SAID: set[tuple[str, str]] = set()
"""The implementation choices already logged at info level."""


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    candidates: Tensor | None = None,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
    impl: str = "auto",
    fp32_head: bool = False,
) -> TokenLogprobs:
    """Log-prob of each target, entropy, and candidate-renormalized log-prob, from the LM head.

    Args:
        hidden: (N, H) final hidden states at the loss positions (float32, bfloat16, ...).
        weight: (V, H) LM-head weight, tied to the embedding or not.
        targets: (N,) long, the sampled token at each position.
        bias: (V,) LM-head bias, if the head has one.
        temperature: the sampler's temperature; logits are divided by it before softmax.
        candidates: (N, K) long, the sampler's candidate set per position padded with -1;
            the target must be a member and ids must not repeat.
        chunk_tokens, chunk_vocab: the tile size; memory is bounded by one tile of logits. None
            for ``chunk_vocab`` takes :func:`default_chunk_vocab` (smaller tiles on CPU, where a
            tile that stays in cache is faster).
        impl: "auto", "triton", "chunked" or "reference" (full logits). The choice and its reason are
            returned in ``.choice`` and logged at DEBUG level.
        fp32_head: the logits' matmuls in float32 from bfloat16/float16 ``hidden`` and ``weight``
            (TRL's ``cast_lm_head_to_fp32``); without it they run in the inputs' dtype, whose rounding
            of each logit (bfloat16 keeps 8 bits) moves the log-probs. The chunked path upcasts a
            weight tile at a time; the others take float32 copies of the inputs (the Triton kernel
            then runs exact IEEE float32 products, slower than half precision's tensor cores).

    Gradients flow to ``hidden``, ``weight`` and ``bias`` from all three outputs. Outputs
    are float32 (float64 for float64 inputs).

    >>> h, w = torch.randn(3, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    >>> out = token_logprobs(h, w, torch.tensor([1, 2, 3]), temperature=0.7, chunk_vocab=16)
    >>> (out.logp.sum() + 0.01 * out.entropy.sum()).backward()
    >>> h.grad.shape, w.grad.shape
    (torch.Size([3, 8]), torch.Size([50, 8]))
    """
    _check_inputs(hidden, weight, targets, bias, temperature, candidates)
    _check_chunks(chunk_tokens, chunk_vocab)
    choice = select_impl(impl, hidden)
    if chunk_vocab is None:
        chunk_vocab = default_chunk_vocab(choice.name, hidden.device)
    if (choice.name, choice.reason) not in _SAID:  # once per choice at info (as tree attention's), then debug
        _SAID.add((choice.name, choice.reason))
        logger.info("token_logprobs: impl=%s (%s)", choice.name, choice.reason)
    else:
        logger.debug("token_logprobs: impl=%s (%s)", choice.name, choice.reason)
    upcast = {}
    if fp32_head and hidden.dtype in HALF_DTYPES:
        if choice.name == "chunked":
            upcast = {"fp32_head": True}
        else:  # gradients flow back through the casts, in the inputs' dtypes
            hidden, weight, bias = hidden.float(), weight.float(), None if bias is None else bias.float()
    out = IMPLS[choice.name](
        hidden,
        weight,
        targets,
        bias=bias,
        temperature=temperature,
        candidates=candidates,
        chunk_tokens=chunk_tokens,
        chunk_vocab=chunk_vocab,
        **upcast,
    )
    out.choice = choice
    return out
