"""The metrics log: one JSON line per step in ``metrics.jsonl``, an optional tracker, a progress bar.

Lines are flushed as steps finish, so a killed run keeps every finished step; a resumed run
first drops the lines past its checkpoint (those steps are replayed, never doubled).
``report_to`` also sends the numeric metrics to TensorBoard, Weights & Biases or trackio
when installed; a missing one is a :class:`~treerl.errors.ConfigError` that says what to
install.

>>> import json, tempfile, pathlib
>>> out = pathlib.Path(tempfile.mkdtemp())
>>> log = MetricsLog(out, report_to="none", config={}, total_steps=2, progress=False)
>>> log.log(1, {"reward/mean": 0.5})
>>> log.close()
>>> json.loads((out / "metrics.jsonl").read_text())
{'step': 1, 'reward/mean': 0.5}
"""

from __future__ import annotations

import html
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from treerl.errors import ConfigError

__all__ = ["MetricsLog", "truncate_metrics", "tracker_for", "read_floats"]


def read_floats(values: Sequence[torch.Tensor | float]) -> list[float]:
    """``[float(v) for v in values]`` with one read back per device and dtype instead of one per tensor.

    On an accelerator every read of a device tensor waits for all the work queued before it (a
    host sync); a learner keeps a window's per-micro-batch metrics as tensors and reads them here
    once, after the last micro-batch. The values are exactly ``float(v)``'s.

    >>> read_floats([torch.tensor(0.5), 2, torch.tensor([True]), torch.tensor(1.25)])
    [0.5, 2.0, 1.0, 1.25]
    """
    out: list[float] = [0.0] * len(values)
    same_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            same_kind.setdefault((value.device, value.dtype), []).append(i)
        else:
            out[i] = float(value)
    for indices in same_kind.values():
        read = torch.stack([values[i].detach().reshape(()) for i in indices]).tolist()  # one sync per device
        for i, value in zip(indices, read):
            out[i] = float(value)
    return out


def tracker_for(report_to: str) -> Any:
    """What ``report_to`` logs with: TensorBoard's ``SummaryWriter``, the ``wandb`` or ``trackio``
    module, or None for ``none``. A missing package is a :class:`~treerl.errors.ConfigError` that
    says what to install; learners call this before loading a model, so the mistake costs no load.

    >>> tracker_for("none") is None
    True
    """
    if report_to == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(f"--report-to tensorboard needs `pip install tensorboard` ({exc}).") from None
        return SummaryWriter
    if report_to in ("wandb", "trackio"):
        try:
            return __import__(report_to)
        except ImportError:
            raise ConfigError(f"--report-to {report_to} needs `pip install {report_to}`.") from None
    return None


class MetricsLog:
    """JSON Lines in ``output_dir`` (flushed each step), plus an optional tracker and progress bar."""

    def __init__(self, output_dir: Path, *, report_to: str, config: dict[str, Any], total_steps: int,
                 start_step: int = 0, progress: bool = True):
        self.tracker = None
        backend = tracker_for(report_to)
        if report_to == "tensorboard":
            self.tracker = ("tensorboard", backend(str(Path(output_dir) / "tensorboard")))
        elif backend is not None:
            named = {"name": config["run_name"]} if config.get("run_name") else {}  # TRL's run_name
            # TRL's project names trackio's; wandb's is $WANDB_PROJECT where set, as transformers' callback reads it
            project = (report_to == "wandb" and os.environ.get("WANDB_PROJECT")) or config.get("project") or "treerl"
            backend.init(project=project, config=config, **named)
            self.tracker = (report_to, backend)
        self.file = open(Path(output_dir) / "metrics.jsonl", "a", encoding="utf-8")
        self.bar, self.last_step = None, start_step
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="learn", unit="step", file=sys.stderr,
                            dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write one step's metrics (and advance the progress bar); step 0 is the evaluation before the first. A
        second line of a step (an evaluation a callback asked for) leaves the bar where it is."""
        self.file.write(json.dumps({"step": step, **metrics}, default=float) + "\n")
        self.file.flush()
        if self.tracker is not None:
            kind, t = self.tracker
            scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            if kind == "tensorboard":
                for k, v in scalars.items():
                    t.add_scalar(k, v, step)
            else:
                t.log(scalars, step=step)
        advanced, self.last_step = step > self.last_step, max(step, self.last_step)
        if self.bar is not None and advanced:
            shown = {}
            if "reward/mean" in metrics:
                shown["reward"] = f"{metrics['reward/mean']:.3f}"
            if "perf/step_s" in metrics:
                shown["step_s"] = f"{metrics['perf/step_s']:.1f}"
            self.bar.set_postfix(shown)
            self.bar.update(1)

    def log_completions(self, step: int, rows: Sequence[dict[str, Any]], text: str) -> None:
        """Print a step's completions table (``text``, without breaking the progress bar) and send its
        ``rows`` to the tracker: a ``completions`` table in wandb or trackio, text in TensorBoard."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)
        if self.tracker is None or not rows:
            return
        kind, t = self.tracker
        if kind == "tensorboard":
            t.add_text("completions", "<pre>" + html.escape(text) + "</pre>", step)
        elif getattr(t, "Table", None) is not None:  # wandb.Table, trackio.Table
            columns = list(rows[0])
            t.log({"completions": t.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])},
                  step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.tracker is not None and self.tracker[0] == "tensorboard":
            self.tracker[1].close()


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop the metric lines past ``last_step`` (and a torn last line) before a resumed run replays them."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError):
            continue  # a torn last line from the killed run
    path.write_text("".join(f"{line}\n" for line in keep))
