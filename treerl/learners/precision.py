"""Mixed precision: float32 master weights and optimizer states, low-precision forward and backward.

A bfloat16 checkpoint trained in pure bfloat16 loses most small updates: bfloat16 keeps 8
significant bits, so an AdamW step of ``lr=1e-6`` on a weight of size ~1e-2 (a relative
change of 1e-4) rounds back to the same weight, and the optimizer's moments round too.
The usual remedy (TRL's ``bf16=True``, accelerate's ``mixed_precision``) is what this
module sets up:

- the **master weights** (and therefore AdamW's states) are float32 (``dtype="float32"``,
  the default; a bfloat16 checkpoint is upcast when loaded);
- the **forward and backward** of the decoder run under ``torch.autocast`` in bfloat16
  (``bf16``) or float16 (``fp16``, with a gradient scaler, since float16 gradients underflow);
- the **LM head, log-probs and the loss** stay float32: the hidden states leave the
  autocast region and are upcast before the fused log-prob head
  (:func:`treerl.learners.forward.packed_logprobs`); a bfloat16 or float16 head (``dtype``
  ``bfloat16``/``auto``) multiplies in its dtype unless ``fp32_head`` (TRL's
  ``cast_lm_head_to_fp32``) upcasts it, in the trainer and in the sampler;
- the **sampler** (the policy's own copy) runs in the compute precision: the autocast
  dtype when there is one, else the master weights' dtype. The sampler/trainer gap this
  leaves is what the importance weights correct.

``dtype="auto"`` keeps the checkpoint's dtype (pure low precision when it is bfloat16), and
:func:`resolve_precision` says so in its description.

>>> p = Precision(weights=torch.float32, autocast=None, device_type="cpu")
>>> p.describe(checkpoint=torch.bfloat16)
'weights float32 (checkpoint bfloat16, upcast), optimizer states float32, forward/backward float32, log-probs and loss float32, sampler float32'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DTYPES", "Precision", "resolve_precision", "checkpoint_dtype", "enable_gradient_checkpointing",
           "set_tf32", "usual_learning_rate", "check_learning_rate", "model_size"]

DTYPES: dict[str, torch.dtype | None] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                         "float16": torch.float16, "auto": None}
"""``--dtype`` choices: the master weights' dtype (``auto``: the checkpoint's)."""


def _name(dtype: torch.dtype | None) -> str:
    return "unknown" if dtype is None else str(dtype).removeprefix("torch.")


@dataclass
class Precision:
    """Which precision each part of a training step runs in, and the gradient scaler of float16."""

    weights: torch.dtype | None
    """Master weights and optimizer states (None: the checkpoint's own dtype)."""
    autocast: torch.dtype | None
    """The decoder's forward and backward under ``torch.autocast`` in this dtype (None: off)."""
    device_type: str = "cpu"
    reason: str = ""
    """Why autocast is on or off (e.g. "--bf16 not given; off on CPU")."""
    scaler: Any = field(default=None, repr=False)
    """A ``torch.amp.GradScaler`` for float16 autocast (None otherwise)."""
    fp32_head: bool = False
    """The LM head's logits in float32 from half-precision weights and hidden states (TRL's
    ``cast_lm_head_to_fp32``): the trainer's log-probs, and the sampler's logits."""

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """The region of the decoder's forward (its backward follows the same casts)."""
        if self.autocast is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.autocast):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled under float16 so that small gradients do not flush to zero."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def _scaled(self) -> bool:
        """Whether the scaler has scaled a loss yet (a first step that trained on nothing has not)."""
        return self.scaler is not None and getattr(self.scaler, "_scale", None) is not None

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring scaled gradients back to their true size (before clipping them)."""
        if self._scaled():
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; under float16, skipped when a gradient overflowed (the scale then shrinks)."""
        if not self._scaled():  # no scaler, or nothing scaled yet: the gradients are their true size
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def sampler_dtype(self, weights: torch.dtype) -> torch.dtype:
        """The policy copy's dtype: what the trainer computes in."""
        return self.autocast or weights

    def describe(self, checkpoint: torch.dtype | None = None, weights: torch.dtype | None = None) -> str:
        """One line for the startup summary: every part and its precision."""
        weights = self.weights or weights or checkpoint
        origin = ""
        if checkpoint is not None and checkpoint != weights:
            origin = f" (checkpoint {_name(checkpoint)}, {'upcast' if _bits(weights) > _bits(checkpoint) else 'cast'})"
        compute = f"{_name(self.autocast)} autocast" if self.autocast is not None else _name(weights)
        if self.scaler is not None:
            compute += " with loss scaling"
        head = "float32" if weights in (torch.float32, torch.float64) or self.autocast is not None else \
            "float32 (head cast to float32)" if self.fp32_head else \
            f"float32 (head in {_name(weights)}, accumulated in float32)"
        sampler = self.sampler_dtype(weights) if weights else None
        text = (f"weights {_name(weights)}{origin}, optimizer states {_name(weights)}, forward/backward {compute}, "
                f"log-probs and loss {head}, sampler {_name(sampler)}"
                f"{' (head float32)' if self.fp32_head and sampler in (torch.bfloat16, torch.float16) else ''}")
        return text + (f" [{self.reason}]" if self.reason else "")


def _bits(dtype: torch.dtype | None) -> int:
    return 0 if dtype is None else torch.finfo(dtype).bits


def checkpoint_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's floating-point parameters (the first one's)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _bf16_supported(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device_type == "cpu"


def resolve_precision(dtype: str, bf16: bool | None, fp16: bool, device: str | torch.device,
                      fp32_head: bool = False) -> Precision:
    """The :class:`Precision` of ``--dtype``/``--bf16``/``--fp16`` (and ``--cast-lm-head-to-fp32``) on ``device``.

    ``bf16=None`` (not given) turns bfloat16 autocast on for a CUDA GPU that supports it
    (TRL's default) and off elsewhere: on CPU, autocast is slower than float32 for small models.

    >>> resolve_precision("float32", None, False, "cpu").autocast is None
    True
    >>> resolve_precision("float32", True, False, "cpu").autocast
    torch.bfloat16
    >>> resolve_precision("float16", False, True, "cpu")
    Traceback (most recent call last):
    ...
    ValueError: fp16 autocast needs float32 master weights (the gradient scaler cannot unscale float16 gradients); use --dtype float32 --fp16, or --bf16.
    """
    device_type = torch.device(device).type
    weights = DTYPES[dtype]
    if fp16 and weights is not torch.float32:
        raise ValueError("fp16 autocast needs float32 master weights (the gradient scaler cannot unscale float16 "
                         "gradients); use --dtype float32 --fp16, or --bf16.")
    if fp16:
        scaler = torch.amp.GradScaler(device_type)
        return Precision(weights, torch.float16, device_type, reason="--fp16", scaler=scaler, fp32_head=fp32_head)
    if bf16 is None:
        on = device_type == "cuda" and _bf16_supported("cuda") and weights is torch.float32
        reason = ("bfloat16 autocast: the default on a CUDA GPU with bfloat16" if on else
                  f"no autocast: the default on {device_type} (--bf16 turns it on)")
        return Precision(weights, torch.bfloat16 if on else None, device_type, reason=reason, fp32_head=fp32_head)
    if bf16 and not _bf16_supported(device_type):
        raise ValueError(f"bf16=True: this {device_type} device does not support bfloat16; use --fp16 (float16 with "
                         "a loss scaler) or --bf16 false.")
    return Precision(weights, torch.bfloat16 if bf16 else None, device_type, reason="--bf16" if bf16 else "--bf16 false",
                     fp32_head=fp32_head)


def set_tf32(tf32: bool | None, device: str | torch.device) -> None:
    """TRL's ``tf32`` on a CUDA ``device``: float32 matmuls and convolutions in TensorFloat-32 (True) or in
    full float32 (False), set as transformers sets them (torch's ``fp32_precision``, or before torch 2.9 its
    ``allow_tf32`` flags), for the whole process as there. None, or another device: left as they are (a CPU
    computes float32 in float32 either way)."""
    if tf32 is None or torch.device(device).type != "cuda":
        return
    if hasattr(torch.backends, "fp32_precision"):  # torch >= 2.9
        torch.backends.fp32_precision = "tf32" if tf32 else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in the backward (transformers' own checkpointing, non-reentrant).

    Non-reentrant checkpointing passes keyword arguments (the tree layout of tree attention)
    through to the recomputed layer, and needs no input that requires grad, so a LoRA model
    whose embeddings are frozen works without ``enable_input_require_grads``.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing: {type(base).__name__} does not support gradient checkpointing; "
                         "drop --gradient-checkpointing.")
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x's name; the old one warns
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


SMALL_MODEL_PARAMS = 100_000_000
"""Below this many parameters a model counts as small (the shipped tiny model has ~2M)."""


def usual_learning_rate(num_params: int, lora: bool) -> tuple[float, float, float]:
    """``(default, low, high)``: the learning rate RL fine-tuning usually takes at this size.

    Large models are fine-tuned at 1e-6 (TRL's GRPO examples, 1e-7 to 1e-5); LoRA adapters
    take about ten times more; a tiny model trained from scratch-like weights takes 2e-4.

    >>> usual_learning_rate(2_000_000, lora=False)
    (0.0002, 1e-05, 0.001)
    >>> usual_learning_rate(600_000_000, lora=True)
    (1e-05, 1e-06, 0.0001)
    """
    if num_params < SMALL_MODEL_PARAMS:
        return 2e-4, 1e-5, 1e-3
    if lora:
        return 1e-5, 1e-6, 1e-4
    return 1e-6, 1e-7, 1e-5


def model_size(num_params: int) -> str:
    """A parameter count as people write it.

    >>> model_size(600_000_000), model_size(1_240_000_000), model_size(1_700_000), model_size(25_000)
    ('600M', '1.2B', '1.7M', '0.025M')
    """
    if num_params >= 1e9:
        return f"{num_params / 1e9:.1f}B"
    return f"{num_params / 1e6:.0f}M" if num_params >= 1e7 else f"{num_params / 1e6:.2g}M"


def check_learning_rate(lr: float | None, num_params: int, lora: bool) -> tuple[float, str | None]:
    """``(learning rate to use, warning or None)``: the default for the size when ``lr`` is None,
    and a warning when the given one is outside the usual range.

    >>> check_learning_rate(2e-4, 600_000_000, lora=False)[1]
    'learning_rate=0.0002 is far above the usual range for a 600M-parameter model fine-tuning all weights (1e-07 to 1e-05, default 1e-06): expect the policy to collapse within a few steps; try --learning-rate 1e-06.'
    """
    default, low, high = usual_learning_rate(num_params, lora)
    if lr is None:
        return default, None
    what = f"a {model_size(num_params)}-parameter model {'with LoRA' if lora else 'fine-tuning all weights'}"
    if lr > high:
        return lr, (f"learning_rate={lr:g} is far above the usual range for {what} ({low:g} to {high:g}, default "
                    f"{default:g}): expect the policy to collapse within a few steps; try --learning-rate {default:g}.")
    if lr < low:
        return lr, (f"learning_rate={lr:g} is far below the usual range for {what} ({low:g} to {high:g}, default "
                    f"{default:g}): the weights will barely move; try --learning-rate {default:g}.")
    return lr, None
