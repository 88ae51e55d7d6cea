"""Malformed tool calls: ending the episode at reward 0 (``malformed_ends_episode``) vs an error message, and a
per-call reward penalty (``malformed_penalty``).

Without it, a malformed call costs a policy only a turn (the error message shows the right
format and the model tries again), so in training a group's malformed calls earn the same
advantage as clean ones and can grow step after step; ``treerl learn`` therefore ends training
episodes at a malformed call by default, while its held-out evaluation keeps the messages.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from _scripted import ScriptedPolicy

import treerl
from treerl.envs import ToolCall
from treerl.learners.core import build
from treerl.learners.evaluation import evaluate_policy
from treerl.learners.grpo import GRPOConfig
from treerl.models import load_default_model

ENV = "treerl/Calculator-v0"
MALFORMED = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}\n</tool_call>'  # a brace short


@pytest.fixture(scope="module")
def tiny():
    return load_default_model()


def test_a_malformed_call_ends_the_episode_at_reward_0_and_runs_no_other_call():
    env = treerl.make(ENV, malformed_ends_episode=True)
    env.reset(seed=0)
    good = env.parser.render([ToolCall("calculator", {"expression": "2 + 2"})])
    obs, reward, terminated, truncated, info = env.step(good + "\n" + MALFORMED)
    assert (obs, reward, terminated, truncated) == ([], 0.0, True, False)
    assert info["termination"] == "malformed_call"
    assert info["metrics"]["episode/malformed_call"] == 1 and info["metrics"]["tool_calls/malformed"] == 1
    assert "episode/final_answer" not in info["metrics"]
    assert [r["error"] for r in info["tool_calls"]] == ["malformed"]  # the well-formed call did not run
    assert "ended at a malformed tool call" in env.feedback()


def test_by_default_the_environment_answers_a_malformed_call_and_the_model_recovers():
    env = treerl.make(ENV)
    _, info = env.reset(seed=0)
    obs, reward, terminated, truncated, step_info = env.step(MALFORMED)
    assert not (terminated or truncated) and obs[0]["role"] == "tool" and "Could not parse" in obs[0]["content"]
    _, reward, terminated, _, _ = env.step(f"\\boxed{{{info['answer']}}}")
    assert terminated and reward == 1.0


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_malformed_ends_episode_must_be_a_bool(value):
    with pytest.raises(ValueError, match="malformed_ends_episode=.* must be true or false"):
        treerl.make(ENV, malformed_ends_episode=value)
    with pytest.raises(ValueError, match="malformed_ends_episode=.* must be true or false"):
        GRPOConfig(output_dir="runs/x", malformed_ends_episode=value)


def test_the_learner_sets_it_on_training_environments_unless_env_kwargs_does():
    assert GRPOConfig(output_dir="runs/x").train_env_factory()().malformed_ends_episode is True
    assert GRPOConfig(output_dir="runs/x", malformed_ends_episode=False).train_env_factory()().malformed_ends_episode \
        is False
    cfg = GRPOConfig(output_dir="runs/x", env_kwargs={"malformed_ends_episode": False})
    assert cfg.train_env_factory()().malformed_ends_episode is False
    assert cfg.train_env_factory(lambda: object())() is not None  # not a ToolEnv: left as it is


def test_training_episodes_end_at_a_malformed_call_and_the_evaluation_lets_the_model_recover(tiny, tmp_path):
    model, tok = tiny
    answer = {}

    def script(task_key: str, generation: int, turn: int) -> str:
        if task_key not in answer:
            answer[task_key] = treerl.make(ENV).reset(seed=int(task_key.split("-")[1]))[1]["answer"]
        return [MALFORMED, f"\\boxed{{{answer[task_key]}}}"][min(turn, 1)]

    policy = ScriptedPolicy(tok, script, end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = GRPOConfig(env=ENV, output_dir=str(tmp_path), steps=1, tasks_per_step=2, group_size=2, eval_episodes=0,
                     progress=False, sample_groups=0)
    run = build(cfg, model=model, tokenizer=tok, policy=policy)
    groups, stats = run.rollout()
    episodes = [e for g in groups for e in g.episodes]
    assert [e.termination for e in episodes] == ["malformed_call"] * 4
    assert all(e.metrics["episode/malformed_call"] == 1 for e in episodes)
    assert stats.summary()["terminations"] == {"malformed_call": 4}

    figures = evaluate_policy(dataclasses.replace(cfg, eval_episodes=4), policy, tok, run.eval_env_factory)  # what the start and end evaluations use
    assert figures["terminations"] == {"final_answer": 4} and figures["success_rate"] == 1.0
    assert figures["tool_calls"]["malformed"] == 4


# -- malformed_penalty: a malformed call costs reward, whether or not the episode goes on ----------------------------


def test_each_malformed_call_costs_the_penalty_and_the_model_still_recovers_to_success():
    env = treerl.make(ENV, malformed_penalty=0.25)
    _, info = env.reset(seed=0)
    good = env.parser.render([ToolCall("calculator", {"expression": "2 + 2"})])
    obs, reward, terminated, truncated, _ = env.step(MALFORMED + "\n" + MALFORMED + "\n" + good)
    assert reward == -0.5 and not (terminated or truncated)  # two broken calls; the clean one ran
    assert [m["content"] for m in obs][-1] == "4"
    obs, reward, terminated, _, _ = env.step(good)
    assert reward == 0.0  # clean calls cost nothing
    _, reward, terminated, _, _ = env.step(f"\\boxed{{{info['answer']}}}")
    assert terminated and reward == 1.0  # the final answer keeps its full reward: success is unchanged


def test_with_malformed_ends_episode_the_penalty_puts_the_ending_below_a_wrong_answer():
    env = treerl.make(ENV, malformed_ends_episode=True, malformed_penalty=0.1)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(MALFORMED + "\n" + MALFORMED + "\n" + MALFORMED)
    assert terminated and info["termination"] == "malformed_call" and reward == pytest.approx(-0.3)
    env = treerl.make(ENV, malformed_ends_episode=True)
    env.reset(seed=0)
    reward = env.step(MALFORMED)[1]
    assert reward == 0.0 and str(reward) == "0.0"  # no penalty: 0, not -0.0


@pytest.mark.parametrize("value", [-0.1, float("inf"), float("nan"), "0.1", True])
def test_malformed_penalty_must_be_a_finite_number_at_least_0(value):
    with pytest.raises(ValueError, match="malformed_penalty=.* must be a finite number >= 0"):
        treerl.make(ENV, malformed_penalty=value)
    if not isinstance(value, str):  # the CLI parses the flag as a float
        with pytest.raises(ValueError, match="malformed_penalty=.* must be a finite number >= 0"):
            GRPOConfig(output_dir="runs/x", malformed_penalty=value)


def test_the_learner_sets_the_penalty_on_training_environments_unless_env_kwargs_does():
    assert GRPOConfig(output_dir="runs/x").train_env_factory()().malformed_penalty == 0.0
    factory = pickle.loads(pickle.dumps(GRPOConfig(output_dir="runs/x", malformed_penalty=0.1).train_env_factory()))
    env = factory()  # pickled as AsyncGRPO sends it to its generator processes
    assert (env.malformed_penalty, env.malformed_ends_episode) == (0.1, True)
    cfg = GRPOConfig(output_dir="runs/x", malformed_penalty=0.1, env_kwargs={"malformed_penalty": 0.3,
                                                                             "malformed_ends_episode": False})
    assert cfg.train_env_factory()().malformed_penalty == 0.3
    assert cfg.eval_env_factory()().malformed_penalty == 0.3  # env_kwargs are the environment's own setting


def test_penalised_training_episodes_sum_their_steps_and_the_evaluation_counts_success(tiny, tmp_path):
    model, tok = tiny
    answer = {}

    def script(task_key: str, generation: int, turn: int) -> str:
        if task_key not in answer:
            answer[task_key] = treerl.make(ENV).reset(seed=int(task_key.split("-")[1]))[1]["answer"]
        return [MALFORMED + "\n" + MALFORMED, f"\\boxed{{{answer[task_key]}}}"][min(turn, 1)]

    policy = ScriptedPolicy(tok, script, end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = GRPOConfig(env=ENV, output_dir=str(tmp_path), steps=1, tasks_per_step=2, group_size=2, eval_episodes=0,
                     progress=False, sample_groups=0, malformed_ends_episode=False, malformed_penalty=0.25)
    run = build(cfg, model=model, tokenizer=tok, policy=policy)
    groups, stats = run.rollout()
    episodes = [e for g in groups for e in g.episodes]
    assert [(e.termination, e.rewards, e.reward) for e in episodes] == [("final_answer", [-0.5, 1.0], 0.5)] * 4
    assert stats.summary()["success_rate"] == 1.0 and stats.summary()["reward/mean"] == 0.5

    figures = evaluate_policy(dataclasses.replace(cfg, eval_episodes=4), policy, tok, run.eval_env_factory)
    assert figures["success_rate"] == 1.0 and figures["reward/mean"] == 1.0  # the evaluation has no penalty
    assert figures["tool_calls"]["malformed"] == 8
