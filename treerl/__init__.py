"""treerl: agentic RL with Gymnasium tool-use environments and prefix-tree trajectories."""

from treerl.envs.registry import make, register, registry

__version__ = "0.1.0"

__all__ = ["make", "register", "registry", "__version__"]
