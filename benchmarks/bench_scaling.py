"""Cost curves: step time and peak memory of treerl's GRPO step and TRL's ``GRPOTrainer`` as the work grows.

    pip install -e ".[bench]"                          # trl, datasets, matplotlib
    python benchmarks/bench_scaling.py                 # CPU: writes "## Cost curves vs TRL GRPOTrainer (CPU)"
    python benchmarks/bench_scaling.py --device cuda   # GPU: flex and Triton backends, bfloat16 autocast
    python benchmarks/bench_scaling.py --points 3 --repeats 2 --axes prompt,group   # reduced scale

Four axes, each grown with the others fixed at :data:`BASE`:

- ``prompt``: tokens of the system prompt with tool schemas, 256 -> 4,096;
- ``group``: generations per task (GRPO's group size), 2 -> 32;
- ``turns``: assistant turns per episode, 1 -> 8, a tool call and its result between turns;
- ``model``: parameters of a Qwen3-architecture model built from a config, 1.7M -> 49M.

Both sides train on the same fixed episodes, built once per point by rendering scripted
conversations with the tiny model's chat template (see ``_scaling.py``): generation is not part
of either step. treerl's step is the GRPO learner's ``pack_groups`` + ``optimize`` (tree
packing: the shared prompt once; tree attention; fused log-probs; loss; backward; clipping;
AdamW). TRL's step is its own ``Trainer.train`` loop, timed from ``on_step_begin`` to
``on_step_end`` as ``bench_vs_trl.py`` times it, with ``GRPOTrainer._prepare_inputs``
(generation and scoring) returning the batch it would build for these completions: its
``training_step`` (``_compute_loss`` over the padded batch, with the fused LM head TRL
installs), gradient clipping, optimizer and scheduler steps. TRL 1.16's GRPO has no
padding-free mode (its ``padding_free`` is SFT's), so its batch is padded: prompts to the
longest prompt (all equal here), completions to the longest completion.

Each side of each point runs in its own child process (one model, one optimizer, fresh
allocator state). Time: on CPU the process CPU time of a step with ``--threads`` torch threads
(1 by default; on a shared machine the CPU time is the figure load disturbs least), on CUDA the
synchronized wall time; the median of ``--repeats`` steps after ``--warmup``. Memory: on CPU
the growth of the child's resident-set high-water mark over a step (reset to the current RSS
just before the step through ``/proc/self/clear_refs``; glibc's mmap threshold pinned so that
freed tensors go back to the OS and each step's peak is its own; tracemalloc cannot see
torch's allocator), on CUDA the growth of ``torch.cuda.max_memory_allocated``; the largest
step's. The ideal is a cost proportional to the unique tokens of the step (the tree's tokens:
each shared prompt once); the tables show the cost per unique token beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, mib, write_section
from _scaling import (
    MODELS,
    Point,
    point_from_json,
    point_json,
    run_treerl,
    run_trl,
    summarize,
)

SECTIONS = {"cpu": "## Cost curves vs TRL GRPOTrainer (CPU)", "cuda": "## Cost curves vs TRL GRPOTrainer (GPU)"}
AXES: dict[str, tuple] = {
    "prompt": (256, 512, 1024, 2048, 4096),
    "group": (2, 4, 8, 16, 32),
    "turns": (1, 2, 4, 8),
    "model": tuple(MODELS),
}
BASE = Point(prompt=512, group=8, turns=2, model="1.7M")
LABELS = {"prompt": "system prompt tokens", "group": "group size", "turns": "assistant turns",
          "model": "model parameters"}


def sides(device: str) -> list[str]:
    """What each point runs: treerl's backend(s) and TRL."""
    return ["treerl-flex", "treerl-triton", "trl"] if device.startswith("cuda") else ["treerl", "trl"]


def axis_points(axis: str, num: int) -> list[Point]:
    """``num`` values of ``axis`` (the first, the last and evenly between), the others at :data:`BASE`."""
    values = AXES[axis]
    if num < len(values):
        values = tuple(values[round(i * (len(values) - 1) / max(num - 1, 1))] for i in range(num))
    return [Point(**{**BASE.__dict__, axis: v}) for v in dict.fromkeys(values)]


def measure(side: str, point: Point, args: argparse.Namespace) -> dict:
    """One side of one point, in this process."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.warmup + args.repeats
    bf16 = args.device.startswith("cuda")
    if side == "trl":
        result = run_trl(point, device=args.device, steps=steps, bf16=bf16)
    else:
        impl = side.split("-", 1)[1] if "-" in side else "auto"  # auto: the segment backend on CPU
        result = run_treerl(point, device=args.device, impl=impl, steps=steps, bf16=bf16)
        result["side"] = side
    return summarize(result, args.warmup, "wall_s" if bf16 else "cpu_s")


def measure_in_child(side: str, point: Point, args: argparse.Namespace) -> dict:
    """:func:`measure` in a fresh process, so each side's memory and allocator are its own."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--point", point_json(point),
           f"--device={args.device}", f"--warmup={args.warmup}", f"--repeats={args.repeats}",
           f"--threads={args.threads or 0}"]
    # A fixed mmap threshold makes glibc return freed large blocks to the OS, so the RSS
    # high-water mark of a step measures that step.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{side} at {point} failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_all(args: argparse.Namespace, measure_fn=measure_in_child) -> dict[str, list[dict]]:
    """Every point of every chosen axis (points shared by axes measured once), the sides alternating."""
    plan = {axis: axis_points(axis, args.points) for axis in args.axes}
    results: dict[Point, dict[str, dict]] = {}
    for n, point in enumerate(dict.fromkeys(p for points in plan.values() for p in points)):
        order = sides(args.device)
        order = order[n % len(order):] + order[:n % len(order)]  # who goes first rotates
        results[point] = {}
        for side in order:
            r = measure_fn(side, point, args)
            results[point][side] = r
            print(f"{point}: {side} {r['time_s']:.3f} s [{', '.join(f'{t:.3f}' for t in r['times_s'])}], "
                  f"peak {mib(r['peak_bytes'])}, tokens {r['counts']}", file=sys.stderr, flush=True)
    return {axis: [{"point": p.__dict__, "value": getattr(p, axis), "sides": results[p]} for p in points]
            for axis, points in plan.items()}


# -- reading the results --------------------------------------------------------------------------


def _value(axis: str, row: dict) -> str:
    if axis == "model":
        return f"{next(iter(row['sides'].values()))['num_params'] / 1e6:.1f}M"
    return f"{row['value']:,}"


def growth(axis: str, rows: list[dict], side: str) -> dict[str, float]:
    """First -> last point along ``axis``: how many times the time, memory and token counts grew."""
    first, last = rows[0]["sides"], rows[-1]["sides"]
    counts0, counts1 = first[side]["counts"], last[side]["counts"]
    return {
        "time": last[side]["time_s"] / first[side]["time_s"],
        "peak": last[side]["peak_bytes"] / max(first[side]["peak_bytes"], 1),
        "unique": counts1["unique_tokens"] / counts0["unique_tokens"],
        "flat": counts1["flat_tokens"] / counts0["flat_tokens"],
        "params": last[side]["num_params"] / first[side]["num_params"],
    }


def axis_table(axis: str, rows: list[dict], names: list[str]) -> str:
    head = (f"| {LABELS[axis]} | unique tokens | flat tokens (TRL padded) | "
            + " | ".join(f"{n} step" for n in names) + " | "
            + " | ".join(f"{n} ms / unique token" for n in names) + " | "
            + " | ".join(f"{n} peak" for n in names) + " | TRL / treerl time | TRL / treerl peak |")
    lines = [head, "|" + "---|" + "---:|" * (head.count("|") - 2)]
    ours = names[0]
    for row in rows:
        s, counts = row["sides"], row["sides"][ours]["counts"]
        unique = counts["unique_tokens"]
        lines.append(
            f"| {_value(axis, row)} | {unique:,} | {counts['flat_tokens']:,} ({counts['padded_tokens']:,}) | "
            + " | ".join(f"{s[n]['time_s']:.3f} s" for n in names) + " | "
            + " | ".join(f"{1e3 * s[n]['time_s'] / unique:.3f}" for n in names) + " | "
            + " | ".join(mib(s[n]["peak_bytes"]) for n in names) + " | "
            + f"**{s['trl']['time_s'] / s[ours]['time_s']:.2f}x** | "
            + (f"{s['trl']['peak_bytes'] / s[ours]['peak_bytes']:.2f}x |" if s[ours]["peak_bytes"] >= 2**20 else "- |")
        )
    return "\n".join(lines)


def verdict(axis: str, rows: list[dict], names: list[str]) -> str:
    """One sentence: what each side's time grew like along the axis, against the tokens' growth."""
    g = {n: growth(axis, rows, n) for n in names}
    any_g = g[names[0]]
    what = (f"parameters x{any_g['params']:.1f} at equal tokens (ideal: time x{any_g['params']:.1f} or less, the "
            "cost per token of the layers grows with the parameters)" if axis == "model" else
            f"unique tokens x{any_g['unique']:.2f}, flat tokens x{any_g['flat']:.2f}")

    def tracks(n: str) -> str:
        if axis == "model":
            return f"time per parameter x{g[n]['time'] / g[n]['params']:.2f}"
        # Which token count the time followed (within 25%), if either.
        ratio = {k: g[n]["time"] / g[n][k] for k in ("unique", "flat")}
        close = [k for k in ("unique", "flat") if 0.8 <= ratio[k] <= 1.25]
        how = (f"follows {close[0]} tokens" if close else
               "grows faster than unique tokens and slower than flat ones" if ratio["unique"] > 1 > ratio["flat"]
               else "grows faster than both token counts" if ratio["flat"] > 1 else "grows slower than both")
        return f"time per unique token x{ratio['unique']:.2f} (1 is ideal), {how}"

    sides_txt = "; ".join(f"{n} time x{g[n]['time']:.2f}, peak x{g[n]['peak']:.2f}, {tracks(n)}" for n in names)
    return f"- **{LABELS[axis]}** {_value(axis, rows[0])} -> {_value(axis, rows[-1])}: {what}; {sides_txt}."


def plot(results: dict[str, list[dict]], names: list[str], path: Path, title: str) -> None:
    """Rows: step time, time per unique token, peak memory; one column per axis; log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = list(results)
    fig, grid = plt.subplots(3, len(axes), figsize=(4.2 * len(axes), 10), squeeze=False)
    for col, axis in enumerate(axes):
        rows = results[axis]
        ours = names[0]
        xs = [r["sides"][ours]["num_params"] / 1e6 if axis == "model" else r["value"] for r in rows]
        unique = [r["sides"][ours]["counts"]["unique_tokens"] for r in rows]
        for n in names:
            times = [r["sides"][n]["time_s"] for r in rows]
            grid[0][col].plot(xs, times, "o-", label=n)
            grid[1][col].plot(xs, [1e3 * t / u for t, u in zip(times, unique)], "o-", label=n)
            grid[2][col].plot(xs, [r["sides"][n]["peak_bytes"] / 2**20 for r in rows], "o-", label=n)
        t0 = rows[0]["sides"][ours]["time_s"]
        scale = [x / xs[0] for x in xs] if axis == "model" else [u / unique[0] for u in unique]
        grid[0][col].plot(xs, [t0 * s for s in scale], "k--", lw=1,
                          label="ideal (x parameters)" if axis == "model" else "ideal (x unique tokens)")
        for row, ylabel in enumerate(("step time (s)", "ms per unique token", "peak memory (MiB)")):
            ax = grid[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x:.1f}" if axis == "model" else f"{x:g}" for x in xs])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        grid[2][col].set_xlabel(LABELS[axis] + (" (M)" if axis == "model" else ""))
        grid[0][col].set_title(f"{LABELS[axis]}")
        grid[0][col].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(results: dict[str, list[dict]], args: argparse.Namespace, figure: str, wall_s: float) -> str:
    import torch
    import trl

    names = sides(args.device)
    on_cuda = args.device.startswith("cuda")
    load = getattr(args, "load", None)
    command = "python benchmarks/bench_scaling.py" + (" " + " ".join(args.argv) if args.argv else "")
    measure = ("synchronized wall time" if on_cuda else
               f"process CPU time with {args.threads} torch thread(s)")
    lines = [
        f"Command: `{command}` (run {datetime.date.today().isoformat()}, torch {torch.__version__}, TRL "
        f"{trl.__version__}, {platform.machine()}, {os.cpu_count()} CPU cores, {args.device}, "
        f"{'bfloat16 autocast on both sides' if on_cuda else 'float32 on both sides'}; "
        f"{wall_s / 60:.1f} min for the whole script"
        + (f"; load average {load[0]} at its start and {load[1]} at its end)." if load else ")."),
        "",
        f"Each axis grows with the others fixed at prompt {BASE.prompt} tokens, group {BASE.group}, "
        f"{BASE.turns} turns, model {BASE.model}. One task per step: one group of G episodes sharing the "
        "rendered prompt (system text, tool schemas, the question); every turn but the last is a tool call "
        "followed by the tool's result, the last a short answer; the episodes are built once per point and "
        "both sides train on the same token ids (generation is not timed). Step time = median "
        f"{measure} of {args.repeats} steps after {args.warmup} warm-up step(s); peak = growth of "
        + ("`torch.cuda.max_memory_allocated`" if on_cuda else "the child process's RSS high-water mark")
        + " over a step, the largest step's. *unique tokens*: the tree's (each shared prompt once), the ideal "
        "cost's measure; *flat tokens*: every episode's path in full, what TRL's batch holds (in brackets with "
        "its right padding). TRL: `GRPOTrainer` defaults (loss `dapo`, fused LM head, SDPA) except "
        "`gradient_checkpointing=False` (treerl's default too) and one optimizer step per group; no "
        "padding-free mode exists for GRPO in TRL 1.16.",
        "",
        f"![cost curves]({figure})",
        "",
    ]
    for axis, rows in results.items():
        lines += [f"**{LABELS[axis]}**", "", axis_table(axis, rows, names), ""]
    lines += ["Which axis each side's cost grows with (first -> last point of each axis):", ""]
    lines += [verdict(axis, rows, names) for axis, rows in results.items()]
    lines += [
        "",
        ("Reading: the unique-token ideal counts each token's work once and the same for every token; two real "
        "costs are outside it. Attention is quadratic in context length, so a longer prompt costs more per "
        "token on both sides (treerl attends over the shared prompt once; TRL once per episode), and so does a "
        "longer episode (more turns: every later token attends over a longer path). Along the model axis, "
        "tokens are fixed and the ideal is cost x parameters; small models spend a large share of a step on "
        "work that does not grow with the parameters (attention scores, norms, the loss, Python), so both sides "
        "grow less than the parameter count. Only the prompt is shared between the "
        "episodes of a group here (every generation differs from its first token), so the more of an episode "
        "its own turns are, the closer flat and unique tokens get and the smaller treerl's lead."),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (flex and Triton backends, bfloat16).")
    parser.add_argument("--axes", default=",".join(AXES), help=f"Comma-separated, from {list(AXES)}.")
    parser.add_argument("--points", type=int, default=5, help="Most points per axis (first, last, evenly between).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed steps per side and point (the median).")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed steps first.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on CPU, torch's on CUDA).")
    parser.add_argument("--no-write", action="store_true", help="Print without writing BENCHMARKS.md or the figure.")
    parser.add_argument("--save-results", type=Path, help="Also write the raw measurements to this JSON file.")
    parser.add_argument("--from-results", type=Path,
                        help="Render (and write) a run saved with --save-results instead of measuring.")
    parser.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--point", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if "--save-results" in args.argv:  # where the raw numbers went is not part of the command to rerun
        at = args.argv.index("--save-results")
        del args.argv[at:at + 2]
    if "--no-write" in args.argv:
        args.argv.remove("--no-write")
    args.axes = [a for a in args.axes.split(",") if a]
    if unknown := [a for a in args.axes if a not in AXES]:
        parser.error(f"--axes: {unknown} not in {list(AXES)}")
    if args.points < 2 or args.repeats < 1 or args.warmup < 0:
        parser.error("--points must be >= 2, --repeats >= 1, --warmup >= 0")
    if args.threads is None and not args.device.startswith("cuda"):
        args.threads = 1
    if args.child:
        print(json.dumps(measure(args.child, point_from_json(args.point), args)))
        return 0
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"bench_scaling: --device {args.device}, but this machine has no CUDA GPU (torch "
                  f"{torch.__version__}); nothing measured, nothing written.")
            return 0
    try:
        import matplotlib  # noqa: F401
        import trl  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f'bench_scaling needs TRL and matplotlib ({exc.name} is missing): pip install -e ".[bench]"')

    start = time.perf_counter()
    if args.from_results:
        saved = json.loads(args.from_results.read_text())
        results, wall_s = saved["results"], saved["wall_s"]
        for key, value in saved["args"].items():  # the measured run's settings, for the report
            setattr(args, key, value)
    else:
        args.load = [round(os.getloadavg()[0], 1)]
        results = run_all(args)
        wall_s = time.perf_counter() - start
        args.load.append(round(os.getloadavg()[0], 1))
    if args.save_results:
        settings = {k: getattr(args, k) for k in ("argv", "device", "repeats", "warmup", "threads", "load")}
        args.save_results.write_text(json.dumps({"results": results, "wall_s": wall_s, "args": settings}))
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    figure = Path("docs") / f"scaling-{kind}.png"
    body = report(results, args, figure.as_posix(), wall_s)
    print(body)
    if not args.no_write:
        plot(results, sides(args.device), args.out.parent / figure,
             f"treerl vs TRL GRPOTrainer, one GRPO step ({args.device})")
        write_section(SECTIONS[kind], body, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
