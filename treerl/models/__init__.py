"""The tiny causal LM that treerl ships and uses by default.

A ~2M-parameter Qwen3 with its own byte-level BPE and a Hermes/Qwen chat template, trained
by :mod:`treerl.models.train_tiny` on Calculator episodes so that it already makes
well-formed tool calls and is right about a third of the time: enough for rollouts, tests
and the quickstart to run on a laptop CPU, with room for RL to improve it. Loading reads
only local files (no network): the weights take milliseconds, the first call in a process a few
seconds more for the transformers imports.

>>> model, tokenizer = load_default_model()  # doctest: +SKIP
>>> tokenizer.apply_chat_template([{"role": "user", "content": "2 + 3?"}], add_generation_prompt=True, tokenize=False)  # doctest: +SKIP
'<|im_start|>user\\n2 + 3?<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treerl.errors import ConfigError

__all__ = ["DEFAULT_MODEL_PATH", "SHIPPED_MODELS", "default_model_path", "load_default_model", "load_model",
           "check_device", "resolve_hub_id", "set_chat_template", "model_directory",
           "shipped_model_path"]

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent / "tiny"
"""Where the shipped model lives inside the installed package."""

SHIPPED_MODELS: dict[str, Path] = {
    "tiny": DEFAULT_MODEL_PATH,
    # The same recipe with reading examples (SDPO's teacher prompt, then a copy of the attempt it
    # shows): a model that, like a pretrained LLM, copies a demonstration in its context.
    "tiny-reader": DEFAULT_MODEL_PATH.parent / "tiny-reader",
    # tiny-reader continued on CodeSandbox word problems (write solve(), imperfect) with reading
    # examples that use a sibling's code or the failed test's reference expression.
    "tiny-coder": DEFAULT_MODEL_PATH.parent / "tiny-coder",
}
"""The models treerl ships, by the name ``--model`` accepts (``--model tiny-reader``)."""

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_path() -> Path:
    """The directory of the shipped tiny model; raises if its files are missing.

    >>> default_model_path().name
    'tiny'
    """
    return shipped_model_path("tiny")


def shipped_model_path(name: str) -> Path:
    """The directory of the shipped model ``name`` (a key of :data:`SHIPPED_MODELS`); raises if its files are missing.

    >>> shipped_model_path("tiny").name
    'tiny'
    """
    path = SHIPPED_MODELS[name]
    missing = [f for f in _REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        how = (f"--init-from {DEFAULT_MODEL_PATH} --p-reading 0.6 --steps 300 --lr 1e-3" if name == "tiny-reader"
               else "")
        raise FileNotFoundError(
            f"the shipped model {name!r} is incomplete: {', '.join(missing)} missing in {path}. "
            f"Reinstall treerl, or rebuild it with `python -m treerl.models.train_tiny --out {path} --seed 0"
            f"{' ' + how if how else ''}`."
        )
    return path


def _shipped(path: str | None) -> str | None:
    """``path`` itself, or the directory of the shipped model it names (a local directory of that name wins)."""
    if path is not None and str(path) in SHIPPED_MODELS and not Path(path).is_dir():
        return str(shipped_model_path(str(path)))
    return path


def check_device(device: Any) -> None:
    """Raise :class:`~treerl.errors.ConfigError` when ``device`` is not a device this machine's torch can use.

    >>> check_device("cpu")
    >>> check_device("bogus")
    Traceback (most recent call last):
    ...
    treerl.errors.ConfigError: device 'bogus' is not a torch device; use --device cpu, cuda, cuda:N or mps.
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device {device!r} is not a torch device; use --device cpu, cuda, cuda:N or mps.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ConfigError(f"device {device!r}: torch {torch.__version__} ({build}) sees no CUDA GPU on this "
                              "machine; use --device cpu.")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s); use "
                              f"--device cuda:0 to cuda:{torch.cuda.device_count() - 1}.")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r}: MPS is not available on this machine; use --device cpu.")


def _check_chat_template(tokenizer: Any, path: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"model {str(path)!r}: its tokenizer has no chat template, and treerl renders every episode "
                          "with one. Save the model with a tokenizer that has one (set tokenizer.chat_template, then "
                          "tokenizer.save_pretrained(DIR)), or use an instruction-tuned model's tokenizer.")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _jinja_literal(value: Any) -> str:
    """``value`` (from JSON or YAML) written as a Jinja expression."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_jinja_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_jinja_literal(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"chat_template_kwargs: {value!r} is not a JSON value; use true/false, numbers, text, lists "
                      "or mappings.")


def set_chat_template(tokenizer: Any, chat_template: str | os.PathLike | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> None:
    """Replace the tokenizer's chat template with the file ``chat_template`` and fix template variables.

    ``template_kwargs`` (``{"enable_thinking": False}``) become ``{% set %}`` lines at the top of
    the template, so every renderer of the run (rollout, evaluation, ``treerl serve``, a
    teacher's context) sees the same values without passing them along.

    >>> class Tok: chat_template = "{{ enable_thinking }}"
    >>> tok = Tok(); set_chat_template(tok, None, {"enable_thinking": False}); tok.chat_template
    '{%- set enable_thinking = false %}{{ enable_thinking }}'
    """
    if chat_template is not None:
        p = Path(chat_template)
        if not p.is_file():
            raise ConfigError(f"chat_template={str(chat_template)!r}: no such file; pass a Jinja template file (e.g. "
                              "one saved from another model's tokenizer_config.json chat_template).")
        tokenizer.chat_template = p.read_text(encoding="utf-8")
    if template_kwargs:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("chat_template_kwargs given, but the tokenizer has no chat template to apply them to; "
                              "pass --chat-template PATH.")
        for name in template_kwargs:
            if not str(name).isidentifier():
                raise ConfigError(f"chat_template_kwargs: {name!r} is not a template variable name.")
        header = "".join(f"{{%- set {k} = {_jinja_literal(v)} %}}" for k, v in template_kwargs.items())
        tokenizer.chat_template = header + tokenizer.chat_template


def load_default_model(device: Any = "cpu") -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Load the shipped model (float32, eval mode) and its tokenizer from local files only.

    ``device`` is anything ``torch`` accepts (``"cpu"``, ``"cuda:0"``, a ``torch.device``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    check_device(device)
    hf_logging.disable_progress_bar()  # a 46-tensor model needs no "Loading weights" bar
    path = default_model_path()
    # local_files_only: a path never needs the Hub, and this keeps it so even if the
    # directory were mistaken for a repo id.
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype="float32")
    return model.to(device).eval(), tokenizer


def resolve_hub_id(model_id: str) -> str:
    """The local snapshot directory of a Hub id (``Qwen/Qwen3-0.6B``) in the Hugging Face cache, offline.

    Nothing is downloaded (treerl never touches the network at run time): a model that is not
    cached raises :class:`~treerl.errors.ConfigError` naming the command that caches it.

    >>> resolve_hub_id("no/such/dir")
    Traceback (most recent call last):
    ...
    treerl.errors.ConfigError: model 'no/such/dir' is not a directory. ...
    """
    not_a_dir = (f"model {model_id!r} is not a directory. Pass a local transformers model directory (config.json, "
                 "weights, tokenizer) or a Hub id such as Qwen/Qwen3-0.6B that is in the Hugging Face cache, with "
                 f"--model, or omit --model to use the shipped tiny model ({DEFAULT_MODEL_PATH}).")
    parts = str(model_id).split("/")
    if len(parts) > 2 or not all(parts) or str(model_id).startswith((".", "~")):
        raise ConfigError(not_a_dir)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # transformers depends on huggingface_hub, so this is a broken install
        raise ConfigError(not_a_dir) from None
    try:
        return snapshot_download(model_id, local_files_only=True)
    except HFValidationError:
        raise ConfigError(not_a_dir) from None
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        from huggingface_hub.constants import HF_HUB_CACHE

        raise ConfigError(
            f"model {model_id!r} is neither a local directory nor in the Hugging Face cache ({HF_HUB_CACHE}); "
            f"treerl does not download at run time. Cache it once with `hf download {model_id}` (or "
            f"`huggingface-cli download {model_id}`, where the network is reachable; set HF_HUB_CACHE to use "
            "another cache), or pass a local directory with --model PATH.") from None


def model_directory(path: str | None) -> str:
    """The directory of ``--model``: itself, a Hub id's cached snapshot, or the shipped model's (None).

    >>> model_directory(None) == str(default_model_path())
    True
    """
    if path is None:
        return str(default_model_path())
    path = _shipped(path)
    return str(path) if Path(path).is_dir() else resolve_hub_id(path)


def _refuse_learn_output(path: Path) -> None:
    """Say where the model is when ``path`` is what ``treerl learn`` wrote around it: its output
    directory or one of its checkpoints (weights and training state, without config or tokenizer)."""
    if (path / "trainer_state.json").is_file() and path.parent.name == "checkpoints":
        run = path.parent.parent
        state = json.loads((path / "trainer_state.json").read_text())
        then = (f" (there now: --model {run / 'model'})" if (run / "model" / "config.json").is_file() else
                f"; a run stopped early writes its latest checkpoint's weights there when it ends at that step: "
                f"treerl learn --config {run / 'config.json'} --resume true --steps {state.get('step', 'N')} "
                "--eval-episodes 0")
        raise ConfigError(f"model {str(path)!r} is a checkpoint of treerl learn (what --resume continues from), not "
                          f"a transformers model: the run writes its trained model at its end to {run / 'model'}"
                          f"{then}.")
    if (path / "model" / "config.json").is_file() or (path / "checkpoints").is_dir():
        where = (f"its trained model is in {path / 'model'} (--model {path / 'model'})"
                 if (path / "model" / "config.json").is_file() else
                 f"it writes its trained model to {path / 'model'} at its end (a run stopped early: resume it with "
                 "--resume true)")
        raise ConfigError(f"model {str(path)!r} is the output directory of treerl learn, not a model: {where}.")


def load_model(path: str | None, device: Any = "cpu", *, chat_template: str | None = None,
               chat_template_kwargs: dict[str, Any] | None = None) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """A transformers causal LM and its tokenizer from a local directory or a cached Hub id, offline, in eval mode.

    ``None`` loads the shipped tiny model, a name of :data:`SHIPPED_MODELS` (``"tiny-reader"``)
    that shipped model; a Hub id is found in the Hugging Face cache
    (:func:`resolve_hub_id`). A path that is not a loadable model directory
    raises :class:`~treerl.errors.ConfigError` saying what to pass instead.

    >>> load_model("no/such/dir")
    Traceback (most recent call last):
    ...
    treerl.errors.ConfigError: model 'no/such/dir' is not a directory. ...
    """
    if path is None:
        model, tokenizer = load_default_model(device=device)
        if chat_template is not None or chat_template_kwargs:
            set_chat_template(tokenizer, chat_template, chat_template_kwargs)
        return model, tokenizer
    path = _shipped(path)
    hub_id = None if Path(path).is_dir() else str(path)
    if hub_id is not None:
        path = resolve_hub_id(hub_id)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    check_device(device)
    hf_logging.disable_progress_bar()
    if (Path(path) / "adapter_config.json").is_file() and not (Path(path) / "config.json").is_file():
        merged = Path(path).parent / "model"
        where = f" (treerl learn saved it merged beside it: --model {merged})" if (merged / "config.json").is_file() else ""
        raise ConfigError(f"model {str(path)!r} is a LoRA adapter, not a whole model: pass the merged model{where}, or "
                          "merge it first (peft: PeftModel.from_pretrained(base, DIR).merge_and_unload()"
                          ".save_pretrained(OUT), and the base's tokenizer beside it).")
    if not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        _refuse_learn_output(Path(path))
        raise ConfigError(f"model {str(path)!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); save the "
                          "tokenizer next to the weights (tokenizer.save_pretrained(DIR)), e.g. the one of the model "
                          "it was fine-tuned from.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if chat_template is not None or chat_template_kwargs:
            set_chat_template(tokenizer, chat_template, chat_template_kwargs)
        _check_chat_template(tokenizer, path)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"model {path!r}: could not load a causal LM and its tokenizer from it "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); pass a directory "
                          "written by save_pretrained (--model PATH).") from None
    if hub_id is not None:  # named as a download names it: peft writes it into a LoRA adapter as its base
        model.name_or_path = model.config.name_or_path = tokenizer.name_or_path = hub_id
    return model.eval(), tokenizer
