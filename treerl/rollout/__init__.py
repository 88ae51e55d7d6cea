"""treerl.rollout."""
