"""Reading a trajectory file back: ``read_all_groups`` vs ``list(read_groups(...))``.

    python benchmarks/bench_read_groups.py     # writes the "## Reading trajectory files" section

Writes ``--groups`` synthetic groups (default 3,000) shaped like multi-turn tool-use rollouts:
a 120-token prompt, ``--group-size`` episodes of 3 turns (10-60 sampled tokens with their
log-probs, a 15-token tool result), messages and tool-call records. Then reads the file
``--runs`` times each way after a warm-up, the two sides alternating in one process; the
heap is collected before every read, so each starts from the same state. Times are process
CPU time; the ratio is the median of the per-run ratios. Both sides must read the same groups
(checked: the same JSON, line for line).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, write_section  # noqa: E402

from treerl.rollout.trajectory import Group, GroupWriter, read_all_groups, read_groups  # noqa: E402

SECTION = "## Reading trajectory files"


def make_group(rng: random.Random, index: int, group_size: int, turns: int = 3) -> Group:
    g = Group(task_key=f"task-{index}", env_id="bench", info={"task_seed": index})
    root = g.add_segment("prompt", [rng.randrange(32_000) for _ in range(120)])
    for _ in range(group_size):
        parent, messages, calls = root, [{"role": "user", "content": "question"}], []
        for _ in range(turns):
            n = rng.randrange(10, 60)
            sampled = g.add_segment("sampled", [rng.randrange(32_000) for _ in range(n)], parent=parent,
                                    logprobs=[-rng.random() for _ in range(n)], policy_version=0,
                                    finish_reason="stop")
            messages.append({"role": "assistant", "content": "x" * n})
            calls.append({"name": "calculator", "arguments": {"expression": "1 + 2"}, "segment": sampled})
            parent = g.add_segment("env", [rng.randrange(32_000) for _ in range(15)], parent=sampled)
            messages.append({"role": "tool", "content": "3"})
        g.add_episode(leaf=parent, reward=rng.random(), rewards=[0.0, 1.0], messages=messages, tool_calls=calls,
                      termination="terminated", metrics={"turns": turns})
    return g


def full_collections() -> int:
    return gc.get_stats()[2]["collections"]


def timed(read, path: Path) -> tuple[float, int, list[Group]]:
    gc.collect()
    passes = full_collections()
    start = time.process_time()
    groups = read(path)
    return time.process_time() - start, full_collections() - passes, groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=3000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing BENCHMARKS.md")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    sides = {"list(read_groups(path))": lambda p: list(read_groups(p)), "read_all_groups(path)": read_all_groups}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "groups.jsonl"
        rng = random.Random(0)
        with GroupWriter(path) as writer:
            for i in range(args.groups):
                writer.write(make_group(rng, i, args.group_size))
        size_mib = path.stat().st_size / 2**20
        before, after = (read(path) for read in sides.values())
        assert [g.to_json() for g in before] == [g.to_json() for g in after], "the two sides read different groups"
        del before, after
        times: dict[str, list[float]] = {name: [] for name in sides}
        passes: dict[str, list[int]] = {name: [] for name in sides}
        for run in range(args.runs):
            for name, read in sides.items():
                seconds, full, groups = timed(read, path)
                del groups
                times[name].append(seconds)
                passes[name].append(full)
                print(f"run {run + 1}: {name} {seconds:.2f} s, {full} full collections", flush=True)
    load_after = os.getloadavg()[0]
    old, new = sides
    ratios = [b / a for a, b in zip(times[old], times[new])]
    rows = "\n".join(f"| `{name}` | {statistics.median(times[name]):.2f} s | {statistics.median(passes[name]):.0f} | "
                     f"{'**1.00x**' if name == old else f'**{statistics.median(ratios):.2f}x**'} |" for name in sides)
    body = f"""Command: `{command_line("bench_read_groups.py")}` (run {datetime.date.today()}, Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs: load average {load_before:.1f} before, {load_after:.1f} after).
{args.groups:,} synthetic groups of {args.group_size} three-turn episodes ({args.groups * args.group_size:,} episodes, {size_mib:.0f} MiB of JSON Lines), read {args.runs} times each way after a warm-up, the two sides alternating in one process, the heap collected before each read. Time: process CPU time; the ratio is the median of the per-run ratios. Both sides read the same groups (checked).

| read | median time | full GC passes per read | time vs `list(read_groups(path))` |
|---|---:|---:|---:|
{rows}

Per-run ratios: {", ".join(f"{r:.2f}" for r in ratios)}.
The groups read are kept, so the cyclic collector's full passes, which the growing heap sets off, walk every token list read so far and free nothing (each group is a cycle, its episodes referring back to it: the back-reference serves `Episode.token_ids` and the other per-episode views, so it stays). `read_all_groups` reads with automatic collection paused; while it runs only its own parsing runs, which leaves no cyclic garbage. `read_groups` itself is unchanged (it yields to the caller's code, whose garbage the collector must still see); the learner's `--from-rollouts` source, `treerl serve --out`'s resume and `treerl view` of a learn output directory read with `read_all_groups`."""
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
