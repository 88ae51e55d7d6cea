"""EnvGroup: one policy on a mix of environments, each task routed to one member."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from pathlib import Path

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


def test_shuffle_dataset_plays_each_pass_over_the_rows_in_an_order_of_its_own():
    """TRL's shuffle_dataset: each pass over a dataset's rows is a permutation of its own, TRL's sampler's
    (torch.randperm passes from one generator seeded with the run's seed); a group shuffles each member's rows,
    and a mixed dataset's rows (which set the mix) as one; without a seed the rows play as written."""
    import torch
    from transformers import AutoTokenizer

    from treerl.learners.grpo import GRPOConfig
    from treerl.models import default_model_path
    from treerl.rollout.engine import task_options

    generator = torch.Generator().manual_seed(3)
    passes = [torch.randperm(5, generator=generator).tolist() for _ in range(2)]
    rows = [{"question": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(5)]
    env = treerl.make("treerl/MathVerify-v0", dataset=rows)
    assert [task_options(env, k, 3)["task_index"] for k in range(10)] == passes[0] + passes[1]
    assert [task_options(env, k)["task_index"] for k in range(10)] == list(range(5)) * 2
    group = EnvGroup({"calc": treerl.make("treerl/Calculator-v0"), "math": env})
    math = [o["task_index"] for o in (task_options(group, k, 3) for k in range(20)) if o["env"] == "math"]
    assert math == passes[0] + passes[1]  # the member's own passes; calc's tasks are drawn by seed
    mixed = make_group("calc=treerl/Calculator-v0,math=treerl/MathVerify-v0", dataset=_mixed_rows() * 2)
    as_written = [tuple(task_options(mixed, k).values()) for k in range(6)]
    shuffled = [[tuple(task_options(mixed, k, 3).values()) for k in range(6 * p, 6 * p + 6)] for p in range(2)]
    assert all(sorted(s) == sorted(as_written) for s in shuffled) and as_written not in shuffled
    assert shuffled[0] != shuffled[1]
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    assert GRPOConfig(output_dir="x", seed=3, shuffle_dataset=True).engine(None, tokenizer, seed=3).shuffle_seed == 3
    # treerl learn's default plays the rows as written
    assert GRPOConfig(output_dir="x", seed=3).engine(None, tokenizer, seed=3).shuffle_seed is None


def test_shuffled_passes_play_whole_steps_as_trls_sampler():
    """TRL's RepeatSampler leaves the short last batch of each pass out (its batch: a step's tasks), so with 5 rows
    and 2 tasks a step each pass plays 4 rows of its permutation; a mixed dataset's rows likewise."""
    import torch
    from transformers import AutoTokenizer

    from treerl.learners.grpo import GRPOConfig
    from treerl.models import default_model_path
    from treerl.rollout.engine import task_options

    generator = torch.Generator().manual_seed(3)
    passes = [torch.randperm(5, generator=generator).tolist()[:4] for _ in range(3)]
    engine = GRPOConfig(output_dir="x", seed=3, shuffle_dataset=True, tasks_per_step=2).engine(
        None, AutoTokenizer.from_pretrained(default_model_path()), seed=3)
    assert (engine.shuffle_seed, engine.shuffle_batch_size) == (3, 2)
    rows = [{"question": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(5)]
    env = treerl.make("treerl/MathVerify-v0", dataset=rows)
    played = [task_options(env, k, engine.shuffle_seed, engine.shuffle_batch_size)["task_index"] for k in range(12)]
    assert played == passes[0] + passes[1] + passes[2]
    try:
        from trl.trainer.utils import RepeatSampler
    except ImportError:  # not in the test extra
        pass
    else:
        sampler = RepeatSampler(rows, mini_repeat_count=1, batch_size=2, shuffle=True, seed=3)
        assert [i for _ in range(3) for i in sampler] == played
    mixed = make_group("calc=treerl/Calculator-v0,math=treerl/MathVerify-v0", dataset=_mixed_rows() * 2)  # 6 rows
    as_written = [tuple(task_options(mixed, k).values()) for k in range(6)]
    generator = torch.Generator().manual_seed(3)
    orders = [torch.randperm(6, generator=generator).tolist()[:4] for _ in range(2)]  # 4 a step: 4 of 6 a pass
    assert [tuple(task_options(mixed, k, 3, 4).values()) for k in range(8)] == \
        [as_written[i] for order in orders for i in order]


def test_shuffled_passes_keep_a_few_generator_states_and_draw_any_pass_again():
    """A long run over a small dataset plays thousands of passes: the order keeps the generator's state every
    64th pass (not every pass, which grew by a few KB a pass), and a pass asked for out of order is the same."""
    import random

    import torch

    from treerl.envs import task_order

    generator = torch.Generator().manual_seed(11)
    expected = [p * 3 + i for p in range(700) for i in torch.randperm(3, generator=generator).tolist()]
    assert [task_order.shuffled_index(k, 3, 11) for k in range(len(expected))] == expected
    passes = task_order._passes[(3, 11)]
    assert len(passes.states) == 11 and len(passes.recent) == 2  # 700 passes, a state every 64
    random.seed(0)
    assert all(task_order.shuffled_index(k, 3, 11) == expected[k] for k in random.sample(range(len(expected)), 200))


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


def test_rollout_plays_both_environments_and_reports_each(tmp_path):
    from treerl.agents import SamplingParams, TransformersPolicy
    from treerl.models import load_default_model
    from treerl.rollout import RolloutEngine

    model, tok = load_default_model()
    policy = TransformersPolicy(model, tok)
    engine = RolloutEngine(policy, tok, params=SamplingParams(max_new_tokens=24), seed=0)
    factory = lambda: make_group(MIX, guess={"max_turns": 2})  # noqa: E731
    groups, stats = asyncio.run(engine.run(factory, MIX, range(4), 3))
    assert [g.info["env"] for g in groups] == ["calc", "guess", "calc", "guess"]
    for g in groups:
        # Every generation of a group hangs off one prompt: the member's own task.
        prompts = {e.path()[0].token_ids == g.segments[0].token_ids for e in g.episodes}
        assert prompts == {True} and g.segments[0].kind == "prompt"
        text = tok.decode(g.segments[0].token_ids)
        assert ("Guess it." in text) == (g.info["env"] == "guess"), text
        assert ("calculator" in text) == (g.info["env"] == "calc"), text
    from treerl.rollout.view import group_row

    assert [group_row(g)["env"] for g in groups] == ["calc", "guess", "calc", "guess"]  # the viewer's column
    summary = stats.summary()
    want = {name: sum(e.reward for g in groups if g.info["env"] == name for e in g.episodes) / 6
            for name in ("calc", "guess")}
    assert summary["reward_by_env"] == pytest.approx(want)
    # Each environment's success rate too (final reward at the threshold), and the table prints both.
    for threshold in (1.0, 0.0):
        wins = {name: sum((e.rewards[-1] if e.rewards else 0.0) >= threshold for g in groups
                          if g.info["env"] == name for e in g.episodes) / 6 for name in ("calc", "guess")}
        assert stats.summary(threshold)["success_by_env"] == pytest.approx(wins)
    from treerl.rollout.summary import summary_table

    rates = stats.summary()["success_by_env"]
    want_row = f"success rate by env  calc {rates['calc']:.1%}, guess {rates['guess']:.1%}"
    assert want_row in summary_table(stats.summary())


def test_learn_logs_each_environments_reward(tmp_path):
    from treerl.learners.grpo import GRPOConfig, train

    train(GRPOConfig(output_dir=str(tmp_path), env=MIX, env_kwargs={"guess": {"max_turns": 2}}, steps=1,
                     tasks_per_step=2, group_size=2, max_new_tokens=24, eval_episodes=0, progress=False,
                     num_threads=1, sample_groups=2))
    [metrics] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/calc", "reward/guess", "success_rate/calc", "success_rate/guess"} <= set(metrics)
    from treerl.rollout import read_groups

    kept = list(read_groups(tmp_path / "trajectories" / "step-000001.jsonl"))
    assert sorted(g.info["env"] for g in kept) == ["calc", "guess"]
    for g in kept:
        calc_reward = [e.reward for e in g.episodes]
        if g.info["env"] == "calc":
            assert metrics["reward/calc"] == pytest.approx(sum(calc_reward) / len(calc_reward))
    # The README's list of metrics names every key, the per-environment one as reward/ENV.
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    documented = set(re.findall(r"`([a-z_]+/[A-Za-z_]+)`", readme)) | {"lr"}
    per_env = r"^(reward|success_rate)/(calc|guess)$"
    logged = {re.sub(r"^(tool_calls|diag)/.*", r"\1/KIND", re.sub(per_env, r"\1/ENV", k))
              for k in metrics if k != "step"}
    assert logged <= documented, sorted(logged - documented)
    assert re.search(r"calc=treerl/Calculator-v0,guess=treerl/GuessNumber-v0", readme)


def _mixed_rows():
    """SkyRL-Gym's form: one dataset whose rows name their environment (``env_class``) and carry its task."""
    return [{"env_class": "math", "question": "What is 1 + 1?", "answer": "2", "level": 1},
            {"env_class": "calc", "prompt": "What is 6 * 7?", "answer": "42"},
            {"env_class": "math", "question": "What is 2 + 5?", "answer": "7", "level": 2}]


def test_one_mixed_dataset_routes_each_row_to_the_environment_it_names(tmp_path):
    path = tmp_path / "mix.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _mixed_rows()))
    env = treerl.make("calc=treerl/Calculator-v0,math=treerl/MathVerify-v0", data_path=str(path))
    # Each member holds its own rows, read its own way (MathVerify's `question` column), in the file's order.
    assert [t.prompt for t in env.envs["math"].dataset] == ["What is 1 + 1?", "What is 2 + 5?"]
    assert env.weights == pytest.approx({"calc": 1 / 3, "math": 2 / 3})
    plays = []
    for k in range(4):  # task k plays row k mod 3
        _, info = env.reset(seed=k, options=env.task_options(k))
        plays.append((info["env"], info["answer"]))
    assert plays == [("math", "2"), ("calc", "42"), ("math", "7"), ("math", "2")]
    assert info["row"] == {"env_class": "math", "level": 1}  # the row's other columns reach reward functions
    # A Parquet file reads the same (SkyRL-Gym's datasets are Parquet).
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    pq.write_table(pyarrow.Table.from_pylist(_mixed_rows()), tmp_path / "mix.parquet")
    env = make_group("calc=treerl/Calculator-v0,math=treerl/MathVerify-v0", data_path=str(tmp_path / "mix.parquet"))
    assert [env.task_options(k)["env"] for k in range(3)] == ["math", "calc", "math"]


def test_a_mixed_dataset_that_does_not_fit_the_group_says_what_to_do(tmp_path):
    ids = "calc=treerl/Calculator-v0,math=treerl/MathVerify-v0"
    with pytest.raises(ValueError, match=r"row 1 has env_class='code'"):
        make_group(ids, dataset=[_mixed_rows()[0], {"env_class": "code", "prompt": "x"}])
    with pytest.raises(ValueError, match=r"row 0 has no 'env' column"):
        make_group(ids, dataset=[{"prompt": "x"}])
    with pytest.raises(ValueError, match=r"row 1 has no 'env' column.*the first row has: 'env', else SkyRL-Gym's"):
        make_group(ids, dataset=[{"env": "math", "question": "1+1?", "answer": "2"}, {"env_class": "calc", "prompt": "x"}])
    with pytest.raises(ValueError, match="no row names 'calc'"):
        make_group(ids, dataset=[_mixed_rows()[0]])
    with pytest.raises(ValueError, match="drop weights"):
        make_group(ids, dataset=_mixed_rows(), weights=[1, 1])
    with pytest.raises(ValueError, match="math has its own data_path"):
        make_group(ids, dataset=_mixed_rows(), math={"data_path": "x.jsonl"})
    with pytest.raises(ValueError, match="guess .treerl/GuessNumber-v0. takes no dataset"):
        make_group("guess=treerl/GuessNumber-v0,math=treerl/MathVerify-v0",
                   dataset=[{"env": "guess"}, {"env": "math", "question": "1?", "answer": "1"}])
    with pytest.raises(ValueError, match="the group's own keyword"):
        treerl.make("data_path=treerl/Calculator-v0,treerl/GuessNumber-v0")


def test_learn_trains_on_one_mixed_dataset(tmp_path):
    from treerl.learners.grpo import GRPOConfig, train

    path = tmp_path / "mix.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _mixed_rows()))
    train(GRPOConfig(output_dir=str(tmp_path / "run"), env="calc=treerl/Calculator-v0,math=treerl/MathVerify-v0",
                     env_kwargs={"data_path": str(path), "calc": {"max_turns": 2}}, steps=1, tasks_per_step=3,
                     group_size=2, max_new_tokens=16, eval_episodes=0, progress=False, num_threads=1,
                     sample_groups=3))
    [metrics] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/calc", "reward/math"} <= set(metrics)
    from treerl.rollout import read_groups

    kept = list(read_groups(tmp_path / "run" / "trajectories" / "step-000001.jsonl"))
    assert [(g.info["env"], g.info["answer"]) for g in kept] == [("math", "2"), ("calc", "42"), ("math", "7")]


def test_eval_plays_each_row_of_a_groups_datasets_at_most_once(capsys):
    from _scripted import ScriptedPolicy

    from treerl.models import load_default_model
    from treerl.rollout.evaluate import EvalConfig, evaluate_with

    _, tok = load_default_model()
    policy = ScriptedPolicy(tok, lambda task, g, turn: "\\boxed{2}", end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    # One mixed dataset: its three rows, once each.
    cfg = EvalConfig(env="calc=treerl/Calculator-v0,math=treerl/MathVerify-v0", env_kwargs={"dataset": _mixed_rows()})
    report = evaluate_with(cfg, policy, tok, num_episodes=8, seed=0)
    assert [(g.info["env"], g.info["answer"]) for g in report.groups] == [("math", "2"), ("calc", "42"), ("math", "7")]
    assert "give 3 tasks before a row repeats" in capsys.readouterr().err
    # Members' own datasets: up to the first task that would replay a row (math's row 0 at task 5).
    rows = [{"question": "1 + 1 = ?", "answer": "2"}, {"question": "2 + 2 = ?", "answer": "4"}]
    cfg = EvalConfig(env=MIX.replace("guess=treerl/GuessNumber-v0", "math=treerl/MathVerify-v0"),
                     env_kwargs={"math": {"dataset": rows}, "calc": {"max_turns": 1}})
    assert evaluate_with(cfg, policy, tok, num_episodes=8, seed=0).num_episodes == 5
    assert evaluate_with(cfg, policy, tok, num_episodes=3, seed=0).num_episodes == 3


def test_held_out_kwargs_of_a_group_merge_per_environment_and_warn_of_each_ones_training_data(tmp_path, capsys):
    from treerl.learners.grpo import GRPOConfig, train

    train_rows = [{"q": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    (tmp_path / "test.jsonl").write_text(json.dumps({"q": "What is 10 + 10?", "answer": "20"}) + "\n")
    ids = "calc=treerl/Calculator-v0,math=treerl/MathVerify-v0"
    math = {"data_path": str(tmp_path / "train.jsonl"), "prompt_key": "q"}
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), env=ids, env_kwargs={"math": math, "calc": {"max_turns": 2}},
                     eval_env_kwargs={"math": {"data_path": str(tmp_path / "test.jsonl")}})
    # math's held-out file, read with its training prompt_key (replacing math's mapping wholesale lost it).
    assert cfg.held_out_env_kwargs()["math"] == {"data_path": str(tmp_path / "test.jsonl"), "prompt_key": "q"}
    env = cfg.eval_env_factory()()
    assert env.envs["math"].dataset[0].prompt == "What is 10 + 10?" and env.envs["calc"].max_turns == 2
    assert cfg.eval_reads_training_data() == []
    # Without it, the held-out evaluation would draw math's training rows: the run says so.
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), env=ids, env_kwargs={"math": math}, steps=1, tasks_per_step=1,
                     group_size=2, max_new_tokens=4, eval_episodes=1, progress=False, num_threads=1, sample_groups=0)
    assert cfg.eval_reads_training_data() == ["math.data_path"]
    train(cfg)
    assert "training data (env_kwargs math.data_path)" in capsys.readouterr().err
    mixed = GRPOConfig(output_dir=str(tmp_path / "run"), env=ids, env_kwargs={"data_path": "mix.jsonl"})
    assert mixed.eval_reads_training_data() == ["data_path"]


@pytest.mark.slow  # a run with a generator process: about 15 s
def test_async_grpo_trains_a_group_on_one_mixed_dataset(tmp_path):
    """The group's factory travels to the generator process (it pickles) and each environment's figures are logged."""
    from treerl.learners.async_grpo import AsyncGRPOConfig, train_async

    (tmp_path / "mix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _mixed_rows()))
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), env="calc=treerl/Calculator-v0,math=treerl/MathVerify-v0",
                          env_kwargs={"data_path": str(tmp_path / "mix.jsonl"), "calc": {"max_turns": 1}}, steps=2,
                          tasks_per_step=3, group_size=2, max_new_tokens=8, eval_episodes=0, progress=False,
                          num_threads=1, max_staleness=0)
    assert train_async(cfg).policy_version == 2
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all({"reward/calc", "reward/math", "success_rate/calc", "success_rate/math"} <= set(m) for m in lines)
