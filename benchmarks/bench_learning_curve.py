"""The README's main job, measured: `treerl learn` on Calculator, held-out success before and after.

    python benchmarks/bench_learning_curve.py            # seeds 0 and 1; writes "## Learning curve"

Runs ``treerl learn --env treerl/Calculator-v0 --output-dir DIR --seed S`` exactly as the
README does (defaults for everything else), once per seed, and records the held-out
success rate at the start and the end (64 episodes, task seeds 10000-10063, temperature 1.0),
the wall time of the whole command, and the training reward every few steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, write_section  # noqa: E402

SECTION = "## Learning curve: treerl learn on Calculator"


def run_seed(seed: int, workdir: Path) -> dict:
    out = workdir / f"calc-{seed}"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "treerl.cli", "learn", "--env", "treerl/Calculator-v0", "--output-dir", str(out),
         "--seed", str(seed), "--progress", "false"],
        capture_output=True, text=True,
    )
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"treerl learn failed for seed {seed}:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"seed": seed, "wall_s": wall, "start": summary["eval_start"]["success_rate"],
            "end": summary["eval_end"]["success_rate"], "metrics": metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--no-write", action="store_true", help="Print without updating BENCHMARKS.md.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_seed(s, Path(tmp)) for s in args.seeds]

    lines = [
        f"Command: `{command_line('bench_learning_curve.py')}` (run {datetime.date.today()}, torch {torch.__version__}, "
        f"{platform.machine()}, 2 CPU cores shared with other jobs), which runs, per seed,",
        "`treerl learn --env treerl/Calculator-v0 --output-dir DIR --seed S` with every other option at its default",
        "(60 steps of 8 tasks x 8 generations, `dapo` loss, learning rate 2e-4, shipped tiny model).",
        "Held-out success: 64 Calculator episodes (task seeds 10000-10063) at temperature 1.0, before and after.",
        "",
        "| seed | held-out success at start | at end | gain | wall time of the whole command | target |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        gain = (r["end"] - r["start"]) * 100
        lines.append(f"| {r['seed']} | {r['start']:.1%} | {r['end']:.1%} | **{gain:+.1f} points** | "
                     f"{r['wall_s'] / 60:.1f} min | >= +20 points within 15 min |")
    lines += ["", "Training reward (mean over the step's 64 episodes) every 6 steps:", "",
              "| step | " + " | ".join(f"seed {r['seed']}" for r in runs) + " |",
              "|---:|" + "---:|" * len(runs)]
    steps = [m["step"] for m in runs[0]["metrics"]]
    for i in range(0, len(steps), 6):
        cells = [f"{r['metrics'][i]['reward/mean']:.3f}" if i < len(r["metrics"]) else "-" for r in runs]
        lines.append(f"| {steps[i]} | " + " | ".join(cells) + " |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
