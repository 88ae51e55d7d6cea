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

Three modules, bottom up:

- :mod:`treerl.kernels.block_sparsity`: the block lists (pure torch);
- :mod:`treerl.kernels.triton_tree_attention_kernels`: the ``@triton.jit`` kernels (a
  forward and two backward kernels, FlashAttention-2 style, float32 accumulation) and
  their launches;
- this module: the backend itself. It checks the inputs (naming the fix when it refuses
  them), picks the tiles, wraps the launches in an autograd Function, and says where the
  kernels cannot run (:func:`triton_unavailable`).

Use it through :func:`treerl.kernels.tree_attention.enable_tree_attention` (``impl="auto"``
takes it on CUDA) or call :func:`triton_tree_attention` directly; it has the signature of
every tree-attention backend::

    out = triton_tree_attention(query, key, value, batch)   # (B, H, T, D) x3 -> (B, T, H, Dv)

On a machine without CUDA the kernels run only under Triton's interpreter, which must be
switched on (``TRITON_INTERPRET=1``) before this module is imported (it imports the
kernels); the tests do that. Without triton this module still imports, and every entry
point says why it cannot run.

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
from dataclasses import dataclass

import torch
from torch import Tensor

from treerl.kernels.block_sparsity import TreeBlockSparsity, cached_depth, tree_block_mask, tree_block_sparsity
from treerl.kernels.tree_layout import TreeBatch
from treerl.kernels.triton_support import INTERPRETED as _INTERPRETED  # read at call time: tests patch it
from treerl.kernels.triton_support import TRITON_MISSING as _TRITON_MISSING
from treerl.kernels.triton_support import triton
from treerl.kernels.triton_tree_attention_kernels import KERNELS, Launch, launch_backward, launch_forward
from treerl.kernels.types import TreeAttentionError


__all__ = [
    "SUPPORTED_DTYPES",
    "MAX_HEAD_DIM",
    "TreeBlockSparsity",
    "compile_for_gpu",
    "interpreting",
    "interpreted_on",
    "triton_tree_attention",
    "triton_unavailable",
    "tree_block_mask",
    "tree_block_sparsity",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Input dtypes of the kernels; scores, softmax statistics and gradients accumulate in float32."""

MAX_HEAD_DIM = 256
"""Largest query/key or value head size: one block row of it must fit in registers and shared memory."""


def interpreting() -> bool:
    """True if the kernels were defined for Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRETED


def interpreted_on(device: torch.device | str) -> bool:
    """True if the kernels run on ``device`` in Triton's CPU interpreter: forward and backward, slowly.

    Such a device is not one :func:`triton_unavailable` accepts (``auto`` must not pick an
    interpreter), yet a model asked to use the Triton backend there does run.

    >>> interpreted_on("cuda")
    False
    """
    device = torch.device(device)
    return (device.type == "cpu" and _INTERPRETED and _TRITON_MISSING is None
            and int(triton.__version__.split(".")[0]) >= 3)


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


def _block_dim(size: int) -> int:
    """Head sizes are padded (and masked) to a power of two >= 16, the smallest tl.dot tile."""
    return max(16, 1 << (size - 1).bit_length())


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


class _TreeAttention(torch.autograd.Function):
    """The launches as one differentiable op; saves only the inputs, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, run: Launch) -> Tensor:
        out, lse = launch_forward(query, key, value, run)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.run = run
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        query, key, value, out, lse = ctx.saved_tensors
        grads = launch_backward(query, key, value, out, lse, grad_out, ctx.run)
        return (*grads, None)


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

    Under ``torch.autocast`` the kernels compute in the autocast dtype, as SDPA and FlexAttention
    do there: a decoder under bfloat16 autocast with float32 weights hands attention float32
    queries and keys (RoPE multiplies them by float32 tables) and a bfloat16 value.
    """
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)  # autocast leaves float64 alone, and so do we
        query, key, value = (x if x.dtype == torch.float64 else x.to(dtype) for x in (query, key, value))
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
    run = Launch(
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
    for kernel in KERNELS:
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
