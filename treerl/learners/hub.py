"""Pushing the trained model to the Hugging Face Hub: TRL's ``push_to_hub``, ``hub_model_id``,
``hub_strategy``, ``hub_private_repo`` and ``hub_token``.

What is pushed is ``output_dir/model``, the model ``from_pretrained`` loads (a LoRA run's adapter
merged into it), with a short ``README.md`` model card; checkpoints (the trainer's weights,
optimizer and random generators for ``--resume``) stay local. The repository is created when the
run starts, so that a missing token or a name the Hub refuses stops the run before it trains.
``hub_strategy=every_save`` also pushes the model after each checkpoint, in the background while
training goes on; a checkpoint whose predecessor is still uploading is not pushed (transformers'
default too); the end of the run waits for the upload in flight, then pushes the final model.
A failed push says so and the run goes on: the model stays in ``output_dir/model``.

Only rank 0 pushes. ``huggingface_hub`` (a dependency of transformers) is imported when a push
happens; without a token given (``hub_token``) it finds the one of ``HF_TOKEN`` or ``hf auth login``.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from treerl.errors import ConfigError

__all__ = ["HubPusher", "create_repo", "create_branch", "upload_model", "write_model_card"]

logger = logging.getLogger(__name__)


def create_repo(name: str, *, token: str | None = None, private: bool | None = None) -> str:
    """Create the model repository ``name`` unless it exists (``private``: None is the Hub's default);
    returns its id with the owner (``name`` alone is the token's user's)."""
    from huggingface_hub import HfApi

    return HfApi(token=token).create_repo(name, private=private, exist_ok=True).repo_id


def _first_line(exc: BaseException) -> str:
    """An exception's first line, or its type's name when it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def create_branch(repo_id: str, revision: str | None, *, token: str | None = None) -> None:
    """Create the branch ``revision`` of ``repo_id`` (from its main branch) unless it exists, as transformers'
    ``push_to_hub`` does before it commits there; None (the main branch) and a pull request's ``refs/pr/N``
    need none."""
    if revision is None or revision.startswith("refs/pr"):
        return
    from huggingface_hub import HfApi

    HfApi(token=token).create_branch(repo_id, branch=revision, exist_ok=True)


def upload_model(folder: Path | str, repo_id: str, *, commit_message: str, token: str | None = None,
                 revision: str | None = None, blocking: bool = True) -> Any:
    """Upload ``folder`` to ``repo_id`` in one commit; returns ``upload_folder``'s ``CommitInfo`` (a ``Future``
    of it when not ``blocking``)."""
    from huggingface_hub import HfApi

    return HfApi(token=token).upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                                            revision=revision, run_as_future=not blocking)


def write_model_card(folder: Path | str, repo_id: str, *, base_model: str | None, learner: str | None,
                     steps: int | None = None, model_name: str | None = None, dataset_name: str | None = None,
                     tags: Sequence[str] = ()) -> Path:
    """A minimal ``README.md`` in ``folder``: the Hub's metadata (the base model when it is a Hub id, never
    a local path), one sentence on how the model was trained, and how to load it from ``repo_id``.

    >>> import tempfile
    >>> card = write_model_card(tempfile.mkdtemp(), "me/calc", base_model="Qwen/Qwen3-0.6B", learner="grpo", steps=60)
    >>> print(card.read_text().split("---")[1].strip())
    base_model: Qwen/Qwen3-0.6B
    library_name: transformers
    tags:
    - treerl
    - grpo
    """
    hub_base = base_model if base_model and _is_hub_id(base_model) else None
    meta = ([f"base_model: {hub_base}"] if hub_base else []) + ["library_name: transformers", "tags:"]
    meta += [f"- {tag}" for tag in dict.fromkeys(["treerl", *([learner.lower()] if learner else []), *tags])]
    if dataset_name:
        meta += ["datasets:", f"- {dataset_name}"]
    how = (f"trained with treerl's `{learner}` learner" if learner
           else "trained with treerl")
    how += (f" on [{dataset_name}](https://huggingface.co/datasets/{dataset_name})" if dataset_name else "")
    how += f" for {steps} steps" if steps else ""
    what = (f"This model is [{hub_base}](https://huggingface.co/{hub_base}) {how}" if hub_base
            else f"This model was {how}")
    text = (f"---\n{chr(10).join(meta)}\n---\n\n# {model_name or repo_id.rsplit('/', 1)[-1]}\n\n{what} "
            "(reinforcement learning).\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"model = AutoModelForCausalLM.from_pretrained(\"{repo_id}\")\n"
            f"tokenizer = AutoTokenizer.from_pretrained(\"{repo_id}\")\n```\n")
    path = Path(folder) / "README.md"
    path.write_text(text)
    return path


def _is_hub_id(name: str) -> bool:
    """``name`` reads as ``owner/repo`` and is not a local directory (whose path the card must not show)."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and not Path(name).exists()


class HubPusher:
    """A run's pushes of its model to one Hub repository, created by :meth:`create`; at most one upload
    in flight, each failure a warning."""

    def __init__(self, repo_id: str, *, token: str | None, base_model: str | None, learner: str | None,
                 revision: str | None = None) -> None:
        self.repo_id, self.token, self.base_model, self.learner = repo_id, token, base_model, learner
        self.revision = revision  # the branch pushed to (None: main)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="treerl-hub")
        self._pending: Future[None] | None = None

    @classmethod
    def create(cls, cfg: Any, *, learner: str | None = None, base_model: str | None = None) -> HubPusher:
        """Create ``cfg``'s repository (``hub_repo_id()``, ``hub_private_repo``) now, on the Hub: a missing or
        refused token fails here, before the run trains, not at its end. ``learner`` and ``base_model`` (a Hub id
        or a directory) are named in the model card."""
        name = cfg.hub_repo_id()
        try:
            repo_id = create_repo(name, token=cfg.hub_token, private=cfg.hub_private_repo)
        except Exception as exc:  # noqa: BLE001 - no token, a refused one, no network: the same fix
            raise ConfigError(f"push_to_hub: the Hub repository {name!r} could not be created ({_first_line(exc)}); "
                              "log in with `hf auth login` (or set HF_TOKEN, or pass --hub-token), check "
                              "--hub-model-id, or drop --push-to-hub (the model is written to output_dir/model "
                              "anyway).") from None
        try:
            create_branch(repo_id, cfg.hub_revision, token=cfg.hub_token)
        except Exception as exc:  # noqa: BLE001 - a name the Hub refuses, a token that may not write there
            raise ConfigError(f"push_to_hub: the branch {cfg.hub_revision!r} of {repo_id} could not be created "
                              f"({_first_line(exc)}); check --hub-revision (a git branch name) and that the token "
                              "may write to the repository, or drop --hub-revision to push to main.") from None
        branch = f", branch {cfg.hub_revision}" if cfg.hub_revision else ""
        print(f"pushing the model to https://huggingface.co/{repo_id} ({cfg.hub_strategy}{branch})", file=sys.stderr)
        return cls(repo_id, token=cfg.hub_token, base_model=base_model, learner=learner, revision=cfg.hub_revision)

    def push(self, folder: Path, commit_message: str, *, write: Callable[[], None] | None = None,
             steps: int | None = None, blocking: bool = False) -> bool:
        """``write()`` the model into ``folder`` (so that it is not rewritten while an upload reads it), add the
        model card and upload it. In the background unless ``blocking``, which first waits for the upload in
        flight; otherwise, with one in flight, nothing is written or pushed. Returns whether it was (started)."""
        if blocking:
            self.wait()
        elif self._pending is not None and not self._pending.done():
            print(f"note: {commit_message}: not pushed, the previous push is still uploading (the next one, or the "
                  "end of the run, pushes newer weights)", file=sys.stderr)
            return False
        if write is not None:
            write()
        write_model_card(folder, self.repo_id, base_model=self.base_model, learner=self.learner, steps=steps)
        if blocking:
            self._upload(folder, commit_message)
        else:
            self._pending = self._executor.submit(self._upload, folder, commit_message)
        return True

    def wait(self) -> None:
        """Return once the upload in flight, if any, has ended (its failure was said already)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()

    def _upload(self, folder: Path, commit_message: str) -> None:
        try:
            upload_model(folder, self.repo_id, commit_message=commit_message, token=self.token,
                         revision=self.revision)
        except Exception as exc:  # noqa: BLE001 - a failed push must not end the run: the model is on disk
            message = (f"push to the Hub failed ({commit_message}): {type(exc).__name__}: {_first_line(exc)}; the "
                       f"model is in {folder}: upload it later with `hf upload {self.repo_id} {folder}`")
            logger.info(message)  # printed below: at warning level Python's last-resort handler printed it twice
            print(f"warning: {message}", file=sys.stderr)
            return
        logger.info("pushed %s to %s (%s)", folder, self.repo_id, commit_message)
