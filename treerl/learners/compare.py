"""``treerl compare runs/a runs/b``: the final figures of learn runs side by side, and how their configs differ.

A step's metrics are noisy, so a metric's "final" value is its mean over the last ``last``
steps that logged it; held-out success comes from ``summary.json`` (start and end), time
from the steps' own ``perf/step_s``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treerl.config import field_help
from treerl.learners.checkpoints import run_settings
from treerl.learners.plots import RunRecord, read_run, run_names
from treerl.rollout.summary import format_table

__all__ = ["CompareConfig", "compare_runs", "compare_table", "FINAL_METRICS"]

FINAL_METRICS = (
    "reward/mean", "reward/std", "reward/success_rate", "tools/invalid_rate", "loss/policy", "entropy/mean",
    "clip/region_frac", "clip/low_frac", "clip/high_frac", "is/ratio_mean", "is/ratio_max", "is/truncated_frac",
    "grad/norm", "tree/packing_ratio", "perf/tokens_per_s", "perf/rollout_s", "perf/step_s",
)
"""The metrics compared, in this order (those no run logged are left out)."""


@dataclass
class CompareConfig:
    """Options of ``treerl compare``."""

    paths: list[str] = field_help(help="Learn output directories to compare.", default_factory=list,
                                  metadata={"cli": False})
    last: int = field_help(5, "Average each metric over the last N steps that logged it.")
    json: bool = field_help(False, "Print the comparison as JSON.")

    def __post_init__(self) -> None:
        if len(self.paths) < 1:
            raise ValueError("paths: name at least one run directory (treerl compare runs/a runs/b).")
        if self.last < 1:
            raise ValueError(f"last={self.last} must be >= 1 (the steps each final value averages).")


def _final(run: RunRecord, key: str, last: int) -> float | None:
    _, values = run.series(key)
    return sum(values[-last:]) / len(values[-last:]) if values else None


def compare_runs(paths: Sequence[str | os.PathLike], last: int = 5) -> dict[str, Any]:
    """Per run: steps, held-out success at start and end, final metrics, total time, differing config."""
    runs = [read_run(p, n) for p, n in zip(paths, run_names(paths))]
    out: dict[str, Any] = {"last": last, "runs": {}}
    configs = {}
    for run in runs:
        configs[run.name] = run_settings(run.path) or {}  # config.json (or summary.json's copy)
        start, end = run.eval_start, run.eval_end
        out["runs"][run.name] = {
            "path": str(run.path),
            "steps": max((m["step"] for m in run.metrics), default=0),
            "eval/success_start": start["success_rate"] if start else None,
            "eval/success_end": end["success_rate"] if end else None,
            "time/steps_s": sum(run.series("perf/step_s")[1]),  # the steps alone: no model load or evaluation
            **{key: _final(run, key, last) for key in FINAL_METRICS},
        }
    keys = sorted({k for c in configs.values() for k in c})
    out["config_differences"] = {
        k: {name: configs[name].get(k) for name in configs} for k in keys
        if len({json.dumps(configs[name].get(k), sort_keys=True) for name in configs}) > 1
    }
    return out


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key.startswith("eval/") or key.endswith(("_rate", "_frac")):
        return f"{value:.1%}"
    if key == "steps":
        return str(value)
    if key.endswith("_s") and not key.endswith("per_s"):  # seconds, not a rate
        return f"{value:.2f} s" if value < 100 else f"{value:.0f} s"
    return f"{value:.4g}"


def compare_table(paths: Sequence[str | os.PathLike], last: int = 5) -> str:
    """The side-by-side table ``treerl compare`` prints."""
    data = compare_runs(paths, last)
    names = list(data["runs"])
    keys = ["steps", "eval/success_start", "eval/success_end", "time/steps_s",
            *[k for k in FINAL_METRICS if any(data["runs"][n][k] is not None for n in names)]]
    rows = [[k, *(_cell(k, data["runs"][n][k]) for n in names)] for k in keys]
    text = format_table([f"metric (last {last} steps)", *names], rows)
    if data["config_differences"]:
        diff_rows = [[k, *(json.dumps(v[n]) for n in names)] for k, v in data["config_differences"].items()
                     if k != "output_dir"]
        if diff_rows:
            text += "\n\n" + format_table(["config (differing)", *names], diff_rows)
    return text

