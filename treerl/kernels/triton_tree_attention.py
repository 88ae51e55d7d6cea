"""Tree attention in Triton: block-sparse FlashAttention over a depth-first tree layout.

A tree-packed row (see :mod:`treerl.kernels.tree_layout`) lets query ``q`` see key ``k``
iff ``k <= q and q < subtree_end_of_token[k]``. Cut the row into query blocks of
``block_m`` tokens and key blocks of ``block_n``: a query block needs only the key blocks
of its root-to-segment paths plus its own causal diagonal, which for a group of siblings
is a small fraction of the row. A host-side pre-pass (:func:`tree_block_sparsity`, in
:mod:`treerl.kernels.block_sparsity`: a few torch ops on ``(B, T)`` tensors, cached on the
:class:`TreeBatch` for every layer) lists, per query block, the key blocks with at least
one visible key, and per key block the query blocks that see it. The kernels walk those
lists only, so a skipped block is never loaded and costs nothing; inside a visited block
the exact per-token test masks scores.

Kernels (FlashAttention-2 style, float32 accumulation for float32, bfloat16 and float16
inputs):

- forward: one program per (query block, batch x head); online softmax over the listed
  key blocks; saves the log-sum-exp (base 2) for the backward;
- backward ``dk, dv``: one program per (key block, batch x key/value head); walks the
  query heads of its group (GQA: keys and values are never repeated) and the query
  blocks that see the block, so no atomics are needed;
- backward ``dq``: one program per (query block, batch x head), same key-block lists as
  the forward.

Use it through :func:`treerl.kernels.tree_attention.enable_tree_attention` (``impl="auto"``
takes it on CUDA) or call :func:`triton_tree_attention` directly; it has the signature of
every tree-attention backend::

    out = triton_tree_attention(query, key, value, batch)   # (B, H, T, D) x3 -> (B, T, H, Dv)

On a machine without CUDA the kernels run only under Triton's interpreter, which must be
switched on (``TRITON_INTERPRET=1``) before this module is imported; the tests do that.

Block lists, checked against the dense mask (this example runs anywhere: no kernel)::

    >>> from treerl.kernels.tree_layout import TreeBatch, TreeLayout
    >>> # a 32-token prompt with two 16-token answers, in blocks of 16 tokens
    >>> batch = TreeBatch([TreeLayout.from_parents([32, 16, 16], [-1, 0, 0])])
    >>> tree_block_mask(batch, 16, 16, "cpu")[0].int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    >>> sparsity = tree_block_sparsity(batch, 16, 16, "cpu")
    >>> sparsity.num_kv_blocks.tolist(), sparsity.num_q_blocks.tolist()
    ([[1, 2, 3, 3]], [[4, 3, 1, 1]])
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from treerl.kernels.block_sparsity import TreeBlockSparsity, cached_depth, tree_block_mask, tree_block_sparsity
from treerl.kernels.tree_layout import TreeBatch
from treerl.kernels.types import TreeAttentionError

try:
    import triton
    import triton.language as tl
except ImportError as _error:  # triton is optional: the torch backends serve without it
    triton = None
    tl = None
    _TRITON_MISSING: str | None = (
        f"triton is not installed ({_error}); it ships with the CUDA builds of torch, or `pip install triton`"
    )
else:
    _TRITON_MISSING = None

__all__ = [
    "SUPPORTED_DTYPES",
    "MAX_HEAD_DIM",
    "TreeBlockSparsity",
    "compile_for_gpu",
    "interpreting",
    "triton_tree_attention",
    "triton_unavailable",
    "tree_block_mask",
    "tree_block_sparsity",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes of the kernels; scores, softmax statistics and gradients accumulate in float32."""

MAX_HEAD_DIM = 256
"""Largest query/key or value head size: one block row of it must fit in registers and shared memory."""

_LOG2E = 1.4426950408889634  # the kernels use exp2, which is what the hardware has


def _interpret_flag() -> bool:
    """Whether @triton.jit will hand out interpreted kernels (it decides when it decorates)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)  # triton >= 3.3; older releases read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Fixed for the life of the module: the kernels below are defined once, at import.
_INTERPRETED: bool = _interpret_flag()


def interpreting() -> bool:
    """True if the kernels were defined for Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRETED


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton backend cannot serve a model on ``device`` (forward and backward), or None.

    This is the ``unavailable`` probe of the backend table. Head sizes and dtypes are only
    known per call: :func:`triton_tree_attention` refuses those it cannot run, naming the fix.

    >>> triton_unavailable(torch.device("cpu")) is not None
    True
    """
    device = torch.device(device)
    if _TRITON_MISSING is not None:
        return _TRITON_MISSING
    if int(triton.__version__.split(".")[0]) < 3:
        return f"the Triton tree-attention kernel needs triton >= 3.0, this is {triton.__version__}"
    if device.type != "cuda":
        return f"the Triton tree-attention kernel needs CUDA (device is {device.type})"
    if _INTERPRETED:
        return (
            "TRITON_INTERPRET=1 was set when treerl's Triton kernels were defined, so they would run in "
            "Triton's slow CPU interpreter; unset it to compile them for the GPU"
        )
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    if torch.cuda.get_device_capability(device) < (7, 0):
        major, minor = torch.cuda.get_device_capability(device)
        return f"Triton needs a GPU of compute capability >= 7.0, this one is {major}.{minor}"
    return None


def _block_dim(size: int) -> int:
    """Head sizes are padded (and masked) to a power of two >= 16, the smallest tl.dot tile."""
    return max(16, 1 << (size - 1).bit_length())


# -- kernels ---------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _dot(a, b, DOT_F32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        # Triton's interpreter gets tl.dot wrong on bfloat16 operands, so it multiplies in
        # float32 there; compiled kernels feed the tensor cores the input dtype.
        if DOT_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32))
        return tl.dot(a, b, input_precision=INPUT_PRECISION)

    @triton.jit
    def _visible(
        offs_q, offs_k, subtree_end_k, depth_q, depth_k, window, HAS_WINDOW: tl.constexpr, KEYS_FIRST: tl.constexpr
    ):
        # The tree test of tree_layout (k <= q and q < subtree_end[k]), as (BM, BN) or (BN, BM).
        # Keys past the row end were loaded with subtree_end 0, so they are never visible.
        if KEYS_FIRST:
            visible = (offs_k[:, None] <= offs_q[None, :]) & (offs_q[None, :] < subtree_end_k[:, None])
            if HAS_WINDOW:
                visible = visible & (depth_q[None, :] - depth_k[:, None] < window)
        else:
            visible = (offs_k[None, :] <= offs_q[:, None]) & (offs_q[:, None] < subtree_end_k[None, :])
            if HAS_WINDOW:
                visible = visible & (depth_q[:, None] - depth_k[None, :] < window)
        return visible

    @triton.jit
    def _tree_attn_fwd(
        Q, K, V, O, LSE, SUBTREE_END, DEPTH, KV_BLOCKS, NUM_KV_BLOCKS, VISITED,
        stride_qb, stride_qh, stride_qt, stride_qd,
        stride_kb, stride_kh, stride_kt, stride_kd,
        stride_vb, stride_vh, stride_vt, stride_vd,
        stride_ob, stride_ot, stride_oh, stride_od,
        num_heads, n_rep, seq_len, head_dim, value_dim, num_q_blocks, num_k_blocks, list_width,
        qk_scale, window,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        HAS_WINDOW: tl.constexpr, RECORD_VISITS: tl.constexpr, DOT_F32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        # int64 batch/head offsets: b * stride_qb passes 2**31 elements for long packed rows.
        b = (pid_bh // num_heads).to(tl.int64)
        h = (pid_bh % num_heads).to(tl.int64)
        kv_h = h // n_rep
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        row_ok = offs_m < seq_len

        q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)  # (BM, D)
        depth_q = offs_m
        if HAS_WINDOW:
            depth_q = tl.load(DEPTH + b * seq_len + offs_m, mask=row_ok, other=0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of log2-scaled scores
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        k_base = K + b * stride_kb + kv_h * stride_kh
        v_base = V + b * stride_vb + kv_h * stride_vh
        list_row = KV_BLOCKS + (b * num_q_blocks + pid_m) * list_width
        num_blocks = tl.load(NUM_KV_BLOCKS + b * num_q_blocks + pid_m)
        for i in range(0, num_blocks):
            kb = tl.load(list_row + i)
            if RECORD_VISITS:
                tl.store(VISITED + (pid_bh * num_q_blocks + pid_m) * num_k_blocks + kb, 1)
            offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
            col_ok = offs_n < seq_len
            k = tl.load(
                k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                mask=col_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0,
            )  # (BN, D)
            v = tl.load(
                v_base + offs_n[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
                mask=col_ok[:, None] & (offs_dv[None, :] < value_dim), other=0.0,
            )  # (BN, Dv)
            subtree_end = tl.load(SUBTREE_END + b * seq_len + offs_n, mask=col_ok, other=0)
            depth_k = offs_n
            if HAS_WINDOW:
                depth_k = tl.load(DEPTH + b * seq_len + offs_n, mask=col_ok, other=0)
            visible = _visible(offs_m, offs_n, subtree_end, depth_q, depth_k, window, HAS_WINDOW, False)

            s = _dot(q, tl.trans(k), DOT_F32, INPUT_PRECISION) * qk_scale  # (BM, BN), log2 units
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing visible yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_shift[:, None])  # (BM, BN)
            alpha = tl.exp2(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32, INPUT_PRECISION)
            m_i = m_new

        # Every real query sees itself, so l_i > 0 on real rows; rows past the end are not stored.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_dv[None, :] * stride_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < value_dim))
        tl.store(LSE + pid_bh * seq_len + offs_m, m_i + tl.log2(l_safe), mask=row_ok)

    @triton.jit
    def _tree_attn_bwd_dkdv(
        Q, K, V, DO, LSE, DELTA, DK, DV, SUBTREE_END, DEPTH, Q_BLOCKS, NUM_Q_BLOCKS, VISITED,
        stride_qb, stride_qh, stride_qt, stride_qd,
        stride_kb, stride_kh, stride_kt, stride_kd,
        stride_vb, stride_vh, stride_vt, stride_vd,
        stride_dob, stride_dot, stride_doh, stride_dod,
        stride_dkb, stride_dkh, stride_dkt, stride_dkd,
        stride_dvb, stride_dvh, stride_dvt, stride_dvd,
        num_heads, num_kv_heads, n_rep, seq_len, head_dim, value_dim, num_q_blocks, num_k_blocks, list_width,
        qk_scale, sm_scale, window,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        HAS_WINDOW: tl.constexpr, RECORD_VISITS: tl.constexpr, DOT_F32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // num_kv_heads).to(tl.int64)
        kv_h = (pid_bh % num_kv_heads).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        col_ok = offs_n < seq_len
        k_mask = col_ok[:, None] & (offs_d[None, :] < head_dim)
        v_mask = col_ok[:, None] & (offs_dv[None, :] < value_dim)

        k = tl.load(
            K + b * stride_kb + kv_h * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
            mask=k_mask, other=0.0,
        )  # (BN, D)
        v = tl.load(
            V + b * stride_vb + kv_h * stride_vh + offs_n[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
            mask=v_mask, other=0.0,
        )  # (BN, Dv)
        subtree_end = tl.load(SUBTREE_END + b * seq_len + offs_n, mask=col_ok, other=0)
        depth_k = offs_n
        if HAS_WINDOW:
            depth_k = tl.load(DEPTH + b * seq_len + offs_n, mask=col_ok, other=0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        list_row = Q_BLOCKS + (b * num_k_blocks + pid_n) * list_width
        num_blocks = tl.load(NUM_Q_BLOCKS + b * num_k_blocks + pid_n)
        # GQA: the n_rep query heads of this key/value head all add into one dk, dv.
        for r in range(0, n_rep):
            h = kv_h * n_rep + r
            q_base = Q + b * stride_qb + h * stride_qh
            do_base = DO + b * stride_dob + h * stride_doh
            stats_base = (b * num_heads + h) * seq_len
            for i in range(0, num_blocks):
                qb = tl.load(list_row + i)
                if RECORD_VISITS:
                    tl.store(VISITED + ((b * num_heads + h) * num_k_blocks + pid_n) * num_q_blocks + qb, 1)
                offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
                row_ok = offs_m < seq_len
                q = tl.load(
                    q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                    mask=row_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0,
                )  # (BM, D)
                do = tl.load(
                    do_base + offs_m[:, None] * stride_dot + offs_dv[None, :] * stride_dod,
                    mask=row_ok[:, None] & (offs_dv[None, :] < value_dim), other=0.0,
                )  # (BM, Dv)
                lse = tl.load(LSE + stats_base + offs_m, mask=row_ok, other=0.0)  # (BM,)
                delta = tl.load(DELTA + stats_base + offs_m, mask=row_ok, other=0.0)  # (BM,)
                depth_q = offs_m
                if HAS_WINDOW:
                    depth_q = tl.load(DEPTH + b * seq_len + offs_m, mask=row_ok, other=0)
                visible = _visible(offs_m, offs_n, subtree_end, depth_q, depth_k, window, HAS_WINDOW, True)

                s_t = _dot(k, tl.trans(q), DOT_F32, INPUT_PRECISION) * qk_scale  # (BN, BM)
                p_t = tl.where(visible, tl.exp2(s_t - lse[None, :]), 0.0)  # P transposed
                dv += _dot(p_t.to(do.dtype), do, DOT_F32, INPUT_PRECISION)  # (BN, Dv)
                dp_t = _dot(v, tl.trans(do), DOT_F32, INPUT_PRECISION)  # (BN, BM)
                ds_t = p_t * (dp_t - delta[None, :])  # softmax backward, dS transposed
                dk += _dot(ds_t.to(q.dtype), q, DOT_F32, INPUT_PRECISION)  # (BN, D)

        dk_ptrs = DK + b * stride_dkb + kv_h * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :] * stride_dkd
        dv_ptrs = DV + b * stride_dvb + kv_h * stride_dvh + offs_n[:, None] * stride_dvt + offs_dv[None, :] * stride_dvd
        tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=v_mask)

    @triton.jit
    def _tree_attn_bwd_dq(
        Q, K, V, DO, LSE, DELTA, DQ, SUBTREE_END, DEPTH, KV_BLOCKS, NUM_KV_BLOCKS, VISITED,
        stride_qb, stride_qh, stride_qt, stride_qd,
        stride_kb, stride_kh, stride_kt, stride_kd,
        stride_vb, stride_vh, stride_vt, stride_vd,
        stride_dob, stride_dot, stride_doh, stride_dod,
        stride_dqb, stride_dqh, stride_dqt, stride_dqd,
        num_heads, n_rep, seq_len, head_dim, value_dim, num_q_blocks, num_k_blocks, list_width,
        qk_scale, sm_scale, window,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        HAS_WINDOW: tl.constexpr, RECORD_VISITS: tl.constexpr, DOT_F32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        # int64 batch/head offsets: b * stride_qb passes 2**31 elements for long packed rows.
        b = (pid_bh // num_heads).to(tl.int64)
        h = (pid_bh % num_heads).to(tl.int64)
        kv_h = h // n_rep
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        row_ok = offs_m < seq_len
        q_mask = row_ok[:, None] & (offs_d[None, :] < head_dim)

        q = tl.load(
            Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
            mask=q_mask, other=0.0,
        )  # (BM, D)
        do = tl.load(
            DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_dv[None, :] * stride_dod,
            mask=row_ok[:, None] & (offs_dv[None, :] < value_dim), other=0.0,
        )  # (BM, Dv)
        lse = tl.load(LSE + pid_bh * seq_len + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + pid_bh * seq_len + offs_m, mask=row_ok, other=0.0)
        depth_q = offs_m
        if HAS_WINDOW:
            depth_q = tl.load(DEPTH + b * seq_len + offs_m, mask=row_ok, other=0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = K + b * stride_kb + kv_h * stride_kh
        v_base = V + b * stride_vb + kv_h * stride_vh
        list_row = KV_BLOCKS + (b * num_q_blocks + pid_m) * list_width
        num_blocks = tl.load(NUM_KV_BLOCKS + b * num_q_blocks + pid_m)
        for i in range(0, num_blocks):
            kb = tl.load(list_row + i)
            if RECORD_VISITS:
                tl.store(VISITED + (pid_bh * num_q_blocks + pid_m) * num_k_blocks + kb, 1)
            offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
            col_ok = offs_n < seq_len
            k = tl.load(
                k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                mask=col_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0,
            )  # (BN, D)
            v = tl.load(
                v_base + offs_n[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
                mask=col_ok[:, None] & (offs_dv[None, :] < value_dim), other=0.0,
            )  # (BN, Dv)
            subtree_end = tl.load(SUBTREE_END + b * seq_len + offs_n, mask=col_ok, other=0)
            depth_k = offs_n
            if HAS_WINDOW:
                depth_k = tl.load(DEPTH + b * seq_len + offs_n, mask=col_ok, other=0)
            visible = _visible(offs_m, offs_n, subtree_end, depth_q, depth_k, window, HAS_WINDOW, False)

            s = _dot(q, tl.trans(k), DOT_F32, INPUT_PRECISION) * qk_scale  # (BM, BN)
            p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
            dp = _dot(do, tl.trans(v), DOT_F32, INPUT_PRECISION)  # (BM, BN)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, DOT_F32, INPUT_PRECISION)  # (BM, D)

        dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :] * stride_dqd
        tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


# -- launch ------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Launch:
    """What the three kernels share for one call: sizes, scales, block lists, flags."""

    sparsity: TreeBlockSparsity
    subtree_end: Tensor  # (B, T) long
    depth: Tensor  # (B, T) long; a stand-in without a window (the kernels then never read it)
    sm_scale: float
    window: int
    has_window: bool
    block_d: int
    block_dv: int
    num_warps: int
    num_stages: int
    dot_f32: bool
    input_precision: str
    visits: tuple[Tensor, Tensor, Tensor] | None  # forward, dk/dv, dq visit records (tests)

    def meta(self) -> dict:
        return dict(
            BLOCK_M=self.sparsity.block_m, BLOCK_N=self.sparsity.block_n, BLOCK_D=self.block_d,
            BLOCK_DV=self.block_dv, HAS_WINDOW=self.has_window, RECORD_VISITS=self.visits is not None,
            DOT_F32=self.dot_f32, INPUT_PRECISION=self.input_precision,
            num_warps=self.num_warps, num_stages=self.num_stages,
        )  # fmt: skip


def _forward(query: Tensor, key: Tensor, value: Tensor, run: _Launch) -> tuple[Tensor, Tensor]:
    """(B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, Dv) -> out (B, T, H, Dv), lse (B, H, T) float32 base 2."""
    batch_size, num_heads, length, head_dim = query.shape
    num_kv_heads, value_dim = key.shape[1], value.shape[-1]
    sp = run.sparsity
    out = torch.empty(batch_size, length, num_heads, value_dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(batch_size, num_heads, length, dtype=torch.float32, device=query.device)
    visited = run.visits[0] if run.visits is not None else lse
    grid = (sp.num_query_blocks, batch_size * num_heads)
    _tree_attn_fwd[grid](
        query, key, value, out, lse, run.subtree_end, run.depth, sp.kv_blocks, sp.num_kv_blocks, visited,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(),
        num_heads, num_heads // num_kv_heads, length, head_dim, value_dim,
        sp.num_query_blocks, sp.num_key_blocks, sp.kv_blocks.shape[-1],
        run.sm_scale * _LOG2E, run.window, **run.meta(),
    )  # fmt: skip
    return out, lse


def _backward(
    query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, run: _Launch
) -> tuple[Tensor, Tensor, Tensor]:
    batch_size, num_heads, length, head_dim = query.shape
    num_kv_heads, value_dim = key.shape[1], value.shape[-1]
    n_rep = num_heads // num_kv_heads
    sp = run.sparsity
    # delta_i = sum_j P_ij dP_ij = <dO_i, O_i>: the softmax-backward term of each query row.
    delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # (B, H, T)
    grad_query, grad_key, grad_value = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    visits = run.visits if run.visits is not None else (lse, lse, lse)
    _tree_attn_bwd_dkdv[(sp.num_key_blocks, batch_size * num_kv_heads)](
        query, key, value, grad_out, lse, delta, grad_key, grad_value, run.subtree_end, run.depth,
        sp.q_blocks, sp.num_q_blocks, visits[1],
        *query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *grad_key.stride(), *grad_value.stride(),
        num_heads, num_kv_heads, n_rep, length, head_dim, value_dim,
        sp.num_query_blocks, sp.num_key_blocks, sp.q_blocks.shape[-1],
        run.sm_scale * _LOG2E, run.sm_scale, run.window, **run.meta(),
    )  # fmt: skip
    _tree_attn_bwd_dq[(sp.num_query_blocks, batch_size * num_heads)](
        query, key, value, grad_out, lse, delta, grad_query, run.subtree_end, run.depth,
        sp.kv_blocks, sp.num_kv_blocks, visits[2],
        *query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *grad_query.stride(),
        num_heads, n_rep, length, head_dim, value_dim,
        sp.num_query_blocks, sp.num_key_blocks, sp.kv_blocks.shape[-1],
        run.sm_scale * _LOG2E, run.sm_scale, run.window, **run.meta(),
    )  # fmt: skip
    return grad_query, grad_key, grad_value


class _TreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, run: _Launch) -> Tensor:
        out, lse = _forward(query, key, value, run)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.run = run
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        query, key, value, out, lse = ctx.saved_tensors
        grads = _backward(query, key, value, out, lse, grad_out, ctx.run)
        return (*grads, None)


# -- the backend --------------------------------------------------------------------------------------


def _check(query: Tensor, key: Tensor, value: Tensor, dropout: float) -> None:
    if _TRITON_MISSING is not None:
        raise TreeAttentionError(f"impl='triton' cannot run: {_TRITON_MISSING}; or use impl='segment'.")
    if query.device.type != "cuda" and not _INTERPRETED:
        raise TreeAttentionError(
            f"the Triton tree-attention kernel needs CUDA tensors, got {query.device.type}; use impl='auto' "
            "(it picks the torch 'segment' backend off CUDA), or set TRITON_INTERPRET=1 before importing treerl "
            "to run the kernel in Triton's CPU interpreter (tests only: it is slow)."
        )
    if dropout:
        raise TreeAttentionError(
            f"the Triton tree-attention kernel has no attention dropout (got dropout={dropout}); "
            "set config.attention_dropout=0.0 or use impl='segment'."
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise TreeAttentionError(
            "query, key and value must be (B, H, T, D), (B, Hkv, T, D) and (B, Hkv, T, Dv), got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}."
        )
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in SUPPORTED_DTYPES:
        raise TreeAttentionError(
            f"the Triton tree-attention kernel takes query, key and value in one of "
            f"{[str(d) for d in SUPPORTED_DTYPES]}, got {query.dtype}, {key.dtype} and {value.dtype}; "
            "cast them to the model's dtype, or use impl='segment'."
        )
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    if max(head_dim, value_dim) > MAX_HEAD_DIM or key.shape[-1] != head_dim:
        raise TreeAttentionError(
            f"the Triton tree-attention kernel supports head sizes up to {MAX_HEAD_DIM} with query and key "
            f"sizes equal, got query {head_dim}, key {key.shape[-1]}, value {value_dim}; use impl='segment'."
        )
    if query.shape[1] % key.shape[1] or key.shape[:3] != value.shape[:3] or query.shape[::2] != key.shape[::2]:
        raise TreeAttentionError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} do not agree: "
            "batch and length must match and the query heads must be a multiple of the key/value heads."
        )


@dataclass(frozen=True)
class _TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _tile_config(device: torch.device, dtype: torch.dtype, block_d: int, block_dv: int) -> _TileConfig:
    """Tile sizes that keep every kernel under ~83 KiB of shared memory, so it launches on any
    GPU of compute capability >= 8.0 (consumer parts allow 99 KiB); figures from compiling for
    sm_80 and sm_90 (see :func:`compile_for_gpu`).

    64 x 64 blocks keep the tree sparsity fine-grained; wide rows (float32 with head size
    128, any dtype with 256) need smaller blocks to fit. The interpreter takes tl.dot's
    smallest tile, so that small test trees still span several blocks.
    """
    if device.type != "cuda":
        return _TileConfig(16, 16, num_warps=4, num_stages=1)
    row_bytes = torch.empty((), dtype=dtype).element_size() * max(block_d, block_dv)
    if row_bytes <= 256:  # bfloat16/float16 up to 128, float32 up to 64
        return _TileConfig(64, 64, num_warps=4 if max(block_d, block_dv) <= 64 else 8, num_stages=2)
    if row_bytes <= 512:  # bfloat16/float16 256, float32 128
        return _TileConfig(32, 32, num_warps=4, num_stages=2)
    return _TileConfig(16, 16, num_warps=4, num_stages=1)  # float32 256


def triton_tree_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    batch: TreeBatch,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    record_visits: list | None = None,
) -> Tensor:
    """Tree attention with the block-sparse Triton kernels. Returns (B, T, H, Dv).

    query: (B, H, T, D); key: (B, Hkv, T, D); value: (B, Hkv, T, Dv), H a multiple of Hkv
    (any strides: transformers passes transposed views). Float32, bfloat16 or float16, with
    float32 accumulation; float32 matmuls follow ``torch.get_float32_matmul_precision()``
    (``"highest"``: full float32, else TF32). Differentiable in query, key and value.

    ``block_m``/``block_n`` (powers of two >= 16) override the tile sizes. ``record_visits``
    is for tests: pass an empty list and the kernels append three int32 tensors marking
    every block they loaded, forward ``(B*H, NQB, NKB)``, backward dk/dv ``(B*H, NKB, NQB)``
    and backward dq ``(B*H, NQB, NKB)`` (the backward ones fill when backward runs).
    """
    _check(query, key, value, dropout)
    device = query.device
    block_d, block_dv = _block_dim(query.shape[-1]), _block_dim(value.shape[-1])
    tiles = _tile_config(device, query.dtype, block_d, block_dv)
    block_m, block_n = block_m or tiles.block_m, block_n or tiles.block_n
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {size}.")
    batch_size, num_heads, length, head_dim = query.shape
    if (batch.batch_size, batch.length) != (batch_size, length):
        raise TreeAttentionError(
            f"the TreeBatch describes {batch.batch_size} rows of {batch.length} tokens but the input has "
            f"{batch_size} rows of {length}; build it with TreeBatch(layouts, length=input_ids.shape[1])."
        )
    sparsity = batch.cached(
        ("triton_block_sparsity", str(device), block_m, block_n, sliding_window),
        lambda: tree_block_sparsity(batch, block_m, block_n, device, sliding_window),
    )
    subtree_end = batch.subtree_end_of_token(device)
    visits = None
    if record_visits is not None:
        nqb, nkb = sparsity.num_query_blocks, sparsity.num_key_blocks
        visits = tuple(
            torch.zeros(batch_size * num_heads, *shape, dtype=torch.int32, device=device)
            for shape in ((nqb, nkb), (nkb, nqb), (nqb, nkb))
        )
        record_visits.extend(visits)
    run = _Launch(
        sparsity=sparsity,
        subtree_end=subtree_end,
        depth=cached_depth(batch, device) if sliding_window is not None else subtree_end,
        sm_scale=float(scaling) if scaling is not None else 1.0 / math.sqrt(head_dim),
        window=int(sliding_window) if sliding_window is not None else 0,
        has_window=sliding_window is not None,
        block_d=block_d,
        block_dv=block_dv,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        dot_f32=_INTERPRETED,
        input_precision="ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32",
        visits=visits,
    )
    return _TreeAttention.apply(query, key, value, run)


_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_for_gpu(
    arch: int,
    dtype: torch.dtype,
    head_dim: int,
    value_dim: int | None = None,
    *,
    sliding_window: bool = False,
) -> dict[str, int]:
    """Compile the three kernels to a cubin for a CUDA architecture, no GPU needed.

    ``arch`` is the compute capability as a number (80 for A100, 90 for H100). Uses the tile
    sizes a call with these shapes would use on the GPU. Returns each kernel's shared memory
    in bytes; raises whatever Triton raises if a kernel does not compile. It checks the
    compiled path, which Triton's interpreter does not run (types, layouts, tl.dot shapes),
    and it needs the kernels compiled, not interpreted (``TRITON_INTERPRET`` unset at import).

    Example (not run here: it takes seconds)::

        compile_for_gpu(90, torch.bfloat16, 128)   # {'_tree_attn_fwd': 50180, ...}
    """
    if _TRITON_MISSING is not None:
        raise RuntimeError(_TRITON_MISSING)
    if _INTERPRETED:
        raise RuntimeError(
            "compile_for_gpu needs the compiled kernels, but TRITON_INTERPRET=1 was set when they were "
            "defined; run it in a process without TRITON_INTERPRET."
        )
    from triton.backends.compiler import GPUTarget

    value_dim = head_dim if value_dim is None else value_dim
    block_d, block_dv = _block_dim(head_dim), _block_dim(value_dim)
    tiles = _tile_config(torch.device("cuda"), dtype, block_d, block_dv)
    element = "*" + _TRITON_DTYPES[dtype]
    pointers = dict.fromkeys(("Q", "K", "V", "O", "DO", "DQ", "DK", "DV"), element)
    pointers.update(LSE="*fp32", DELTA="*fp32", VISITED="*fp32", SUBTREE_END="*i64", DEPTH="*i64")
    pointers.update(dict.fromkeys(("KV_BLOCKS", "NUM_KV_BLOCKS", "Q_BLOCKS", "NUM_Q_BLOCKS"), "*i32"))
    constexprs = dict(
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_WINDOW=sliding_window, RECORD_VISITS=False, DOT_F32=False,
        INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )  # fmt: skip
    shared = {}
    for kernel in (_tree_attn_fwd, _tree_attn_bwd_dkdv, _tree_attn_bwd_dq):
        signature = {
            name: "constexpr" if name in constexprs
            else pointers.get(name, "fp32" if name in ("qk_scale", "sm_scale") else "i32")
            for name in kernel.arg_names
        }  # fmt: skip
        compiled = triton.compile(
            triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
            target=GPUTarget("cuda", arch, 32),
            options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        )
        shared[kernel.__name__] = compiled.metadata.shared
    return shared
