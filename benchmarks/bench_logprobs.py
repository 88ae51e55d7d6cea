"""Chunked LM-head log-probs vs full logits: peak memory and time, forward + backward.

    python benchmarks/bench_logprobs.py            # vocab 32k, 8k tokens, hidden 256, float32

Each variant runs in a fresh subprocess so its memory peak is its own. On CPU the peak
is the growth of the process's resident-set high-water mark (VmHWM, restarted just
before the call) over one forward + backward: torch's CPU allocator takes large blocks
from the OS and returns them, so RSS sees every big tensor, while tracemalloc sees none
of torch's allocations. On CUDA it is
``torch.cuda.max_memory_allocated`` over the same call. Times are the median of
``--runs`` calls after that first one. The script prints a markdown table and replaces
the section "## Log-probs without full logits" in BENCHMARKS.md.
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
VARIANTS = ("reference", "chunked")


def run_variant(args: argparse.Namespace) -> dict:
    """In the child process: build inputs, measure one call's memory peak, then time ``runs`` calls."""
    import torch

    from treerl.kernels.logprobs import token_logprobs

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

    def step() -> None:
        out = token_logprobs(hidden, weight, targets, temperature=0.8, candidates=candidates, impl=args.impl)
        (out.logp.sum() - 0.01 * out.entropy.sum() + out.logp_candidates.sum()).backward()
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
        token_logprobs(hidden[:8].detach(), weight.detach(), targets[:8], candidates=candidates[:8], impl=args.impl)
        base = reset_rss_peak()
        step()
        peak_bytes = rss_peak() - base
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"impl": args.impl, "peak_bytes": peak_bytes, "median_s": statistics.median(times), "times_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3, help="timed calls per variant after the memory-measuring one")
    parser.add_argument("--impl", choices=VARIANTS, help=argparse.SUPPRESS)  # set in the child process
    parser.add_argument("--no-write", action="store_true", help="print the table without updating BENCHMARKS.md")
    args = parser.parse_args()

    if args.impl:  # child
        print(json.dumps(run_variant(args)))
        return

    results = {}
    for impl in VARIANTS:
        cmd = [sys.executable, __file__, "--impl", impl] + [
            f"--{k}={getattr(args, k)}" for k in ("vocab", "tokens", "hidden", "dtype", "device", "runs")
        ]
        print(f"running {impl} ...", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[impl] = json.loads(done.stdout.strip().splitlines()[-1])

    ref, chunked = results["reference"], results["chunked"]
    logits_bytes = args.tokens * args.vocab * 4
    lines = [
        f"vocab {args.vocab:,}, {args.tokens:,} tokens, hidden {args.hidden}, {args.dtype} on {args.device}, "
        f"top-64 candidates, forward + backward wrt hidden and weight (one float32 logits tensor "
        f"is {mib(logits_bytes)}). Peak = growth of "
        + ("`torch.cuda.max_memory_allocated`" if args.device.startswith("cuda") else "the process RSS high-water mark")
        + f" over one call; time = median of {args.runs} calls.",
        "",
        "| path | peak memory | median time | time vs full logits |",
        "|---|---:|---:|---:|",
    ]
    for name, label in (("reference", "full logits (reference)"), ("chunked", "chunked (1024 x 8192 tiles)")):
        r = results[name]
        lines.append(
            f"| {label} | {mib(r['peak_bytes'])} | {r['median_s']:.2f} s | {r['median_s'] / ref['median_s']:.2f}x |"
        )
    lines += [
        "",
        f"Peak memory ratio chunked / full: {chunked['peak_bytes'] / max(ref['peak_bytes'], 1):.3f}.",
    ]
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        cpu = platform.processor() or platform.machine()
        import torch

        body = (
            f"Command: `python benchmarks/bench_logprobs.py` (run {datetime.date.today().isoformat()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {cpu}).\n\n{table}\n"
        )
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
