"""The tiny causal LM that treerl ships and uses by default.

A ~2M-parameter Qwen3 with its own byte-level BPE and a Hermes/Qwen chat template, trained
by :mod:`treerl.models.train_tiny` on Calculator episodes so that it already makes
well-formed tool calls and is right about a third of the time: enough for rollouts, tests
and the quickstart to run on a laptop CPU, with room for RL to improve it. Loading reads
only local files (no network) and takes well under a second.

>>> model, tokenizer = load_default_model()  # doctest: +SKIP
>>> tokenizer.apply_chat_template([{"role": "user", "content": "2 + 3?"}], add_generation_prompt=True, tokenize=False)  # doctest: +SKIP
'<|im_start|>user\\n2 + 3?<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treerl.errors import ConfigError

__all__ = ["DEFAULT_MODEL_PATH", "default_model_path", "load_default_model", "load_model", "check_device"]

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent / "tiny"
"""Where the shipped model lives inside the installed package."""

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_path() -> Path:
    """The directory of the shipped tiny model; raises if its files are missing.

    >>> default_model_path().name
    'tiny'
    """
    missing = [name for name in _REQUIRED_FILES if not (DEFAULT_MODEL_PATH / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the shipped tiny model is incomplete: {', '.join(missing)} missing in {DEFAULT_MODEL_PATH}. "
            "Reinstall treerl, or rebuild it with `python -m treerl.models.train_tiny --out "
            f"{DEFAULT_MODEL_PATH} --seed 0`."
        )
    return DEFAULT_MODEL_PATH


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


def load_model(path: str | None, device: Any = "cpu") -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """A transformers causal LM and its tokenizer from a local directory, offline, in eval mode.

    ``None`` loads the shipped tiny model. A path that is not a loadable model directory
    raises :class:`~treerl.errors.ConfigError` saying what to pass instead.

    >>> load_model("no/such/dir")
    Traceback (most recent call last):
    ...
    treerl.errors.ConfigError: model 'no/such/dir' is not a directory. ...
    """
    if path is None:
        return load_default_model(device=device)
    if not Path(path).is_dir():
        raise ConfigError(
            f"model {path!r} is not a directory. Pass a local transformers model directory (config.json, weights, "
            f"tokenizer) with --model PATH, or omit --model to use the shipped tiny model ({DEFAULT_MODEL_PATH})."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    check_device(device)
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        _check_chat_template(tokenizer, path)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"model {path!r}: could not load a causal LM and its tokenizer from it "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); pass a directory "
                          "written by save_pretrained (--model PATH).") from None
    return model.eval(), tokenizer
