"""ReasoningGymEnv: reasoning-gym's procedural datasets played by treerl.

The first tests use a stand-in that follows ``reasoning_gym.dataset.ProceduralDataset``'s interface
(``__len__``, ``__getitem__`` giving ``question``/``answer``/``metadata``, ``score_answer(answer,
entry)``), so they run without the package; the last ones play the real package's datasets and skip
where reasoning-gym is not installed (``pip install 'treerl[reasoning-gym]'``).
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

import treerl
from treerl.envs import ReasoningGymEnv, check_env
from treerl.envs.reasoning_gym import SYSTEM_PROMPT, extract_answer
from treerl.errors import MissingExtraError

_NEEDS_RG = "the reasoning-gym tests need the reasoning-gym extra (pip install 'treerl[reasoning-gym]')"


class _Sums:
    """ProceduralDataset's interface without the package: entry ``i`` is ``i + seed``'s sum with 1; partial
    credit (0.5) for the right number written with a trailing period, as reasoning-gym's scorers grade
    near misses; ``"boom"`` makes the scorer raise."""

    def __init__(self, size=8, seed=0):
        self.size, self.seed = size, seed

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        a = i + self.seed
        return {"question": f"What is {a} + 1?", "answer": str(a + 1), "metadata": {"a": a}}

    def score_answer(self, answer, entry):
        if answer == "boom":
            raise ValueError("cannot parse")
        if answer is None:
            return 0.0
        return 1.0 if answer == entry["answer"] else 0.5 if answer == entry["answer"] + "." else 0.0


def test_an_entry_is_posed_and_its_answer_tag_scored_by_the_datasets_own_scorer():
    env = ReasoningGymEnv(generator=_Sums())
    obs, info = env.reset(seed=0, options={"task_index": 3})
    assert obs == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 3 + 1?"}]
    assert (info["task_id"], info["answer"]) == ("3", "4")
    obs, reward, terminated, truncated, info = env.step("3 + 1 = 4.\n<answer>4</answer>")
    assert (obs, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info["metrics"]["rg/answered"] == 1 and info["termination"] == "final_answer"

    env.reset(seed=0, options={"task_index": 3})
    assert env.step("<answer> 4. </answer>")[1] == 0.5  # the scorer's partial credit is the reward
    env.reset(seed=0, options={"task_index": 3})
    _, reward, terminated, _, info = env.step("The answer is 4.")  # no tag: the scorer sees None
    assert (reward, terminated, info["metrics"]["rg/answered"]) == (0.0, True, 0)
    assert "no <answer>" in env.feedback()
    env.reset(seed=0, options={"task_index": 3})
    _, reward, _, _, info = env.step("<answer>boom</answer>")  # a scorer that raises scores 0, counted
    assert (reward, info["metrics"]["rg/score_error"]) == (0.0, 1)


def test_tasks_are_drawn_by_the_seed_and_the_generator_is_shared_by_forks():
    env = ReasoningGymEnv(generator=_Sums(size=100))
    drawn = [env.reset(seed=s)[1]["task_id"] for s in range(5)]
    assert drawn == [env.reset(seed=s)[1]["task_id"] for s in range(5)] and len(set(drawn)) > 1
    env.reset(seed=0, options={"task_index": 7})
    fork = env.fork()
    assert fork.generator is env.generator and fork.task.answer == "8"
    assert fork.step("<answer>8</answer>")[1] == 1.0 and not env.done  # the fork's episode is its own
    assert env.validate(num_tasks=4).ok
    check_env(env)


def test_extract_answer_reads_the_last_answer_tag_as_reasoning_gym_does():
    assert extract_answer("<answer>1</answer> no, <answer>\n 2 \n</answer>") == "2"
    assert extract_answer("<answer>a\nb</answer>") == "a\nb"
    assert extract_answer("<answer>unclosed") is None and extract_answer("") is None


def test_a_dataset_and_a_generator_cannot_both_be_given_or_neither():
    with pytest.raises(ValueError, match="needs one dataset"):
        ReasoningGymEnv()
    with pytest.raises(ValueError, match="needs one dataset"):
        ReasoningGymEnv("leg_counting", generator=_Sums())
    with pytest.raises(ValueError, match="configure a dataset built by name"):
        ReasoningGymEnv(generator=_Sums(), min_animals=2)
    with pytest.raises(ValueError, match="no entries"):
        ReasoningGymEnv(generator=_Sums(size=0))


def test_an_rg_id_without_the_package_names_the_extra(monkeypatch, capsys):
    from treerl.cli import main

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'treerl\[reasoning-gym\]'"):
        treerl.make("rg/leg_counting")
    assert treerl.registry["rg/leg_counting"].kwargs == {"dataset_name": "leg_counting"}  # registered on first use
    assert main(["eval", "--env", "rg/leg_counting", "--env-kwargs", json.dumps({"size": 5})]) == 2
    err = capsys.readouterr().err
    assert "pip install 'treerl[reasoning-gym]'" in err and "cannot be built with them" not in err


def test_the_engine_plays_a_generator_and_records_the_score_and_metrics():
    from _scripted import ScriptedPolicy

    from treerl.models import load_default_model
    from treerl.rollout.engine import RolloutEngine

    _, tok = load_default_model()
    end_id = tok.convert_tokens_to_ids("<|im_end|>")

    class Ones(_Sums):  # every answer is 1, so the script can know it
        def __getitem__(self, i):
            return {"question": f"What is {i} - {i - 1}?", "answer": "1", "metadata": {}}

    # Generation 0 answers right; generation 1 forgets the tag.
    policy = ScriptedPolicy(tok, lambda task, g, turn: "<answer>1</answer>" if g == 0 else "1", end_id=end_id)
    factory = lambda: ReasoningGymEnv(generator=Ones())  # noqa: E731
    groups, stats = asyncio.run(RolloutEngine(policy, tok, seed=0).run(factory, "tests/RGSums", range(2), 2))
    [right, untagged] = groups[0].episodes
    assert (right.reward, right.metrics["rg/answered"], right.metrics["env/answered"]) == (1.0, 1, 1)
    assert (untagged.reward, untagged.metrics["rg/answered"], untagged.metrics["env/answered"]) == (0.0, 0, 0)
    summary = stats.summary()  # what learn logs per step: the share of replies with a tag
    assert summary["env_metrics"] == {"env/answered": 0.5, "env/score_error": 0.0}


# -- the real package ------------------------------------------------------------------------------------------------


def test_reasoning_gyms_datasets_play_score_and_pass_the_checker():
    reasoning_gym = pytest.importorskip("reasoning_gym", reason=_NEEDS_RG)
    from reasoning_gym.utils import SYSTEM_PROMPTS
    from reasoning_gym.utils import extract_answer as rg_extract_answer

    assert SYSTEM_PROMPT == SYSTEM_PROMPTS["default"]
    for text in ("<answer>1</answer> then <answer> 2 </answer>", "<answer>\na\nb\n</answer>", "none", "<answer></answer>"):
        assert extract_answer(text) == rg_extract_answer(text)

    env = treerl.make("rg/leg_counting", size=20, seed=1)
    assert env.spec.id == "rg/leg_counting" and len(env.dataset) == 20
    entry = reasoning_gym.create_dataset("leg_counting", size=20, seed=1)[5]
    obs, info = env.reset(seed=0, options={"task_index": 5})
    assert obs[-1]["content"] == entry["question"] and info["answer"] == entry["answer"]
    assert env.step(f"Counting...\n<answer>{entry['answer']}</answer>")[1] == 1.0
    env.reset(seed=0, options={"task_index": 5})
    assert env.step(f"<answer>{int(entry['answer']) + 1}</answer>")[1] == 0.0
    check_env(env)  # gold answers earn 1.0
    with pytest.raises(LookupError, match="Did you mean 'leg_counting'"):
        treerl.make("rg/leg_countin")
    with pytest.raises(TypeError, match=r"'min_animal' is no field.*'min_animals'"):
        treerl.make("rg/leg_counting", min_animal=2)
    assert treerl.make("rg/leg_counting", min_animals=2, max_animals=2).generator.config.max_animals == 2


def test_a_group_of_reasoning_gym_datasets_plays_each_with_its_own_config():
    pytest.importorskip("reasoning_gym", reason=_NEEDS_RG)
    env = treerl.make("rg/leg_counting,rg/basic_arithmetic", leg_counting={"size": 10, "seed": 1},
                      basic_arithmetic={"size": 10, "seed": 2})
    played = []
    for k in range(4):
        obs, info = env.reset(seed=k, options=env.task_options(k))
        played.append(info["env"])
        assert env.step(f"<answer>{info['answer']}</answer>")[1] == 1.0
    assert set(played) == {"leg_counting", "basic_arithmetic"}
    check_env(env)


def test_treerl_learn_trains_on_an_rg_dataset(tmp_path):
    pytest.importorskip("reasoning_gym", reason=_NEEDS_RG)
    from treerl.cli import main
    from treerl.rollout import read_groups

    out = tmp_path / "run"
    assert main(["learn", "--env", "rg/leg_counting", "--env-kwargs", json.dumps({"size": 50, "seed": 1}),
                 "--output-dir", str(out), "--steps", "1", "--tasks-per-step", "2", "--group-size", "2",
                 "--max-new-tokens", "8", "--eval-episodes", "0", "--num-threads", "1", "--progress", "false"]) == 0
    [metrics] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["step"] == 1 and metrics["reward/mean"] == metrics["reward/mean"]  # finite
    [groups] = [list(read_groups(p)) for p in sorted((out / "trajectories").glob("*.jsonl"))]
    assert groups[0].env_id == "rg/leg_counting" and all(g.info["answer"].isdigit() for g in groups)
