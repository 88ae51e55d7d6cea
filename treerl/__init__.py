"""treerl: agentic RL with Gymnasium tool-use environments and prefix-tree trajectories.

>>> import treerl
>>> "treerl/Calculator-v0" in treerl.registry
True
"""

from treerl.envs import Env, Task, ToolEnv, check_env, make, register, registry, tool

__version__ = "0.1.0"

__all__ = ["Env", "ToolEnv", "Task", "tool", "make", "register", "registry", "check_env", "GRPOConfig", "GRPOTrainer",
           "__version__"]


def __getattr__(name: str):
    # TRL's entry point (`from treerl import GRPOConfig, GRPOTrainer`), imported on first use: it loads torch.
    if name in ("GRPOConfig", "GRPOTrainer"):
        from treerl import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'treerl' has no attribute {name!r}")
