"""treerl.agents."""
