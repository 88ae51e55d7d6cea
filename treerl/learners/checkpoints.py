"""Checkpoints: written atomically, found by step, loaded back with the state a resumed run needs.

A checkpoint is a directory ``output_dir/checkpoints/step-N`` holding the trained weights
(``model.safetensors``: a LoRA run's adapter and base weights as the trainer holds them;
with ``sync_ref_model``, the KL reference's in ``reference.safetensors``), the optimizer and
scheduler states, the random-number generators of torch, numpy and Python, and
:class:`TrainerState` as ``trainer_state.json``. It is written into ``step-N.tmp`` and
renamed, so a killed run leaves either a whole checkpoint or none (and perhaps a
``step-N.tmp``, which :func:`resume_checkpoint` removes), and a resumed run continues bit
for bit as if it had never stopped. With transformers' ``save_only_model`` a checkpoint holds the
weights and ``trainer_state.json`` alone (:func:`is_model_only`), which no run continues from.

>>> import tempfile, pathlib
>>> out = pathlib.Path(tempfile.mkdtemp())
>>> latest_checkpoint(out) is None
True
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["TrainerState", "save_checkpoint", "checkpoint_step", "latest_checkpoint", "resume_checkpoint",
           "load_checkpoint", "load_weights", "checkpoint_path", "earlier_run", "clear_run", "prune_checkpoints",
           "keep_only_best", "run_settings", "is_model_only"]


@dataclass
class TrainerState:
    """Where a run is: what a resumed run starts from."""

    step: int = 0
    """Steps taken (a GRPO step takes num_iterations x num_minibatches optimizer steps)."""
    policy_version: int = 0
    """The weights version the policy samples with (one per published update)."""
    next_task: int = 0
    """The index of the first task the next step plays."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What a learner counts across the whole run besides these (AsyncGRPO: its totals), JSON-serializable;
    a resumed run continues from it (a checkpoint written before it existed has none)."""
    best_metric: float | None = None
    """With ``metric_for_best_model``: its best value over the evaluations after a step (transformers')."""
    best_step: int | None = None
    """The step of that evaluation (transformers' ``best_global_step``, in steps here)."""
    best_model_checkpoint: str | None = None
    """The checkpoint of the best evaluation's step, once one was written at that step (transformers'): what
    ``save_total_limit`` keeps and ``load_best_model_at_end`` loads."""


REFERENCE_FILE = "reference.safetensors"
"""A checkpoint's KL reference, written once ``sync_ref_model`` has moved it from the starting weights."""
OPTIMIZER_FILE = "optimizer.pt"
"""A checkpoint's optimizer and scheduler states, which a model-only one (``save_only_model``) lacks."""


def checkpoint_path(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step-{step}"


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    state: TrainerState, reference: torch.nn.Module | None = None, model_only: bool = False) -> None:
    """Write a whole checkpoint to ``path`` (replacing one there), atomically; with ``reference`` (a KL
    reference that is no longer the starting weights), its weights too. ``model_only`` (transformers'
    ``save_only_model``) writes the weights and the state alone: no optimizer, scheduler, random generators
    or reference, so nothing a run could continue from."""
    from safetensors.torch import save_model

    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_model(model, str(tmp / "model.safetensors"))  # handles tied embeddings
    if not model_only:
        if reference is not None:
            save_model(reference, str(tmp / REFERENCE_FILE))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / OPTIMIZER_FILE)
        torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
                   tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)  # a checkpoint directory either exists whole or not at all


def is_model_only(path: Path) -> bool:
    """Whether the checkpoint at ``path`` holds the weights alone (written with ``save_only_model``): it has no
    optimizer state to continue a run from."""
    return not (Path(path) / OPTIMIZER_FILE).exists()


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint directory (``step-N``, :func:`checkpoint_path`) was written after."""
    return int(Path(path).name.split("-", 1)[1])


def _checkpoints(output_dir: Path) -> list[Path]:
    """``output_dir``'s checkpoints by step, lowest first (unfinished ``.tmp`` ones are ignored)."""
    ckpts = [p for p in (Path(output_dir) / "checkpoints").glob("step-*")
             if p.is_dir() and p.name.split("-", 1)[1].isdigit()]
    return sorted(ckpts, key=checkpoint_step)


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint of the highest step in ``output_dir``, or None (unfinished ``.tmp`` ones are ignored)."""
    ckpts = _checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(output_dir: Path, keep: int | None, best: Path | str | None = None) -> None:
    """Remove the checkpoints of the lowest steps until ``keep`` are left (None keeps all), as TRL's
    save_total_limit; never the latest (what ``--resume`` continues from) nor ``best`` (the best model's
    checkpoint), so that ``keep=1`` beside a best that is not the latest keeps two, as transformers' rotation.

    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> for step in (2, 10, 4, 6):
    ...     checkpoint_path(out, step).mkdir(parents=True)
    >>> prune_checkpoints(out, 3, best=checkpoint_path(out, 2))
    >>> sorted(p.name for p in (out / "checkpoints").iterdir())
    ['step-10', 'step-2', 'step-6']
    >>> prune_checkpoints(out, 1, best=checkpoint_path(out, 2))
    >>> sorted(p.name for p in (out / "checkpoints").iterdir())
    ['step-10', 'step-2']
    """
    if keep is None:
        return
    ckpts = _checkpoints(output_dir)
    protected = {ckpts[-1].name} if ckpts else set()
    if best is not None:
        protected.add(Path(best).name)
    remaining = len(ckpts)
    for path in ckpts:
        if remaining <= max(keep, len(protected)):
            break
        if path.name not in protected:
            shutil.rmtree(path)
            remaining -= 1


def keep_only_best(output_dir: Path, best: Path | str) -> None:
    """Remove every checkpoint but ``best``: transformers' end of a run with ``save_total_limit=1`` and a best
    model checkpoint, where the latest goes too (``--resume`` then continues from the best)."""
    for path in _checkpoints(output_dir):
        if path.name != Path(best).name:
            shutil.rmtree(path)


RUN_FILES = ("metrics.jsonl", "diagnostics.jsonl", "eval_start.json", "summary.json", "reward_extras.jsonl",
             "groups.jsonl", "checkpoints", "trajectories", "plots", "model", "adapter", "tensorboard")
"""What a learner writes into its output directory (config.json aside, rewritten at every start)."""


def run_settings(output_dir: Path) -> dict[str, Any] | None:
    """The settings a run in ``output_dir`` was started with: its ``config.json``, or, where a model's config
    replaced that (a TRL script's ``trainer.model.config.save_pretrained(output_dir)``), the copy the finished
    run keeps in ``summary.json``; None when neither holds them.

    >>> import json, tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (out / "summary.json").write_text(json.dumps({"steps": 2, "config": {"learner": "grpo", "steps": 2}}))
    >>> _ = (out / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 512}))
    >>> run_settings(out)
    {'learner': 'grpo', 'steps': 2}
    """
    out = Path(output_dir)
    for path, key in ((out / "config.json", None), (out / "summary.json", "config")):
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found = found.get(key) if key is not None and isinstance(found, dict) else found
        if isinstance(found, dict) and "model_type" not in found:  # every transformers config has model_type
            return found
    return None


def earlier_run(output_dir: Path) -> list[str]:
    """The files of an earlier run in ``output_dir`` that a new run would mix with its own.

    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> earlier_run(out)
    []
    >>> (out / "metrics.jsonl").write_text("")
    0
    >>> earlier_run(out)
    ['metrics.jsonl']
    """
    return [name for name in ("metrics.jsonl", "checkpoints", "model") if (Path(output_dir) / name).exists()]


def clear_run(output_dir: Path) -> None:
    """Remove what a learner wrote into ``output_dir`` (:data:`RUN_FILES`), nothing else."""
    for name in RUN_FILES:
        path = Path(output_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def resume_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint a resumed run starts from (see :func:`latest_checkpoint`), after removing the
    unfinished ``step-N.tmp`` directories that a run killed while writing one leaves behind.

    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp())
    >>> (out / "checkpoints" / "step-2.tmp").mkdir(parents=True)
    >>> (out / "checkpoints" / "step-1").mkdir()
    >>> resume_checkpoint(out).name, sorted(p.name for p in (out / "checkpoints").iterdir())
    ('step-1', ['step-1'])
    """
    for tmp in (Path(output_dir) / "checkpoints").glob("step-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    return latest_checkpoint(output_dir)


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """The trained weights of the checkpoint at ``path`` into ``model``, in place (a LoRA run's adapter and base
    weights as the trainer holds them); nothing else of it."""
    from safetensors.torch import load_model

    load_model(model, str(Path(path) / "model.safetensors"))


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, reference: torch.nn.Module | None = None) -> TrainerState:
    """Load weights, optimizer, scheduler and generators from ``path`` in place; returns its state. A
    ``reference`` takes the checkpoint's reference weights where it has them (else it stays as it is:
    the starting weights). A model-only checkpoint (:func:`is_model_only`) gives its weights and state alone:
    the optimizer, scheduler and generators stay as they are."""
    from safetensors.torch import load_model

    load_weights(path, model)
    if reference is not None and (path / REFERENCE_FILE).exists():
        load_model(reference, str(path / REFERENCE_FILE))
    if not is_model_only(path):
        opt = torch.load(path / OPTIMIZER_FILE, weights_only=False)
        optimizer.load_state_dict(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
        rng = torch.load(path / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
    state = json.loads((path / "trainer_state.json").read_text())
    return TrainerState(step=int(state["step"]), policy_version=int(state["policy_version"]),
                        next_task=int(state["next_task"]), extra=dict(state.get("extra", {})),
                        best_metric=state.get("best_metric"), best_step=state.get("best_step"),
                        best_model_checkpoint=state.get("best_model_checkpoint"))
