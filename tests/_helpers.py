"""Test helpers shared by several test modules (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from treerl.kernels.tree_layout import TreeLayout


def depth_first(lens: list[int], parents: list[int]) -> TreeLayout:
    """Any parent list (parents before children) reordered depth first."""
    children: dict[int, list[int]] = {s: [] for s in range(len(lens))}
    for s, p in enumerate(parents):
        if p != -1:
            children[p].append(s)
    order, stack = [], [s for s in range(len(lens)) if parents[s] == -1][::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    new = {old: i for i, old in enumerate(order)}
    new_parents = [-1 if parents[o] == -1 else new[parents[o]] for o in order]
    return TreeLayout.from_parents([lens[o] for o in order], new_parents)


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any ATen op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.worst_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel, self.worst_op = t.numel(), str(func)
        return result


class HostReads(TorchDispatchMode):
    """Counts the values read back from tensors to Python: ``item()``, ``float()``, ``int()``,
    ``bool()`` (each an ATen ``_local_scalar_dense``) and ``tolist()``. On an accelerator each
    read of a device tensor is a host sync: the CPU waits for everything queued before it.
    Run on CPU tensors the count is what CUDA would pay for the same code, for the reads of
    tensors that would live on the device.
    """

    def __init__(self):
        super().__init__()
        self.count = 0
        self._tolist = None

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        reads = self

        def tolist(tensor):
            reads.count += 1
            return reads._tolist(tensor)

        torch.Tensor.tolist = tolist  # tolist reads the data directly, without an ATen op
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def processed_forward(model, prompt: list[int], token_ids: list[int], params):
    """The processed distribution each of ``token_ids`` was drawn from, by one forward of ``model``
    over the prompt and the sampled tokens (the independent reference for a policy's records)."""
    from treerl.agents.sampling import process_logits

    with torch.no_grad():
        logits = model(torch.tensor([prompt + token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
    return process_logits(logits, params)


def assert_drawn_from(generation, processed, *, abs_tol: float, ordered: bool) -> None:
    """A generation's log-probs and candidate sets are those of ``processed`` (its candidates in the
    same order when ``ordered``, else as sets)."""
    import pytest

    from treerl.agents.sampling import candidate_lists

    want = candidate_lists(processed)
    if ordered:
        assert generation.candidates == want
    for t, token in enumerate(generation.token_ids):
        ids = processed.candidate_ids[t].tolist()
        assert generation.logprobs[t] == pytest.approx(processed.logprobs[t, ids.index(token)].item(), abs=abs_tol)
        if not ordered:
            assert set(generation.candidates[t]) == set(want[t])


def sandbox_package() -> dict[str, str]:
    """``treerl/envs/sandbox*.py`` and every ``treerl.envs`` module they import (transitively), as the files
    of a bare package (``{"treerl/envs/NAME.py": source}``, with empty ``__init__.py`` files): what a test
    that runs the sandbox inside a sandbox copies in, since the real ``treerl/envs/__init__.py`` pulls
    in far more than the sandbox needs. Read from the imports, so a new one is copied too."""
    import treerl.envs.sandbox

    envs = Path(treerl.envs.sandbox.__file__).parent
    todo = sorted(path.stem for path in envs.glob("sandbox*.py"))
    files = {"treerl/__init__.py": "", "treerl/envs/__init__.py": ""}
    while todo:
        name = todo.pop()
        key = f"treerl/envs/{name}.py"
        if key in files:
            continue
        files[key] = source = (envs / f"{name}.py").read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            todo += [m.split(".")[2] for m in modules if m.startswith("treerl.envs.")]
    return files


class FakeHub:
    """``huggingface_hub.HfApi`` without a network: :meth:`install` puts a stand-in in its place that
    records each call (``tokens``, ``repos``: ``(repo_id, private)``, ``branches``: ``(repo_id, branch)``,
    ``uploads``: the repository, the folder's files and model card at that moment, the commit message, the
    revision). ``before_upload(upload)`` runs
    inside each upload (in the pusher's thread for a background push): it may block or raise."""

    def __init__(self, owner: str = "me") -> None:
        self.owner, self.tokens, self.repos, self.uploads, self.branches = owner, [], [], [], []
        self.before_upload = None
        self.create_error: Exception | None = None
        self.branch_error: Exception | None = None

    def install(self, monkeypatch) -> FakeHub:
        import huggingface_hub

        hub = self

        class Api:
            def __init__(self, token=None, **kwargs):
                hub.tokens.append(token)

            def create_repo(self, repo_id, *, private=None, exist_ok=False, **kwargs):
                assert exist_ok, "an existing repository (a resumed run's) must be reused"
                if hub.create_error is not None:
                    raise hub.create_error
                hub.repos.append((repo_id, private))
                return type("RepoUrl", (), {"repo_id": repo_id if "/" in repo_id else f"{hub.owner}/{repo_id}"})()

            def create_branch(self, repo_id, *, branch, exist_ok=False, **kwargs):
                assert exist_ok, "an existing branch (a resumed run's) must be reused"
                if hub.branch_error is not None:
                    raise hub.branch_error
                hub.branches.append((repo_id, branch))

            def upload_folder(self, *, repo_id, folder_path, commit_message=None, revision=None, run_as_future=False,
                              **kwargs):
                folder = Path(folder_path)
                card = folder / "README.md"
                upload = {"repo_id": repo_id, "files": sorted(p.name for p in folder.iterdir()),
                          "message": commit_message, "card": card.read_text() if card.exists() else None,
                          "revision": revision}
                hub.uploads.append(upload)
                if hub.before_upload is not None:
                    hub.before_upload(upload)
                upload["done"] = True
                return f"commit of {commit_message}"

        monkeypatch.setattr(huggingface_hub, "HfApi", Api)
        return self


class OneParameterModel(torch.nn.Module):
    """The smallest model transformers' own Trainer trains (``w``, pulled toward each row's ``x``): the oracle of
    the tests that check when treerl saves, evaluates, keeps the best or stops, against that Trainer."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return {"loss": ((self.w - x) ** 2).mean()}


def one_parameter_rows(n: int, start: float = 0.0) -> list[dict[str, torch.Tensor]]:
    """``n`` rows for :class:`OneParameterModel`, ``x`` = start, start + 1, ..."""
    return [{"x": torch.tensor([float(i + start)])} for i in range(n)]


def oracle_args(tmp_path, **options):
    """transformers' TrainingArguments for an oracle run on the CPU, quiet (no report, no progress, no log
    lines), with ``options``."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True,
                             logging_strategy="no", **options)


def trainer_recorder():
    """A transformers TrainerCallback that records the global steps of ``on_save`` (``saves``) and
    ``on_evaluate`` (``evals``), and :class:`OneParameterModel`'s ``w`` at each step's end (``weights``)."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self):
            self.saves, self.evals, self.weights = [], [], {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if model is not None:
                self.weights[state.global_step] = model.w.item()

        def on_save(self, args, state, control, **kwargs):
            self.saves.append(state.global_step)

        def on_evaluate(self, args, state, control, **kwargs):
            self.evals.append(state.global_step)

    return Record()


def scripted_eval_reward(values):
    """A reward function whose value on the evaluation's rows (split "eval") is the next of ``values``, one per
    evaluation; on the training rows the completion's length, so that the weights move."""
    calls = []

    def reward(completions, split, **kwargs):
        if split[0] == "eval":
            calls.append(len(calls))
            return [values[len(calls) - 1]] * len(completions)
        return [float(len(c)) for c in completions]

    return reward
