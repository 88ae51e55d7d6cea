"""Built-in environments, registered on ``import treerl`` (their modules load on first use)."""

from treerl.envs.registry import register

BUILTIN_ENVS = {
    "treerl/Calculator-v0": "treerl.envs.builtin.calculator:CalculatorEnv",
    "treerl/MathVerify-v0": "treerl.envs.builtin.math_verify:MathVerifyEnv",
    "treerl/CodeSandbox-v0": "treerl.envs.builtin.code_sandbox:CodeSandboxEnv",
    "treerl/GuessNumber-v0": "treerl.envs.builtin.guess_number:GuessNumberEnv",
}

for _id, _entry_point in BUILTIN_ENVS.items():
    register(_id, _entry_point, override=True)
