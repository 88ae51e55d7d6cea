"""Training diagnostics a program can read: structured warnings after each step.

Each check compares one metric of the step with a threshold; when it fires it writes one
JSON line (``step``, ``kind``, ``value``, ``threshold``, ``action``) to ``diagnostics.jsonl``,
logs a warning, and sets the metric ``diag/<kind>`` to 1 for that step.

>>> import tempfile, pathlib
>>> d = Diagnostics(pathlib.Path(tempfile.mkdtemp()) / "diagnostics.jsonl")
>>> d.check(1, {"reward/zero_std_frac": 1.0})["diag/zero_reward_variance"]
1.0
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Check", "CHECKS", "Diagnostics", "RECORDED_ACTIONS"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Check:
    kind: str
    metric: str
    threshold: float
    above: bool
    """Fire when the metric is above the threshold (else below)."""
    action: str


CHECKS: tuple[Check, ...] = (
    Check("zero_reward_variance", "reward/zero_std_frac", 0.9, True,
          "Most groups have identical rewards, so their advantages are 0: raise group_size or temperature, "
          "or use easier/harder tasks."),
    Check("length_limit", "episode/length_limit_frac", 0.9, True,
          "Almost every final turn hit max_new_tokens: raise --max-new-tokens or shorten the expected answers."),
    Check("sampler_trainer_mismatch", "is/ratio_max", 5.0, True,
          "The trainer's probabilities differ strongly from the sampler's: check that both use the same "
          "temperature/top-k and weights (policy version), or lower --is-ratio-high."),
    Check("clip_fraction_high", "clip/region_frac", 0.3, True,
          "Many tokens are clipped: lower the learning rate or widen epsilon_low/epsilon_high."),
    Check("entropy_collapse", "entropy/mean", 0.02, False,
          "The policy's entropy collapsed: lower the learning rate, raise temperature, or add --entropy-coef."),
)


RECORDED_ACTIONS: dict[str, str] = {
    "length_limit": "Almost every final turn stopped at the length limit it was sampled with, which --max-new-tokens "
                    "does not set for groups recorded elsewhere: raise the max_tokens (or max_completion_tokens) "
                    "the client sends to `treerl serve`, or the --max-new-tokens of the `treerl rollout` that "
                    "recorded them; or shorten the expected answers.",
}
"""The actions that apply instead when the groups come from a source (``--from-server``, ``--from-rollouts``)."""


class Diagnostics:
    """Runs :data:`CHECKS` (and a rising tool-error check) after every step.

    ``actions`` replace the checks' own by kind, where another fix applies (:data:`RECORDED_ACTIONS`).
    """

    def __init__(self, path: Path, checks: tuple[Check, ...] = CHECKS, tool_error_window: int = 5,
                 actions: dict[str, str] | None = None):
        self.path = Path(path)
        self.path.touch()  # present from the start (empty: nothing fired), as metrics.jsonl is
        self.checks = checks
        self.actions = dict(actions or {})
        self.window = tool_error_window
        self._tool_errors: list[float] = []

    def check(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        fired: dict[str, float] = {}
        for c in self.checks:
            value = metrics.get(c.metric)
            if value is None:
                continue
            if (value > c.threshold) if c.above else (value < c.threshold):
                self.report(step, c.kind, float(value), c.threshold, self.actions.get(c.kind, c.action))
                fired[f"diag/{c.kind}"] = 1.0
        rate = metrics.get("tools/invalid_rate")
        if rate is not None:
            self._tool_errors.append(float(rate))
            if len(self._tool_errors) > 2 * self.window:
                self._tool_errors.pop(0)
            if len(self._tool_errors) == 2 * self.window:
                before = sum(self._tool_errors[: self.window]) / self.window
                after = sum(self._tool_errors[self.window:]) / self.window
                if after > before + 0.1:
                    self.report(step, "tool_errors_rising", after, before + 0.1,
                                "The tool-call error rate is rising: inspect tools/* metrics and the rollouts; "
                                "lower the learning rate or reward well-formed calls.")
                    fired["diag/tool_errors_rising"] = 1.0
        return fired

    def report(self, step: int, kind: str, value: float, threshold: float, action: str) -> None:
        """Write one diagnostic line and log it (the checks call this; a learner may too)."""
        record = {"step": step, "kind": kind, "value": value, "threshold": threshold, "action": action}
        logger.warning("diagnostic %s at step %d: %.4g (threshold %.4g). %s", kind, step, value, threshold, action)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
