"""Plots of learn runs, drawn from their ``metrics.jsonl`` and ``summary.json`` (matplotlib, optional).

:func:`write_plots` draws one PNG per subject; with several runs each figure overlays them:

- ``reward.png``: reward mean per step (with its moving average) and the step's success rate
  (when it differs from the reward);
  held-out success at the start and the end as markers;
- ``tool_calls.png``: tool-call outcomes per step, as fractions of the step's calls;
- ``entropy.png``: the trained tokens' mean entropy;
- ``clip_is.png``: clipped fractions of the loss, and the sampler/trainer importance ratios;
- ``packing.png``: the tree packing ratio;
- ``step_time.png``: each step's time split into rollout, train and weight sync.

``treerl learn`` draws them into ``output_dir/plots`` at the end, ``treerl plot runs/a
[runs/b ...]`` redraws and overlays. matplotlib is the optional extra ``treerl[plot]``; without
it :class:`MatplotlibMissing` says what to install. The figures use matplotlib's object API
(no pyplot), so drawing never touches a user's interactive backend.

>>> moving_average([1.0, 3.0, 5.0, 7.0], 2)
[1.0, 2.0, 4.0, 6.0]
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treerl.config import field_help
from treerl.errors import ConfigError

__all__ = ["PlotConfig", "MatplotlibMissing", "RunRecord", "read_run", "write_plots", "moving_average", "PLOTS"]

PLOTS = ("reward", "tool_calls", "entropy", "clip_is", "packing", "step_time")

OUTCOME_COLOURS = {"ok": "#2a9d55", "no_call": "#8c8c8c", "malformed": "#d62728", "unknown_tool": "#9467bd",
                   "invalid_arguments": "#ff7f0e", "tool_error": "#8c564b", "timeout": "#e377c2"}
RUN_STYLES = ("-", "--", ":", "-.")


@dataclass
class PlotConfig:
    """Options of ``treerl plot``."""

    paths: list[str] = field_help(help="Learn output directories; several are overlaid.", default_factory=list,
                                  metadata={"cli": False})
    out: str | None = field_help(None, "Folder for the PNG files (default: RUN/plots for one run, ./plots for "
                                       "several).")

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("paths: name at least one learn output directory (treerl plot runs/a [runs/b ...]).")


class MatplotlibMissing(ConfigError):
    """Plots need matplotlib, which is the optional extra ``treerl[plot]``."""


@dataclass
class RunRecord:
    """What a learn output directory says about its run."""

    name: str
    path: Path
    metrics: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, over the steps that logged it."""
        pairs = [(m["step"], float(m[key])) for m in self.metrics if isinstance(m.get(key), (int, float))]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def keys(self) -> set[str]:
        return {k for m in self.metrics for k in m}

    @property
    def eval_start(self) -> dict[str, Any] | None:
        if self.summary.get("eval_start"):
            return self.summary["eval_start"]
        start = self.path / "eval_start.json"  # a run still going, or stopped before its summary
        return json.loads(start.read_text()) if start.is_file() else None

    @property
    def eval_end(self) -> dict[str, Any] | None:
        return self.summary.get("eval_end")


def read_run(path: str | os.PathLike, name: str | None = None) -> RunRecord:
    """Read a learn output directory (``metrics.jsonl``, and ``summary.json`` when the run finished)."""
    path = Path(path)
    metrics_file = path / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ConfigError(f"{path}: no metrics.jsonl; pass the --output-dir of a `treerl learn` run.")
    metrics = []
    for line in metrics_file.read_text(encoding="utf-8").splitlines():
        try:
            metrics.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
    summary_file = path / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    return RunRecord(name=name or path.name, path=path, metrics=metrics, summary=summary)


def run_names(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Short labels for runs: the directory name, or more of the path where names repeat."""
    names = [Path(p).name or str(p) for p in paths]
    if len(set(names)) < len(names):
        names = [str(p) for p in paths]
    return names


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over at most ``window`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MatplotlibMissing("plots need matplotlib: pip install 'treerl[plot]' (or pip install matplotlib), "
                                "then redraw them with `treerl plot RUN_DIR`.") from None
    return Figure, FigureCanvasAgg


def write_plots(paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike | None = None, *,
                dpi: int = 110) -> list[Path]:
    """Draw the plots of one or more runs (overlaid) into ``out_dir``; returns the files written.

    ``out_dir`` defaults to ``RUN/plots`` for one run and to ``plots`` (here) for several.
    """
    if not paths:
        raise ConfigError("treerl plot needs at least one run directory (the --output-dir of `treerl learn`).")
    Figure, FigureCanvasAgg = _matplotlib()
    runs = [read_run(p, n) for p, n in zip(paths, run_names(paths))]
    out = Path(out_dir) if out_dir is not None else (runs[0].path / "plots" if len(runs) == 1 else Path("plots"))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in PLOTS:
        fig = Figure(figsize=(7.5, 4.2) if name != "step_time" else (7.5, 2.6 + 1.6 * len(runs)),
                     layout="constrained")
        FigureCanvasAgg(fig)
        _DRAW[name](fig, runs)
        fig.savefig(out / f"{name}.png", dpi=dpi)
        written.append(out / f"{name}.png")
    return written


# -- the figures ---------------------------------------------------------------------------------


def _style(i: int) -> str:
    return RUN_STYLES[i % len(RUN_STYLES)]


def _label(runs: Sequence[RunRecord], run: RunRecord, what: str) -> str:
    return what if len(runs) == 1 else f"{run.name}: {what}"


def _finish_axes(ax, title: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _draw_reward(fig, runs: Sequence[RunRecord]) -> None:
    ax = fig.subplots()
    colours = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
    for i, run in enumerate(runs):
        colour = colours[i % len(colours)]
        steps, reward = run.series("reward/mean")
        if steps:
            window = max(1, len(steps) // 10)
            ax.plot(steps, reward, color=colour, alpha=0.25, linewidth=1)
            ax.plot(steps, moving_average(reward, window), color=colour, linewidth=2,
                    label=_label(runs, run, f"reward (mean over {window} steps)" if window > 1 else "reward"))
        success_steps, success = run.series("reward/success_rate")
        if success_steps and (success_steps, success) != (steps, reward):  # 0/1 rewards: the same line twice
            ax.plot(success_steps, moving_average(success, max(1, len(success_steps) // 10)), color=colour,
                    linestyle="--", linewidth=1.2, label=_label(runs, run, "training success rate"))
        last = max((m["step"] for m in run.metrics), default=0)
        for step, ev, marker in ((0, run.eval_start, "o"), (last, run.eval_end, "s")):
            if ev:
                ax.plot([step], [ev["success_rate"]], marker=marker, color=colour, markersize=8, linestyle="none",
                        markeredgecolor="black")
                ax.annotate(_label(runs, run, f"held-out {ev['success_rate']:.0%}"), (step, ev["success_rate"]),
                            textcoords="offset points", xytext=(6, -12 if step == 0 else 6), fontsize=8)
    ax.set_ylim(-0.02, 1.05)
    _finish_axes(ax, "Reward and success (markers: held-out success at start and end)", "reward / rate")


def _draw_tool_calls(fig, runs: Sequence[RunRecord]) -> None:
    ax = fig.subplots()
    for i, run in enumerate(runs):
        kinds = sorted(k.removeprefix("tool_calls/") for k in run.keys() if k.startswith("tool_calls/"))
        # A step logs the outcomes it saw: an outcome it did not log had 0 calls that step.
        logged = [m for m in run.metrics if any(f"tool_calls/{k}" in m for k in kinds)]
        steps = [m["step"] for m in logged]
        totals = [sum(float(m.get(f"tool_calls/{k}", 0.0)) for k in kinds) for m in logged]
        for kind in kinds:
            fractions = [float(m.get(f"tool_calls/{kind}", 0.0)) / t if t else 0.0 for m, t in zip(logged, totals)]
            ax.plot(steps, fractions, color=OUTCOME_COLOURS.get(kind, "#333333"), linestyle=_style(i),
                    label=_label(runs, run, kind))
        if not kinds:  # runs logged before per-outcome counts: the invalid rate only
            steps, invalid = run.series("tools/invalid_rate")
            ax.plot(steps, invalid, color="#d62728", linestyle=_style(i), label=_label(runs, run, "invalid"))
    ax.set_ylim(-0.02, 1.05)
    _finish_axes(ax, "Tool-call outcomes (fraction of each step's calls)", "fraction")


def _draw_lines(fig, runs: Sequence[RunRecord], keys: Sequence[str], title: str, ylabel: str, ax=None) -> None:
    ax = ax or fig.subplots()
    for i, run in enumerate(runs):
        for j, key in enumerate(keys):
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, values, color=f"C{j}", linestyle=_style(i), label=_label(runs, run, key))
    _finish_axes(ax, title, ylabel)


def _draw_entropy(fig, runs: Sequence[RunRecord]) -> None:
    _draw_lines(fig, runs, ["entropy/mean"], "Entropy of the trained tokens", "nats")


def _draw_clip_is(fig, runs: Sequence[RunRecord]) -> None:
    left, right = fig.subplots(1, 2)
    clip = sorted({k for r in runs for k in r.keys() if k.startswith("clip/")})
    _draw_lines(fig, runs, clip, "Clipped fractions", "fraction", ax=left)
    is_keys = sorted({k for r in runs for k in r.keys() if k.startswith("is/")})
    _draw_lines(fig, runs, is_keys, "Importance sampling (sampler/trainer)", "value", ax=right)


def _draw_packing(fig, runs: Sequence[RunRecord]) -> None:
    _draw_lines(fig, runs, ["tree/packing_ratio"], "Tree packing ratio (path tokens / unique tokens)", "ratio")


def _draw_step_time(fig, runs: Sequence[RunRecord]) -> None:
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs):
        by_step = {m["step"]: m for m in run.metrics if "perf/step_s" in m}
        steps = sorted(by_step)
        rollout = [float(by_step[s].get("perf/rollout_s", 0.0)) for s in steps]
        sync = [float(by_step[s].get("perf/sync_s", 0.0)) for s in steps]
        train = [max(float(by_step[s]["perf/step_s"]) - r - y, 0.0) for s, r, y in zip(steps, rollout, sync)]
        ax.stackplot(steps, rollout, train, sync, labels=["rollout", "train", "sync"],
                     colors=["#4c72b0", "#dd8452", "#55a868"], alpha=0.85)
        _finish_axes(ax, "Step time" + ("" if len(runs) == 1 else f": {run.name}"), "seconds")


_DRAW = {"reward": _draw_reward, "tool_calls": _draw_tool_calls, "entropy": _draw_entropy,
         "clip_is": _draw_clip_is, "packing": _draw_packing, "step_time": _draw_step_time}
