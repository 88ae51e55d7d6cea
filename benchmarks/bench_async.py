"""AsyncGRPO vs synchronous GRPO on this machine: episodes per second, and held-out success at the end.

    python benchmarks/bench_async.py                    # writes "## AsyncGRPO vs synchronous GRPO"
    python benchmarks/bench_async.py --repeats 1 --throughput-steps 6 --learning-steps 0 --no-write   # a quick look

Calculator with 0 ms and with 100 ms of tool latency (the tool sleeps, as a remote tool
would). Both learners run the same seeds, the same tasks and the same number of trained
episodes (8 tasks x 8 generations per step):

- **synchronous**: ``treerl.learners.grpo.train``, one process, torch's default threads;
- **async**: ``treerl.learners.async_grpo.train_async`` with one generator process and the
  trainer, one torch thread each (the machine's two cores split between them), at the
  default ``max_staleness``.

Throughput: ``--repeats`` pairs of runs of ``--throughput-steps`` steps, sync and async
alternating so they see the same machine; episodes/s over steps 2..N (the first step of
either is warm-up: process start, first weights) and over the whole ``train`` call. The
ratio is the median over pairs. Learning: one run of each of ``--learning-steps`` steps
(the CLI default, 60) with held-out success on 64 Calculator episodes before and after.
Each run is a fresh interpreter (``--one``), this file run by path.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from treerl.envs.builtin.calculator import CalculatorEnv  # noqa: E402
from treerl.envs.builtin.calculator_tasks import calculator  # noqa: E402
from treerl.envs.tools import tool  # noqa: E402

SECTION = "## AsyncGRPO vs synchronous GRPO"
TASKS, GROUP = 8, 8


class LatencyCalculatorEnv(CalculatorEnv):
    """Calculator whose tool answers after ``latency`` seconds, as a remote tool would."""

    def __init__(self, latency: float = 0.0, **kwargs):
        @tool(name="calculator", timeout=5.0)
        async def slow_calculator(expression: str) -> str:
            """Evaluate an arithmetic expression.

            Args:
                expression: Arithmetic using numbers, + - * / and parentheses, e.g. "(3 + 4) * 2".
            """
            await asyncio.sleep(latency)
            return calculator(expression)

        super().__init__(tools=[slow_calculator], **kwargs)


def one(kind: str, latency: float, steps: int, eval_episodes: int, seed: int, out: Path) -> dict:
    """One run in this interpreter; returns its figures."""
    from treerl.learners.async_grpo import AsyncGRPOConfig, train_async
    from treerl.learners.grpo import GRPOConfig, train

    common = dict(output_dir=str(out), steps=steps, tasks_per_step=TASKS, group_size=GROUP, seed=seed,
                  eval_episodes=eval_episodes, progress=False)
    factory = functools.partial(LatencyCalculatorEnv, latency=latency)
    start = time.perf_counter()
    if kind == "sync":
        train(GRPOConfig(**common), env_factory=factory)
    else:
        train_async(AsyncGRPOConfig(**common, num_generators=1), env_factory=factory)
    wall = time.perf_counter() - start
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    steady = sum(m["perf/step_s"] for m in metrics[1:])
    return {
        "kind": kind, "latency": latency, "steps": steps, "wall_s": wall,
        "steady_eps": (len(metrics) - 1) * TASKS * GROUP / steady if steady > 0 else 0.0,
        "whole_eps": steps * TASKS * GROUP / wall,
        "start": (summary["eval_start"] or {}).get("success_rate"),
        "end": (summary["eval_end"] or {}).get("success_rate"),
        "staleness_mean": statistics.fmean(m.get("async/staleness_mean", 0.0) for m in metrics),
        "trainer_idle": statistics.fmean(m.get("async/trainer_idle_frac", 0.0) for m in metrics[1:]) if kind == "async"
        else None,
        "generator_idle": statistics.fmean(m.get("async/generator_idle_frac", 0.0) for m in metrics[1:])
        if kind == "async" else None,
        "dropped": summary.get("async", {}).get("dropped_groups"),
        # What publishing a version costs the trainer per step: to its in-process policy (sync), or a
        # safetensors file on shared memory that the generator loads (async, timed by the pool).
        "publish_s": statistics.median(m["perf/sync_s"] for m in metrics),
        "pool_publish_s": statistics.median(m["async/weight_publish_s"] for m in metrics[1:]) if kind == "async"
        else None,
    }


def spawn(kind: str, latency: float, steps: int, eval_episodes: int, seed: int, workdir: Path) -> dict:
    out = workdir / f"{kind}-{latency}-{steps}-{time.monotonic_ns()}"
    proc = subprocess.run([sys.executable, __file__, "--one", kind, "--latency", str(latency), "--steps", str(steps),
                           "--eval-episodes", str(eval_episodes), "--seed", str(seed), "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_average() -> str:
    try:
        return " / ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--throughput-steps", type=int, default=10)
    parser.add_argument("--learning-steps", type=int, default=60, help="0 skips the learning runs.")
    parser.add_argument("--learning-latencies", type=float, nargs="+", default=None,
                        help="Tool latencies of the learning runs (default: every --latencies).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="Print without updating BENCHMARKS.md.")
    parser.add_argument("--report-from", type=Path, nargs="+", default=None,
                        help="Write the section from the per-run lines these runs printed on stderr instead of "
                             "running (e.g. throughput and learning measured by two commands).")
    parser.add_argument("--command", default=None, help="With --report-from: the commands that measured them.")
    parser.add_argument("--note", default="", help="A sentence added after the command (e.g. the machine's load).")
    parser.add_argument("--one", choices=["sync", "async"], help=argparse.SUPPRESS)
    parser.add_argument("--latency", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--eval-episodes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.latency, args.steps, args.eval_episodes, args.seed, args.out)))
        return

    if args.report_from:
        rows, learning, loads = from_logs(args.report_from)
        command = args.command or " and ".join(f"the runs logged in {p.name}" for p in args.report_from)
    else:
        rows, learning, loads = measure(args)
        command = (f"`python benchmarks/bench_async.py --latencies {' '.join(f'{x:g}' for x in args.latencies)} "
                   f"--repeats {args.repeats} --throughput-steps {args.throughput_steps} --learning-steps "
                   f"{args.learning_steps}"
                   + (f" --learning-latencies {' '.join(f'{x:g}' for x in args.learning_latencies)}"
                      if args.learning_latencies else "") + (f" --seed {args.seed}" if args.seed else "") + "`")
    body = render(rows, learning, loads, command, args.note, args.seed)
    print(body)
    if not args.no_write:
        from _common import write_section

        write_section(SECTION, body)


def from_logs(paths: list[Path]) -> tuple[list, list, list[str]]:
    """Throughput pairs and learning runs from the JSON lines a measuring run printed on stderr."""
    pairs: dict[float, list] = {}
    learning, loads = [], []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.startswith('{"load"'):
                loads.append(json.loads(line)["load"])
            if not line.startswith('{"sync"'):
                continue
            record = json.loads(line)
            s, a = record["sync"], record["async"]
            if s["start"] is None:  # no held-out evaluation: a throughput pair
                pairs.setdefault(s["latency"], []).append((s, a))
            else:
                learning.append((s["latency"], s, a))
    return sorted(pairs.items()), learning, loads or ["not recorded in the logs"]


def measure(args: argparse.Namespace) -> tuple[list, list, list[str]]:
    loads = [load_average()]
    rows, learning = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for latency in args.latencies:
            pairs = []
            for _ in range(args.repeats):
                s = spawn("sync", latency, args.throughput_steps, 0, args.seed, Path(tmp))
                a = spawn("async", latency, args.throughput_steps, 0, args.seed, Path(tmp))
                pairs.append((s, a))
                print(json.dumps({"sync": s, "async": a}), file=sys.stderr)
            rows.append((latency, pairs))
            loads.append(load_average())
        # Throughput at every latency first, then the (much longer) learning runs.
        for latency in (args.learning_latencies or args.latencies) if args.learning_steps else ():
            s = spawn("sync", latency, args.learning_steps, 64, args.seed, Path(tmp))
            a = spawn("async", latency, args.learning_steps, 64, args.seed, Path(tmp))
            learning.append((latency, s, a))
            print(json.dumps({"sync": s, "async": a}), file=sys.stderr)
            loads.append(load_average())
            print(json.dumps({"load": loads[-1]}), file=sys.stderr)
    return rows, learning, loads


def render(rows: list, learning: list, loads: list[str], command: str, note: str, seed: int) -> str:
    med = statistics.median
    rows = [(latency, pairs) for latency, pairs in rows if pairs]  # --repeats 0: learning runs only
    lines = [
        f"Command: {command} (run {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPU cores shared "
        f"with other engineers' jobs; load average (1/5/15 min) sampled between runs: {', '.join(loads)}). {note}",
        f"Calculator, {TASKS} tasks x {GROUP} generations per step, seed {seed}, shipped tiny model, every other "
        "option at its default. Sync: `train`, one process, torch's default threads. Async: `train_async`, one "
        "generator process + the trainer, one torch thread each, default max_staleness (2), score centering.",
        "Episodes/s: trained episodes per wall second over steps 2..N (steady) and over the whole `train` call "
        "(with process start and first weights); median over the pairs, each pair run back to back.",
        "",
        "| tool latency | sync episodes/s (steady) | async episodes/s (steady) | **ratio (steady)** | "
        "ratio (whole call) | async trainer idle | async generator idle | mean staleness | weight publish per step, "
        "sync / async | target |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for latency, pairs in rows:
        ratio = med(a["steady_eps"] / s["steady_eps"] for s, a in pairs)
        whole = med(a["whole_eps"] / s["whole_eps"] for s, a in pairs)
        target = ">= 1.6x" if latency >= 0.1 else "-"
        lines.append(
            f"| {latency * 1000:.0f} ms | {med(s['steady_eps'] for s, _ in pairs):.1f} | "
            f"{med(a['steady_eps'] for _, a in pairs):.1f} | **{ratio:.2f}x** | {whole:.2f}x | "
            f"{med(a['trainer_idle'] for _, a in pairs):.0%} | {med(a['generator_idle'] for _, a in pairs):.0%} | "
            f"{med(a['staleness_mean'] for _, a in pairs):.2f} | "
            f"{med(s['publish_s'] for s, _ in pairs) * 1000:.0f} ms / "
            f"{med(a['publish_s'] for _, a in pairs) * 1000:.0f} ms | {target} |")
    publish = [a["pool_publish_s"] for _, pairs in rows for _, a in pairs] or [float("nan")]
    lines.append("")
    lines.append("Weight publish per step: the trainer's `perf/sync_s`, median over steps and pairs (sync: into the "
                 "sampler's in-process copy; async: a safetensors file on `/dev/shm`, of which the pool's own "
                 f"`async/weight_publish_s` is {med(publish) * 1000:.0f} ms); the generator loads it between batches.")
    lines.append("")
    lines.append("Per pair (steady ratio): " + "; ".join(
        f"{latency * 1000:.0f} ms: " + ", ".join(f"{a['steady_eps'] / s['steady_eps']:.2f}x" for s, a in pairs)
        for latency, pairs in rows))
    if learning:
        lines += [
            "",
            f"Held-out success (64 Calculator episodes, task seeds 10000-10063, temperature 1.0) after "
            f"{learning[0][1]['steps']} steps, same seed, same trained episodes:",
            "",
            "| tool latency | sync: start -> end | async: start -> end | async - sync at the end | sync wall | "
            "async wall | episodes/s async / sync (steady) | async groups dropped | target |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for latency, s, a in learning:
            lines.append(
                f"| {latency * 1000:.0f} ms | {s['start']:.1%} -> {s['end']:.1%} | "
                f"{a['start']:.1%} -> {a['end']:.1%} | "
                f"**{(a['end'] - s['end']) * 100:+.1f} points** | {s['wall_s'] / 60:.1f} min | {a['wall_s'] / 60:.1f} "
                f"min | {a['steady_eps'] / s['steady_eps']:.2f}x | {a['dropped']} | async within 5 points of sync "
                "or better |")
    lines += [
        "",
        "What a GPU deployment with vLLM generators changes: here one generator and the trainer share two CPU cores, "
        "and the tiny model's decoding is bound by per-step overhead; what async can gain is generating while the "
        "trainer trains, several steps' episodes in one batch, and tool latency hidden behind other episodes, "
        "while the two processes compete for the same two cores. With "
        "vLLM generators on their own GPUs (`--generator-policy vllm`, or Ray actors with `--device cuda`), decoding "
        "is continuous-batched and far cheaper per token than training, so the trainer's step time sets the pace and "
        "the generators' job is to keep the buffer full at the staleness bound; the number of generators is then "
        "sized so that they produce `tasks_per_step` groups per trainer step. Weights no longer fit a file on "
        "shared memory cheaply (15 GB for a 7B model in bf16): they go through vLLM's weight-update path "
        "(`--generator-policy vllm` sends them with `collective_rpc`), Ray's object store, or an NCCL broadcast "
        "from the trainer's GPU to each generator's (`--weight-transport broadcast`; measured here only with gloo "
        "on CPU: no GPU on this machine). The publish time (`async/weight_publish_s`, "
        f"{med(publish) * 1000:.0f} ms for the tiny model here) becomes a real cost that the staleness bound must "
        "cover. The trainer scales on its own GPUs under `accelerate launch` (rank 0 feeds every rank its share of "
        "each step's groups).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
