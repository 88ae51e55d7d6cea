"""Fused LM-head log-probs in Triton: the GPU path of :func:`treerl.kernels.token_logprobs`.

Same inputs and outputs as the tiled torch path (``chunked`` in
:mod:`treerl.kernels.logprobs`, whose docstring explains why the trainer renormalizes
over the sampler's candidate set), computed by two kernels that never build the
``[tokens x vocab]`` logits:

* **forward**: program ``(i, j)`` takes a block of ``BLOCK_N`` tokens and walks the
  ``j``-th span of ``chunk_vocab`` vocabulary rows tile by tile. Each tile of logits is a
  ``tl.dot`` over the hidden size, accumulated in float32; from it the program keeps an
  online log-sum-exp (running max ``m``, ``s = sum e^(z-m)``, and ``a = sum e^(z-m)(z-m)``
  for the entropy), the target's logit, and a second online log-sum-exp whose running
  maximum is taken over candidate members only. Each span writes these six numbers per
  token, and a few ``(spans, N)`` torch ops merge them. Splitting the vocabulary into
  spans keeps the GPU busy when the batch holds few token blocks.
* **backward** recomputes the same tiles, forms the gradient wrt the logits from the saved
  per-token ``lse``, ``E_p[z]`` and candidate ``lse`` (see ``_ChunkedLogprobs`` for the
  formulas), and adds ``dz @ W`` into the hidden gradient and ``dz^T @ h`` into the
  weight gradient with float32 atomics. Atomics make the gradients' last bits depend on
  the order programs finish; values match the torch path to float32 rounding.

Inputs of float32, bfloat16 and float16 are supported; the matmuls run in the input dtype
(tensor cores for half precision; exact IEEE float32 for float32 inputs, not TF32), and
everything after the matmul is float32. float64 goes to the torch path.

The kernels run where Triton can run them: on CUDA, or on CPU under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported; the test suite does so on
machines without a GPU). :func:`triton_logprobs_unavailable` says which of these is
missing, in words, so ``impl="auto"`` can log why it fell back and tests can skip with it.

Example (on a GPU, or under the interpreter)::

    >>> import torch
    >>> hidden, weight = torch.randn(5, 16), torch.randn(100, 16)
    >>> targets = torch.tensor([3, 7, 0, 99, 42])
    >>> if triton_logprobs_unavailable(hidden.device, hidden.dtype) is None:
    ...     out = triton_token_logprobs(hidden, weight, targets, temperature=0.7, chunk_vocab=64)
    ...     assert out.logp.shape == out.entropy.shape == (5,)
"""

import contextlib

import torch
from torch import Tensor

from treerl.errors import TreerlError
from treerl.kernels.triton_support import IMPORT_ERROR as _TRITON_IMPORT_ERROR
from treerl.kernels.triton_support import INTERPRETED as _INTERPRETED
from treerl.kernels.triton_support import tl, triton
from treerl.kernels.types import TokenLogprobs


__all__ = [
    "triton_token_logprobs",
    "triton_logprobs_unavailable",
    "TritonUnavailableError",
    "SUPPORTED_DTYPES",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes the kernels take; others (float64) use the torch path."""

# The float32 weight gradient of a half-precision head is built this many bytes at a time
# (a group of vocabulary rows per launch), then rounded once into the head's dtype.
_WEIGHT_GRAD_GROUP_BYTES = 512 * 2**20


class TritonUnavailableError(TreerlError, RuntimeError):
    """The Triton log-prob kernel cannot run here; the message says why and what to use instead."""


# --------------------------------------------------------------------------- availability


def _why_unavailable(
    device: torch.device, dtype: torch.dtype | None, *, interpreted: bool, import_error: str | None
) -> str | None:
    """The probe as a pure function of its facts (testable without a GPU)."""
    if import_error is not None:
        return (
            f"triton cannot be imported ({import_error}); install it (`pip install triton`, Linux only) "
            "or use impl='chunked'"
        )
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return (
            f"the Triton kernel takes {', '.join(str(d) for d in SUPPORTED_DTYPES)}, not {dtype}; "
            "use impl='chunked' (float64 is for gradcheck)"
        )
    if device.type == "cuda":
        if interpreted:
            return (
                "the Triton kernels were defined under TRITON_INTERPRET=1 (the CPU interpreter); "
                "unset it before importing treerl to run them on the GPU"
            )
        return None
    if device.type == "cpu" and interpreted:
        return None  # slow, for tests only: impl="auto" never picks it on CPU
    return (
        f"tensors are on {device.type}; the Triton kernel needs CUDA (or, for tests on CPU, "
        "TRITON_INTERPRET=1 set before importing treerl)"
    )


def triton_logprobs_unavailable(device: torch.device | str, dtype: torch.dtype | None = None) -> str | None:
    """Why :func:`triton_token_logprobs` cannot run on ``device`` for ``dtype``, or None if it can.

    >>> "impl='chunked'" in triton_logprobs_unavailable("cuda", torch.float64)
    True
    """
    return _why_unavailable(
        torch.device(device), dtype, interpreted=_INTERPRETED, import_error=_TRITON_IMPORT_ERROR
    )


# --------------------------------------------------------------------------- kernels

if triton is not None:

    def _configs(gpu_configs: list[tuple[int, int, int, int, int]]) -> list:
        # The interpreter cannot benchmark several configs; one small tile keeps it fast.
        # tl.dot needs every block dimension >= 16.
        if _INTERPRETED:
            return [triton.Config({"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_H": 16}, num_warps=1, num_stages=1)]
        return [
            triton.Config({"BLOCK_N": n, "BLOCK_V": v, "BLOCK_H": h}, num_warps=w, num_stages=s)
            for n, v, h, w, s in gpu_configs
        ]

    _FORWARD_CONFIGS = _configs(
        [(64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 3), (128, 64, 32, 4, 4), (32, 128, 64, 4, 3)]
    )
    _BACKWARD_CONFIGS = _configs([(64, 128, 64, 8, 3), (64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (32, 128, 64, 4, 3)])

    @triton.jit
    def _logits_tile(
        h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, temperature,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
        DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """(BLOCK_N, BLOCK_V) tempered logits in float32; rows/cols are int64 indices."""
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_ok = ks < H
            h = tl.load(h_ptr + rows[:, None] * H + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[:, None] * H + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_FP32:  # the interpreter's tl.dot gets bfloat16 wrong
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        return acc / temperature

    @triton.jit
    def _members(c_ptr, rows, row_ok, cols, K, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
        """(BLOCK_N, BLOCK_V) bool: is column ``cols[j]`` in row ``rows[i]``'s candidate set (-1 pads)."""
        hits = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.int32)
        for j in range(0, K):
            c = tl.load(c_ptr + rows * K + j, mask=row_ok, other=-1)
            hits += (cols[None, :] == c[:, None]).to(tl.int32)
        return hits > 0

    @triton.autotune(configs=_FORWARD_CONFIGS, key=["H", "HAS_BIAS", "HAS_CAND"])
    @triton.jit
    def _forward_kernel(
        h_ptr, w_ptr, b_ptr, y_ptr, c_ptr, stats_ptr,
        N, V, H, K, temperature, span,
        HAS_BIAS: tl.constexpr, HAS_CAND: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """Per (token block, vocabulary span): six (N,) rows of ``stats[:, span_index]``.

        stats: (6, num_spans, N) float32 = m, s, a, z_target, m_cand, s_cand (see module docstring).
        """
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
        v_start = pid_v.to(tl.int64) * span
        v_end = tl.minimum(v_start + span, V)

        m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_N,), tl.float32)
        a = tl.zeros((BLOCK_N,), tl.float32)
        z_target = tl.zeros((BLOCK_N,), tl.float32)
        m_cand = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s_cand = tl.zeros((BLOCK_N,), tl.float32)
        for v0 in range(v_start, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < v_end
            z = _logits_tile(
                h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, temperature,
                HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_H, DOT_FP32, PRECISION,
            )
            z = tl.where(col_ok[None, :], z, float("-inf"))
            # Every tile holds a valid column, so m_new is finite and alpha = 0 on the first tile.
            m_new = tl.maximum(m, tl.max(z, axis=1))
            alpha = tl.exp(m - m_new)
            shift = tl.where(s > 0, m - m_new, 0.0)  # avoids -inf * 0 before the first tile
            # Padding columns get zs = 0 and e = 0 (not -inf and 0, whose product is nan).
            zs = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
            e = tl.where(col_ok[None, :], tl.exp(zs), 0.0)
            # a is kept relative to the running max (not sum p*z) so large logits do not cancel.
            a = alpha * (a + shift * s) + tl.sum(e * zs, axis=1)
            s = alpha * s + tl.sum(e, axis=1)
            m = m_new
            # A ragged span end masks columns of the next span, which may hold the target.
            is_target = (cols[None, :] == y[:, None]) & col_ok[None, :]
            z_target += tl.sum(tl.where(is_target, z, 0.0), axis=1)
            if HAS_CAND:
                # A span may hold no member of a row's set: keep m_cand = -inf and s_cand = 0 then.
                z_c = tl.where(_members(c_ptr, rows, row_ok, cols, K, BLOCK_N, BLOCK_V), z, float("-inf"))
                m_c_new = tl.maximum(m_cand, tl.max(z_c, axis=1))
                pivot = tl.where(m_c_new == float("-inf"), 0.0, m_c_new)
                s_cand = s_cand * tl.exp(m_cand - pivot) + tl.sum(tl.exp(z_c - pivot[:, None]), axis=1)
                m_cand = m_c_new

        row_stride = tl.num_programs(1).to(tl.int64) * N
        out = stats_ptr + pid_v.to(tl.int64) * N + rows
        tl.store(out, m, mask=row_ok)
        tl.store(out + row_stride, s, mask=row_ok)
        tl.store(out + 2 * row_stride, a, mask=row_ok)
        tl.store(out + 3 * row_stride, z_target, mask=row_ok)
        tl.store(out + 4 * row_stride, m_cand, mask=row_ok)
        tl.store(out + 5 * row_stride, s_cand, mask=row_ok)

    @triton.autotune(
        configs=_BACKWARD_CONFIGS,
        key=["H", "HAS_BIAS", "HAS_CAND", "NEED_H", "NEED_W", "NEED_B"],
        # Benchmarking configs runs the atomics; put the accumulators back afterwards.
        restore_value=["gh_ptr", "gw_ptr", "gb_ptr"],
    )
    @triton.jit
    def _backward_kernel(
        h_ptr, w_ptr, b_ptr, y_ptr, c_ptr, lse_ptr, ez_ptr, lse_cand_ptr, g_logp_ptr, g_ent_ptr, g_cand_ptr,
        gh_ptr, gw_ptr, gb_ptr,
        N, H, K, temperature, span, v_lo, v_hi,
        HAS_BIAS: tl.constexpr, HAS_CAND: tl.constexpr, NEED_H: tl.constexpr, NEED_W: tl.constexpr,
        NEED_B: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """Adds this (token block, span of [v_lo, v_hi))'s share of the gradients.

        gh: (N, H) float32; gw: (v_hi - v_lo, H) float32, row 0 is vocabulary row v_lo;
        gb: (V,) float32. d logp / dz_v = 1[v=y] - p_v; d entropy / dz_v = -p_v (z_v - E_p[z]);
        d logp_cand / dz_v = 1[v=y] - q_v 1[v in C], q = softmax over C.
        """
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        expected_z = tl.load(ez_ptr + rows, mask=row_ok, other=0.0)
        g_logp = tl.load(g_logp_ptr + rows, mask=row_ok, other=0.0)
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
        g_target = g_logp
        if HAS_CAND:
            g_cand = tl.load(g_cand_ptr + rows, mask=row_ok, other=0.0)
            lse_cand = tl.load(lse_cand_ptr + rows, mask=row_ok, other=0.0)
            g_target += g_cand
        v_start = v_lo + pid_v.to(tl.int64) * span
        v_end = tl.minimum(v_start + span, v_hi)
        for v0 in range(v_start, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < v_end
            z = _logits_tile(
                h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, temperature,
                HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_H, DOT_FP32, PRECISION,
            )
            p = tl.exp(z - lse[:, None])
            dz = -p * (g_logp[:, None] + g_ent[:, None] * (z - expected_z[:, None]))
            dz += tl.where(cols[None, :] == y[:, None], g_target[:, None], 0.0)
            if HAS_CAND:
                q = tl.exp(z - lse_cand[:, None])
                member = _members(c_ptr, rows, row_ok, cols, K, BLOCK_N, BLOCK_V)
                dz -= tl.where(member, g_cand[:, None] * q, 0.0)
            # Padding rows and columns may hold inf/nan from exp; they contribute nothing.
            dz = tl.where(row_ok[:, None] & col_ok[None, :], dz / temperature, 0.0)  # d/d logits
            if NEED_B:
                tl.atomic_add(gb_ptr + cols, tl.sum(dz, axis=0), mask=col_ok)
            # Round dz to the input dtype for the tensor cores, as the torch path does.
            if DOT_FP32:
                d = dz
            else:
                d = dz.to(h_ptr.dtype.element_ty)
            for k0 in range(0, H, BLOCK_H):
                ks = k0 + tl.arange(0, BLOCK_H)
                k_ok = ks < H
                if NEED_H:
                    w = tl.load(
                        w_ptr + cols[:, None] * H + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
                    )
                    if DOT_FP32:
                        w = w.to(tl.float32)
                    gh = tl.dot(d, w, input_precision=PRECISION)  # (BLOCK_N, BLOCK_H)
                    tl.atomic_add(
                        gh_ptr + rows[:, None] * H + ks[None, :], gh, mask=row_ok[:, None] & k_ok[None, :]
                    )
                if NEED_W:
                    h = tl.load(
                        h_ptr + rows[:, None] * H + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
                    )
                    if DOT_FP32:
                        h = h.to(tl.float32)
                    gw = tl.dot(tl.trans(d), h, input_precision=PRECISION)  # (BLOCK_V, BLOCK_H)
                    tl.atomic_add(
                        gw_ptr + (cols - v_lo)[:, None] * H + ks[None, :], gw, mask=col_ok[:, None] & k_ok[None, :]
                    )


# --------------------------------------------------------------------------- launches


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs get exact products (the torch path does not use TF32 by default either).
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch_context(device: torch.device):
    # Triton launches on the current CUDA device; make it the tensors' device.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _forward_stats(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, candidates: Tensor | None,
    temperature: float, span: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Run the forward kernel and merge its spans: (lse, entropy, z_target, lse_cand), each (N,) float32."""
    num_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    num_spans = triton.cdiv(vocab, span)
    stats = torch.empty(6, num_spans, num_tokens, dtype=torch.float32, device=hidden.device)
    has_cand = candidates is not None
    with _launch_context(hidden.device):
        if num_tokens > 0:  # Triton rejects an empty grid; the merge below copes with N = 0
            _forward_kernel[lambda meta: (triton.cdiv(num_tokens, meta["BLOCK_N"]), num_spans)](
                hidden, weight, bias if bias is not None else weight, targets, candidates if has_cand else targets,
                stats,
                num_tokens, vocab, hidden_size, candidates.shape[1] if has_cand else 0, float(temperature), span,
                HAS_BIAS=bias is not None, HAS_CAND=has_cand, DOT_FP32=_INTERPRETED,
                PRECISION=_precision(hidden.dtype),
            )
    m, s, a, z_target, m_cand, s_cand = stats.unbind(0)  # each (S, N)
    # Merge spans as the kernel merges tiles; every span has a valid column, so m is finite.
    m_max = m.max(dim=0).values  # (N,)
    scale = (m - m_max).exp()  # (S, N)
    s_all = (scale * s).sum(dim=0)
    a_all = (scale * (a + (m - m_max) * s)).sum(dim=0)
    lse = m_max + s_all.log()
    entropy = s_all.log() - a_all / s_all
    lse_cand = (m_cand + s_cand.log()).logsumexp(dim=0) if has_cand else None  # spans without members add 0
    return lse, entropy, z_target.sum(dim=0), lse_cand


class _TritonLogprobs(torch.autograd.Function):
    """Forward and backward kernels; saves per token only ``lse``, entropy and the candidate ``lse``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, candidates, temperature, span):
        lse, entropy, z_target, lse_cand = _forward_stats(hidden, weight, bias, targets, candidates, temperature, span)
        logp = z_target - lse
        has_cand = candidates is not None
        logp_cand = z_target - lse_cand if has_cand else torch.zeros_like(logp)
        ctx.save_for_backward(hidden, weight, bias, targets, candidates, lse, entropy, lse_cand)
        ctx.config = (float(temperature), span)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(() if has_cand else (logp_cand,)))
        return logp, entropy, logp_cand

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_entropy, g_cand):
        hidden, weight, bias, targets, candidates, lse, entropy, lse_cand = ctx.saved_tensors
        temperature, span = ctx.config
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 7
        has_cand = candidates is not None
        if not has_cand:
            g_cand = None
        num_tokens, hidden_size = hidden.shape
        if (g_logp is None and g_entropy is None and g_cand is None) or not (need_h or need_w or need_b):
            return none
        if num_tokens == 0:  # Triton rejects an empty grid
            inputs = zip((hidden, weight, bias), (need_h, need_w, need_b))
            return tuple(torch.zeros_like(t) if need else None for t, need in inputs) + none[3:]
        vocab = weight.shape[0]
        device = hidden.device
        zeros = torch.zeros(num_tokens, dtype=torch.float32, device=device)
        g_logp = zeros if g_logp is None else g_logp.float().contiguous()  # (N,)
        g_entropy = zeros if g_entropy is None else g_entropy.float().contiguous()  # (N,)
        g_cand = zeros if g_cand is None else g_cand.float().contiguous()  # (N,)
        expected_z = lse - entropy  # (N,) E_p[z]
        dummy = torch.zeros(1, dtype=torch.float32, device=device)
        grad_h = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=device) if need_h else dummy
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=device) if need_b else dummy
        grad_w = torch.empty_like(weight) if need_w else None
        # A float32 head accumulates straight into its gradient; a half-precision one in
        # float32 groups of rows, each rounded once into the head's dtype.
        if weight.dtype == torch.float32 or not need_w:
            group = vocab
        else:
            group = max(span, _WEIGHT_GRAD_GROUP_BYTES // (4 * hidden_size) // span * span)
        for v_lo in range(0, vocab, group):
            v_hi = min(v_lo + group, vocab)
            if not need_w:
                gw = dummy
            elif weight.dtype == torch.float32:
                gw = grad_w.zero_()
            else:
                gw = torch.zeros(v_hi - v_lo, hidden_size, dtype=torch.float32, device=device)
            num_spans = triton.cdiv(v_hi - v_lo, span)
            with _launch_context(device):
                _backward_kernel[lambda meta: (triton.cdiv(num_tokens, meta["BLOCK_N"]), num_spans)](
                    hidden, weight, bias if bias is not None else weight, targets,
                    candidates if has_cand else targets, lse, expected_z, lse_cand if has_cand else lse,
                    g_logp, g_entropy, g_cand, grad_h, gw, grad_b,
                    num_tokens, hidden_size, candidates.shape[1] if has_cand else 0, temperature, span, v_lo, v_hi,
                    HAS_BIAS=bias is not None, HAS_CAND=has_cand, NEED_H=need_h, NEED_W=need_w, NEED_B=need_b,
                    DOT_FP32=_INTERPRETED, PRECISION=_precision(hidden.dtype),
                )
            if need_w and weight.dtype != torch.float32:
                grad_w[v_lo:v_hi] = gw
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w,
            grad_b.to(bias.dtype) if need_b else None,
            None, None, None, None,
        )


def triton_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    candidates: Tensor | None = None,
    chunk_tokens: int = 1024,
    chunk_vocab: int = 8192,
) -> TokenLogprobs:
    """The fused Triton path of :func:`treerl.kernels.token_logprobs`; same arguments and outputs.

    Inputs are assumed checked (``token_logprobs`` checks them before dispatching here).
    ``chunk_vocab`` is the vocabulary span one program walks (more spans, more programs
    for small batches); ``chunk_tokens`` is accepted so the implementations are
    interchangeable: the token tile is the kernel's own (autotuned on GPU). Memory beyond
    the inputs and gradients: ``6 x spans x N`` float32 forward statistics, a float32
    ``(N, H)`` hidden gradient, and for a half-precision head float32 weight gradients of at
    most 512 MiB at a time. Raises :class:`TritonUnavailableError` where the kernel cannot
    run, with the reason.

    >>> import torch
    >>> h = torch.randn(3, 8, requires_grad=True)
    >>> w = torch.randn(50, 8, requires_grad=True)
    >>> if triton_logprobs_unavailable(h.device, h.dtype) is None:
    ...     out = triton_token_logprobs(h, w, torch.tensor([1, 2, 3]), chunk_vocab=16)
    ...     (out.logp.sum() + 0.01 * out.entropy.sum()).backward()
    ...     assert h.grad.shape == (3, 8) and w.grad.shape == (50, 8)
    """
    why_not = triton_logprobs_unavailable(hidden.device, hidden.dtype)
    if why_not is not None:
        raise TritonUnavailableError(f"triton_token_logprobs cannot run: {why_not}")
    if not isinstance(chunk_vocab, int) or isinstance(chunk_vocab, bool) or chunk_vocab < 1:
        raise ValueError(f"chunk_vocab must be an int >= 1, got {chunk_vocab!r}; the default 8192 suits GPUs")
    logp, entropy, logp_cand = _TritonLogprobs.apply(
        hidden.contiguous(),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        targets.contiguous(),
        None if candidates is None else candidates.contiguous(),
        float(temperature),
        chunk_vocab,
    )
    return TokenLogprobs(logp, entropy, logp_cand if candidates is not None else None)
