"""treerl: agentic RL with Gymnasium tool-use environments and prefix-tree trajectories.

>>> import treerl
>>> "treerl/Calculator-v0" in treerl.registry
True
"""

from treerl.envs import Env, Task, ToolEnv, check_env, make, register, registry, tool

__version__ = "0.1.0"

_TRAINER_API = ("GRPOConfig", "GRPOTrainer", "SDPOConfig", "SDPOTrainer", "AsyncGRPOConfig", "AsyncGRPOTrainer")

__all__ = ["Env", "ToolEnv", "Task", "tool", "make", "register", "registry", "check_env", *_TRAINER_API,
           "__version__"]


def __getattr__(name: str):
    # TRL's entry points (`from treerl import GRPOConfig, GRPOTrainer`, and SDPO's and AsyncGRPO's as TRL's
    # experimental ones), imported on first use: they load torch.
    if name in _TRAINER_API:
        from treerl import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'treerl' has no attribute {name!r}")
