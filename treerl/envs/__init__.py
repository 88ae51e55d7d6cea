"""Environments: the Gymnasium contract for multi-turn tool use, tools, parsers, verifiers.

>>> import treerl
>>> env = treerl.make("treerl/Calculator-v0")
>>> obs, info = env.reset(seed=0)
>>> [m["role"] for m in obs]
['system', 'user']
"""

from treerl.envs.checker import EnvCheckError, check_env
from treerl.envs.core import Env, Message, Task, ToolEnv, ValidationReport
from treerl.envs.group import EnvGroup
from treerl.envs.parsers import PARSERS, ParseResult, ToolCall, ToolCallParser, get_parser
from treerl.envs.reasoning_gym import ReasoningGymEnv
from treerl.envs.registry import EnvSpec, make, register, registry
from treerl.envs.skyrl import SkyRLEnv
from treerl.envs.spaces import ChatMessages, Completion
from treerl.envs.text import TextEnv
from treerl.envs.tools import Tool, ToolResult, run_tool_call, tool
from treerl.errors import EnvError, ToolCallError, ToolErrorKind, ToolTimeout, TreerlError

from treerl.envs import builtin  # noqa: E402,F401  (registers the built-in environments)

__all__ = [
    "Env", "ToolEnv", "TextEnv", "SkyRLEnv", "ReasoningGymEnv", "EnvGroup", "Task", "Message", "ValidationReport",
    "ChatMessages", "Completion",
    "Tool", "tool", "ToolResult", "run_tool_call",
    "ToolCall", "ParseResult", "ToolCallParser", "PARSERS", "get_parser",
    "TreerlError", "EnvError", "ToolCallError", "ToolTimeout", "ToolErrorKind",
    "EnvSpec", "register", "make", "registry",
    "check_env", "EnvCheckError",
]
