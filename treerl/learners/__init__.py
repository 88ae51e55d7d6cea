"""treerl.learners."""
