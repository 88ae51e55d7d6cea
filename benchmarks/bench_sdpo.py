"""SDPO vs GRPO at equal samples, from the shipped model: held-out success at the end of training.

    python benchmarks/bench_sdpo.py                  # Calculator and CodeSandbox, seeds 0 and 1; writes "## SDPO vs GRPO"
    python benchmarks/bench_sdpo.py --envs treerl/Calculator-v0 --seeds 0 --no-write --workdir runs/bench-sdpo

Every run is ``treerl learn [--learner sdpo ...] --env ENV --output-dir DIR --seed S`` with
every other option at its default: 60 steps of 8 tasks x 8 generations (3,840 episodes per
run, the same for every learner), the shipped tiny model, learning rate 2e-4, evaluation on
64 held-out episodes (task seeds 10000-10063, temperature 1.0) before and after. The learners:

- ``grpo``: the default learner (``dapo`` loss);
- ``sdpo``: ``--learner sdpo`` with its defaults (distillation alone, top-k 100 with a tail,
  alpha 0.5, EMA teacher at rate 0.05, IS clip 2, demonstrations and environment feedback);
- ``sdpo+grpo``: the same with ``--distillation-weight 0.5`` (half GRPO's loss, half SDPO's).

The runs of one environment and seed follow each other (grpo, sdpo, sdpo+grpo), so a change
in the machine's load hits the learners alike. Each finished run keeps its ``summary.json``
in ``--workdir``; rerunning with the same workdir skips the finished runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_section  # noqa: E402

SECTION = "## SDPO vs GRPO at equal samples"
LEARNERS: dict[str, list[str]] = {
    "grpo": [],
    "sdpo": ["--learner", "sdpo"],
    "sdpo+grpo": ["--learner", "sdpo", "--distillation-weight", "0.5"],
}
ENVS = ("treerl/Calculator-v0", "treerl/CodeSandbox-v0")


def run_one(env: str, learner: str, seed: int, workdir: Path, extra: list[str]) -> dict:
    out = workdir / f"{env.split('/')[-1]}-{learner}-{seed}"
    record = out / "bench.json"
    if record.exists():
        return json.loads(record.read_text())
    start = time.monotonic()
    cmd = [sys.executable, "-m", "treerl.cli", "learn", *LEARNERS[learner], "--env", env, "--output-dir", str(out),
           "--seed", str(seed), "--progress", "false", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {"env": env, "learner": learner, "seed": seed, "wall_s": wall,
              "start": summary["eval_start"]["success_rate"], "end": summary["eval_end"]["success_rate"],
              "reward_start": summary["eval_start"]["reward/mean"], "reward_end": summary["eval_end"]["reward/mean"],
              "step_s": statistics.median(m["perf/step_s"] for m in metrics),
              "train_reward": [m["reward/mean"] for m in metrics],
              "sdpo": {k: statistics.mean(m[k] for m in metrics if k in m) for k in
                       ("sdpo/reprompt_frac", "sdpo/demonstration_frac", "sdpo/feedback_used_frac",
                        "sdpo/no_teacher_group_frac", "sdpo/divergence", "sdpo/teacher_logp", "sdpo/student_logp",
                        "sdpo/logp_gap_success", "sdpo/logp_gap_failure")
                       if any(k in m for m in metrics)}}
    record.write_text(json.dumps(result))
    print(f"{env} {learner} seed {seed}: {result['start']:.1%} -> {result['end']:.1%} "
          f"({wall / 60:.1f} min)", file=sys.stderr, flush=True)
    return result


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def report(runs: list[dict], envs: list[str], seeds: list[int], loads: list[str], extra: list[str]) -> str:
    lines = [
        f"Command: `python benchmarks/bench_sdpo.py` (run {datetime.date.today()}, torch {torch.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs; load average before the runs "
        f"{loads[0]}, after {loads[-1]}). Per environment, seed and learner:",
        "`treerl learn [--learner sdpo [--distillation-weight 0.5]] --env ENV --output-dir DIR --seed S`"
        + (f" `{' '.join(extra)}`" if extra else "") + ", every other option at its default: 60 steps x 8 tasks x "
        "8 generations = 3,840 episodes for every learner, the shipped tiny model, learning rate 2e-4. "
        "Held-out success: 64 episodes (task seeds 10000-10063) at temperature 1.0, before and after.",
        "`sdpo` is distillation alone (top-k 100 with a tail, alpha 0.5, EMA teacher 0.05, IS clip 2, "
        "demonstrations and environment feedback); `sdpo+grpo` blends it half and half with GRPO's loss.",
        "",
    ]
    for env in envs:
        env_runs = [r for r in runs if r["env"] == env]
        lines += [f"**{env}**", "",
                  "| learner | seed | held-out success at start | at end | gain | held-out mean reward at end | "
                  "median step | wall time |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for learner in LEARNERS:
            for r in (r for r in env_runs if r["learner"] == learner):
                lines.append(f"| {learner} | {r['seed']} | {r['start']:.1%} | {r['end']:.1%} | "
                             f"{(r['end'] - r['start']) * 100:+.1f} pts | {r['reward_end']:.3f} | "
                             f"{r['step_s']:.1f} s | {r['wall_s'] / 60:.1f} min |")
        lines += ["", "| learner | mean success at end over seeds " + ", ".join(map(str, seeds))
                  + " | mean gain | step time / GRPO's (median steps, same seeds) |", "|---|---:|---:|---:|"]
        grpo = [r["step_s"] for r in env_runs if r["learner"] == "grpo"]
        for learner in LEARNERS:
            own = [r for r in env_runs if r["learner"] == learner]
            if not own:
                continue
            ratio = f"{statistics.mean(r['step_s'] for r in own) / statistics.mean(grpo):.2f}x" if grpo else "-"
            lines.append(f"| {learner} | {statistics.mean(r['end'] for r in own):.1%} | "
                         f"{statistics.mean((r['end'] - r['start']) * 100 for r in own):+.1f} pts | {ratio} |")
        sdpo_runs = [r for r in env_runs if r["sdpo"]]
        if sdpo_runs:
            keys = list(sdpo_runs[0]["sdpo"])
            lines += ["", "SDPO's own metrics, mean over the steps of each run:", "",
                      "| run | " + " | ".join(k.removeprefix("sdpo/") for k in keys) + " |",
                      "|---|" + "---:|" * len(keys)]
            for r in sdpo_runs:
                lines.append(f"| {r['learner']} seed {r['seed']} | "
                             + " | ".join(f"{r['sdpo'].get(k, float('nan')):.3f}" for k in keys) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", default=list(ENVS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--learners", nargs="+", default=list(LEARNERS), choices=list(LEARNERS))
    parser.add_argument("--workdir", type=Path, default=None, help="Keep runs here (rerunning skips finished ones).")
    parser.add_argument("--no-write", action="store_true", help="Print without updating BENCHMARKS.md.")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="More flags for every run, after --, e.g. -- --steps 5")
    args = parser.parse_args()
    extra = [a for a in args.extra if a != "--"]
    loads = [_load()]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        runs = [run_one(env, learner, seed, workdir, extra)
                for env in args.envs for seed in args.seeds for learner in args.learners]
    loads.append(_load())
    body = report(runs, args.envs, args.seeds, loads, extra)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
