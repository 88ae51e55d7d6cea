"""The Triton kernels of tree attention, and their launches: block-sparse FlashAttention over a tree.

A query ``q`` of a tree-packed row sees key ``k`` iff ``k <= q and q < subtree_end_of_token[k]``
(see :mod:`treerl.kernels.tree_layout`). Every program walks only the block lists of a
:class:`~treerl.kernels.block_sparsity.TreeBlockSparsity`, so a skipped block is never
loaded; inside a visited block that exact per-token test (and the sliding window, if any)
masks the scores.

Kernels (FlashAttention-2 style, float32 accumulation for float32, bfloat16 and float16
inputs):

- forward: one program per (query block, batch x head); online softmax over the listed
  key blocks; saves the log-sum-exp (base 2) for the backward;
- backward ``dk, dv``: one program per (key block, batch x key/value head); walks the
  query heads of its group (GQA: keys and values are never repeated) and the query
  blocks that see the block, so no atomics are needed;
- backward ``dq``: one program per (query block, batch x head), same key-block lists as
  the forward.

Shapes: query (B, H, T, D), key (B, Hkv, T, D), value (B, Hkv, T, Dv), any strides;
out (B, T, H, Dv); lse (B, H, T) float32, base 2.

This is the lower half of :mod:`treerl.kernels.triton_tree_attention`, which checks the
inputs, picks the tiles, and wraps these launches in an autograd Function; call that.
The launches live here because they pass the kernels' arguments in signature order.

Triton is optional (:mod:`treerl.kernels.triton_support`): where it cannot be imported this
module still imports, no kernel is defined and :data:`KERNELS` is empty, and the callers check
``TRITON_MISSING`` before launching anything. Kernels defined here are interpreted when
``TRITON_INTERPRET=1`` was set before the import (``INTERPRETED``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from treerl.kernels.block_sparsity import TreeBlockSparsity
from treerl.kernels.triton_support import tl, triton


__all__ = ["KERNELS", "Launch", "launch_backward", "launch_forward"]

_LOG2E = 1.4426950408889634  # the kernels use exp2, which is what the hardware has


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

KERNELS: tuple = (_tree_attn_fwd, _tree_attn_bwd_dkdv, _tree_attn_bwd_dq) if triton is not None else ()
"""The three ``@triton.jit`` kernels: forward, backward dk/dv, backward dq; empty where triton is missing."""


# -- launch ------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Launch:
    """What the three kernels share for one call: sizes, scales, block lists, flags.

    Built by :func:`treerl.kernels.triton_tree_attention.triton_tree_attention`, which picks
    the tiles; the launches below turn it into the kernels' arguments.
    """

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
        """The compile-time constants and launch options every kernel takes."""
        return dict(
            BLOCK_M=self.sparsity.block_m, BLOCK_N=self.sparsity.block_n, BLOCK_D=self.block_d,
            BLOCK_DV=self.block_dv, HAS_WINDOW=self.has_window, RECORD_VISITS=self.visits is not None,
            DOT_F32=self.dot_f32, INPUT_PRECISION=self.input_precision,
            num_warps=self.num_warps, num_stages=self.num_stages,
        )  # fmt: skip


def launch_forward(query: Tensor, key: Tensor, value: Tensor, run: Launch) -> tuple[Tensor, Tensor]:
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


def launch_backward(
    query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, run: Launch
) -> tuple[Tensor, Tensor, Tensor]:
    """The dk/dv kernel, then the dq kernel: gradients shaped and typed like query, key and value.

    out: (B, T, H, Dv) and lse: (B, H, T) from :func:`launch_forward`; grad_out: (B, T, H, Dv).
    """
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
