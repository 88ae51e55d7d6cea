"""The README's two pictures, from a finished `treerl learn` run (the main job):

    treerl learn --env treerl/Calculator-v0 --output-dir runs/calc
    python docs/screenshots.py runs/calc

writes ``docs/view-tree.png`` (``treerl view runs/calc`` in headless Chromium: the last sampled
step's group whose rewards differ most, its branches open, tokens coloured by the sampler's
log-prob) and ``docs/reward.png`` (the reward plot ``treerl learn`` drew into ``runs/calc/plots``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _browser import browser_missing, chromium, open_view  # noqa: E402

from treerl.rollout.view import ViewConfig, group_row, load_groups, write_view  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    if (reason := browser_missing()) is not None:
        raise SystemExit(f"no browser: {reason}")
    reward_plot = args.run_dir / "plots" / "reward.png"
    if not reward_plot.is_file():
        raise SystemExit(f"{reward_plot} is missing: run `treerl plot {args.run_dir}` (needs treerl[plot]).")

    html, _ = write_view(ViewConfig(paths=[str(args.run_dir)], out=str(args.run_dir / "view.html")))
    groups = load_groups([args.run_dir])
    last = max(sg.step for sg in groups)
    pick = max((i for i, sg in enumerate(groups) if sg.step == last),
               key=lambda i: (group_row(groups[i].group)["reward_std"], -i))
    args.out.mkdir(parents=True, exist_ok=True)
    with chromium(width=1400, height=900) as context:
        page, errors, _, _ = open_view(context, html.resolve().as_uri())
        page.evaluate("(g) => TV.select(g)", pick)
        page.click("#expand-all")
        page.click("button.colour[data-colour=logprob]")
        page.screenshot(path=str(args.out / "view-tree.png"))
        if errors:
            raise SystemExit(f"the page logged errors: {errors}")
    shutil.copyfile(reward_plot, args.out / "reward.png")
    for name in ("view-tree.png", "reward.png"):
        print(args.out / name, f"{(args.out / name).stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
