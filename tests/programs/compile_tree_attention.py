"""Run by tests/test_triton_tree_attention.py in a process without TRITON_INTERPRET: compile the
tree-attention kernels for the GPU architectures given as JSON in argv[1] and print the
resources each needs, as JSON on the last line.

The test process runs the kernels under the interpreter, which ``@triton.jit`` fixed at import,
so compiling for a real GPU needs a fresh interpreter.
"""

import json
import sys

import torch

from treerl.kernels.triton_tree_attention import compile_for_gpu

if __name__ == "__main__":
    cases = json.loads(sys.argv[1])
    print(json.dumps([compile_for_gpu(arch, getattr(torch, dtype), d, sliding_window=w)
                      for arch, dtype, d, w in cases]))
