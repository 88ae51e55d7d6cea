"""treerl view at scale: 10,000 episodes opened in headless Chromium, next to 100.

    python benchmarks/bench_view.py            # writes the "## treerl view: 10,000 episodes" section

1. Records real Calculator trajectories with the shipped tiny model (16 tasks x 8 generations,
   the engine's defaults), then repeats those groups under new task keys until the view holds
   10,000 episodes (1,250 groups), and builds a 104-episode view (13 groups) the same way.
2. Opens each page in Debian's chromium (Playwright, a fresh profile, no network), the two
   sizes alternating, and reads in the page: time from navigation start to the page being
   usable (index parsed, list rendered), time to open a group (parse its data, build the
   token-merged tree, render, lay out), time to colour every token of an expanded group,
   and time to sort the whole list. Medians of several loads.

The page's budget is 3 s for 10,000 episodes; the ratio to the 104-episode page shows how the
cost grows with the file.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from _browser import browser_missing, chromium, open_view, timed  # noqa: E402
from _common import command_line, write_section  # noqa: E402

from treerl.agents.transformers_policy import TransformersPolicy  # noqa: E402
from treerl.models import load_default_model  # noqa: E402
from treerl.rollout import read_groups  # noqa: E402
from treerl.rollout.record import RolloutConfig, record  # noqa: E402
from treerl.rollout.view import SourcedGroup, build_html, load_tokenizer  # noqa: E402

SECTION = "## treerl view: 10,000 episodes"


def recorded_groups(path: Path, num_tasks: int, group_size: int):
    model, tok = load_default_model()
    policy = TransformersPolicy(model, tok)
    try:
        record(RolloutConfig(out=str(path), num_tasks=num_tasks, group_size=group_size, progress=False), policy, tok)
    finally:
        policy.close()
    return list(read_groups(path))


def repeated(base, num_episodes: int) -> list[SourcedGroup]:
    out, episodes = [], 0
    while episodes < num_episodes:
        g = copy.copy(base[len(out) % len(base)])
        g.task_key = f"copy-{len(out)}"
        out.append(SourcedGroup(g, source="bench"))
        episodes += len(g.episodes)
    return out


def measure(context, url: str, num_groups: int) -> dict[str, float]:
    page, errors, requests, ready = open_view(context, url)
    group = timed(page, "open", num_groups - 1)
    page.click("#expand-all")
    colour = timed(page, "colour", "logprob")
    sort = timed(page, "sort", "reward_mean")
    tokens = page.locator(".text .tok").count()
    page.close()
    if errors or len(requests) != 1:
        raise SystemExit(f"the page logged errors {errors} or requested {requests}")
    return {"ready": ready, "group": group, "colour": colour, "sort": sort, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="Page loads per size.")
    parser.add_argument("--no-write", action="store_true", help="Print without updating BENCHMARKS.md.")
    args = parser.parse_args()
    if (reason := browser_missing()) is not None:
        raise SystemExit(f"no browser: {reason}")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        base = recorded_groups(tmp / "r.jsonl", num_tasks=16, group_size=8)
        record_s = time.perf_counter() - start
        tok = load_tokenizer(None)
        sizes = {}
        for name, episodes in (("small", 100), ("large", 10_000)):
            groups = repeated(base, episodes)
            start = time.perf_counter()
            page = build_html(groups, tok, title=f"{episodes} episodes")
            build_s = time.perf_counter() - start
            path = tmp / f"{name}.html"
            path.write_text(page, encoding="utf-8")
            sizes[name] = {"groups": len(groups), "episodes": sum(len(g.group.episodes) for g in groups),
                           "mib": path.stat().st_size / 2**20, "build_s": build_s, "url": path.resolve().as_uri(),
                           "runs": []}
        with chromium() as context:
            for _ in range(args.repeats):  # the sizes alternate, so both see the same machine load
                for size in sizes.values():
                    size["runs"].append(measure(context, size["url"], size["groups"]))
    load_after = os.getloadavg()[0]

    def med(size: dict, key: str) -> float:
        return statistics.median(r[key] for r in size["runs"])

    small, large = sizes["small"], sizes["large"]
    rows = [
        "| page | groups | episodes | file | Python build | ready (navigation start to usable) | open a group | "
        "colour its tokens | sort the list |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in (("small", small), ("large", large)):
        rows.append(f"| {name} | {s['groups']:,} | {s['episodes']:,} | {s['mib']:.1f} MiB | {s['build_s']:.1f} s | "
                    f"**{med(s, 'ready'):.0f} ms** | {med(s, 'group'):.0f} ms | {med(s, 'colour'):.0f} ms "
                    f"({s['runs'][0]['tokens']} tokens) | {med(s, 'sort'):.1f} ms |")
    ratio = med(large, "ready") / med(small, "ready")
    worst = max(r["ready"] for r in large["runs"])
    body = "\n".join([
        f"Command: `{command_line('bench_view.py')}` (run {datetime.date.today()}, {platform.machine()}, "
        f"2 CPU cores shared with other jobs: load average {load_before:.1f} before, {load_after:.1f} after), "
        "Debian's chromium headless through Playwright.",
        "",
        f"Trajectories: {len(base)} real Calculator groups of 8 episodes recorded with the shipped tiny model "
        f"({record_s:.0f} s), repeated under new task keys. Times are read in the page with performance.now(), "
        f"medians of {args.repeats} loads per size, the sizes alternating.",
        "",
        *rows,
        "",
        f"10,000 episodes are usable {med(large, 'ready') / 1000:.2f} s after navigation starts (slowest of "
        f"{args.repeats} loads: {worst / 1000:.2f} s; budget 3 s), {ratio:.1f}x the time of the 104-episode page "
        f"for {large['episodes'] / small['episodes']:.0f}x the episodes: the page parses only the small index up "
        "front, keeps every group's data as text until it is opened, and renders only the list rows in view.",
        "`tests/test_view.py::test_ten_thousand_episodes_open_in_under_3_s` checks the same budget on every test run.",
    ])
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
