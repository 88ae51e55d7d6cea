"""The user's own pieces from the command line: a Hub id from the local cache, their data (TRL's
conversational format, extra columns for the rewards), a held-out file, reward functions by
import path (async, None), a chat template and its variables; each failure names the fix."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import torch

from treerl.agents.chat_templates import template_gaps
from treerl.cli import main
from treerl.errors import ConfigError
from treerl.learners.grpo import GRPOConfig
from treerl.learners.importance import ImportanceConfig
from treerl.models import default_model_path, load_model, set_chat_template

REWARDS = '''
import asyncio

async def mentions_answer(prompts, completions, answer, level, log_extra, **kwargs):
    await asyncio.sleep(0)
    log_extra("level", level)
    return [1.0 if a in c[-1]["content"] else 0.0 for c, a in zip(completions, answer)]

def only_hard(completions, level, **kwargs):
    # None: "not applicable" -- left out of the weighted sum, as in TRL.
    return [len(c[-1]["content"]) / 100 if lv == "hard" else None for c, lv in zip(completions, level)]
'''


def _hub_cache(tmp_path, repo_id="acme/tiny-chat"):
    """The shipped model placed in a Hugging Face cache as a download would leave it."""
    import shutil

    org, name = repo_id.split("/")
    root = tmp_path / "hub" / f"models--{org}--{name}"
    snapshot = root / "snapshots" / ("0" * 40)
    shutil.copytree(default_model_path(), snapshot)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0" * 40)
    return tmp_path / "hub"


def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(_hub_cache(tmp_path)))
    model, tok = load_model("acme/tiny-chat")
    assert model.config.model_type == "qwen3" and tok.chat_template
    with pytest.raises(ConfigError, match=r"nor in the Hugging Face cache .*hf download acme/other"):
        load_model("acme/other")
    with pytest.raises(ConfigError, match="is not a directory"):
        load_model("./no/such/dir")


def test_missing_tokenizer_is_reported_as_such(tmp_path):
    model, _ = load_model(None)
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(ConfigError, match="has no tokenizer"):
        load_model(str(tmp_path / "m"))


def test_chat_template_file_and_variables(tmp_path):
    _, tok = load_model(None)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                        "{% if not enable_thinking %}<no-think>{% endif %}")
    set_chat_template(tok, template, {"enable_thinking": False})
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<user>hi<no-think>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert any("ignores `tools`" in gap for gap in template_gaps(tok, tools))
    _, shipped = load_model(None)
    assert template_gaps(shipped, tools) == []
    with pytest.raises(ConfigError, match="no such file"):
        set_chat_template(tok, tmp_path / "missing.jinja")


def test_learn_on_the_users_data_rewards_and_held_out_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    train_rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i),
                   "level": "hard" if i % 2 else "easy"} for i in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "What is 10 + 10?", "answer": "20"}) + "\n")
    code = main(["learn", "--env", "treerl/MathVerify-v0", "--env-kwargs", '{"data_path": "train.jsonl"}',
                 "--eval-env-kwargs", '{"data_path": "test.jsonl"}', "--output-dir", "run", "--steps", "1",
                 "--tasks-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--eval-episodes", "1",
                 "--reward-funcs", "my_rewards.py:mentions_answer,my_rewards.py:only_hard",
                 "--reward-weights", "1.0", "0.5", "0.1", "--progress", "false", "--sample-groups", "0"])
    assert code == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["learning_rate"] == 2e-4  # the tiny model's
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward_fn/mentions_answer_mean" in metrics and "reward_fn/only_hard_mean" in metrics
    extras = [json.loads(line) for line in (tmp_path / "run" / "reward_extras.jsonl").read_text().splitlines()]
    assert extras[0]["step"] == 1 and set(extras[0]["level"]) <= {"easy", "hard"} and len(extras[0]["level"]) == 4
    # The held-out evaluation played the test file's row, not a training row.
    cfg = GRPOConfig(output_dir="run", env="treerl/MathVerify-v0", env_kwargs={"data_path": "train.jsonl"},
                     eval_env_kwargs={"data_path": "test.jsonl"})
    env = cfg.eval_env_factory()()
    _, info = env.reset(seed=cfg.eval_seed)
    assert info["answer"] == "20"


def test_conversational_prompt_and_extra_columns_reach_the_rewards():
    import math

    from treerl.agents.transformers_policy import TransformersPolicy
    from treerl.envs.builtin.math_verify import MathVerifyEnv
    from treerl.learners.rewards import score
    from treerl.rollout.options import EpisodeOptions

    rows = [{"prompt": [{"role": "system", "content": "Answer in tags."}, {"role": "user", "content": "1 + 1?"}],
             "answer": "2", "level": "hard"}, {"prompt": "2 + 2?", "answer": "4", "level": "easy"}]
    opts = EpisodeOptions(env="treerl/MathVerify-v0", env_kwargs={"dataset": rows}, max_new_tokens=4)
    model, tok = load_model(None)
    policy = TransformersPolicy(model, tok, continuous_batching=False)
    import asyncio

    try:
        groups, _ = asyncio.run(opts.engine(policy, tok, seed=0).run(opts.env_factory(), opts.env, range(2), 2))
    finally:
        policy.close()
    seen = {}

    def hard_only(prompts, completions, level, **kwargs):
        seen["prompts"] = prompts
        return [1.0 if lv == "hard" else None for lv in level]

    metrics = {}
    rewards = score(groups, [hard_only], metrics)
    levels = [g.info["row"]["level"] for g in groups for _ in g.episodes]
    assert [r for r, lv in zip(rewards[:, 1].tolist(), levels) if lv == "hard"] == [1.0, 1.0]
    assert all(math.isnan(r) for r, lv in zip(rewards[:, 1].tolist(), levels) if lv == "easy")
    assert metrics["reward_fn/hard_only_mean"] == 1.0
    roles = {tuple(m["role"] for m in p) for p in seen["prompts"]}
    assert roles == {("system", "user")}  # one system message, then the row's user message
    systems = {g.info["row"]["level"]: p[0]["content"] for g, p in zip([g for g in groups for _ in g.episodes],
                                                                       seen["prompts"])}
    # A row's own system message is used as TRL uses it; a row without one gets the environment's.
    assert systems == {"hard": "Answer in tags.", "easy": MathVerifyEnv.system_prompt}


def test_reward_options_name_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    assert main(["learn", "--output-dir", "r", "--reward-funcs", "my_rewards.py"]) == 2
    assert "is not MODULE:FUNCTION" in capsys.readouterr().err
    assert main(["learn", "--output-dir", "r", "--reward-funcs", "my_rewards.py:nope"]) == 2
    assert "has no function 'nope'" in capsys.readouterr().err
    assert main(["learn", "--output-dir", "r", "--reward-funcs", "my_rewards.py:only_hard",
                 "--reward-weights", "1.0"]) == 2
    assert "give 2: the environment's reward first" in capsys.readouterr().err


def test_trl_names_are_aliases_and_typos_get_a_suggestion(tmp_path, capsys):
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    args = build_parser().parse_args(["learn", "--output-dir", "x", "--num-generations", "3", "--max-steps", "5",
                                      "--loss-type", "grpo", "--save-steps", "2", "--scale-rewards", "batch"])
    cfg = config_from_args(GRPOConfig, args)
    assert (cfg.group_size, cfg.steps, cfg.loss, cfg.save_every) == (3, 5, "grpo", 2)
    assert cfg.advantage_scale == "batch"  # TRL's scale_rewards: the same group/batch/none
    for given, scale in (("false", "none"), ("True", "group")):  # TRL's older booleans, mapped as TRL maps them
        args = build_parser().parse_args(["learn", "--output-dir", "x", "--scale-rewards", given])
        assert config_from_args(GRPOConfig, args).advantage_scale == scale
    assert GRPOConfig(output_dir="x", scale_rewards=False).advantage_scale == "none"
    for given, scale in (("false", "none"), ("true", "group")):  # a TRL YAML file's booleans
        (tmp_path / "s.yaml").write_text(f"scale_rewards: {given}\n")
        args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "s.yaml")])
        assert config_from_args(GRPOConfig, args).advantage_scale == scale
    (tmp_path / "c.yaml").write_text("num_generations: 4\nmodel_name_or_path: some/dir\n")
    cfg = config_from_args(GRPOConfig, build_parser().parse_args(["learn", "--output-dir", "x", "--config",
                                                                  str(tmp_path / "c.yaml")]))
    assert cfg.group_size == 4 and cfg.model == "some/dir"
    with pytest.raises(SystemExit):  # argparse's own exit (status 2)
        main(["learn", "--output-dir", "x", "--lerning-rate", "1e-5"])
    assert "did you mean --learning-rate?" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # another command's flag: say whose, not "did you mean" itself
        main(["eval", "--eval-env-kwargs", "{}"])
    assert "--eval-env-kwargs is a flag of treerl learn" in capsys.readouterr().err
    (tmp_path / "d.yaml").write_text("lerning_rate: 1e-5\n")
    assert main(["learn", "--output-dir", "x", "--config", str(tmp_path / "d.yaml")]) == 2
    assert "(lerning_rate: did you mean learning_rate?)" in capsys.readouterr().err


def test_trl_names_are_aliases_in_python_too():
    """A TRL user's GRPOConfig(...) keyword arguments: the aliases the flags and YAML keys take, the same refusal
    of an option named twice, and the same hint for an option that is not here."""
    from treerl.learners.sdpo import SDPOConfig
    from treerl.rollout.evaluate import EvalConfig

    cfg = GRPOConfig(output_dir="x", num_generations=4, max_steps=5, loss_type="grpo", save_steps=2,
                     scale_rewards="batch", max_completion_length=64)
    assert (cfg.group_size, cfg.steps, cfg.loss, cfg.save_every, cfg.advantage_scale) == (4, 5, "grpo", 2, "batch")
    assert SDPOConfig(output_dir="x", num_generations=2).group_size == 2  # every learner's config
    assert EvalConfig(num_generations=3).rollouts_per_task == 3
    with pytest.raises(TypeError, match="num_generations and group_size name the same option; keep one"):
        GRPOConfig(output_dir="x", num_generations=4, group_size=8)
    with pytest.raises(TypeError, match="no option max_prompt_length: prompts are never cut here"):
        GRPOConfig(output_dir="x", max_prompt_length=16)


def test_trls_defaults_written_out_are_taken(tmp_path):
    """A TRL script or YAML file that writes out TRL's defaults runs: an option refused here is taken at the
    value that means what happens here anyway, TRL's None is "off" (min_p) or "the other option" (epsilon_high
    follows epsilon); any other value is still refused. min_p=None and epsilon_high=None crashed comparing None."""
    from treerl.cli import build_parser
    from treerl.config import config_from_args
    from treerl.learners.async_grpo import AsyncGRPOConfig
    from treerl.learners.sdpo import SDPOConfig

    trl_defaults = dict(min_p=None, epsilon_high=None, chat_template_kwargs=None, repetition_penalty=1.0,
                        log_completions=False, push_to_hub=False, hub_model_id=None, hub_strategy="every_save",
                        sync_ref_model=False, generation_batch_size=None, steps_per_generation=None,
                        generation_kwargs=None, importance_sampling_level="token", save_strategy="steps",
                        gradient_checkpointing_kwargs={"use_reentrant": False}, top_entropy_quantile=1.0,
                        multi_objective_aggregation="sum_then_normalize", disable_dropout=False,
                        use_liger_kernel=False, ds3_gather_for_generation=True, dataloader_num_workers=0,
                        save_only_model=False, lr_scheduler_kwargs={}, do_train=True)
    for config in (GRPOConfig, SDPOConfig, AsyncGRPOConfig):
        cfg = config(output_dir="x", epsilon=0.1, **trl_defaults)
        assert (cfg.min_p, cfg.epsilon_low, cfg.epsilon_high, cfg.chat_template_kwargs) == (0.0, 0.1, 0.1, {})
    assert GRPOConfig(output_dir="x", epsilon_high=None).epsilon_high == 0.2  # TRL's epsilon, 0.2
    assert GRPOConfig(output_dir="x").epsilon_high == 0.28  # treerl's own default is unchanged
    assert GRPOConfig(output_dir="x", sapo_temperature_neg=1.2).sapo_tau_neg == 1.2  # TRL's name of the same
    # TRL's max_tool_calling_iterations: N rounds of tools, each followed by another turn (None: no limit of TRL's)
    assert GRPOConfig(output_dir="x", max_tool_calling_iterations=2, env_kwargs={"data_path": "d"}).env_kwargs == \
        {"data_path": "d", "max_turns": 3}
    assert GRPOConfig(output_dir="x", max_tool_calling_iterations=None).env_kwargs == {}
    with pytest.raises(TypeError, match="max_tool_calling_iterations=2 .max_turns=3. and env_kwargs' max_turns=5"):
        GRPOConfig(output_dir="x", max_tool_calling_iterations=2, env_kwargs={"max_turns": 5})
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--max-tool-calling-iterations", "0"])
    assert config_from_args(GRPOConfig, args).env_kwargs == {"max_turns": 1}
    # a group's keyword arguments are keyed by member: each member gets the limit, and the group builds
    group = GRPOConfig(output_dir="x", env="calc=treerl/Calculator-v0,guess=treerl/GuessNumber-v0",
                       max_tool_calling_iterations=2, env_kwargs={"guess": {"high": 8}, "weights": [3, 1]})
    assert group.env_kwargs == {"calc": {"max_turns": 3}, "guess": {"high": 8, "max_turns": 3}, "weights": [3, 1]}
    assert {name: env.max_turns for name, env in group.train_env_factory()().envs.items()} == {"calc": 3, "guess": 3}
    with pytest.raises(TypeError, match=r"env_kwargs\['guess'\]'s max_turns=5"):
        GRPOConfig(output_dir="x", env="calc=treerl/Calculator-v0,guess=treerl/GuessNumber-v0",
                   max_tool_calling_iterations=2, env_kwargs={"guess": {"max_turns": 5}})
    for name, value, said in (("trust_remote_code", True, "not supported"), ("hub_always_push", True, "skipped while"),
                              ("use_liger_kernel", True, "not supported"),
                              ("dataset_name", "x/y", "a script's dataset option")):
        with pytest.raises(TypeError, match=f"no option {name}: .*{said}"):
            GRPOConfig(output_dir="x", **{name: value})
    text = "".join(f"{k}: {'null' if v is None else str(v).lower() if isinstance(v, bool) else v}\n"
                   for k, v in trl_defaults.items() if k != "gradient_checkpointing_kwargs")
    (tmp_path / "trl.yaml").write_text(text + "epsilon: 0.1\ngradient_checkpointing_kwargs:\n  use_reentrant: false\n")
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "trl.yaml")])
    cfg = config_from_args(GRPOConfig, args)
    assert (cfg.min_p, cfg.epsilon_high, cfg.chat_template_kwargs) == (0.0, 0.1, {})
    (tmp_path / "bad.yaml").write_text("trust_remote_code: true\n")
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "bad.yaml")])
    with pytest.raises(ConfigError, match="trust_remote_code: not supported"):
        config_from_args(GRPOConfig, args)


def test_each_of_trls_grpo_options_at_its_default_is_taken_or_refused_by_name():
    """Every option of TRL's own GRPOConfig (not the TrainingArguments it extends), at TRL's default: taken,
    or refused with a message that names it, never a crash that names nothing (min_p=None compared None)."""
    import dataclasses

    trl = pytest.importorskip("trl")
    transformers = pytest.importorskip("transformers")
    inherited = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    for option in dataclasses.fields(trl.GRPOConfig):
        if option.name in inherited or option.name == "output_dir":
            continue
        default = option.default_factory() if option.default_factory is not dataclasses.MISSING else option.default
        try:
            GRPOConfig(output_dir="x", **{option.name: default})
        except (TypeError, ValueError) as exc:
            assert option.name in str(exc), (option.name, default, str(exc))


def test_trl_batch_sizes_set_the_tasks_of_a_step(tmp_path, monkeypatch):
    """TRL's optimizer step takes per_device_train_batch_size x gradient_accumulation_steps x processes
    completions, num_generations per prompt: tasks_per_step here, in Python, YAML and flags alike."""
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    cfg = GRPOConfig(output_dir="x", per_device_train_batch_size=4, gradient_accumulation_steps=4, num_generations=8)
    assert (cfg.tasks_per_step, cfg.group_size) == (2, 8)
    assert GRPOConfig(output_dir="x", per_device_train_batch_size=16).tasks_per_step == 2  # group_size 8, TRL's too
    assert GRPOConfig(output_dir="x", gradient_accumulation_steps=2).tasks_per_step == 2  # TRL's batch of 8
    monkeypatch.setenv("WORLD_SIZE", "2")  # accelerate launch: per device, and tasks_per_step counts every process's
    assert GRPOConfig(output_dir="x", per_device_train_batch_size=8, num_generations=4).tasks_per_step == 4
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match=r"4 x 1 x 1 = 4 completions .* divisible by num_generations=8"):
        GRPOConfig(output_dir="x", per_device_train_batch_size=4)
    with pytest.raises(TypeError, match="per_device_train_batch_size and tasks_per_step set the same thing; keep one"):
        GRPOConfig(output_dir="x", per_device_train_batch_size=16, tasks_per_step=2)
    # TRL's default steps_per_generation (gradient_accumulation_steps): one optimizer step per generation;
    # another sets num_minibatches (tests/test_num_minibatches.py).
    cfg = GRPOConfig(output_dir="x", per_device_train_batch_size=4, num_generations=4, steps_per_generation=1)
    assert (cfg.tasks_per_step, cfg.num_minibatches) == (1, 1)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0 must be a whole number >= 1"):
        GRPOConfig(output_dir="x", gradient_accumulation_steps=0)
    (tmp_path / "c.yaml").write_text("per_device_train_batch_size: 4\ngradient_accumulation_steps: 2\n"
                                     "num_generations: 4\n")
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml")])
    assert config_from_args(GRPOConfig, args).tasks_per_step == 2
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--per-device-train-batch-size", "6",
                                      "--num-generations", "3"])
    assert config_from_args(GRPOConfig, args).tasks_per_step == 2
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--per-device-train-batch-size", "6"])
    with pytest.raises(ConfigError, match="divisible by num_generations=8"):
        config_from_args(GRPOConfig, args)


def test_trls_max_steps_and_save_steps_count_optimizer_steps(tmp_path):
    """TRL's max_steps and save_steps count optimizer steps, num_iterations of them per generation; a step
    here is one generation and num_iterations optimizer steps, so they are divided by it."""
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    cfg = GRPOConfig(output_dir="x", max_steps=8, save_steps=4, num_iterations=2)
    assert (cfg.steps, cfg.save_every, cfg.num_iterations) == (4, 2, 2)
    other = GRPOConfig(output_dir="x", max_steps=5, save_steps=2)
    assert (other.steps, other.save_every) == (5, 2)
    with pytest.raises(ValueError, match="max_steps=5 counts optimizer steps .* num_iterations=2 of them per step"):
        GRPOConfig(output_dir="x", max_steps=5, num_iterations=2)
    with pytest.raises(TypeError, match="max_steps and steps name the same option; keep one"):
        GRPOConfig(output_dir="x", max_steps=5, steps=5)
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--max-steps", "6", "--num-iterations", "3"])
    assert config_from_args(GRPOConfig, args).steps == 2
    (tmp_path / "c.yaml").write_text("max_steps: 6\nsave_steps: 3\nnum_iterations: 3\n")
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml")])
    assert (config_from_args(GRPOConfig, args).steps, config_from_args(GRPOConfig, args).save_every) == (2, 1)


def test_trls_save_steps_below_1_is_a_fraction_of_the_run(tmp_path):
    """TRL's save_steps < 1 is a fraction of the run's optimizer steps (rounded up); every other value is a
    whole number of them. A fraction kept as save_every never saved: (step + 1) % 0.25 is never 0."""
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    assert GRPOConfig(output_dir="x", max_steps=10, save_steps=0.25).save_every == 3  # TRL: ceil(10 x 0.25)
    assert GRPOConfig(output_dir="x", steps=8, num_iterations=2, save_steps=0.5).save_every == 4  # 8 of 16
    assert GRPOConfig(output_dir="x", save_steps=0.1).save_every == 6  # of the 60 steps by default
    assert GRPOConfig(output_dir="x", save_steps=4.0).save_every == 4
    with pytest.raises(ValueError, match=r"save_steps=0.1 is 1 optimizer step\(s\) of max_steps=10, not a multiple "
                                         "of num_iterations=2"):
        GRPOConfig(output_dir="x", max_steps=10, num_iterations=2, save_steps=0.1)
    with pytest.raises(ValueError, match="save_steps=2.5: a whole number of optimizer steps, or a fraction"):
        GRPOConfig(output_dir="x", save_steps=2.5)
    with pytest.raises(ValueError, match="max_steps=2.5: a whole number of optimizer steps"):
        GRPOConfig(output_dir="x", max_steps=2.5)
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--max-steps", "20", "--save-steps", "0.5"])
    assert config_from_args(GRPOConfig, args).save_every == 10


def test_trls_eval_strategy_steps_sets_eval_every_as_save_steps_sets_save_every(tmp_path):
    """TRL's eval_strategy="steps" evaluates every eval_steps optimizer steps (a fraction < 1 of the run's, rounded
    up; unset: logging_steps, GRPOConfig's 10): eval_every is that divided by num_iterations. "no", TRL's default,
    and the evaluation options TRL scripts pass at their defaults are taken; "epoch" waits for the rows
    (tests/test_save_strategy.py)."""
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    assert GRPOConfig(output_dir="x", eval_strategy="steps", eval_steps=4).eval_every == 4
    assert GRPOConfig(output_dir="x", max_steps=8, num_iterations=2, eval_strategy="steps", eval_steps=4).eval_every == 2
    assert GRPOConfig(output_dir="x", max_steps=10, eval_strategy="steps", eval_steps=0.25).eval_every == 3
    assert GRPOConfig(output_dir="x", steps=8, num_iterations=2, eval_strategy="steps", eval_steps=0.5).eval_every == 4
    assert GRPOConfig(output_dir="x", eval_strategy="steps").eval_every == 10  # logging_steps' default, as in TRL
    assert GRPOConfig(output_dir="x", eval_strategy="steps", eval_steps=None).eval_every == 10  # TRL's None: the same
    with pytest.warns(UserWarning, match="logging_steps=5 changes nothing"):
        assert GRPOConfig(output_dir="x", eval_strategy="steps", logging_steps=5).eval_every == 5
    assert GRPOConfig(output_dir="x", eval_strategy="no", eval_steps=3, do_eval=False,
                      per_device_eval_batch_size=8).eval_every == 0  # TRL's defaults, as a TRL script passes them
    with pytest.warns(UserWarning, match="eval_steps=3 changes nothing without eval_strategy='steps'"):
        assert GRPOConfig(output_dir="x", eval_steps=3).eval_every == 0
    with pytest.warns(UserWarning, match="per_device_eval_batch_size=4 changes nothing here"):
        GRPOConfig(output_dir="x", per_device_eval_batch_size=4)
    assert GRPOConfig(output_dir="x", eval_strategy="epoch", eval_steps=3).every_epoch == ["eval_every"]
    with pytest.raises(ValueError, match="eval_steps=3 counts optimizer steps .* num_iterations=2"):
        GRPOConfig(output_dir="x", num_iterations=2, eval_strategy="steps", eval_steps=3)
    # The messages name what the user wrote: eval_steps (not save_steps), and logging_steps' 10 where it was unset.
    with pytest.raises(ValueError, match=r"eval_steps=0.5 is 5 optimizer step\(s\) of max_steps=10, .* give "
                                         "eval_steps in optimizer steps"):
        GRPOConfig(output_dir="x", eval_strategy="steps", eval_steps=0.5, num_iterations=2, max_steps=10)
    with pytest.raises(ValueError, match=r"eval_steps \(unset, so logging_steps=10, as in TRL\) counts optimizer"):
        GRPOConfig(output_dir="x", eval_strategy="steps", num_iterations=4)
    with pytest.raises(ValueError, match="eval_steps=2.5: a whole number of optimizer steps, or a fraction"):
        GRPOConfig(output_dir="x", eval_strategy="steps", eval_steps=2.5)
    with pytest.raises(TypeError, match="eval_strategy and eval_every set the same thing; keep one"):
        GRPOConfig(output_dir="x", eval_strategy="steps", eval_every=2)
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--max-steps", "20", "--eval-strategy", "steps",
                                      "--eval-steps", "0.5"])
    assert config_from_args(GRPOConfig, args).eval_every == 10
    (tmp_path / "c.yaml").write_text("max_steps: 6\neval_strategy: steps\neval_steps: 3\nnum_iterations: 3\n"
                                     "eval_on_start: false\n")
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml")])
    cfg = config_from_args(GRPOConfig, args)
    assert (cfg.steps, cfg.eval_every, cfg.eval_on_start) == (2, 1, False)
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml"),
                                      "--eval-every", "2"])
    assert config_from_args(GRPOConfig, args).eval_every == 2  # the flag over the file's TRL options


def test_a_flag_overrides_the_config_files_trl_option_of_another_name(tmp_path):
    """--config's rule, flags override the file, holds across TRL's names and treerl's: --steps over the file's
    max_steps (as when max_steps was an alias), --tasks-per-step over its batch sizes, and the other way round."""
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    def cfg(text, *flags):
        (tmp_path / "c.yaml").write_text(text)
        args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml"), *flags])
        return config_from_args(GRPOConfig, args)

    c = cfg("max_steps: 10\nsave_steps: 4\n", "--steps", "3", "--save-every", "1")
    assert (c.steps, c.save_every) == (3, 1)
    assert cfg("steps: 10\n", "--max-steps", "4", "--num-iterations", "2").steps == 2
    batch = "per_device_train_batch_size: 16\ngradient_accumulation_steps: 2\nnum_generations: 4\n"
    assert cfg(batch, "--tasks-per-step", "3").tasks_per_step == 3
    assert cfg(batch, "--per-device-train-batch-size", "4").tasks_per_step == 2  # with the file's accumulation
    assert cfg("tasks_per_step: 5\nnum_generations: 4\n", "--per-device-train-batch-size", "8").tasks_per_step == 2
    with pytest.raises(ConfigError, match="max_steps and steps name the same option"):  # one file: keep one
        cfg("max_steps: 10\nsteps: 3\n")


def test_trls_report_to_list_of_one_tracker(tmp_path):
    """TRL's report_to is a list (open-r1's YAML: report_to: [wandb]); one tracker, or none, maps as it is."""
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    assert GRPOConfig(output_dir="x", report_to=["tensorboard"]).report_to == "tensorboard"
    assert GRPOConfig(output_dir="x", report_to=[]).report_to == "none"
    assert GRPOConfig(output_dir="x", report_to=["none"]).report_to == "none"
    with pytest.raises(ValueError, match=r"report_to=\['wandb', 'tensorboard'\]: treerl logs to one tracker"):
        GRPOConfig(output_dir="x", report_to=["wandb", "tensorboard"])
    (tmp_path / "c.yaml").write_text("report_to:\n- tensorboard\n")
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml")])
    assert config_from_args(GRPOConfig, args).report_to == "tensorboard"
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--report-to", "tensorboard"])
    assert config_from_args(GRPOConfig, args).report_to == "tensorboard"


def test_trls_run_name_names_the_tracker_run(tmp_path, monkeypatch):
    import types

    from treerl.learners.metrics import MetricsLog

    inits = []
    fake = types.SimpleNamespace(init=lambda **kwargs: inits.append(kwargs), log=lambda *a, **k: None,
                                 finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = GRPOConfig(output_dir=str(tmp_path), report_to="wandb", run_name="qwen3-calc")
    MetricsLog(tmp_path, report_to="wandb", config=dataclasses.asdict(cfg), total_steps=1, progress=False)
    MetricsLog(tmp_path, report_to="wandb", config={"run_name": None}, total_steps=1, progress=False)
    assert inits[0]["name"] == "qwen3-calc" and "name" not in inits[1]
    # the project: TRL's (trackio's), which $WANDB_PROJECT overrides for wandb, as transformers' callback reads it
    assert [i["project"] for i in inits] == ["treerl", "treerl"]
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    MetricsLog(tmp_path, report_to="wandb", config={"project": "huggingface"}, total_steps=1, progress=False)
    monkeypatch.setitem(sys.modules, "trackio", fake)
    MetricsLog(tmp_path, report_to="trackio", config={"project": "huggingface"}, total_steps=1, progress=False)
    assert [i["project"] for i in inits[2:]] == ["mine", "huggingface"]


def test_log_completions_prints_and_logs_each_steps_completions(tmp_path, monkeypatch, capsys):
    """TRL's log_completions: each step's completions on stderr (prompt without the system message, the
    conversation after it) and as a ``completions`` table in the tracker, with each reward column and the
    advantage the episode was trained with; num_completions_to_print keeps the first N."""
    import importlib.machinery
    import types

    from treerl.learners.grpo import train
    from treerl.rollout.trajectory import read_groups

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    logged = []
    fake = types.SimpleNamespace(init=lambda **kwargs: None, log=lambda data, step: logged.append((step, data)),
                                 finish=lambda: None, Table=Table,
                                 __spec__=importlib.machinery.ModuleSpec("wandb", None))  # transformers looks
    monkeypatch.setitem(sys.modules, "wandb", fake)

    def brevity(completions, **kwargs):
        return [-len(c[-1]["content"]) / 100 for c in completions]

    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), steps=2, tasks_per_step=1, group_size=2, eval_episodes=0,
                     log_completions=True, num_completions_to_print=1, report_to="wandb", max_new_tokens=24)
    train(cfg, reward_funcs=[brevity], reward_weights=[1.0, 1.0])
    tables = [(step, data["completions"]) for step, data in logged if "completions" in data]
    assert [step for step, _ in tables] == [1, 2]
    assert all(t.columns == ["prompt", "completion", "env", "brevity", "advantage"] and len(t.data) == 1
               for _, t in tables)
    first = next(iter(read_groups(tmp_path / "run" / "trajectories" / "step-000001.jsonl"))).episodes[0]
    prompt, completion, env, short, advantage = tables[0][1].data[0]
    assert env == pytest.approx(first.reward) and advantage == pytest.approx(first.advantage)
    assert short == pytest.approx(-len(first.messages[-1]["content"]) / 100)  # the reward function's own column
    assert prompt.startswith("user: ") and "system" not in prompt and completion.startswith("assistant: ")
    err = capsys.readouterr().err
    assert "step 1: 1 of 2 completions" in err and "step 2: 1 of 2 completions" in err
    assert f"advantage {advantage:.3f}" in err and "completion:\n    assistant: " in err
    with pytest.raises(ValueError, match="num_completions_to_print=0 must be >= 1"):
        GRPOConfig(output_dir="x", num_completions_to_print=0)


def test_logged_completions_show_the_environments_reward_and_each_reward_functions_column():
    """Episode.rewards holds one reward per turn: a two-turn episode's environment column is its total, and the
    reward functions' columns are the step's scores (a function's None: nan), not the turns' rewards."""
    from treerl.learners.samples import completion_rows, format_completions
    from treerl.rollout.trajectory import Episode, Group, Segment

    group = Group(task_key="t", env_id="e", segments=[Segment(kind="prompt", token_ids=[1])])
    talk = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "calc"},
            {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]
    group.episodes = [Episode(leaf=0, reward=1.0, rewards=[0.0, 1.0], group=group, messages=talk),
                      Episode(leaf=0, reward=0.0, rewards=[0.0, 0.0], group=group, messages=talk)]

    (row, _) = completion_rows([group], [0.5, -0.5], ["env"])
    assert row["env"] == 1.0 and set(row) == {"prompt", "completion", "env", "advantage"}
    scores = torch.tensor([[1.0, 0.25], [0.0, float("nan")]])  # (E, 1 + functions)
    rows = completion_rows([group], [0.5, -0.5], ["env", "short"], rewards=scores)
    assert [(r["env"], r["short"]) for r in rows[:1]] == [(1.0, 0.25)] and math.isnan(rows[1]["short"])
    assert "env 1.000 · short 0.250 · advantage 0.500" in format_completions(1, rows, 2)


def test_trls_vllm_server_base_url_is_the_server_url_and_top_k_0_is_none():
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    assert GRPOConfig(output_dir="x", vllm_server_base_url="http://gpu:8000").vllm_server_url == "http://gpu:8000"
    assert GRPOConfig(output_dir="x", top_k=0).top_k is None  # TRL's default, 0: top-k off
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--top-k", "0"])
    assert config_from_args(GRPOConfig, args).top_k is None


def test_the_logged_lr_is_the_one_each_step_trained_with(tmp_path):
    # As transformers' Trainer logs learning_rate (read before the scheduler steps): a linear decay over
    # 2 steps trains at 1e-3, then 5e-4; the rate after the step (5e-4, then 0) is the next step's.
    out = tmp_path / "run"
    assert main(["learn", "--env", "treerl/Calculator-v0", "--output-dir", str(out), "--max-steps", "2",
                 "--lr-scheduler-type", "linear", "--learning-rate", "1e-3", "--tasks-per-step", "1",
                 "--group-size", "2", "--max-new-tokens", "8", "--eval-episodes", "0", "--num-threads", "1"]) == 0
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([1e-3, 5e-4])


def test_trls_lr_scheduler_types_decay_over_the_runs_optimizer_steps():
    import torch

    from treerl.cli import build_parser
    from treerl.config import config_from_args
    from treerl.learners.core import make_scheduler

    def lrs(**kwargs):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched = make_scheduler(opt, GRPOConfig(output_dir="x", **kwargs))
        out = [sched.get_last_lr()[0]]
        for _ in range(4):
            opt.step()
            sched.step()
            out.append(round(sched.get_last_lr()[0], 3))
        return out

    assert lrs(steps=4) == [1.0, 1.0, 1.0, 1.0, 1.0]  # treerl's default: constant
    assert lrs(steps=4, lr_scheduler_type="linear") == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lrs(steps=4, lr_scheduler_type="cosine") == [1.0, 0.854, 0.5, 0.146, 0.0]
    # TRL's max_steps counts optimizer steps: 2 steps of 2 updates decay over 4.
    assert lrs(max_steps=4, num_iterations=2, lr_scheduler_type="linear") == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lrs(steps=4, warmup_steps=2, lr_scheduler_type="linear")[:3] == [0.0, 0.5, 1.0]
    # TRL's warmup_ratio: that fraction of the run's optimizer steps, rounded up.
    assert GRPOConfig(output_dir="x", max_steps=10, warmup_ratio=0.1).warmup_steps == 1
    assert GRPOConfig(output_dir="x", max_steps=8, num_iterations=2, warmup_ratio=0.3).warmup_steps == 3
    # TRL's max_steps=-1 runs by num_train_epochs (TRL's 3): the warm-up waits for the rows to set the length.
    assert GRPOConfig(output_dir="x", max_steps=-1, warmup_ratio=0.1).fractions_of_run == {"warmup_ratio": 0.1}
    with pytest.raises(TypeError, match="warmup_ratio and warmup_steps set the same thing"):
        GRPOConfig(output_dir="x", warmup_ratio=0.1, warmup_steps=2)
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--max-steps", "20", "--warmup-ratio", "0.1"])
    assert config_from_args(GRPOConfig, args).warmup_steps == 2
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--lr-scheduler-type", "cosine"])
    assert config_from_args(GRPOConfig, args).lr_scheduler_type == "cosine"
    with pytest.raises(ValueError, match="lr_scheduler_type='polynomial': use one of constant, linear, cosine"):
        GRPOConfig(output_dir="x", lr_scheduler_type="polynomial")


def test_trls_warmup_steps_below_one_is_a_fraction_of_the_run():
    """transformers 5 (TRL 1.16's) has no warmup_ratio: warmup_steps in (0, 1) is that fraction of the run's optimizer
    steps, rounded up (TrainingArguments.get_warmup_steps), and a float of 1 or more is truncated to whole steps."""
    from transformers import TrainingArguments

    assert TrainingArguments(output_dir="x", warmup_steps=0.1).get_warmup_steps(20) == 2
    assert GRPOConfig(output_dir="x", max_steps=20, warmup_steps=0.1).warmup_steps == 2
    assert GRPOConfig(output_dir="x", max_steps=8, num_iterations=2, warmup_steps=0.3).warmup_steps == 3
    assert GRPOConfig(output_dir="x", max_steps=-1, warmup_steps=0.1).fractions_of_run == {"warmup_ratio": 0.1}
    assert GRPOConfig(output_dir="x", max_steps=20, warmup_steps=3.0).warmup_steps == 3
    with pytest.raises(TypeError, match="warmup_ratio and warmup_steps set the same thing"):
        GRPOConfig(output_dir="x", warmup_ratio=0.1, warmup_steps=0.2)


def test_trls_adamw_options_reach_the_optimizer_and_a_resumed_run_keeps_them(tmp_path):
    """adam_beta1, adam_beta2, adam_epsilon and optim (TRL's names, flags and YAML keys) build the AdamW;
    its checkpoint restores the same optimizer on --resume."""
    import torch

    from treerl.cli import build_parser
    from treerl.config import config_from_args
    from treerl.learners.core import build
    from treerl.learners.grpo import train

    (tmp_path / "c.yaml").write_text("adam_beta1: 0.8\nadam_epsilon: 1.0e-6\n")
    args = build_parser().parse_args(["learn", "--output-dir", str(tmp_path / "out"), "--config",
                                      str(tmp_path / "c.yaml"), "--adam-beta2", "0.95", "--optim",
                                      "adamw_torch_fused", "--steps", "1", "--tasks-per-step", "1", "--group-size",
                                      "2", "--max-new-tokens", "8", "--eval-episodes", "0", "--progress", "false",
                                      "--num-threads", "1", "--sample-groups", "0"])
    cfg = config_from_args(GRPOConfig, args)
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon, cfg.optim) == (0.8, 0.95, 1e-6, "adamw_torch_fused")
    train(cfg)
    saved = torch.load(tmp_path / "out" / "checkpoints" / "step-1" / "optimizer.pt", weights_only=False)
    [group] = saved["optimizer"]["param_groups"]
    assert (group["betas"], group["eps"], group["fused"]) == ((0.8, 0.95), 1e-6, True)
    run = build(dataclasses.replace(cfg, resume=True, steps=2))
    [group] = run.optimizer.param_groups
    assert (group["betas"], group["eps"], group["fused"]) == ((0.8, 0.95), 1e-6, True)
    assert {int(state["step"]) for state in run.optimizer.state.values()} == {1}  # its moments came back too
    default = GRPOConfig(output_dir="x")
    assert (default.adam_beta1, default.adam_beta2, default.adam_epsilon) == (0.9, 0.999, 1e-8)  # TRL's


def test_resuming_with_other_optimizer_settings_says_the_checkpoints_optimizer_keeps_its_own(tmp_path, capsys):
    """The checkpoint's optimizer comes back with its learning rate and AdamW settings (as transformers' does), so
    changing them on --resume changes nothing: the warning says so, not that config.json records them."""
    from treerl.learners.core import build
    from treerl.learners.grpo import train

    cfg = GRPOConfig(output_dir=str(tmp_path / "out"), steps=1, tasks_per_step=1, group_size=2, max_new_tokens=8,
                     eval_episodes=0, progress=False, sample_groups=0, learning_rate=1e-3)
    train(cfg)
    capsys.readouterr()
    run = build(dataclasses.replace(cfg, resume=True, steps=2, learning_rate=5e-4, adam_beta1=0.8))
    [group] = run.optimizer.param_groups
    assert (group["lr"], group["betas"]) == (1e-3, (0.9, 0.999))
    err = capsys.readouterr().err
    assert "optimizer settings that differ from the run's: learning_rate 0.001 -> 0.0005; adam_beta1 0.9 -> 0.8: " \
           "they change nothing, the checkpoint's optimizer keeps its own" in err
    assert "config.json will record" not in err


def test_a_resumed_runs_config_json_records_the_optimizer_settings_its_checkpoint_kept(tmp_path, capsys):
    """Optimizer settings changed on --resume change nothing, so config.json keeps those the run trains with: a later
    resume with them warns of nothing, and `treerl learn --config config.json` repeats the run's learning rate."""
    from treerl.learners.core import build
    from treerl.learners.grpo import train

    out = tmp_path / "out"
    cfg = GRPOConfig(output_dir=str(out), steps=1, tasks_per_step=1, group_size=2, max_new_tokens=8,
                     eval_episodes=0, progress=False, sample_groups=0, learning_rate=1e-3)
    train(cfg)
    build(dataclasses.replace(cfg, resume=True, steps=2, learning_rate=5e-4, adam_beta1=0.8))
    recorded = json.loads((out / "config.json").read_text())
    assert (recorded["learning_rate"], recorded["adam_beta1"]) == (1e-3, 0.9)
    capsys.readouterr()
    run = build(dataclasses.replace(cfg, resume=True, steps=2))  # the settings the run has trained with all along
    assert "differ from the run's" not in capsys.readouterr().err
    assert run.optimizer.param_groups[0]["lr"] == 1e-3


def test_optim_takes_trls_names_of_torchs_adamw_and_refuses_other_optimizers_by_name():
    for name in ("adamw_torch", "adamw_torch_fused"):
        assert GRPOConfig(output_dir="x", optim=name).optim == name
    for name in ("adamw_8bit", "adafactor", "sgd", "paged_adamw_32bit"):
        with pytest.raises(ValueError, match=f"optim='{name}' is not supported: the optimizer is torch's AdamW .*"
                                             r"GRPOTrainer\(optimizers=\(optimizer, None\)\)"):
            GRPOConfig(output_dir="x", optim=name)
    for bad in ({"adam_beta1": 1.0}, {"adam_beta2": -0.1}, {"adam_beta1": float("nan")}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=.* must be in \\[0, 1\\)"):
            GRPOConfig(output_dir="x", **bad)
    for eps in (0.0, -1e-8, float("inf")):
        with pytest.raises(ValueError, match="adam_epsilon=.* must be > 0"):
            GRPOConfig(output_dir="x", adam_epsilon=eps)


def test_a_passed_optimizer_with_adamw_options_set_is_refused_not_ignored(tmp_path):
    """The optimizer passed trains with its own settings, so AdamW options set in the config would change
    nothing: refused before the model loads (GRPOTrainer's optimizers= alike); at their defaults, taken."""
    import torch

    from treerl import GRPOTrainer
    from treerl.learners import core
    from treerl.learners.grpo import train

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1)

    with pytest.raises(ConfigError, match="adam_beta2=0.95, weight_decay=0.1: these configure the AdamW treerl "
                                          "makes, but an optimizer was passed"):
        train(GRPOConfig(output_dir=str(tmp_path / "a"), adam_beta2=0.95, weight_decay=0.1), optimizer=sgd)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    trainer = GRPOTrainer(model="tiny", reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=GRPOConfig(output_dir=str(tmp_path / "b"), adam_epsilon=1e-6),
                          train_dataset=[{"prompt": "Hi"}], optimizers=(opt, None))
    with pytest.raises(ConfigError, match="adam_epsilon=1e-06: these configure the AdamW"):
        trainer.train()
    assert not (tmp_path / "b").exists()  # refused before anything was written
    # TRL's default optim, as a TRL config written out names it, is a default here too
    core._refuse_unused_adamw_options(GRPOConfig(output_dir="x", optim="adamw_torch_fused"))


@pytest.mark.parametrize("option", ["hub_always_push",
                                    "gradient_checkpointing_kwargs", "torch_dtype",
                                    "vllm_group_port", "trust_remote_code", "generation_kwargs"])
def test_trainingarguments_options_a_trl_script_sets_are_refused_with_what_to_do(option):
    with pytest.raises(TypeError, match=f"GRPOConfig\\(\\) has no option {option}: "):
        GRPOConfig(output_dir="x", **{option: 1})


HUB_RUN = dict(tasks_per_step=2, group_size=2, max_new_tokens=8, eval_episodes=0, progress=False, num_threads=1,
               sample_groups=0, save_every=1, push_to_hub=True)


def test_push_to_hub_pushes_the_model_after_each_checkpoint_and_at_the_end(tmp_path, monkeypatch):
    """TRL's push_to_hub, hub_strategy every_save (its default), hub_private_repo and hub_token: the repository
    (named after the output directory, as transformers does) is created at the start; the model a user loads
    with from_pretrained, with its tokenizer and a model card, is pushed after each checkpoint and at the end;
    the token reaches the Hub client, not config.json."""
    from _helpers import FakeHub

    from treerl.learners.grpo import train

    hub = FakeHub(owner="me").install(monkeypatch)
    out = tmp_path / "calc-grpo"
    cfg = GRPOConfig(output_dir=str(out), steps=3, hub_private_repo=True, hub_token="hf_secret", **HUB_RUN)
    assert "hf_secret" not in repr(cfg)
    train(cfg)

    assert hub.repos == [("calc-grpo", True)]
    assert [(u["repo_id"], u["message"]) for u in hub.uploads] == [
        ("me/calc-grpo", "Training in progress, step 1"), ("me/calc-grpo", "Training in progress, step 2"),
        ("me/calc-grpo", "End of training, step 3")]
    for upload in hub.uploads:
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "README.md"} <= set(upload["files"])
        assert not {"optimizer.pt", "trainer_state.json"} & set(upload["files"])  # checkpoints stay local
    card = hub.uploads[-1]["card"]
    assert "- treerl\n- grpo\n" in card and "for 3 steps" in card and 'from_pretrained("me/calc-grpo")' in card
    assert "base_model" not in card  # the shipped model has no Hub id (and a local path is never shown)
    assert set(hub.tokens) == {"hf_secret"}
    assert "hf_secret" not in (out / "config.json").read_text()
    assert "hub_token" not in json.loads((out / "config.json").read_text())

    hub.uploads.clear()
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(_hub_cache(tmp_path)))
    train(GRPOConfig(output_dir=str(tmp_path / "end"), model="acme/tiny-chat", steps=2, hub_strategy="end",
                     hub_model_id="acme/calc", **HUB_RUN))
    assert hub.repos[-1] == ("acme/calc", None) and [u["message"] for u in hub.uploads] == ["End of training, step 2"]
    assert "base_model: acme/tiny-chat\n" in hub.uploads[0]["card"]  # a Hub id: the Hub links the base model
    assert set(hub.tokens) == {"hf_secret", None}  # without hub_token: huggingface_hub's own (HF_TOKEN, hf auth login)


def test_a_failed_or_slow_push_warns_and_the_run_waits_for_it_at_the_end(tmp_path, monkeypatch, capsys):
    """every_save uploads in the background: a checkpoint whose predecessor still uploads is not pushed (as
    transformers does), the end of the run waits for the upload in flight before it rewrites the model and
    pushes, and a failed push is a warning, not the end of the run."""
    import threading

    from _helpers import FakeHub

    from treerl.learners.grpo import train

    hub = FakeHub().install(monkeypatch)
    out = tmp_path / "run"
    release = threading.Event()

    def upload(u):
        if u["message"] == "Training in progress, step 1":
            # Held until released after the last step; the run's end must not get past its wait before that.
            while not release.wait(0.05):
                if (out / "summary.json").exists():
                    u["ended_by"] = "the run's end, which did not wait"
                    break
            u.setdefault("ended_by", "release")
            raise OSError("503 Service Unavailable")

    hub.before_upload = upload

    def after_step(step, metrics):
        if step == 3:
            threading.Timer(2.0, release.set).start()

    result = train(GRPOConfig(output_dir=str(out), steps=3, **HUB_RUN), callbacks=[after_step])

    assert result.steps == 3 and (out / "summary.json").exists()
    assert [u["message"] for u in hub.uploads] == ["Training in progress, step 1", "End of training, step 3"]
    assert hub.uploads[0]["ended_by"] == "release" and "done" not in hub.uploads[0] and hub.uploads[1]["done"]
    err = capsys.readouterr().err
    assert "Training in progress, step 2: not pushed, the previous push is still uploading" in err
    assert ("warning: push to the Hub failed (Training in progress, step 1): OSError: 503 Service Unavailable; the "
            f"model is in {out / 'model'}: upload it later with `hf upload me/run {out / 'model'}`") in err


def test_push_to_hub_creates_the_repository_before_training(tmp_path, monkeypatch):
    """A missing or refused token is said at the start, not after the run."""
    from _helpers import FakeHub

    from treerl.learners.grpo import train

    hub = FakeHub().install(monkeypatch)
    hub.create_error = OSError("401 Client Error: Unauthorized")
    with pytest.raises(ConfigError, match="push_to_hub: the Hub repository 'run' could not be created \\(401 Client "
                                          "Error: Unauthorized\\); log in with `hf auth login`"):
        train(GRPOConfig(output_dir=str(tmp_path / "run"), steps=1, **HUB_RUN))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # a branch the Hub refuses (hub_revision) is said as such, not as a missing login
    hub.create_error, hub.branch_error = None, OSError("400 Client Error: Invalid rev id: a..b")
    with pytest.raises(ConfigError, match="the branch 'a..b' of me/run could not be created \(400 Client Error: "
                                          "Invalid rev id: a..b\); check --hub-revision"):
        train(GRPOConfig(output_dir=str(tmp_path / "run"), steps=1, hub_revision="a..b", **HUB_RUN))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_trls_hub_options_as_flags_and_yaml_keys(tmp_path):
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    args = build_parser().parse_args(["learn", "--output-dir", "x", "--push-to-hub", "--hub-model-id", "me/calc",
                                      "--hub-strategy", "end", "--hub-private-repo", "true"])
    cfg = config_from_args(GRPOConfig, args)
    assert (cfg.push_to_hub, cfg.hub_repo_id(), cfg.hub_strategy, cfg.hub_private_repo) == \
        (True, "me/calc", "end", True)
    (tmp_path / "trl.yaml").write_text("push_to_hub: true\nhub_model_id: me/calc\nhub_strategy: every_save\n"
                                       "hub_token: hf_secret\n")
    cfg = config_from_args(GRPOConfig, build_parser().parse_args(["learn", "--output-dir", "runs/calc", "--config",
                                                                  str(tmp_path / "trl.yaml")]))
    assert (cfg.push_to_hub, cfg.hub_model_id, cfg.hub_token) == (True, "me/calc", "hf_secret")
    assert "hub_token" not in cfg.recorded() and cfg.recorded()["hub_model_id"] == "me/calc"
    assert GRPOConfig(output_dir="runs/calc-grpo", push_to_hub=True).hub_repo_id() == "calc-grpo"  # transformers'
    for strategy in ("checkpoint", "all_checkpoints"):
        with pytest.raises(ValueError, match=f"hub_strategy='{strategy}': checkpoints here are the trainer's resume "
                                             "state"):
            GRPOConfig(output_dir="x", push_to_hub=True, hub_strategy=strategy)
    with pytest.raises(ValueError, match="hub_model_id 'me/calc/v2' is not a Hub repository name"):
        GRPOConfig(output_dir="x", push_to_hub=True, hub_model_id="me/calc/v2")
    with pytest.raises(ValueError, match="the output directory's name 'my run' is not a Hub repository name: .* Give "
                                         "--hub-model-id USER/NAME"):
        GRPOConfig(output_dir="runs/my run", push_to_hub=True)


def test_trls_importance_sampling_options_set_the_is_fields_and_off_policy_masking_trains(tmp_path):
    """TRL's vllm_importance_sampling_* options (mode, correction, clip_max or its older cap, clip_min) set
    --is-level/--is-mode/--is-ratio-high/--is-ratio-low, and its off_policy_mask_threshold masks as TRL's does."""
    import math

    from treerl.cli import build_parser
    from treerl.config import config_from_args
    from treerl.learners.grpo import train
    from treerl.learners.sdpo import SDPOConfig

    for config in (GRPOConfig, SDPOConfig):
        cfg = config(output_dir="x", vllm_importance_sampling_mode="sequence_mask",
                     vllm_importance_sampling_clip_max=3.0, vllm_importance_sampling_clip_min=0.5,
                     off_policy_mask_threshold=0.5)
        assert cfg.importance_config() == ImportanceConfig(level="sequence", mode="mask", ratio_low=0.5,
                                                           ratio_high=3.0, opsm_threshold=0.5)
    assert GRPOConfig(output_dir="x", vllm_importance_sampling_correction=False).is_mode == "off"
    assert GRPOConfig(output_dir="x", vllm_importance_sampling_cap=4.0).is_ratio_high == 4.0
    assert GRPOConfig(output_dir="x", vllm_importance_sampling_clip_max=None).is_ratio_high == math.inf
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--vllm-importance-sampling-mode", "token_mask"])
    cfg = config_from_args(GRPOConfig, args)
    assert (cfg.is_level, cfg.is_mode) == ("token", "mask")
    with pytest.raises(TypeError, match="vllm_importance_sampling_.* options and is_mode set the same thing"):
        GRPOConfig(output_dir="x", vllm_importance_sampling_mode="token_mask", is_mode="truncate")
    with pytest.raises(ValueError, match="TRL's modes are token_truncate"):
        GRPOConfig(output_dir="x", vllm_importance_sampling_mode="sequence")
    with pytest.raises(ValueError, match="opsm_threshold is -1.0; it bounds a mean KL"):
        GRPOConfig(output_dir="x", off_policy_mask_threshold=-1.0)
    logged = []  # skip_zero_advantage=False: the tiny model's groups tie, and the step must still forward them
    train(GRPOConfig(output_dir=str(tmp_path / "run"), steps=1, tasks_per_step=2, group_size=2, max_new_tokens=8,
                     eval_episodes=0, progress=False, sample_groups=0, off_policy_mask_threshold=0.0, is_ratio_low=0.5,
                     skip_zero_advantage=False), callbacks=[lambda step, metrics: logged.append(metrics)])
    assert "is/opsm_masked_frac" in logged[0]


def test_trl_options_that_change_nothing_here_are_taken_with_a_note(tmp_path, capsys):
    """logging_steps (every step is logged), num_train_epochs beside max_steps (which TRL then follows),
    remove_unused_columns=False (every column reaches the reward functions): accepted, each with a note;
    where they would change the run they are refused with what to do."""
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    with pytest.warns(UserWarning, match="logging_steps=10 changes nothing here: every step is logged"):
        cfg = GRPOConfig(output_dir="x", logging_steps=10, max_steps=5, num_train_epochs=1,
                         remove_unused_columns=False)
    assert cfg.steps == 5 and not hasattr(cfg, "logging_steps")
    # Alone, or beside TRL's max_steps=-1, num_train_epochs sets the run's length (tests/test_num_train_epochs.py).
    assert GRPOConfig(output_dir="x", num_train_epochs=1, max_steps=-1).num_train_epochs == 1
    with pytest.raises(TypeError, match="remove_unused_columns=True: every column of the dataset reaches"):
        GRPOConfig(output_dir="x", remove_unused_columns=True)
    (tmp_path / "c.yaml").write_text("logging_steps: 1\nlogging_first_step: true\nlogging_strategy: steps\n"
                                     "num_train_epochs: 1\nmax_steps: 3\n")
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml")])
    with pytest.warns(UserWarning, match="logging_first_step=True changes nothing here"):
        assert config_from_args(GRPOConfig, args).steps == 3
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--logging-steps", "10"])
    with pytest.warns(UserWarning, match="logging_steps=10 changes nothing here"):
        config_from_args(GRPOConfig, args)
    assert main(["learn", "--output-dir", "x", "--num-train-epochs", "2"]) == 2  # the calculator has no rows
    assert "num_train_epochs=2 counts passes over a training dataset" in capsys.readouterr().err


def test_options_that_are_not_here_say_what_to_use_instead(tmp_path, capsys):
    """A TRL option with no field, or another learner's option, is refused with what to use, not with a
    "did you mean" for a look-alike (--max-prompt-length is not --max-completion-length)."""
    cases = [("--max-prompt-length", "128", "prompts are never cut here: --max-episode-tokens"),
             ("--cache-implementation", "static", "not supported: generation uses the policy's own KV cache"),
             ("--trust-remote-code", "true", "not supported: --model loads architectures transformers ships"),
             ("--max-staleness", "2", "an option of treerl learn --learner async_grpo, not of --learner grpo")]
    for flag, value, expected in cases:
        with pytest.raises(SystemExit):
            main(["learn", "--output-dir", "x", flag, value])
        err = capsys.readouterr().err
        assert f"{flag}: {expected}" in err and "did you mean" not in err, err
    # an open-r1 recipe's log_level: info and TRL's use_peft: true were told "did you mean is_level?" or nothing
    (tmp_path / "c.yaml").write_text("max_prompt_length: 128\nmax_staleness: 2\nlog_level: info\nuse_peft: true\n")
    assert main(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert "(max_prompt_length: prompts are never cut here" in err
    assert "(max_staleness: an option of treerl learn --learner async_grpo" in err
    assert "(log_level: not supported: treerl prints its progress" in err and "did you mean is_level" not in err
    assert "(use_peft: LoRA is on when --lora-r is set" in err
    assert GRPOConfig(output_dir="x", log_level="passive").steps == 60  # transformers' default is taken
    # in Python too (it said "did you mean max_steps?")
    with pytest.raises(TypeError, match="max_staleness: an option of treerl learn --learner async_grpo, not of "
                                        "--learner grpo"):
        GRPOConfig(output_dir="x", max_staleness=2)


def test_learning_rate_default_and_warning_follow_the_model_size():
    from treerl.learners.precision import check_learning_rate

    assert check_learning_rate(None, 2_000_000, lora=False) == (2e-4, None)
    assert check_learning_rate(None, 1_200_000_000, lora=False) == (1e-6, None)
    assert check_learning_rate(None, 1_200_000_000, lora=True) == (1e-5, None)
    assert "far above" in check_learning_rate(2e-4, 1_200_000_000, lora=False)[1]
    assert "far below" in check_learning_rate(1e-9, 2_000_000, lora=False)[1]
    assert check_learning_rate(3e-6, 1_200_000_000, lora=False)[1] is None


def test_trls_max_completion_length_bounds_generation(tmp_path):
    """TRL's max_completion_length is its generation limit (and dr_grpo's normalizer): each episode's completion
    ends there, and a turn may use all of it (max_new_tokens, unless given); it was only the normalizer."""
    from transformers import AutoTokenizer

    from treerl.cli import build_parser
    from treerl.config import config_from_args
    from treerl.models import default_model_path

    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), max_completion_length=12)
    assert (cfg.max_new_tokens, cfg.loss_config().max_completion_length) == (12, 12)
    assert GRPOConfig(output_dir="x", max_completion_length=12, max_new_tokens=5).max_new_tokens == 5
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--max-completion-length", "12"])
    assert config_from_args(GRPOConfig, args).max_new_tokens == 12
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    assert cfg.engine(None, tokenizer, seed=0).max_completion_tokens == 12  # the budget: tests/test_rollout.py


def test_isolated_tool_defined_in_an_imported_file(tmp_path):
    import asyncio

    from treerl.cli import import_user_modules

    path = tmp_path / "my_tools.py"
    path.write_text("import os\nfrom treerl import tool\n\n@tool(isolate=True, timeout=30)\n"
                    "def which_process(x: int) -> str:\n    \"\"\"The process that ran the call.\n\n"
                    "    Args:\n        x: Echoed back.\n    \"\"\"\n    return f'{x} {os.getpid()}'\n")
    import runpy

    namespace = runpy.run_path(str(path), run_name=f"treerl_user_module:{path.resolve()}")
    import_user_modules([str(path)])  # as `--import my_tools.py` runs it
    out = asyncio.run(namespace["which_process"].acall({"x": 7}))
    x, pid = out.split()
    assert x == "7" and int(pid) != __import__("os").getpid()  # ran in a process of its own


SCRIPT_WITH_ISOLATED_TOOL = """
import asyncio
from treerl import tool

@tool(isolate=True, timeout=60)
def add(a: int, b: int) -> int:
    return a + b

def main():
    try:
        print("RESULT", asyncio.run(add.acall({"a": 1, "b": 2})))
    except TypeError as exc:
        print("BUG", exc)
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_an_isolated_tool_in_a_script_runs_or_says_what_the_script_lacks(tmp_path, guarded):
    import subprocess
    import sys

    script = tmp_path / "agent.py"
    script.write_text(SCRIPT_WITH_ISOLATED_TOOL + ('if __name__ == "__main__":\n    main()\n' if guarded else "main()\n"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path).stdout.splitlines()
    if guarded:
        assert out == ["RESULT 3"]
    else:  # the tool's process ran the script again (and its call) while loading the tool, and died
        assert out[-1].startswith("BUG tool 'add' has isolate=True") and 'if __name__ == "__main__":' in out[-1]


def test_flat_records_are_what_trl_collates():
    pytest.importorskip("trl", reason="the bench extra (trl) compares with its collator")
    import asyncio

    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from treerl.agents.transformers_policy import TransformersPolicy
    from treerl.rollout.options import EpisodeOptions
    from treerl.rollout.trajectory import to_flat_records

    rows = [{"prompt": "1 + 1?", "answer": "2", "level": "easy"}]
    opts = EpisodeOptions(env="treerl/MathVerify-v0", env_kwargs={"dataset": rows}, max_new_tokens=6)
    model, tok = load_model(None)
    policy = TransformersPolicy(model, tok, continuous_batching=False)
    try:
        groups, _ = asyncio.run(opts.engine(policy, tok, seed=0).run(opts.env_factory(), opts.env, range(1), 2))
    finally:
        policy.close()
    records = list(to_flat_records(groups))
    for r in records:
        assert r["input_ids"] == r["prompt_ids"] + r["completion_ids"] and r["answer"] == "2"
        assert r["info"] == {"level": "easy"} and len(r["labels"]) == len(r["input_ids"])
    batch = DataCollatorForLanguageModeling(pad_token_id=0)(records)  # SFTTrainer's collator, as is
    sampled = torch.tensor(records[0]["assistant_masks"], dtype=torch.bool)
    n = len(records[0]["input_ids"])
    assert torch.equal(batch["labels"][0, :n][sampled], batch["input_ids"][0, :n][sampled])
    assert bool((batch["labels"][0, :n][~sampled] == -100).all()) and sampled.any()


def test_a_tool_env_datasets_extra_columns_reach_the_reward_functions():
    from treerl import ToolEnv, tool
    from treerl.learners.rewards import score
    from treerl.rollout.trajectory import Group

    @tool
    def noop() -> str:
        """Does nothing."""
        return "ok"

    rows = [{"prompt": "Say hi.", "answer": "hi", "difficulty": "easy", "id": "r0"},
            {"prompt": "Say bye.", "answer": "bye", "difficulty": "hard", "info": {"row": {"source": "mine"}}}]
    env = ToolEnv(tools=[noop], dataset=rows)
    seen = {}

    def by_difficulty(completions, difficulty, **kwargs):
        seen.update(difficulty=list(difficulty), rest=sorted(kwargs))
        return [1.0 if d == "hard" else 0.0 for d in difficulty]

    groups = []
    for index in range(2):
        _, info = env.reset(seed=0, options={"task_index": index})
        group = Group(task_key=str(index), env_id="mine", info={"task_id": info["task_id"], "row": info["row"]})
        root = group.add_segment("prompt", [1, 2])
        group.add_episode(leaf=group.add_segment("sampled", [3], parent=root, logprobs=[-1.0], policy_version=0),
                          reward=0.0)
        groups.append(group)
    rewards = score(groups, [by_difficulty], {})
    assert seen["difficulty"] == ["easy", "hard"] and rewards[:, 1].tolist() == [0.0, 1.0]
    assert "source" in seen["rest"] and "id" not in seen["rest"]  # a row's own info["row"] is kept too


def test_a_tool_env_datasets_info_column_reaches_the_reward_functions():
    # TRL passes every column but the prompt to reward functions, and verifiers users keep their
    # metadata in an `info` column; the environment still reads it as Task.info.
    from treerl import ToolEnv

    rows = [{"prompt": "Say hi.", "answer": "hi", "info": {"difficulty": "easy"}},
            {"prompt": "Say bye.", "answer": "bye", "info": {"difficulty": "hard"}, "topic": "greetings"}]
    env = ToolEnv(dataset=rows)
    seen = []
    for index in range(2):
        _, info = env.reset(seed=0, options={"task_index": index})
        assert env.task.info["difficulty"] == rows[index]["info"]["difficulty"]
        seen.append(info["row"])
    assert seen == [{"info": {"difficulty": "easy"}}, {"info": {"difficulty": "hard"}, "topic": "greetings"}]


def test_a_reward_function_of_another_shape_is_told_trls():
    # verifiers' reward functions score one completion at a time and return a float; TRL's take the batch.
    from treerl.learners.rewards import score
    from treerl.rollout.trajectory import Group

    group = Group(task_key="0", env_id="mine", info={"task_id": "0", "answer": "hi", "num_prompt_messages": 1})
    root = group.add_segment("prompt", [1, 2])
    group.add_episode(leaf=group.add_segment("sampled", [3], parent=root, logprobs=[-1.0], policy_version=0),
                      reward=0.0)

    def correct(completion, answer, **kwargs):  # one completion
        return 1.0

    def one_float(completions, **kwargs):
        return 1.0

    for func, says in ((correct, "cannot take TRL's arguments (missing a required argument: 'completion')"),
                       (one_float, "returned a float, not a list of rewards")):
        with pytest.raises((TypeError, ValueError)) as err:
            score([group], [func], {})
        assert f"reward function {func.__name__!r}" in str(err.value) and says in str(err.value), str(err.value)
        assert "f(prompts, completions, completion_ids, **kwargs)" in str(err.value)


def test_the_process_group_waits_ddp_timeout_seconds(monkeypatch):
    """NCCL's default (10 minutes) is shorter than rank 0's held-out evaluation of a large model, which the
    other ranks wait through: the group treerl makes waits --ddp-timeout (TrainingArguments' 1800 s)."""
    import datetime
    import socket

    import torch.distributed as dist

    from treerl.learners.distributed import Ranks

    made = {}
    real = dist.init_process_group

    def init(**kwargs):
        made.update(kwargs)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        real(backend=kwargs["backend"], timeout=kwargs["timeout"], init_method=f"tcp://127.0.0.1:{port}",
             world_size=1, rank=0)

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "init_process_group", init)
    try:
        assert Ranks.from_env("cpu", timeout_s=3600) == Ranks()  # the group of one this test made
        assert made["backend"] == "gloo" and made["timeout"] == datetime.timedelta(seconds=3600)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_warning_is_printed_once(tmp_path):
    """Printed as `warning: ...` and logged below warning level: with no logging set up, Python's
    last-resort handler printed every such warning a second time."""
    import subprocess
    import sys

    code = ("import torch\nfrom treerl.learners.core import _check_size_defaults\n"
            "from treerl.learners.grpo import GRPOConfig\n"
            f"_check_size_defaults(GRPOConfig(output_dir={str(tmp_path)!r}, learning_rate=1.0), "
            "torch.nn.Linear(2, 2), True)\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert err.count("learning_rate=1 is far above") == 1, err


def test_a_hub_id_model_is_named_by_its_id_so_its_lora_adapter_names_the_base(tmp_path, monkeypatch):
    # peft writes the base model's name_or_path into adapter_config.json: the cache snapshot's
    # directory there would make an adapter pushed to the Hub unloadable on any other machine.
    import huggingface_hub.constants
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(_hub_cache(tmp_path)))
    model, tok = load_model("acme/tiny-chat")
    assert model.name_or_path == model.config.name_or_path == tok.name_or_path == "acme/tiny-chat"
    lora = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    lora.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "acme/tiny-chat"


@pytest.mark.parametrize("disable_dropout", [False, True])
def test_disable_dropout_sets_every_dropout_module_of_the_trained_model_to_0(tmp_path, disable_dropout):
    """TRL's disable_dropout: after LoRA, each torch.nn.Dropout of the trained model (LoRA's own too) drops
    nothing; off, --lora-dropout stays."""
    from treerl.learners.core import build

    cfg = GRPOConfig(output_dir=str(tmp_path / "out"), lora_r=2, lora_dropout=0.5, disable_dropout=disable_dropout,
                     tasks_per_step=1, group_size=2, max_new_tokens=4, eval_episodes=0)
    run = build(cfg)
    try:
        rates = {m.p for m in run.model.modules() if isinstance(m, torch.nn.Dropout)}
    finally:
        run.policy.close()
    assert rates == ({0.0} if disable_dropout else {0.5})
