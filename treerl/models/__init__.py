"""treerl.models."""
