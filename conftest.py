"""Test-session setup shared by every test module and every doctest in ``treerl/``.

Triton kernels run on this CPU-only machine through Triton's interpreter, which must be
switched on before any kernel is defined (``@triton.jit`` reads it at decoration time), so it
is set here, at the repository root, before test modules or the package's modules (collected
for their doctests) import anything. On a machine with a GPU the real kernels run.
"""

import os


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Programs the tests run by path in a fresh interpreter; not test modules.
collect_ignore_glob = ["tests/programs/*"]
