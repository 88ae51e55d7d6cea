"""SkyRLEnv: SkyRL-Gym's text environments and datasets played by treerl.

The first tests use a stand-in that follows ``skyrl_gym.envs.base_text_env.BaseTextEnv``'s
interface exactly, so they run without the package; the last ones play the real package's gsm8k
environments and skip where skyrl-gym is not installed (``pip install 'treerl[skyrl]'``).
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

import treerl
from treerl.envs import EnvError, SkyRLEnv, check_env
from treerl.errors import MissingExtraError


class _Guess:
    """BaseTextEnv's interface without the package: ``__init__(env_config, extras)``, ``init(prompt) ->
    (messages, metadata)``, ``step(action) -> {observations, reward, done, metadata, postprocessed_action}``,
    ``get_metrics()``, ``close()``. Guess the number in ``reward_spec.ground_truth`` within ``max_turns``."""

    closed: list[int] = []

    def __init__(self, env_config=None, extras={}):  # noqa: B006 - SkyRL's signature
        assert "reward_spec" in extras, "reward_spec field is required"
        self.secret = str(extras["reward_spec"]["ground_truth"])
        self.max_turns = extras.get("max_turns", 3)
        self.hint = (env_config or {}).get("hint", "Try again.")
        self.turns = 0
        self.tool_groups, self.tool_to_toolgroup = [], {}

    def init(self, prompt):
        return [{"role": "system", "content": "Answer with a number."}, *prompt], {"secret_len": len(self.secret)}

    def step(self, action):
        self.turns += 1
        right = action.strip() == self.secret
        done = right or self.turns >= self.max_turns
        obs = [] if done else [{"role": "user", "content": self.hint}]
        return {"observations": obs, "reward": 1 if right else 0, "done": done,
                "metadata": {"right": right, "guess": action.strip()}, "postprocessed_action": None}

    def get_metrics(self):
        return {"guesses": self.turns}

    def close(self):
        _Guess.closed.append(id(self))


def _rows(n=2, env_class="guess"):
    return [{"data_source": "tests", "prompt": [{"role": "user", "content": f"Guess my number ({i})."}],
             "env_class": env_class, "reward_spec": {"method": "rule", "ground_truth": str(i + 2)},
             "extra_info": {"index": i}} for i in range(n)]


def test_a_base_text_env_plays_with_its_rows_extras_rewards_ends_and_metadata():
    env = SkyRLEnv(_Guess, dataset=_rows(), env_config={"hint": "Higher or lower?"}, max_turns=2)
    obs, info = env.reset(seed=0, options={"task_index": 1})
    assert obs == [{"role": "system", "content": "Answer with a number."},
                   {"role": "user", "content": "Guess my number (1)."}]
    # The row without prompt and env_class is SkyRL's extras (max_turns added, as SkyRL's generator does).
    assert info["row"] == {"data_source": "tests", "reward_spec": {"method": "rule", "ground_truth": "3"},
                           "extra_info": {"index": 1}, "max_turns": 2}
    assert info["answer"] == "3" and info["task_id"] == "1" and info["metadata"] == {"secret_len": 1}
    assert env.env.hint == "Higher or lower?" and env.env.max_turns == 2

    obs, reward, terminated, truncated, info = env.step("7")
    assert obs == [{"role": "user", "content": "Higher or lower?"}]
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert type(reward) is float and info["metadata"] == {"right": False, "guess": "7"}
    assert info["metrics"] == {"turns": 1}
    assert env.episode_metrics() == {"right": 0.0, "guesses": 1.0}  # the metadata's numbers only, and get_metrics()
    obs, reward, terminated, truncated, info = env.step("3")
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert env.episode_metrics() == {"right": 1.0, "guesses": 2.0}  # a later step's replaces an earlier one's
    with pytest.raises(EnvError, match="finished"):
        env.step("3")


def test_max_turns_truncates_an_environment_that_does_not_end():
    class Endless(_Guess):
        def step(self, action):
            return {**super().step(action), "done": False, "observations": [{"role": "user", "content": "More."}]}

    env = SkyRLEnv(Endless, dataset=_rows(), max_turns=2)
    env.reset(seed=0, options={"task_index": 0})
    assert env.step("1")[2:4] == (False, False)
    _, _, terminated, truncated, info = env.step("1")
    assert (terminated, truncated, info["termination"]) == (False, True, "max_turns")


def test_fork_copies_the_skyrl_environment_and_reset_and_close_close_it():
    env = SkyRLEnv(_Guess, dataset=_rows())
    env.reset(seed=0, options={"task_index": 0})
    first = env.env
    fork = env.fork()
    assert fork.env is not env.env and fork.dataset is env.dataset  # the rows are shared, read-only
    fork.step("9")
    assert fork.env.turns == 1 and env.env.turns == 0
    assert env.step("2")[1:3] == (1.0, True)
    env.reset(seed=1)  # a new episode closes the last one's environment
    assert id(first) in _Guess.closed
    second = env.env
    env.close()
    assert id(second) in _Guess.closed and env.env is None
    with pytest.warns(UserWarning, match="no gold answers"):
        check_env(SkyRLEnv(_Guess, dataset=_rows()))  # Gymnasium's checker and treerl's pass


def test_rows_and_environments_that_cannot_play_say_why():
    with pytest.raises(ValueError, match="needs its tasks"):
        SkyRLEnv(_Guess)
    with pytest.raises(ValueError, match="row 0 has no 'prompt' column"):
        SkyRLEnv(_Guess, dataset=[{"question": "1?"}])
    env = SkyRLEnv(_Guess, dataset=[{"prompt": "Guess.", "env_class": "guess"}])  # no reward_spec
    with pytest.raises(EnvError, match=r"_Guess cannot be built from dataset row 0: AssertionError: reward_spec"):
        env.reset(seed=0)
    env = SkyRLEnv(_Guess, dataset=[{"prompt": "Guess.", "reward_spec": {"ground_truth": "1"}}])
    assert env.reset(seed=0)[0][-1] == {"role": "user", "content": "Guess."}  # a string prompt: one user message

    class Broken(_Guess):
        def step(self, action):
            return None  # BaseTextEnv.step's body is `pass`

    env = SkyRLEnv(Broken, dataset=_rows())
    env.reset(seed=0)
    with pytest.raises(EnvError, match=r"Broken.step\(\) returned None: a SkyRL-Gym step returns"):
        env.step("1")


def test_a_skyrl_id_without_the_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # import skyrl_gym raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'treerl\[skyrl\]'"):
        treerl.make("skyrl/gsm8k", dataset=_rows(env_class="gsm8k"))
    assert treerl.registry["skyrl/gsm8k"].kwargs == {"env_class": "gsm8k"}  # registered on first use


def test_the_command_line_names_the_missing_extra_not_the_flag(monkeypatch, capsys, tmp_path):
    from treerl.cli import main

    monkeypatch.setitem(sys.modules, "skyrl_gym", None)
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(_rows(env_class="gsm8k")[0]) + "\n")
    assert main(["eval", "--env", "skyrl/gsm8k", "--env-kwargs", json.dumps({"data_path": str(path)})]) == 2
    err = capsys.readouterr().err
    assert "pip install 'treerl[skyrl]'" in err and "cannot be built with them" not in err


def test_the_engine_plays_a_skyrl_environment_and_records_its_metrics():
    from _scripted import ScriptedPolicy

    from treerl.models import load_default_model
    from treerl.rollout.engine import RolloutEngine

    _, tok = load_default_model()
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    policy = ScriptedPolicy(tok, lambda task, g, turn: str(turn + g + 2), end_id=end_id)
    factory = lambda: SkyRLEnv(_Guess, dataset=_rows(), max_turns=3)  # noqa: E731
    groups, stats = asyncio.run(RolloutEngine(policy, tok, seed=0).run(factory, "tests/SkyRLGuess", range(2), 2))
    # Task 0's secret is 2: generation 0 guesses 2 at once, generation 1 guesses 3, 4, 5 and runs out of turns.
    [first, second] = groups[0].episodes
    assert (first.reward, first.termination, first.metrics["env/guesses"]) == (1.0, "terminated", 1.0)
    assert (second.reward, second.termination, second.metrics["turns"]) == (0.0, "terminated", 3)
    assert (first.metrics["env/right"], second.metrics["env/right"], second.metrics["env/guesses"]) == (1.0, 0.0, 3.0)
    # Averaged as SkyRL's default aggregation does, over the episodes (task 1's secret is 3: generation 0 guesses 2
    # then 3, generation 1 guesses 3 at once).
    assert stats.summary()["env_metrics"] == {"env/guesses": (1 + 3 + 2 + 1) / 4, "env/right": 0.75}
    assert groups[0].info["answer"] == "2" and groups[1].info["answer"] == "3"
    text = tok.decode(second.token_ids)
    assert "Answer with a number." in text and text.count("Try again.") == 2


# -- the real package ------------------------------------------------------------------------------------------------


def _gsm8k_rows(env_classes=("gsm8k",)):
    """Rows as SkyRL's gsm8k preprocessing writes them."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + 2? Let's think step by step and output the final "
                                                    "answer after \"####\"."}],
             "env_class": env_classes[i % len(env_classes)],
             "reward_spec": {"method": "rule", "ground_truth": str(i + 2)},
             "extra_info": {"split": "train", "index": i}} for i in range(4)]


def test_skyrl_gyms_gsm8k_plays_forks_and_passes_the_checker():
    pytest.importorskip("skyrl_gym", reason="the SkyRL-Gym tests need the skyrl extra (pip install 'treerl[skyrl]')")
    env = treerl.make("skyrl/gsm8k", dataset=_gsm8k_rows())
    assert env.spec.id == "skyrl/gsm8k" and type(env.env_class) is str
    obs, info = env.reset(seed=0, options={"task_index": 1})
    assert obs[0]["content"].startswith("What is 1 + 2?") and info["answer"] == "3"
    fork = env.fork()
    assert fork.step("1 + 2 = 3\n#### 3") == ([], 1.0, True, False, {"turn": 1, "metadata": {}, "metrics": {"turns": 1},
                                                                        "termination": None})
    assert env.step("#### 4")[1:3] == (0.0, True)  # the fork's episode was its own
    assert env.reset(seed=0, options={"task_index": 0})[1]["answer"] == "2"
    assert env.step("no answer")[1] == 0.0  # gsm8k's int 0, as a float
    with pytest.warns(UserWarning, match="no gold answers"):
        check_env(treerl.make("skyrl/gsm8k", dataset=_gsm8k_rows()))
    with pytest.raises(LookupError, match="Did you mean 'gsm8k'"):
        treerl.make("skyrl/gsm8", dataset=_gsm8k_rows())
    with pytest.raises(ValueError, match="row 1 has env_class='gsm8k_multi_turn'.*--env skyrl/gsm8k,skyrl/gsm8k_m"):
        treerl.make("skyrl/gsm8k", dataset=_gsm8k_rows(("gsm8k", "gsm8k_multi_turn")))


def test_a_mixed_skyrl_parquet_dataset_plays_on_a_group(tmp_path):
    pytest.importorskip("skyrl_gym", reason="the SkyRL-Gym tests need the skyrl extra (pip install 'treerl[skyrl]')")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    path = tmp_path / "mix.parquet"
    pq.write_table(pyarrow.Table.from_pylist(_gsm8k_rows(("gsm8k", "gsm8k_multi_turn"))), path)
    env = treerl.make("skyrl/gsm8k,skyrl/gsm8k_multi_turn", data_path=str(path), gsm8k_multi_turn={"max_turns": 2})
    played = []
    for k in range(4):
        obs, info = env.reset(seed=k, options=env.task_options(k))
        played.append((info["env"], info["answer"], env.step("#### 0")[0]))
    assert [p[:2] for p in played] == [("gsm8k", "2"), ("gsm8k_multi_turn", "3"), ("gsm8k", "4"),
                                      ("gsm8k_multi_turn", "5")]
    # gsm8k ends after one answer; the multi-turn one asks again (max_turns reached its extras).
    assert played[0][2] == [] and "final numeric answer" in played[1][2][0]["content"]


def test_treerl_learn_trains_on_skyrl_gsm8k(tmp_path):
    pytest.importorskip("skyrl_gym", reason="the SkyRL-Gym tests need the skyrl extra (pip install 'treerl[skyrl]')")
    from treerl.cli import main

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_rows()))
    out = tmp_path / "run"
    assert main(["learn", "--env", "skyrl/gsm8k", "--env-kwargs", json.dumps({"data_path": str(path)}),
                 "--output-dir", str(out), "--steps", "1", "--tasks-per-step", "2", "--group-size", "2",
                 "--max-new-tokens", "8", "--eval-episodes", "0", "--num-threads", "1", "--progress", "false"]) == 0
    [metrics] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["step"] == 1 and metrics["reward/mean"] == metrics["reward/mean"]  # finite
    from treerl.rollout import read_groups

    [groups] = [list(read_groups(p)) for p in sorted((out / "trajectories").glob("*.jsonl"))]
    assert [g.info["answer"] for g in groups] == ["2", "3"] and groups[0].env_id == "skyrl/gsm8k"
