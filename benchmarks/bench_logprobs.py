"""Chunked LM-head log-probs vs full logits: peak memory and time, forward + backward.

    python benchmarks/bench_logprobs.py            # vocab 32k, 8k tokens, hidden 256, float32

Four variants: full logits (the reference) and the chunked path, each with and without a
top-64 candidate set per token (the sampler's support under top-k/top-p, which the learner
renormalizes over for unbiased importance sampling). Each runs in a fresh subprocess so its
memory peak is its own. On CPU the peak is the growth of the process's resident-set
high-water mark (VmHWM, restarted just before the call) over one forward + backward:
torch's CPU allocator takes large blocks from the OS and returns them, so RSS sees every big
tensor, while tracemalloc sees none of torch's allocations. On CUDA it is
``torch.cuda.max_memory_allocated`` over the same call. Time is the median of ``--runs``
calls after that first one: on CPU the process CPU time with ``--threads`` torch threads (so
that other jobs on a shared machine do not enter the ratios), on CUDA synchronized wall time.
The script prints a markdown table and replaces the section "## Log-probs without full
logits" in BENCHMARKS.md.
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
VARIANTS = (("reference", True), ("chunked", True), ("reference", False), ("chunked", False))
"""(implementation, with candidates)."""


def run_variant(args: argparse.Namespace) -> dict:
    """In the child process: build inputs, measure one call's memory peak, then time ``runs`` calls."""
    import torch

    from treerl.kernels.logprobs import token_logprobs

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
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
    if not args.candidates:
        candidates = None

    def step() -> None:
        out = token_logprobs(hidden, weight, targets, temperature=0.8, candidates=candidates, impl=args.impl)
        loss = out.logp.sum() - 0.01 * out.entropy.sum()
        if candidates is not None:
            loss = loss + out.logp_candidates.sum()
        loss.backward()
        hidden.grad = weight.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak_bytes = torch.cuda.max_memory_allocated() - base
    else:
        # Warm up on a few tokens first so one-time allocations (thread pools, BLAS
        # buffers) are not charged to the call, then restart the high-water mark.
        token_logprobs(hidden[:8].detach(), weight.detach(), targets[:8],
                       candidates=None if candidates is None else candidates[:8], impl=args.impl)
        base = reset_rss_peak()
        step()
        peak_bytes = rss_peak() - base
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = []
    for _ in range(args.runs):
        start = clock()
        step()
        times.append(clock() - start)
    return {"impl": args.impl, "peak_bytes": peak_bytes, "median_s": statistics.median(times), "times_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3, help="timed calls per variant after the memory-measuring one")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU time is measured)")
    parser.add_argument("--impl", choices=("reference", "chunked"), help=argparse.SUPPRESS)  # set in the child
    parser.add_argument("--candidates", type=int, default=1, help=argparse.SUPPRESS)  # set in the child
    parser.add_argument("--no-write", action="store_true", help="print the table without updating BENCHMARKS.md")
    args = parser.parse_args()

    if args.impl:  # child
        print(json.dumps(run_variant(args)))
        return

    results = {}
    for impl, with_candidates in VARIANTS:
        cmd = [sys.executable, __file__, "--impl", impl, f"--candidates={int(with_candidates)}"] + [
            f"--{k}={getattr(args, k)}" for k in ("vocab", "tokens", "hidden", "dtype", "device", "runs", "threads")
        ]
        print(f"running {impl} (candidates: {with_candidates}) ...", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[impl, with_candidates] = json.loads(done.stdout.strip().splitlines()[-1])

    logits_bytes = args.tokens * args.vocab * 4
    on_cuda = args.device.startswith("cuda")
    lines = [
        f"vocab {args.vocab:,}, {args.tokens:,} tokens, hidden {args.hidden}, {args.dtype} on {args.device}, "
        f"forward + backward wrt hidden and weight (one float32 logits tensor is {mib(logits_bytes)}), with and "
        "without a top-64 candidate set per token. Peak = growth of "
        + ("`torch.cuda.max_memory_allocated`" if on_cuda else "the process RSS high-water mark")
        + f" over one call; time = median of {args.runs} calls, "
        + ("synchronized wall time." if on_cuda else f"process CPU time with {args.threads} torch thread(s)."),
        "",
        "| path | candidates | peak memory | median time | time vs full logits |",
        "|---|---|---:|---:|---:|",
    ]
    for with_candidates in (True, False):
        ref = results["reference", with_candidates]
        for name, label in (("reference", "full logits (reference)"), ("chunked", "chunked (1024 x 8192 tiles)")):
            r = results[name, with_candidates]
            lines.append(
                f"| {label} | {'top-64' if with_candidates else 'none'} | {mib(r['peak_bytes'])} | "
                f"{r['median_s']:.2f} s | {r['median_s'] / ref['median_s']:.2f}x |"
            )
    chunked, ref = results["chunked", True], results["reference", True]
    lines += [
        "",
        f"Peak memory ratio chunked / full (with candidates): {chunked['peak_bytes'] / max(ref['peak_bytes'], 1):.3f}. "
        f"Chunked with candidates / chunked without: "
        f"{chunked['median_s'] / results['chunked', False]['median_s']:.2f}x.",
    ]
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        cpu = platform.processor() or platform.machine()
        import torch

        body = (
            f"Command: `python benchmarks/bench_logprobs.py` (run {datetime.date.today().isoformat()}, "
            f"torch {torch.__version__}, {cpu}).\n\n{table}\n"
        )
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
