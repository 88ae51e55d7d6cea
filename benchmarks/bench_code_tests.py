"""What judging code by stdin/stdout cases costs against assert tests, side by side in one run.

    python benchmarks/bench_code_tests.py            # writes the "## Code tests: stdin/stdout cases vs asserts" section
    python benchmarks/bench_code_tests.py --rounds 5 --cases 3 10 30

CodeSandbox judges a task's tests in one of two ways (README, "Code tasks"):

- ``asserts``: :func:`~treerl.envs.verifiers.unit_test_results` runs the code and every
  assert test in one sandboxed process;
- ``cases``: :func:`~treerl.envs.verifiers.io_test_results` runs the code once per case, all
  cases in one sandboxed run (a harness that forks a process per case, one after another),
  and compares the output outside, where the code cannot reach the judge.

For ``N`` tests of the same function (a sum, asserted or printed), each round times one call
of each side, in alternating order; the figure is cases / asserts per round, median over
rounds, for wall time and for the CPU time of the sandboxed processes (``RUSAGE_CHILDREN``).
A last row times ``stop_at_failure`` (CodeSandbox's ``reward="all"``) against judging every
case, for a program that loops on every input under a 1 s limit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, publish

SECTION = "## Code tests: stdin/stdout cases vs asserts"
FUNCTION = "def add(a, b):\n    return a + b\n"
PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(fn) -> tuple[float, float, object]:
    cpu, start = _children_cpu(), time.perf_counter()
    out = fn()
    return time.perf_counter() - start, _children_cpu() - cpu, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", type=int, nargs="+", default=[3, 10, 30])
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing BENCHMARKS.md")
    args = ap.parse_args()

    from treerl.envs.sandbox import SandboxLimits, max_concurrent_runs
    from treerl.envs.verifiers import io_test_results, unit_test_results

    limits = SandboxLimits(timeout_s=10.0)
    unit_test_results(FUNCTION, ["assert add(1, 2) == 3"], limits=limits)  # warm-up: imports, first sandbox
    rows = []
    for n in args.cases:
        tests = [f"assert add({i}, {i + 1}) == {2 * i + 1}" for i in range(n)]
        cases = [{"input": f"{i} {i + 1}\n", "output": f"{2 * i + 1}\n"} for i in range(n)]
        sides = {"asserts": lambda: unit_test_results(FUNCTION, tests, limits=limits),
                 "cases": lambda: io_test_results(PROGRAM, cases, limits=limits)}
        per_round = []
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            timed = {}
            for name in order:
                wall, cpu, report = _timed(sides[name])
                if report.fraction != 1.0:
                    raise SystemExit(f"{name} with {n} tests did not pass: {report}")
                timed[name] = (wall, cpu)
            per_round.append(timed)
            print(f"{n} tests, round {r + 1}: {timed}", file=sys.stderr)
        rows.append((n, per_round))

    loop = "while True:\n    pass\n"
    slow = SandboxLimits(timeout_s=1.0)
    looping = [{"input": f"{i}\n", "output": f"{i}\n"} for i in range(8)]
    stop_rounds = []
    for r in range(max(args.rounds // 2, 1)):
        every = _timed(lambda: io_test_results(loop, looping, limits=slow))[0]
        first = _timed(lambda: io_test_results(loop, looping, limits=slow, stop_at_failure=True))[0]
        stop_rounds.append((every, first))
        print(f"stop_at_failure round {r + 1}: every case {every:.2f} s, stop at failure {first:.2f} s", file=sys.stderr)

    def med(values):
        return statistics.median(values)

    lines = [
        f"`{command_line('bench_code_tests.py')}` on {datetime.date.today().isoformat()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, `max_concurrent_runs()` = {max_concurrent_runs()}; load average at the end: "
        f"{os.getloadavg()[0]:.2f}. One call per side per round, sides alternating, {args.rounds} rounds; "
        "ratios are cases / asserts within a round, median over rounds. CPU: user + system time of the "
        "sandboxed processes (`RUSAGE_CHILDREN`).",
        "",
        "| tests | asserts ms | cases ms | cases / asserts (wall) | cases / asserts (CPU) | per round (wall) |",
        "|---|---|---|---|---|---|",
    ]
    for n, per_round in rows:
        wall = [r["cases"][0] / r["asserts"][0] for r in per_round]
        cpu = [r["cases"][1] / r["asserts"][1] for r in per_round]
        lines.append(f"| {n} | {med(r['asserts'][0] for r in per_round) * 1000:.0f} | "
                     f"{med(r['cases'][0] for r in per_round) * 1000:.0f} | **{med(wall):.2f}x** | {med(cpu):.2f}x | "
                     + ", ".join(f"{x:.2f}" for x in wall) + " |")
    ratios = [first / every for every, first in stop_rounds]
    lines += [
        "",
        f"A program that loops on each of 8 cases under a 1 s limit: `stop_at_failure=True` (CodeSandbox's "
        f"`reward=\"all\"`) takes **{med(ratios):.2f}x** the time of judging every case "
        f"({med(f for _, f in stop_rounds):.2f} s vs {med(e for e, _ in stop_rounds):.2f} s, median of "
        f"{len(stop_rounds)} rounds: " + ", ".join(f"{x:.2f}" for x in ratios) + ").",
        "",
        "Cases share one sandboxed run, with a process forked for each (a few ms), where asserts share "
        "one process; what it buys is a judge the code cannot reach "
        "(`tests/test_verifiers.py::test_the_unit_test_harness_can_be_fooled_and_io_tests_cannot`). "
        "The cases of a call run one after another, so a program that times out on every case takes "
        "the sum of their limits.",
    ]
    publish(SECTION, "\n".join(lines), no_write=args.no_write)


if __name__ == "__main__":
    main()
