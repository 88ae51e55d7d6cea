"""A bfloat16 run of the shipped model against its float32 run, same seed: learning curve and
held-out success at the end.

    python benchmarks/bench_precision.py --steps 10 --tasks-per-step 2 --group-size 4   # writes "## Precision"

Runs ``treerl learn --env treerl/Calculator-v0`` twice with the same seed and sizes: once as
is (float32 weights, float32 compute on CPU) and once with ``--bf16`` (float32 master weights
and AdamW states, bfloat16 autocast for the forward and backward, sampler in bfloat16).
Records the training reward per step, the held-out success at start and end, and each
run's wall time. On a CPU without bfloat16 units the bfloat16 run is much slower; the figure
of interest is whether it learns as the float32 run does, not its speed.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_section  # noqa: E402

SECTION = "## Precision: bfloat16 autocast vs float32 (shipped model, Calculator)"


def run(name: str, extra: list[str], args: argparse.Namespace, workdir: Path) -> dict:
    out = workdir / name
    cmd = [sys.executable, "-m", "treerl.cli", "learn", "--env", "treerl/Calculator-v0", "--output-dir", str(out),
           "--seed", str(args.seed), "--steps", str(args.steps), "--tasks-per-step", str(args.tasks_per_step),
           "--group-size", str(args.group_size), "--eval-episodes", str(args.eval_episodes), "--progress", "false",
           "--sample-groups", "0", *extra]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    curve = [json.loads(line)["reward/mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    precision = next((line for line in proc.stderr.splitlines() if line.startswith("precision:")), "")
    return {"name": name, "wall_s": time.monotonic() - start, "curve": curve, "precision": precision,
            "start": summary["eval_start"]["success_rate"], "end": summary["eval_end"]["success_rate"],
            "command": " ".join(["treerl", *cmd[3:5], "...", *extra])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tasks-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--eval-episodes", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run("float32", [], args, Path(tmp)), run("bf16", ["--bf16"], args, Path(tmp))]
    lines = [
        f"`python benchmarks/bench_precision.py --steps {args.steps} --tasks-per-step {args.tasks_per_step} "
        f"--group-size {args.group_size} --eval-episodes {args.eval_episodes} --seed {args.seed}` on "
        f"{platform.machine()} ({platform.processor() or 'cpu'}), one run each (a small budget: "
        "bfloat16 autocast on a CPU without bfloat16 units is slower, see wall s; one seed, so the curves are noisy "
        f"and {args.eval_episodes} held-out episodes move in steps of {100 / args.eval_episodes:.0f} points).",
        "",
        "| run | precision | held-out success start -> end | reward/mean by step | wall s |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        curve = " ".join(f"{v:.2f}" for v in r["curve"])
        lines.append(f"| {r['name']} | {r['precision'].removeprefix('precision: ')} | {r['start']:.1%} -> "
                     f"{r['end']:.1%} | {curve} | {r['wall_s']:.0f} |")
    write_section(SECTION, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
