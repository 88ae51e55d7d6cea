"""A new tool, environment and verifier in about 40 lines.

    python examples/custom_env.py          # plays the gold answer once
    treerl envs --import examples/custom_env.py   # lists it with the built-in environments
"""

import numpy as np

import treerl
from treerl.envs import Task, ToolCall, ToolEnv, tool
from treerl.envs.verifiers import math_verify_reward

PRICES = {"apple": 3, "bread": 5, "milk": 4, "cheese": 9}


@tool
def price(item: str) -> int:
    """Look up the price of one item in the shop.

    Args:
        item: The item's name, e.g. "apple".
    """
    if item not in PRICES:
        raise KeyError(f"no item {item!r}; the shop sells {sorted(PRICES)}")
    return PRICES[item]


class ShoppingEnv(ToolEnv):
    """What does a basket cost? Look prices up, then answer in \\boxed{}."""

    description = "Total the price of a shopping basket with a price(item) tool."
    system_prompt = "Use the price tool for each item, then give the total as \\boxed{number}."
    tool_list = (price,)

    def sample_task(self, rng: np.random.Generator) -> Task:
        items = [str(i) for i in rng.choice(sorted(PRICES), size=2, replace=False)]
        total = sum(PRICES[i] for i in items)
        return Task(prompt=f"How much do {items[0]} and {items[1]} cost together?", answer=str(total), info={"items": items})

    def score(self, task: Task, completion: str) -> float:  # the verifier
        return math_verify_reward(completion, task.answer)

    def gold_actions(self, task: Task) -> list[str]:
        calls = [ToolCall("price", {"item": i}) for i in task.info["items"]]
        return [self.parser.render(calls), f"\\boxed{{{task.answer}}}"]


treerl.register("examples/Shopping-v0", ShoppingEnv, override=True)

if __name__ == "__main__":
    env = treerl.make("examples/Shopping-v0")
    obs, info = env.reset(seed=0)
    for action in env.gold_actions(env.task):
        obs, reward, terminated, truncated, info = env.step(action)
        print(f"reward={reward} terminated={terminated} observation={obs}")
