"""Chunked LM-head log-probs vs full logits: peak memory and time, forward + backward.

    python benchmarks/bench_logprobs.py            # vocab 32k, 8k tokens, hidden 256, float32

Variants: full logits (the reference) and the chunked path with its default tiles, each with
and without a top-64 candidate set per token (the sampler's support under top-k/top-p, which
the learner renormalizes over for unbiased importance sampling), and the chunked path with
the earlier 1024 x 8192 tiles beside them. Memory: each variant runs one forward + backward
in a fresh subprocess, so its peak is its own; on CPU the peak is the growth of the process's
resident-set high-water mark (VmHWM, restarted just before the call): torch's CPU allocator
takes large blocks from the OS and returns them, so RSS sees every big tensor, while
tracemalloc sees none of torch's allocations. On CUDA it is ``torch.cuda.max_memory_allocated``.
Time: one more process runs every variant ``--runs`` times after a warm-up, the variants
interleaved round by round in a rotating order, so load from other jobs falls on all of them
alike; on CPU each call's time is the thread's CPU time with ``--threads`` torch threads (1 by
default: with one thread the thread CPU time is the whole call's work and a busy machine's
waiting is not in it), on CUDA synchronized wall time. The ratios are the medians of the
per-round ratios. The script prints a markdown table and replaces the section "## Log-probs
without full logits" in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import mib, reset_rss_peak, rss_peak, write_section  # noqa: E402

SECTION = "## Log-probs without full logits"
VARIANTS = {
    "reference+cand": ("reference", True, None),
    "chunked+cand": ("chunked", True, None),
    "chunked-8192+cand": ("chunked", True, 8192),
    "reference": ("reference", False, None),
    "chunked": ("chunked", False, None),
}
"""name: (implementation, with candidates, chunk_vocab (None: the default))."""


def build_inputs(args: argparse.Namespace):
    import torch

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(args.tokens, args.hidden, generator=gen) / args.hidden**0.5).to(device, dtype)
    weight = torch.randn(args.vocab, args.hidden, generator=gen).to(device, dtype)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    # A 64-token candidate set holding the target, as the sampler would record it: the
    # target plus 63 distinct nonzero offsets from it, so no id repeats within a row.
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(args.vocab - 1, generator=gen)[:63] + 1])
    candidates = ((targets.cpu()[:, None] + offsets) % args.vocab).to(device)  # (N, 64)
    return hidden, weight, targets, candidates


def make_step(name: str, inputs, device):
    import torch

    from treerl.kernels.logprobs import token_logprobs

    hidden, weight, targets, all_candidates = inputs
    impl, with_candidates, chunk_vocab = VARIANTS[name]
    candidates = all_candidates if with_candidates else None

    def step() -> None:
        out = token_logprobs(hidden, weight, targets, temperature=0.8, candidates=candidates, impl=impl,
                             chunk_vocab=chunk_vocab)
        loss = out.logp.sum() - 0.01 * out.entropy.sum()
        if candidates is not None:
            loss = loss + out.logp_candidates.sum()
        loss.backward()
        hidden.grad = weight.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def measure_memory(args: argparse.Namespace) -> dict:
    """In a child process: the memory peak of one forward + backward of ``args.variant``."""
    import torch

    from treerl.kernels.logprobs import token_logprobs

    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    inputs = build_inputs(args)
    step = make_step(args.variant, inputs, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        return {"peak_bytes": torch.cuda.max_memory_allocated() - base}
    # Warm up on a few tokens first so one-time allocations (thread pools, BLAS buffers)
    # are not charged to the call, then restart the high-water mark.
    hidden, weight, targets, candidates = inputs
    token_logprobs(hidden[:8].detach(), weight.detach(), targets[:8], candidates=candidates[:8],
                   impl=VARIANTS[args.variant][0])
    base = reset_rss_peak()
    step()
    return {"peak_bytes": rss_peak() - base}


def measure_time(args: argparse.Namespace) -> dict:
    """In a child process: every variant ``runs`` times, interleaved; per-call times."""
    import torch

    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    inputs = build_inputs(args)
    names = list(VARIANTS)
    steps = {name: make_step(name, inputs, device) for name in names}
    for name in names:
        steps[name]()  # warm-up
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.runs):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = clock()
            steps[name]()
            times[name].append(clock() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds (every variant once per round)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU time is measured)")
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)  # memory child
    parser.add_argument("--time-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true", help="print the table without updating BENCHMARKS.md")
    args = parser.parse_args()

    if args.variant:
        print(json.dumps(measure_memory(args)))
        return
    if args.time_child:
        print(json.dumps(measure_time(args)))
        return

    wall = time.perf_counter()
    common = [f"--{k}={getattr(args, k)}" for k in ("vocab", "tokens", "hidden", "dtype", "device", "runs", "threads")]
    peaks = {}
    for name in VARIANTS:
        print(f"memory: {name} ...", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, f"--variant={name}", *common],
                              capture_output=True, text=True, check=True)
        peaks[name] = json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]
    print("time: every variant, interleaved ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, "--time-child", *common], capture_output=True, text=True,
                          check=True)
    times = json.loads(done.stdout.strip().splitlines()[-1])
    wall = time.perf_counter() - wall
    for name, t in times.items():
        print(f"  {name}: {', '.join(f'{x:.2f}' for x in t)} s", file=sys.stderr)

    from treerl.kernels.logprobs import default_chunk_vocab

    import torch

    tile = default_chunk_vocab("chunked", torch.device(args.device))
    logits_bytes = args.tokens * args.vocab * 4
    on_cuda = args.device.startswith("cuda")

    def vs(name: str, base: str) -> float:
        return statistics.median(a / b for a, b in zip(times[name], times[base]))

    labels = {
        "reference": "full logits (reference)",
        "chunked": f"chunked, 1024 x {tile} tiles (the default)",
        "chunked-8192": "chunked, 1024 x 8192 tiles (the earlier default)",
    }
    lines = [
        f"vocab {args.vocab:,}, {args.tokens:,} tokens, hidden {args.hidden}, {args.dtype} on {args.device}, "
        f"forward + backward wrt hidden and weight (one float32 logits tensor is {mib(logits_bytes)}), with and "
        "without a top-64 candidate set per token. Peak = growth of "
        + ("`torch.cuda.max_memory_allocated`" if on_cuda else "the process RSS high-water mark")
        + " over one call, each variant in its own process. Time: "
        + ("synchronized wall time" if on_cuda else f"thread CPU time with {args.threads} torch thread(s)")
        + f", every variant once per round for {args.runs} rounds in one process (interleaved); the ratio is "
        "the median of the per-round ratios to full logits with the same candidates.",
        "",
        "| path | candidates | peak memory | median time | time vs full logits |",
        "|---|---|---:|---:|---:|",
    ]
    for name, (impl, with_candidates, chunk_vocab) in VARIANTS.items():
        base = "reference+cand" if with_candidates else "reference"
        label = labels["chunked-8192" if chunk_vocab == 8192 else impl]
        lines.append(
            f"| {label} | {'top-64' if with_candidates else 'none'} | {mib(peaks[name])} | "
            f"{statistics.median(times[name]):.2f} s | **{vs(name, base):.2f}x** |"
        )
    lines += [
        "",
        f"Peak memory ratio chunked / full (with candidates): {peaks['chunked+cand'] / max(peaks['reference+cand'], 1):.3f}. "
        f"Chunked with candidates / chunked without: {vs('chunked+cand', 'chunked'):.2f}x; "
        f"default tiles / 1024 x 8192 tiles (with candidates): {vs('chunked+cand', 'chunked-8192+cand'):.2f}x.",
        f"Per-round time with candidates, chunked / full logits: "
        + ", ".join(f"{a / b:.2f}" for a, b in zip(times["chunked+cand"], times["reference+cand"])) + ".",
    ]
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        cpu = platform.processor() or platform.machine()
        command = "python benchmarks/bench_logprobs.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
        body = (
            f"Command: `{command}` (run {datetime.date.today().isoformat()}, torch {torch.__version__}, {cpu}; "
            f"{wall / 60:.1f} min wall time for the whole script).\n\n{table}\n"
        )
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
