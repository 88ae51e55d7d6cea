"""treerl.kernels."""
