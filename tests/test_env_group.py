"""EnvGroup: one policy on a mix of environments, each task routed to one member."""

from __future__ import annotations

from collections import Counter

import pytest

import treerl
from treerl.envs import EnvError, EnvGroup, check_env
from treerl.envs.registry import make_group
from treerl.errors import ConfigError

MIX = "calc=treerl/Calculator-v0,guess=treerl/GuessNumber-v0"


def test_equal_weights_route_round_robin_and_weights_hold_in_every_stretch():
    env = treerl.make(MIX)
    assert [env.route(k) for k in range(6)] == ["calc", "guess"] * 3
    weighted = make_group(MIX, weights={"calc": 3, "guess": 1})
    for start in (0, 8, 1001):  # any 4 consecutive tasks: 3 calc, 1 guess
        assert Counter(weighted.route(k) for k in range(start, start + 4)) == {"calc": 3, "guess": 1}
    odd = make_group(MIX, weights=[0.7, 0.3])  # weights as a list, in order
    assert Counter(odd.route(k) for k in range(100)) == {"calc": 70, "guess": 30}
    assert {make_group(MIX, weights=[0, 1]).route(k) for k in range(10)} == {"guess"}


def test_routing_by_task_env_name_and_reset_determinism():
    env = treerl.make(MIX)
    _, info = env.reset(seed=0, options={"env": "guess"})
    assert info["env"] == "guess" and env.current == "guess" and env.tool_schemas == []
    _, info = env.reset(seed=1, options={"task": {"prompt": "What is 2+3?", "answer": "5", "env": "calc"}})
    assert info["env"] == "calc" and info["answer"] == "5" and env.tool_schemas[0]["function"]["name"] == "calculator"
    with pytest.raises(EnvError, match="no environment 'math'"):
        env.reset(seed=0, options={"env": "math"})
    # Seeded resets repeat (and a second group built alike agrees); unseeded ones follow the group's np_random.
    other = treerl.make(MIX)
    for seed in range(4):
        assert env.reset(seed=seed) == other.reset(seed=seed)
    env.reset(seed=7)
    other.reset(seed=7)
    assert [env.reset()[1]["env"] for _ in range(6)] == [other.reset()[1]["env"] for _ in range(6)]


def test_a_dataset_member_plays_its_rows_in_order():
    rows = [{"question": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(3)]
    env = EnvGroup({"calc": treerl.make("treerl/Calculator-v0"), "math": treerl.make("treerl/MathVerify-v0",
                                                                                       dataset=rows)})
    options = [env.task_options(i) for i in range(8)]
    assert [o["env"] for o in options] == ["calc", "math"] * 4
    assert [o["task_index"] for o in options if o["env"] == "math"] == [0, 1, 2, 0]
    _, info = env.reset(seed=3, options=options[3])
    assert info["task_id"] == "1" and info["answer"] == "2"


def test_the_group_passes_check_env_and_its_forks_are_independent():
    env = treerl.make(MIX)
    check_env(env)
    env.reset(seed=0)  # calc
    child = env.fork()
    assert child.current_env is not env.current_env
    child.step("\\boxed{1}")
    assert env.current_env.turn == 0 and child.current_env.turn == 1
    # A fork is a whole group: an idle member is forked when the fork first plays it, never shared in play,
    # and closing the fork leaves the original's members open.
    fork = env.fork()
    assert fork.envs["guess"] is env.envs["guess"]
    assert fork.reset(seed=1)[1]["env"] == "guess" and fork.envs["guess"] is not env.envs["guess"]
    closed = []
    env.envs["guess"].close = lambda: closed.append("guess")
    env.fork().close()
    assert closed == []


def test_bad_group_specs_say_what_to_do():
    with pytest.raises(ValueError, match="names no environment of the group"):
        make_group(MIX, math={"data_path": "x.jsonl"})
    with pytest.raises(TypeError):  # a member's own keyword it does not take
        make_group(MIX, guess={"no_such": 1})
    with pytest.raises(ConfigError, match="two environments called 'Calculator-v0'"):
        treerl.make("treerl/Calculator-v0,treerl/Calculator-v0")
    with pytest.raises(ValueError, match="reward/mean is another metric"):
        treerl.make("mean=treerl/Calculator-v0,treerl/GuessNumber-v0")
    with pytest.raises(ValueError, match="one per environment"):
        make_group(MIX, weights=[1])
    with pytest.raises(KeyError, match="treerl/Calculater-v0"):  # a misspelled member: its own close matches
        treerl.make("treerl/Calculater-v0,treerl/GuessNumber-v0")


def test_training_defaults_reach_members_unless_their_kwargs_set_them(tmp_path):
    from treerl.learners.grpo import GRPOConfig

    cfg = GRPOConfig(output_dir=str(tmp_path), env="calc=treerl/Calculator-v0,code=treerl/CodeSandbox-v0",
                     env_kwargs={"code": {"malformed_ends_episode": False}})
    env = cfg.train_env_factory()()
    assert env.envs["calc"].malformed_ends_episode is True
    assert env.envs["code"].malformed_ends_episode is False
