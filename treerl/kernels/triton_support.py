"""Triton where it can be imported: the modules, why not elsewhere, and whether kernels are interpreted.

Every Triton kernel module of treerl imports Triton through here, so "is it installed" and
"are kernels compiled or interpreted" are answered once. Triton is optional (it ships for
Linux, with the CUDA builds of torch): where it cannot be imported, ``triton`` and ``tl``
are None and :data:`IMPORT_ERROR` says why; the callers check before launching anything.

``@triton.jit`` decides when it decorates whether a kernel is compiled or interpreted, so
:data:`INTERPRETED` is the mode at import: ``TRITON_INTERPRET=1`` must be set before then to
run kernels on the CPU (the test suite does so).

>>> isinstance(INTERPRETED, bool)
True
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError as _error:  # the torch paths serve without it
    triton = tl = None
    IMPORT_ERROR: str | None = f"{type(_error).__name__}: {_error}"
else:
    IMPORT_ERROR = None

__all__ = ["IMPORT_ERROR", "INTERPRETED", "TRITON_MISSING", "interpreting", "tl", "triton"]

TRITON_MISSING: str | None = (
    None if IMPORT_ERROR is None
    else f"triton cannot be imported ({IMPORT_ERROR}); it ships with the CUDA builds of torch, or `pip install triton`"
)
"""Why Triton kernels cannot run at all here, as a sentence; None where Triton imports."""


def interpreting() -> bool:
    """Whether ``@triton.jit`` hands out interpreted kernels now."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)  # triton >= 3.3; older releases read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRETED: bool = interpreting()
"""True if kernels defined at import were defined for Triton's CPU interpreter; fixed for the process."""
