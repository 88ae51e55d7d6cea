"""Adaptive entropy control (Skywork-OR1, https://arxiv.org/abs/2505.22312; TRL's ``use_adaptive_entropy``).

The entropy bonus's coefficient follows the policy's entropy, one optimizer step at a time, as TRL's
``GRPOTrainer`` moves ``entropy_coef``:

- an optimizer step's loss subtracts ``coef x`` its mean entropy only when the entropy measured at the
  previous optimizer step was at or below ``entropy_target`` (none measured yet: no bonus);
- after the step, with ``H`` the mean entropy of the step's trained tokens (every micro-batch's, every
  process's; with ``top_entropy_quantile`` the kept ones), ``coef`` becomes ``min(coef + delta, max)`` when
  ``H <= target``, else ``max(coef - delta, min)``; ``H`` is then the gate of the next step.

Both numbers live in the run's :class:`~treerl.learners.checkpoints.TrainerState` ``extra``, so a resumed
run continues the sequence (TRL keeps them in its checkpoint's ``entropy_ctrl_state.json``).

>>> control = AdaptiveEntropy(coef=0.0, target=0.2, coef_min=0.0, coef_max=0.01, delta=0.005)
>>> control.applied_coef()  # nothing measured yet
0.0
>>> for entropy in (0.1, 0.1, 0.1, 0.5):
...     control.update(entropy)
...     print(control.coef, control.applied_coef())
0.005 0.005
0.01 0.01
0.01 0.01
0.005 0.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["AdaptiveEntropy"]

STATE_KEY = "adaptive_entropy"
"""``TrainerState.extra``'s entry: ``{"coef": ..., "last_entropy": ...}``."""


@dataclass
class AdaptiveEntropy:
    """The controller's settings and state: ``coef`` (TRL's mutable ``entropy_coef``) and ``last_entropy``
    (TRL's ``_last_world_entropy``, inf before the first optimizer step)."""

    coef: float
    target: float
    coef_min: float
    coef_max: float
    delta: float
    last_entropy: float = math.inf

    @classmethod
    def of_run(cls, cfg: Any, extra: dict[str, Any]) -> AdaptiveEntropy | None:
        """The controller of a run with ``cfg.use_adaptive_entropy`` (None without), from ``cfg.entropy_coef``
        or from ``extra`` where a checkpoint left it (TRL restores a checkpoint's over the config's)."""
        if not getattr(cfg, "use_adaptive_entropy", False):
            return None
        saved = extra.get(STATE_KEY, {})
        return cls(coef=float(saved.get("coef", cfg.entropy_coef)), target=cfg.entropy_target,
                   coef_min=cfg.entropy_coef_min, coef_max=cfg.entropy_coef_max, delta=cfg.entropy_coef_delta,
                   last_entropy=float(saved.get("last_entropy", math.inf)))

    def save(self, extra: dict[str, Any]) -> None:
        """Write the state into ``extra`` (a checkpoint's ``TrainerState.extra``)."""
        extra[STATE_KEY] = {"coef": self.coef, "last_entropy": self.last_entropy}

    def applied_coef(self) -> float:
        """The coefficient of this optimizer step's bonus: ``coef`` when the last entropy was at or below the
        target, else 0 (the same for every micro-batch of the step)."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """After an optimizer step whose trained tokens had mean entropy ``entropy`` (nats)."""
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy
