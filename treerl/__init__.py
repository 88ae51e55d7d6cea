"""treerl: agentic RL with Gymnasium tool-use environments and prefix-tree trajectories.

>>> import treerl
>>> "treerl/Calculator-v0" in treerl.registry
True
"""

from treerl.envs import Env, Task, ToolEnv, check_env, make, register, registry, tool

__version__ = "0.1.0"

__all__ = ["Env", "ToolEnv", "Task", "tool", "make", "register", "registry", "check_env", "__version__"]
