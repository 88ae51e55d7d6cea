"""The Triton kernels against the torch paths on a GPU: time and peak memory, forward + backward.

    python benchmarks/bench_kernels.py              # both benchmarks; needs a CUDA GPU
    python benchmarks/bench_kernels.py --only tree_attention --runs 5 --no-write

Two independent functions, one per kernel:

- :func:`bench_tree_attention`: the block-sparse Triton tree-attention kernel against the
  torch ``reference`` (dense tree mask), ``segment`` and FlexAttention (``flex``) backends
  of :mod:`treerl.kernels.tree_attention`, on packed GRPO-like trees, one attention layer,
  forward + backward with respect to query, key and value.
- :func:`bench_logprobs`: the fused Triton LM-head log-probs of
  :mod:`treerl.kernels.triton_logprobs` against the chunked torch path.

Time is the median of ``--runs`` calls after warm-up (FlexAttention's compile and
Triton's autotuning happen there), with the per-batch planning that every layer of a
forward shares (block lists, segment buckets, block masks) already cached; "setup" is how
much longer the first call on a fresh batch takes, i.e. that planning, paid once per
forward. Peak memory is ``torch.cuda.max_memory_allocated`` during one call, less what was
allocated before it (the inputs). Each run replaces its own section of BENCHMARKS.md, with
the date and the device name, and only when it ran on a GPU; without CUDA it says so and
exits 0 without measuring or writing anything.
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_section  # noqa: E402

import torch

TREE_SECTION = "## Tree attention: Triton kernel vs torch backends (GPU)"
LOGPROBS_SECTION = "## Fused LM-head log-probs: Triton vs chunked torch (GPU)"


# -- shared helpers ---------------------------------------------------------------------------------


def _needs_gpu(name: str, device: torch.device) -> bool:
    """True (after saying so) when there is no CUDA device to measure on."""
    if device.type != "cuda":
        return False  # --device cpu: a smoke run of this script (under TRITON_INTERPRET=1), never written
    if torch.cuda.is_available():
        return False
    print(f"{name}: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured, BENCHMARKS.md unchanged.")
    return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(step: Callable[[], object], runs: int, device: torch.device, warmup: int = 2) -> tuple[float, int]:
    """(median seconds of ``runs`` calls after ``warmup``, peak bytes of one call above what was allocated).

    The peak is measured on CUDA only (0 elsewhere).
    """
    for _ in range(warmup):
        step()
    _sync(device)
    peak = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"


def _failure(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text[:100]


def _provenance(command: str) -> str:
    import triton

    name = torch.cuda.get_device_name()
    return (
        f"Command: `{command}` (run {datetime.date.today().isoformat()} on {name}, torch {torch.__version__}, "
        f"triton {triton.__version__})."
    )


# -- tree attention ---------------------------------------------------------------------------------


def _workloads(scale: int) -> dict[str, list]:
    """Packed trees (one TreeLayout per row) shaped like the groups the learners train on.

    ``scale`` divides every segment length (for smoke runs); names give the full sizes.
    """
    from treerl.kernels.tree_layout import TreeLayout

    rng = random.Random(0)

    def group(prompt: int, answers: list[int]) -> TreeLayout:
        return TreeLayout.from_parents([prompt] + answers, [-1] + [0] * len(answers))

    def branching(num_segments: int, low: int, high: int) -> TreeLayout:
        # Multi-turn rollouts forked mid-episode: each segment hangs off a random earlier one,
        # then the segments are put in depth-first order.
        parents = [-1] + [rng.randrange(s) for s in range(1, num_segments)]
        lens = [rng.randint(low, high) for _ in range(num_segments)]
        children: dict[int, list[int]] = {s: [] for s in range(num_segments)}
        for s, p in enumerate(parents[1:], start=1):
            children[p].append(s)
        order, stack = [], [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(children[node]))
        new = {old: i for i, old in enumerate(order)}
        return TreeLayout.from_parents([lens[o] for o in order], [-1] + [new[parents[o]] for o in order[1:]])

    return {
        "GRPO group: 1k prompt, 16 answers of 1k": [group(1024 // scale, [1024 // scale] * 16)],
        "256 short siblings of a 2k prompt": [group(2048 // scale, [max(1, rng.randint(8, 64) // scale)
                                                                     for _ in range(256)])],
        "branching multi-turn tree, 48 segments": [branching(48, 64 // scale, 384 // scale)],
        "4 rows of 4 answers (padding)": [group(512 // scale, [rng.randint(64, 1024) // scale for _ in range(4)])
                                          for _ in range(4)],
    }  # fmt: skip


def bench_tree_attention(args: argparse.Namespace) -> str | None:
    """Time and peak memory of each tree-attention backend; returns the markdown body, or None without a GPU."""
    device = torch.device(args.device)
    if _needs_gpu("bench_tree_attention", device):
        return None
    from treerl.kernels import triton_tree_attention as tta
    from treerl.kernels.block_sparsity import tree_block_sparsity
    from treerl.kernels.tree_attention import BACKENDS
    from treerl.kernels.tree_layout import TreeBatch

    dtype = getattr(torch, args.dtype)
    backends: dict[str, Callable | str] = {}
    # A smoke run on CPU forces every backend; on CUDA each says why it cannot run, if it cannot.
    smoke = device.type != "cuda"
    why_not_triton = None if smoke else tta.triton_unavailable(device)
    backends["triton"] = tta.triton_tree_attention if why_not_triton is None else f"unavailable: {why_not_triton}"
    for name in ("flex", "segment", "reference"):
        why_not = None if smoke else BACKENDS[name].unavailable(device)
        backends[name] = BACKENDS[name].attend if why_not is None else f"unavailable: {why_not}"
    # The tiles the kernel will use, to report the fraction of blocks it visits.
    tiles = tta._tile_config(device, dtype, tta._block_dim(args.head_dim), tta._block_dim(args.head_dim))

    num_heads, num_kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    lines = [
        f"One attention layer, forward + backward with respect to q, k and v: {num_heads} query heads, "
        f"{num_kv_heads} key/value heads, head size {head_dim}, {args.dtype}. Time: median of {args.runs} calls "
        "after warm-up, per-batch planning cached (as for every layer after the first); setup: extra time of "
        "the first call on a fresh batch. Peak: `torch.cuda.max_memory_allocated` during one call, above "
        "the inputs. Max |Δ|: largest output difference from the Triton kernel.",
        "",
        "| workload | tokens | Triton blocks visited | backend | fwd+bwd | setup | peak memory | max \\|Δ\\| |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for workload, layouts in _workloads(args.scale).items():
        length = max(layout.num_tokens for layout in layouts)
        gen = torch.Generator(device="cpu").manual_seed(0)
        batch_size = len(layouts)

        def inputs():
            q = torch.randn(batch_size, num_heads, length, head_dim, generator=gen)
            k = torch.randn(batch_size, num_kv_heads, length, head_dim, generator=gen)
            v = torch.randn(batch_size, num_kv_heads, length, head_dim, generator=gen)
            return [x.to(device, dtype).requires_grad_() for x in (q, k, v)]

        q, k, v = inputs()
        grad_out = torch.randn(batch_size, length, num_heads, head_dim, generator=gen).to(device, dtype)
        density = tree_block_sparsity(TreeBatch(layouts), tiles.block_m, tiles.block_n, device).density()
        first = True
        triton_out = None
        for name, attend in backends.items():
            head = f"| {workload} | {length:,} | {density:.1%} |" if first else "| | | |"
            first = False
            if isinstance(attend, str):
                lines.append(f"{head} {name} | {attend} | | | |")
                continue
            if name == "reference" and length > args.max_reference_tokens:
                lines.append(f"{head} {name} | skipped: T > {args.max_reference_tokens:,} (dense T x T mask) | | | |")
                continue
            batch = TreeBatch(layouts)

            def step(attend=attend, batch=batch):
                out = attend(q, k, v, batch)  # (B, T, H, D)
                torch.autograd.grad(out, (q, k, v), grad_out)
                return out

            try:
                median, peak = _measure(step, args.runs, device)
                fresh = TreeBatch(layouts)
                _sync(device)
                start = time.perf_counter()
                out = step(batch=fresh).detach()
                _sync(device)
                setup = max(time.perf_counter() - start - median, 0.0)
            except Exception as error:  # report the failure of one backend, measure the others
                lines.append(f"{head} {name} | failed: {_failure(error)} | | | |")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            if name == "triton":
                triton_out, diff = out.float(), "-"
            else:
                diff = f"{(out.float() - triton_out).abs().max().item():.2e}" if triton_out is not None else "-"
            lines.append(f"{head} {name} | {median * 1e3:,.2f} ms | {setup * 1e3:,.1f} ms | {_mib(peak)} | {diff} |")
            del out
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"bench_tree_attention: {workload} done", file=sys.stderr, flush=True)
    table = "\n".join(lines)
    print(table)
    if smoke:
        return None  # figures from the interpreter say nothing about the kernel
    return f"{_provenance('python benchmarks/bench_kernels.py')}\n\n{table}\n"


# -- fused LM-head log-probs ------------------------------------------------------------------------


def bench_logprobs(args: argparse.Namespace) -> str | None:
    """Time and peak memory of the Triton log-probs against the chunked torch path and full logits; None without a GPU.

    Vocabularies of 32k (Llama-like) and ``--lp-vocab`` (152k, Qwen-like), ``--lp-tokens``
    loss positions, a 64-token candidate set per position (the renormalized path the
    learners use), temperature 0.8; gradients of all three outputs wrt hidden and weight.
    ``--device cpu`` (under TRITON_INTERPRET=1) is a smoke run at toy sizes that writes nothing.
    """
    device = torch.device(args.device)
    if _needs_gpu("bench_logprobs", device):
        return None
    from treerl.kernels.logprobs import chunked_token_logprobs, reference_token_logprobs
    from treerl.kernels.triton_logprobs import triton_logprobs_unavailable, triton_token_logprobs

    smoke = device.type != "cuda"
    dtype = getattr(torch, args.dtype)
    tokens, hidden_size, num_cand = args.lp_tokens, args.lp_hidden, 64
    vocabs = sorted({32_000, args.lp_vocab})
    if smoke:  # the interpreter runs each kernel program in Python
        tokens, hidden_size, num_cand, vocabs = min(tokens, 48), min(hidden_size, 32), 8, [320, 1000]
    why_not = triton_logprobs_unavailable(device, dtype)
    paths: dict[str, Callable | str] = {
        "triton": triton_token_logprobs if why_not is None else f"unavailable: {why_not}",
        "chunked (torch)": chunked_token_logprobs,
        "full logits": reference_token_logprobs,
    }
    lines = [
        f"{tokens:,} loss positions, hidden {hidden_size}, {num_cand} candidates per position, {args.dtype}, "
        "temperature 0.8; forward + backward of `logp.sum() - 0.01 * entropy.sum() + logp_candidates.sum()` "
        f"with respect to hidden and weight. Time: median of {args.runs} calls after warm-up (Triton's "
        "autotuning happens there); peak: `torch.cuda.max_memory_allocated` during one call, above the inputs. "
        "Max |Δ|: largest `logp` difference from the first path measured.",
        "",
        "| vocab | path | fwd+bwd | peak memory | max \\|Δ\\| |",
        "|---:|---|---:|---:|---:|",
    ]
    for vocab in vocabs:
        gen = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(tokens, hidden_size, device=device, generator=gen) / hidden_size**0.5
        hidden = hidden.to(dtype).requires_grad_()
        weight = torch.randn(vocab, hidden_size, device=device, generator=gen).to(dtype).requires_grad_()
        targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
        # The target plus distinct nonzero offsets from it: a valid candidate set in every row.
        offsets = torch.randperm(vocab - 1, device=device, generator=gen)[: num_cand - 1] + 1
        candidates = (targets[:, None] + torch.cat([offsets.new_zeros(1), offsets])) % vocab  # (N, K)
        first_logp = None
        for name, fn in paths.items():
            if isinstance(fn, str):
                lines.append(f"| {vocab:,} | {name} | {fn} | | |")
                continue

            def step(fn=fn):
                out = fn(hidden, weight, targets, temperature=0.8, candidates=candidates)
                loss = out.logp.sum() - 0.01 * out.entropy.sum() + out.logp_candidates.sum()
                torch.autograd.grad(loss, (hidden, weight))
                return out

            try:
                median, peak = _measure(step, args.runs, device)
                logp = step().logp.detach()
            except Exception as error:  # one path failing (full logits: out of memory) should not hide the others
                lines.append(f"| {vocab:,} | {name} | failed: {_failure(error)} | | |")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            if first_logp is None:
                first_logp, diff = logp, "-"
            else:
                diff = f"{(logp - first_logp).abs().max().item():.2e}"
            lines.append(f"| {vocab:,} | {name} | {median * 1e3:,.2f} ms | {_mib(peak)} | {diff} |")
            del logp
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del hidden, weight, targets, candidates, first_logp
        print(f"bench_logprobs: vocab {vocab:,} done", file=sys.stderr, flush=True)
    table = "\n".join(lines)
    print(table)
    if smoke:
        return None  # figures from the interpreter say nothing about the kernel
    return f"{_provenance('python benchmarks/bench_kernels.py')}\n\n{table}\n"


# -- entry point ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["tree_attention", "logprobs"], help="run one benchmark")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--runs", type=int, default=10, help="timed calls per variant after warm-up")
    parser.add_argument("--no-write", action="store_true", help="print the tables without updating BENCHMARKS.md")
    parser.add_argument("--scale", type=int, default=1, help="divide every segment length by this (quicker runs)")
    parser.add_argument(
        "--device", default="cuda", help="'cpu': smoke-test the tree-attention code with TRITON_INTERPRET=1, no figures"
    )
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--max-reference-tokens", type=int, default=20_000, help="skip the dense-mask reference on longer rows"
    )
    parser.add_argument("--lp-tokens", type=int, default=8192)
    parser.add_argument("--lp-vocab", type=int, default=151_936)
    parser.add_argument("--lp-hidden", type=int, default=4096)
    args = parser.parse_args(argv)

    sections = {}
    if args.only in (None, "tree_attention"):
        sections[TREE_SECTION] = bench_tree_attention(args)
    if args.only in (None, "logprobs"):
        sections[LOGPROBS_SECTION] = bench_logprobs(args)
    for section, body in sections.items():
        if body is not None and not args.no_write:
            write_section(section, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
