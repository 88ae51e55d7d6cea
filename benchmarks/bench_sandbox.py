"""What the sandbox's isolation costs per call: this tree against the sandbox before it, side by side.

    python benchmarks/bench_sandbox.py            # writes the "## Sandbox: cost per call" section of BENCHMARKS.md
    python benchmarks/bench_sandbox.py --baseline REV --rounds 7 --calls 15

The baseline is the project at ``REV`` (default: the commit before the namespaces, cgroup
and result-pipe sandbox came in), unpacked with ``git archive`` into a temporary
directory. Each round starts one measuring process per side (this script with
``--measure``, the side's tree first on ``PYTHONPATH``), in alternating order; each does
two warm-up calls, then ``--calls`` timed calls of each workload, and reports medians:

- ``pass``: ``run_python("pass")``, the fixed cost of one sandboxed run;
- ``unit tests``: ``unit_test_results`` of a small function against three asserts, the
  CodeSandbox verifier's call.

The figure is the ratio new / baseline per round (median over rounds, with the spread),
for wall time and for the CPU time of the sandbox's own processes (``RUSAGE_CHILDREN``);
absolute milliseconds are shown too but depend on the machine's load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import publish

SECTION = "## Sandbox: cost per call"
CODE = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def measure(calls: int) -> tuple[dict[str, float], str]:
    """In a measuring process: median seconds per call of each workload with the importable treerl."""
    import treerl.envs.sandbox
    from treerl.envs.sandbox import SandboxLimits, run_python
    from treerl.envs.verifiers import unit_test_results

    limits = SandboxLimits(timeout_s=10.0)
    workloads = {
        "pass": lambda: run_python("pass", limits=limits),
        "unit tests": lambda: unit_test_results(CODE, TESTS, limits=limits),
    }
    out = {}
    for name, fn in workloads.items():
        for _ in range(2):
            fn()
        walls, cpus = [], []
        for _ in range(calls):
            before = _children_cpu()
            start = time.perf_counter()
            result = fn()
            walls.append(time.perf_counter() - start)
            cpus.append(_children_cpu() - before)
        ok = result.ok if name == "pass" else result.fraction == 1.0
        if not ok:
            raise SystemExit(f"the {name!r} workload failed on this side: {result}")
        out[name] = statistics.median(walls)
        out[name + " (CPU)"] = statistics.median(cpus)
    return out, treerl.envs.sandbox.__file__


def _children_cpu() -> float:
    """User + system seconds of every reaped descendant: the sandboxed processes' own work, less
    sensitive to a loaded machine than wall time (the parent's own share is not in it)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def baseline_commit(rev: str | None) -> str:
    if rev:
        return subprocess.check_output(["git", "rev-parse", rev], cwd=ROOT, text=True).strip()
    first = subprocess.check_output(
        ["git", "log", "--diff-filter=A", "--format=%H", "--", "treerl/envs/sandbox_cgroup.py"], cwd=ROOT, text=True
    ).split()
    if not first:
        raise SystemExit("no commit adds treerl/envs/sandbox_cgroup.py; pass --baseline REV")
    return subprocess.check_output(["git", "rev-parse", first[-1] + "^"], cwd=ROOT, text=True).strip()


def unpack(commit: str, into: Path) -> Path:
    archive = into / "tree.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", commit, "treerl"], cwd=ROOT, stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def run_side(tree: Path, calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--measure", str(calls)], env=env, cwd=tree,
                         capture_output=True, text=True, check=True)
    timings, module = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(module).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"the measuring process imported {module}, not the sandbox of {tree}")
    return timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=None, help="the commit to compare against (default: see above)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=11)
    ap.add_argument("--measure", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing BENCHMARKS.md")
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    commit = baseline_commit(args.baseline)
    with tempfile.TemporaryDirectory(prefix="treerl-bench-sandbox-") as tmp:
        base_tree = unpack(commit, Path(tmp))
        rounds = []
        for i in range(args.rounds):
            sides = [("baseline", base_tree), ("new", ROOT)]
            if i % 2:
                sides.reverse()
            rounds.append({name: run_side(tree, args.calls) for name, tree in sides})
            print(f"round {i + 1}: {rounds[-1]}", file=sys.stderr)
    from treerl.envs.sandbox import sandbox_capabilities

    caps = sandbox_capabilities()
    lines = [
        f"`python benchmarks/bench_sandbox.py --rounds {args.rounds} --calls {args.calls}` on "
        f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} CPUs, running as "
        f"{'root' if os.geteuid() == 0 else 'a plain user'}; baseline `{commit[:12]}` (the sandbox before its own "
        "filesystem view, pid namespace, whole-run cgroup and result pipe). Median seconds per call within a round "
        f"({args.calls} calls after 2 warm-ups), then the median over {args.rounds} rounds, sides alternating; "
        f"load average at the end: {os.getloadavg()[0]:.2f}. Rows marked (CPU): user + system time of the "
        "sandbox's own processes per call (`RUSAGE_CHILDREN`), which a loaded machine disturbs less than wall time.",
        "",
        "| workload | baseline ms | new ms | new / baseline (median) | per round |",
        "|---|---|---|---|---|",
    ]
    for name in rounds[0]["new"]:
        ratios = [r["new"][name] / r["baseline"][name] for r in rounds]
        base_ms = statistics.median(r["baseline"][name] for r in rounds) * 1000
        new_ms = statistics.median(r["new"][name] for r in rounds) * 1000
        lines.append(f"| `{name}` | {base_ms:.1f} | {new_ms:.1f} | **{statistics.median(ratios):.2f}x** | "
                     + ", ".join(f"{x:.2f}" for x in ratios) + " |")
    lines += ["", "What the new side enforced on this machine (`sandbox_capabilities()`):", ""]
    # The interpreter's path names this machine's checkout: keep only what it is.
    lines += [f"- `{key}`: {value.replace(sys.executable, 'the project venv python') if isinstance(value, str) else value}"
              for key, value in caps.items()]
    publish(SECTION, "\n".join(lines), no_write=args.no_write)


if __name__ == "__main__":
    main()
