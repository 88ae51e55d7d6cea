"""``treerl.GRPOTrainer``: a TRL GRPO script runs with only its import changed (the shipped tiny model, a
step or two of 2 tasks x 2 generations each)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from treerl import GRPOConfig, GRPOTrainer
from treerl.learners.checkpoints import latest_checkpoint
from treerl.models import default_model_path, load_model

SYSTEM = "Use the calculator tool, then answer with \\boxed{number}."


def small(tmp_path, **kwargs) -> GRPOConfig:
    options = dict(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2, tasks_per_step=2,
                   max_new_tokens=8, progress=False, sample_groups=0)
    return GRPOConfig(**{**options, **kwargs})


def changed(model_dir) -> bool:
    before = load_file(default_model_path() / "model.safetensors")
    after = load_file(model_dir / "model.safetensors")
    return any(not torch.equal(before[k], after[k]) for k in before)


def test_a_trl_script_trains_with_only_its_import_changed(tmp_path):
    from datasets import Dataset

    dataset = Dataset.from_list([{"prompt": f"What is {i} + {i}?", "level": ["easy", "hard"][i % 2]}
                                 for i in range(4)])
    seen = {}

    def reward_len(completions, level, **kwargs):  # TRL's quickstart reward, on the text of each completion
        seen.update(completions=completions, level=level, prompts=kwargs.get("prompts"))
        return [-abs(20 - len(completion)) for completion in completions]

    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=small(tmp_path, max_steps=2),
                          train_dataset=dataset, eval_dataset=dataset.select(range(2)))
    result = trainer.train()

    assert result.steps == 2 and changed(result.model_dir)
    # TRL's standard format: text prompts give the functions text, not lists of messages.
    assert all(isinstance(c, str) for c in seen["completions"])
    assert set(seen["level"]) <= {"easy", "hard"} and len(seen["level"]) == 4  # the extra column, per completion
    assert json.loads((tmp_path / "out" / "config.json").read_text())["env"] == "GRPOTrainer.train_dataset"
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for m in metrics:  # the reward trained on is the function's alone (the environment's weight is 0)
        assert m["reward/mean"] == pytest.approx(m["reward_fn/reward_len_mean"])
    figures = trainer.evaluate()
    assert set(figures) == {"eval_reward", "eval_reward_std", "eval_rewards/reward_len/mean",
                            "eval_rewards/reward_len/std", "eval_frac_reward_zero_std"}
    assert figures["eval_reward"] == pytest.approx(figures["eval_rewards/reward_len/mean"])
    assert figures["eval_reward"] <= 0  # -|20 - length|
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "model.safetensors").is_file()


def test_push_to_hub_pushes_what_save_model_writes_with_a_model_card(tmp_path, monkeypatch):
    """TRL's trainer.push_to_hub(): the trained model (what save_model copies) with a model card, to
    args.hub_model_id with args.hub_private_repo and args.hub_token; open-r1's model card arguments taken."""
    from _helpers import FakeHub

    hub = FakeHub(owner="me").install(monkeypatch)
    def reward_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, train_dataset=[{"prompt": "Say hi"}] * 2,
                          args=small(tmp_path, hub_model_id="acme/tiny-grpo", hub_private_repo=False,
                                     hub_token="hf_secret"))
    with pytest.raises(ValueError, match="push_to_hub\\(\\) pushes the trained model: call train\\(\\) first"):
        trainer.push_to_hub()
    trainer.train()
    assert hub.uploads == []  # args.push_to_hub is off: the run pushed nothing
    commit = trainer.push_to_hub(dataset_name="open-r1/OpenR1-Math-220k", tags=["open-r1"])

    assert commit == "commit of End of training"  # TRL's default message
    assert hub.repos == [("acme/tiny-grpo", False)] and set(hub.tokens) == {"hf_secret"}
    (upload,) = hub.uploads
    assert upload["repo_id"] == "acme/tiny-grpo"
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(upload["files"])
    assert set(upload["files"]) - {"README.md"} == {p.name for p in trainer.result.model_dir.iterdir()} - {"README.md"}
    assert "datasets:\n- open-r1/OpenR1-Math-220k" in upload["card"] and "- open-r1\n" in upload["card"]
    assert "`grpo` learner" in upload["card"] and "hf_secret" not in (tmp_path / "out" / "config.json").read_text()
    trainer.push_to_hub(commit_message="Second version", token="hf_other")
    assert hub.uploads[-1]["message"] == "Second version" and hub.tokens[-1] == "hf_other"


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
def test_rows_play_in_the_order_trls_sampler_draws_them(tmp_path):
    """TRL's RepeatSampler (shuffle_dataset, its default) draws each pass over the rows as a torch.randperm from
    one generator seeded with args.seed; the same passes here (checked against TRL itself where installed), and
    the rows as written with shuffle_dataset=False."""
    from datasets import Dataset

    rows = [{"prompt": f"Row {i}"} for i in range(4)]
    generator = torch.Generator().manual_seed(7)
    passes = [torch.randperm(4, generator=generator).tolist() for _ in range(2)]

    def played(dataset, **options):
        seen = []

        def reward(prompts, **kwargs):
            seen.extend(prompts[::2])  # a group's two generations share their prompt
            return [0.0] * len(prompts)

        GRPOTrainer(model="tiny", reward_funcs=reward, train_dataset=dataset,
                    args=small(tmp_path, max_steps=4, max_new_tokens=2, overwrite_output_dir=True, **options)).train()
        return [int(p.split()[1]) for p in seen]

    assert played(rows, seed=7) == passes[0] + passes[1] != list(range(4)) * 2
    assert played(Dataset.from_list(rows), seed=7, shuffle_dataset=False) == list(range(4)) * 2
    try:
        from trl.trainer.grpo_trainer import RepeatSampler
    except ImportError:  # not in the test extra
        return
    sampler = RepeatSampler(rows, mini_repeat_count=1, shuffle=True, seed=7)
    assert [list(sampler), list(sampler)] == passes


def test_dataset_columns_named_like_treerls_own_arguments_reach_reward_functions_as_written():
    """TRL passes every column of the row: a HumanEval-like task_id (or termination, env_reward) column is the
    dataset's value, not treerl's argument of that name, which stays for rows without the column."""
    from treerl.rollout.rewards import score
    from treerl.rollout.trajectory import Group

    seen = {}

    def reward(completions, task_id, termination, env_reward, **kwargs):
        seen.update(task_id=task_id, termination=termination, env_reward=env_reward)
        return [0.0] * len(completions)

    groups = []
    for index, row in enumerate([{"task_id": "HumanEval/0", "termination": "none", "env_reward": 5.0}, {}]):
        group = Group(task_key=str(index), env_id="rows", info={"task_id": str(index), "row": row})
        root = group.add_segment("prompt", [1, 2])
        group.add_episode(leaf=group.add_segment("sampled", [3], parent=root, logprobs=[-1.0], policy_version=0),
                          reward=0.0, termination="final_answer")
        groups.append(group)
    score(groups, [reward], {})
    assert seen == {"task_id": ["HumanEval/0", "1"], "termination": ["none", "final_answer"],
                    "env_reward": [5.0, 0.0]}


def test_text_prompts_under_another_column_give_reward_functions_text():
    from treerl.trainer import _trl_format

    def reward(prompts, completions, **kwargs):
        return [float(isinstance(c, str)) for c in completions]

    messages = {"prompts": [[{"role": "user", "content": "Hi"}]],
                "completions": [[{"role": "assistant", "content": "Yo"}]]}
    assert _trl_format(reward, [{"question": "Hi"}], [], "question")(**messages) == [1.0]
    assert _trl_format(reward, [{"question": "Hi"}], [], "prompt")(**messages) == [0.0]  # not where the prompt is


def test_conversational_prompts_and_tools_play_multi_turn_episodes(tmp_path):
    calls = []

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "2 + 3".
        """
        calls.append(expression)
        return str(eval(expression, {"__builtins__": {}}))  # the tiny model writes + and - of small numbers

    rows = [{"prompt": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"Tara has {i + 11} marbles, buys 9 more and then gives away 15. "
                                                    "How many marbles are left?"}],
             "answer": str(i + 5)} for i in range(2)]
    seen = {}

    def boxed(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [float(f"\\boxed{{{a}}}" in c[-1]["content"]) for c, a in zip(completions, answer)]

    trainer = GRPOTrainer(model="tiny", reward_funcs=[boxed], tools=[calculator], train_dataset=rows,
                          args=small(tmp_path, max_new_tokens=32))
    trainer.train()

    assert calls, "the model called no tool"
    # Conversational: the row's messages as the prompt, the episode's messages as the completion.
    assert all([m["role"] for m in p] == ["system", "user"] and p[0]["content"] == SYSTEM for p in seen["prompts"])
    turns = [[m["role"] for m in c] for c in seen["completions"]]
    assert ["assistant", "tool", "assistant"] in turns, turns
    assert sorted(set(seen["answer"])) == ["5", "6"]
    # TRL's max_tool_calling_iterations: N rounds of tool calls, each followed by a turn (N + 1 turns in all)
    limited = GRPOTrainer(model="tiny", reward_funcs=[boxed], tools=[calculator], train_dataset=rows,
                          args=small(tmp_path, max_tool_calling_iterations=2))
    assert limited._env_factory(limited.train_dataset)().max_turns == 3


def test_peft_config_a_loaded_model_and_trl_callbacks(tmp_path):
    from peft import LoraConfig
    from transformers import TrainerCallback

    class Logs(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.events.append("begin")

        def on_log(self, args, state, control, logs=None, **kwargs):
            # TRL's names, as TRL's own logs give them to on_log (treerl's beside them)
            trl = {"loss", "grad_norm", "learning_rate", "reward", "reward_std", "rewards/<lambda>/mean", "epoch"}
            self.events.append((state.global_step, trl <= set(logs) and logs["reward"] == logs["reward/mean"]))

        def on_train_end(self, args, state, control, **kwargs):
            self.events.append("end")

    steps = []
    logs = Logs()
    model, _ = load_model(None)  # the tokenizer comes from where the model was loaded from
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=small(tmp_path), train_dataset=[{"prompt": "Hi"}, {"prompt": "Count to 3."}],
                          peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "v_proj"]),
                          callbacks=[logs, lambda step, metrics: steps.append(step)])
    result = trainer.train()

    adapter = json.loads((result.output_dir / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], sorted(adapter["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    config = json.loads((result.output_dir / "config.json").read_text())
    assert (config["lora_r"], config["lora_target_modules"]) == (4, ["q_proj", "v_proj"])
    assert logs.events == ["begin", (1, True), "end"] and steps == [1]
    # peft's own default targets where the LoraConfig names none (q_proj and v_proj for Qwen3).
    default = GRPOTrainer(model="tiny", reward_funcs=len, args=small(tmp_path), train_dataset=[{"prompt": "Hi"}],
                          peft_config=LoraConfig(r=2))
    assert default.args.lora_target_modules == ["q_proj", "v_proj"] and default.args.lora_r == 2


def test_callbacks_given_as_classes_or_added_later_are_called_as_transformers_calls_them(tmp_path):
    """transformers' Trainer makes a callback given as a class (callbacks=[MyCallback]), and add_callback,
    pop_callback and remove_callback change the list before train()."""
    from transformers import PrinterCallback, TrainerCallback

    class Steps(TrainerCallback):
        seen: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            Steps.seen.append(state.global_step)

    class Other(Steps):
        pass

    functions = []
    trainer = GRPOTrainer(model="tiny", reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          train_dataset=[{"prompt": "Hi"}] * 2, args=small(tmp_path, max_new_tokens=2),
                          callbacks=[Steps, Other])
    removed = trainer.pop_callback(Other)
    assert isinstance(removed, Other) and trainer.pop_callback(Other) is None
    trainer.add_callback(Other)
    trainer.remove_callback(Other)
    trainer.remove_callback(PrinterCallback)  # one of TRL's default callbacks: none here, nothing to remove
    trainer.add_callback(lambda step, metrics: functions.append(step))
    trainer.train()
    assert Steps.seen == [1] and functions == [1]  # the class made once; Other no longer there


def test_log_metric_values_and_frac_reward_zero_std_are_logged_under_trls_names(tmp_path):
    """TRL's test_train_reward_func_with_log_metric: log_metric(name, value) lands in log_history (and on_log's
    logs) under name, and in evaluate()'s figures as eval_NAME; frac_reward_zero_std is logged too."""
    from transformers import TrainerCallback

    class Logs(TrainerCallback):
        seen: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            Logs.seen.append(logs)

    def reward_func(completions, log_metric, **kwargs):
        log_metric("custom_accuracy", 0.75)
        return [float(len(completion)) for completion in completions]

    rows = [{"prompt": "Hi"}] * 2
    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_func, train_dataset=rows, eval_dataset=rows[:1],
                          args=small(tmp_path, max_new_tokens=4), callbacks=[Logs])
    trainer.train()

    (step_logs,) = Logs.seen
    assert step_logs["custom_accuracy"] == 0.75 and step_logs["rewards/reward_func/mean"] >= 0
    assert step_logs["frac_reward_zero_std"] == step_logs["reward/zero_std_frac"]
    logged_keys = {k for entry in trainer.state.log_history for k in entry}
    assert {"custom_accuracy", "frac_reward_zero_std"} <= logged_keys
    assert trainer.evaluate()["eval_custom_accuracy"] == 0.75


def test_a_callback_event_that_is_never_called_is_named_in_a_warning(tmp_path):
    """transformers' on_substep_end (no gradient accumulation here) and on_prediction_step have no place here: a
    callback overriding one is told so when it is added, not left to wait for a call that never comes; on_save and
    on_step_begin are called, and not named."""
    import warnings

    from transformers import TrainerCallback

    class Saves(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            pass

        def on_substep_end(self, args, state, control, **kwargs):
            pass

        def on_prediction_step(self, args, state, control, **kwargs):
            pass

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            pass

        def on_step_begin(self, args, state, control, **kwargs):
            pass

        def on_epoch_end(self, args, state, control, **kwargs):
            pass

    def make(*callbacks):
        return GRPOTrainer(model="tiny", reward_funcs=len, train_dataset=[{"prompt": "Hi"}], args=small(tmp_path),
                           callbacks=list(callbacks))

    with pytest.warns(UserWarning, match=r"Saves\.on_substep_end, \.on_prediction_step will not be called: .* "
                                         "calls on_train_begin, on_epoch_begin, .*, on_save, on_epoch_end, "
                                         r"on_train_end only \(no substeps"):
        make(Saves)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(Logs(), lambda step, metrics: None)  # only events that are called, and a step function


def test_trl_callbacks_count_optimizer_steps_as_trl_does(tmp_path):
    from transformers import TrainerCallback

    from treerl.trainer import _TrainerCallbacks

    class Steps(TrainerCallback):
        seen: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append((state.global_step, state.max_steps))

    callbacks = _TrainerCallbacks([Steps()], small(tmp_path, max_steps=4, num_iterations=2))  # 2 steps of 2 updates
    callbacks(1, {})
    callbacks(2, {})
    assert Steps.seen == [(2, 4), (4, 4)]


@pytest.mark.parametrize("eval_on_start", [None, True])
def test_eval_strategy_steps_scores_the_eval_dataset_during_training_as_evaluate_does(tmp_path, eval_on_start):
    """TRL's eval_strategy="steps": the eval_dataset scored with the reward functions every eval_steps optimizer
    steps (and before the first with eval_on_start, off by default as in TRL), under TRL's names in the logged
    metrics and to on_evaluate."""
    from transformers import TrainerCallback

    class Evaluations(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.seen.append((state.global_step, sorted(metrics)))

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    calls = Evaluations()
    rows = [{"prompt": f"What is {i} + {i}?"} for i in range(4)]
    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, train_dataset=rows, eval_dataset=rows[:2],
                          args=small(tmp_path, max_steps=4, num_iterations=2, eval_strategy="steps", eval_steps=2,
                                     **({} if eval_on_start is None else {"eval_on_start": eval_on_start})),
                          callbacks=[calls])
    trainer.train()

    names = sorted(["eval_reward", "eval_reward_std", "eval_rewards/reward_len/mean", "eval_rewards/reward_len/std",
                    "eval_frac_reward_zero_std"])
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    start = [0] if eval_on_start else []
    assert [m["step"] for m in lines] == [*start, 1, 2]  # 2 steps of 2 optimizer steps, evaluated after each
    for m in lines:
        assert set(names) <= set(m) and m["eval_reward"] <= 0  # -|20 - length|
    assert calls.seen == [(step, names) for step in (*start, 2, 4)]  # TRL's optimizer steps
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["eval_end"] is None  # no held-out episodes


def test_eval_strategy_steps_also_evaluates_at_the_end_of_training_as_transformers_does(tmp_path):
    """transformers' Trainer evaluates at the last step when it is not a multiple of eval_steps (DefaultFlowCallback:
    'evaluate at the end if we have a step-based eval strategy'): max_steps 3, eval_steps 2 evaluate at 2 and 3."""
    from transformers import TrainerCallback

    class Evaluations(TrainerCallback):
        seen: list = []

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.seen.append(state.global_step)

    rows = [{"prompt": f"What is {i} + {i}?"} for i in range(2)]
    trainer = GRPOTrainer(model="tiny", reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          train_dataset=rows, eval_dataset=rows[:1], callbacks=[Evaluations()],
                          args=small(tmp_path, max_steps=3, eval_strategy="steps", eval_steps=2,
                                     num_generations_eval=2))
    trainer.train()
    assert Evaluations.seen == [2, 3]


def test_reward_functions_see_the_runs_steps_in_trainer_state_when_evaluating_too(tmp_path):
    """TRL's curriculum reward, global_step / max_steps of trainer_state: the evaluation during training and
    evaluate() after it give the run's state then, as TRL's trainer.state (not 0 and 0, a division by zero)."""
    states = []

    def curriculum(completions, trainer_state, split, **kwargs):
        states.append((split[0], trainer_state.global_step, trainer_state.max_steps))
        return [trainer_state.global_step / trainer_state.max_steps] * len(completions)

    rows = [{"prompt": f"What is {i} + {i}?", "split": "train"} for i in range(2)]
    trainer = GRPOTrainer(model="tiny", reward_funcs=curriculum, train_dataset=rows,
                          eval_dataset=[{"prompt": "What is 5 + 5?", "split": "eval"}],
                          args=small(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=4,
                                     num_iterations=2, max_new_tokens=2))
    trainer.train()
    figures = trainer.evaluate()

    # 2 steps of 2 optimizer steps: scored before each, evaluated after the last, and again by evaluate()
    assert states == [("train", 0, 4), ("train", 2, 4), ("eval", 4, 4), ("eval", 4, 4)]
    assert figures["eval_reward"] == 1.0


def test_unsupported_arguments_are_refused_by_name(tmp_path):
    from peft import LoraConfig

    rows = [{"prompt": "Hi"}]

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    def refused(match, **kwargs):
        kwargs = {"model": "tiny", "reward_funcs": reward, "args": small(tmp_path), "train_dataset": rows, **kwargs}
        with pytest.raises(ValueError, match=match):
            GRPOTrainer(**kwargs)

    refused("reward model", reward_funcs=["acme/reward-model"])
    refused("quantization_config", quantization_config=object())
    refused("reward_processing_classes", reward_processing_classes=object())
    refused("rollout_func", rollout_func=lambda prompts, trainer: {})
    refused("optimizers=.*warm-up, then args.lr_scheduler_type's", optimizers=(None, object()))
    refused("use_dora", peft_config=LoraConfig(r=2, use_dora=True))
    refused("regular expression", peft_config=LoraConfig(r=2, target_modules=".*proj"))
    refused("one per function", args=small(tmp_path, reward_weights=[1.0, 0.5]))
    refused("no 'prompt' column", train_dataset=[{"question": "Hi"}])
    refused("mapping of several datasets", eval_dataset={"a": rows, "b": rows})
    refused(r"args.eval_every=1 \(eval_strategy='steps'\) scores an eval_dataset during training: pass "
            r"GRPOTrainer\(eval_dataset=...\)", args=small(tmp_path, eval_strategy="steps", eval_steps=1))


def test_a_trl_script_with_its_batch_sizes_and_logging_options(tmp_path):
    """The GRPOConfig of TRL's course and of Unsloth's notebooks: TRL's batch sizes set the step's tasks
    (4 completions of 2 generations each: 2 tasks), the logging options and the epochs beside max_steps
    change nothing (each with a note)."""
    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    with pytest.warns(UserWarning, match="changes nothing"):
        args = GRPOConfig(output_dir=str(tmp_path / "out"), num_train_epochs=1, max_steps=1,
                          per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=2,
                          logging_steps=10, remove_unused_columns=False, max_new_tokens=8, progress=False,
                          sample_groups=0)
    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=args,
                          train_dataset=[{"prompt": f"What is {i} + {i}?"} for i in range(4)])
    result = trainer.train()

    assert result.steps == 1 and changed(result.model_dir)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["tasks_per_step"], config["group_size"]) == (2, 2)


# -- environment_factory -----------------------------------------------------------------------------------------


class CalculatorEnv:
    """A TRL environment: reset(**row) says what to do, calculator is its tool, get_reward scores the episode."""

    made: list[CalculatorEnv] = []

    def __init__(self):
        CalculatorEnv.made.append(self)
        self.resets, self.calls = [], []

    def reset(self, **row) -> str:
        self.resets.append(row)
        return " Use the calculator."

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "2 + 3".
        """
        self.calls.append(expression)
        return str(eval(expression, {"__builtins__": {}}))  # the tiny model writes + and - of small numbers

    def get_reward(self) -> float:
        return float(len(self.calls))


class EchoEnv:
    """A TRL environment without get_reward: its reward is the reward functions' to give."""

    def reset(self, **row) -> None:
        self.row = row

    def echo(self, text: str) -> str:
        """Say it back.

        Args:
            text: What to say.
        """
        return text


def marbles(i: int, **columns) -> dict:
    return {"prompt": [{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": f"Tara has {i + 11} marbles, buys 9 more and then gives away 15. "
                                                   "How many marbles are left?"}], "answer": str(i + 5), **columns}


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
def test_an_environment_factory_plays_a_fresh_object_per_episode_with_its_tools_and_get_reward(tmp_path):
    CalculatorEnv.made = []
    seen = {}

    def format_reward(prompts, completions, environments, **kwargs):  # TRL's way to read the episodes' objects
        seen.update(prompts=prompts, environments=environments, completions=completions)
        return [0.5] * len(completions)

    rows = [marbles(i) for i in range(2)]
    trainer = GRPOTrainer(model="tiny", reward_funcs=format_reward, environment_factory=CalculatorEnv,
                          train_dataset=rows, args=small(tmp_path, max_new_tokens=32))
    trainer.train()

    probe, *played = CalculatorEnv.made  # the trainer checks one object, as TRL does; then one per episode
    assert len(played) == 4 and not probe.resets
    assert all(env.resets in ([rows[0]], [rows[1]]) for env in played)  # reset(**row): the row's columns, once
    # Each episode's own object, in the order of the episodes.
    assert len({id(env) for env in seen["environments"]}) == 4 and set(seen["environments"]) == set(played)
    results = [[m["content"] for m in c if m["role"] == "tool"] for c in seen["completions"]]
    assert results == [[str(eval(e, {"__builtins__": {}})) for e in env.calls] for env in seen["environments"]]
    assert any(env.calls for env in played), "the model called no tool"
    # reset()'s text is appended to the last message of the prompt.
    assert all(p[-1]["content"].endswith("How many marbles are left? Use the calculator.") for p in seen["prompts"])
    metrics = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    calls = sum(len(env.calls) for env in played) / 4
    assert metrics["reward_fn/CalculatorEnv_mean"] == pytest.approx(calls)  # get_reward(), under the class name
    assert metrics["reward/mean"] == pytest.approx(0.5 + calls)  # weight 1, beside the reward function's
    assert trainer.args.reward_weights == [0.0, 1.0, 1.0]
    figures = trainer.evaluate(rows[:1])
    assert set(figures) == {"eval_reward", "eval_reward_std", "eval_rewards/format_reward/mean",
                            "eval_rewards/CalculatorEnv/mean", "eval_rewards/format_reward/std",
                            "eval_rewards/CalculatorEnv/std", "eval_frac_reward_zero_std"}


def test_a_dict_environment_factory_routes_each_row_to_its_environment(tmp_path):
    from treerl.envs.prompts import PromptEnv

    rows = [marbles(0, environment="calc"), marbles(1, environment="echo")]
    factories = {"calc": CalculatorEnv, "echo": EchoEnv}
    env = PromptEnv(dataset=rows, environment_factory=factories)
    for index, tools in ((0, ["calculator"]), (1, ["echo"])):  # only the row's environment's tools are shown
        _, info = env.reset(seed=0, options={"task_index": index})
        assert [t["function"]["name"] for t in info["tools"]] == tools
    assert env.environment.row == {k: v for k, v in rows[1].items() if k != "environment"}  # not passed to reset

    seen = {}

    def kinds(environments, environment, **kwargs):
        seen.update(types=[type(e).__name__ for e in environments], names=environment)
        return [0.0] * len(environments)

    trainer = GRPOTrainer(model="tiny", reward_funcs=kinds, environment_factory=factories, train_dataset=rows,
                          args=small(tmp_path, max_new_tokens=16))
    trainer.train()
    assert sorted(seen["names"]) == ["calc", "calc", "echo", "echo"]
    assert seen["types"] == [{"calc": "CalculatorEnv", "echo": "EchoEnv"}[n] for n in seen["names"]]
    metrics = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward_fn/CalculatorEnv_mean" in metrics and "reward_fn/EchoEnv_mean" not in metrics


def test_a_dataset_that_only_routes_plays_each_rows_environment_after_an_empty_user_message(tmp_path):
    """TRL's multiple environments example: rows with an 'environment' column and no prompt; each episode's prompt
    is an empty user message plus its environment's reset() text, and reset() gets neither column."""
    from datasets import Dataset

    class Game:
        def reset(self, **row) -> str:
            self.resets = [row]
            return "Reach the goal tile."

        def move(self, action: str) -> str:
            """Apply an action.

            Args:
                action: One of up, down, left, right.
            """
            return "ok"

    seen = {}

    def kinds(prompts, environments, **kwargs):
        seen.update(prompts=prompts, types=[type(e).__name__ for e in environments],
                    resets=[e.resets for e in environments])
        return [0.0] * len(prompts)

    dataset = Dataset.from_dict({"environment": ["calc", "game"]})
    trainer = GRPOTrainer(model="tiny", reward_funcs=kinds, environment_factory={"calc": CalculatorEnv, "game": Game},
                          train_dataset=dataset, args=small(tmp_path, max_new_tokens=4))
    trainer.train()

    assert sorted(seen["types"]) == ["CalculatorEnv", "CalculatorEnv", "Game", "Game"]
    for kind, prompt, resets in zip(seen["types"], seen["prompts"], seen["resets"]):
        text = {"CalculatorEnv": " Use the calculator.", "Game": "Reach the goal tile."}[kind]
        assert prompt == [{"role": "user", "content": text}] and resets == [{}]  # each episode's own object


def test_without_train_dataset_the_environments_reset_gives_the_prompt(tmp_path):
    class Sum:
        resets = []

        def reset(self, **row) -> str:
            Sum.resets.append(row)
            self.answer = None
            return "What is 2 + 3? Answer with the submit tool."

        def submit(self, answer: int) -> str:
            """Give the answer.

            Args:
                answer: The sum.
            """
            self.answer = answer
            return "ok"

        def get_reward(self) -> float:
            return float(self.answer == 5)

    seen = []
    result = GRPOTrainer(model="tiny", environment_factory=Sum, args=small(tmp_path, max_new_tokens=8),
                         reward_funcs=lambda prompts, **kw: seen.extend(prompts) or [0.0] * len(prompts)).train()

    assert result.steps == 1 and len(Sum.resets) == 4
    assert all(row == {"prompt": [{"role": "user", "content": ""}]} for row in Sum.resets)  # TRL's placeholder row
    assert all(p == [{"role": "user", "content": "What is 2 + 3? Answer with the submit tool."}] for p in seen)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["env"] == "GRPOTrainer.environment_factory"


def test_environment_factory_shapes_that_cannot_be_played_are_refused(tmp_path):
    from treerl.envs.prompts import PromptEnv
    from treerl.errors import EnvError

    def refused(match, **kwargs):
        kwargs = {"model": "tiny", "args": small(tmp_path), "train_dataset": [marbles(0)], **kwargs}
        with pytest.raises(ValueError, match=match):
            GRPOTrainer(**kwargs)

    refused("needs reward_funcs.*defines get_reward", environment_factory=EchoEnv)
    refused("no reward source", environment_factory=EchoEnv, reward_funcs=[])
    refused("has no reset", environment_factory=object)
    refused("needs a train_dataset with an 'environment' column", environment_factory={"echo": EchoEnv},
            reward_funcs=len, train_dataset=None)
    refused("Row 0 has environment='calc'", environment_factory={"echo": EchoEnv}, reward_funcs=len,
            train_dataset=[marbles(0, environment="calc")])
    refused("branch_factor", environment_factory=CalculatorEnv, args=small(tmp_path, branch_factor=2, branch_at_turn=1))

    def echo(text: str) -> str:
        """Say it.

        Args:
            text: What.
        """
        return text

    with pytest.raises(ValueError, match="Tool names must be unique"):
        PromptEnv(dataset=[{"prompt": "Hi"}], tools=[echo], environment_factory=EchoEnv).reset(seed=0)

    class Random:  # a task drawn at random in reset(): the generations of a row would see different prompts
        count = 0

        def reset(self, **row) -> str:
            Random.count += 1
            return f"Task {Random.count}."

    env = PromptEnv(dataset=[{"prompt": "Hi"}], environment_factory=Random)
    env.reset(seed=0)
    env.fork()  # the first generation plays the object reset() made
    with pytest.raises(EnvError, match="must return the same text for the same row"):
        env.fork()

    class Parts:
        def reset(self, **row):
            return [{"type": "text", "text": "Hi"}]

    with pytest.raises(EnvError, match="return a string"):
        PromptEnv(dataset=[{"prompt": "Hi"}], environment_factory=Parts).reset(seed=0)
    env = PromptEnv(dataset=[{"prompt": "Hi"}], environment_factory=EchoEnv)
    env.reset(seed=0)
    env.fork().step("I am done.")
    played = env.fork()
    played.step('<tool_call>\n{"name": "echo", "arguments": {"text": "a"}}\n</tool_call>')
    with pytest.raises(EnvError, match="cannot fork an episode in play"):
        played.fork()


def test_evaluate_samples_at_the_training_temperature_as_trl_does(tmp_path, monkeypatch):
    """TRL generates its evaluation with args.temperature; treerl's eval_temperature, set, still wins."""
    import treerl.rollout.evaluate as evaluate_module

    temperatures = []
    real = evaluate_module.evaluate_with

    def recording(*args, **kwargs):
        temperatures.append(kwargs["temperature"])
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "evaluate_with", recording)
    rows = [{"prompt": "What is 1 + 1?"}]

    def reward_len(completions, **kwargs):
        return [float(len(c)) for c in completions]

    GRPOTrainer(model="tiny", reward_funcs=reward_len, args=small(tmp_path, temperature=0.7),
                eval_dataset=rows, train_dataset=rows).evaluate()
    GRPOTrainer(model="tiny", reward_funcs=reward_len, args=small(tmp_path, temperature=0.7, eval_temperature=0.3),
                eval_dataset=rows, train_dataset=rows).evaluate()
    assert temperatures == [0.7, 0.3]


def test_open_r1s_post_training_calls_report_the_run(tmp_path, capsys):
    """open-r1's grpo.py after trainer.train(): TRL's metrics, log_metrics, save_metrics, save_state and the
    accelerator, with the run's own figures, beside treerl's run files, which they leave as they were."""
    rows = [{"prompt": f"What is {i} + {i}?"} for i in range(3)]

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    args = small(tmp_path, max_steps=4, num_iterations=2)  # 2 steps of 2 optimizer steps, 2 tasks x 2 each
    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=args, train_dataset=rows)
    assert trainer.accelerator.is_main_process and trainer.accelerator.num_processes == 1
    train_result = trainer.train(resume_from_checkpoint=None)
    out = tmp_path / "out"
    run_files = {name: (out / name).read_text() for name in ("config.json", "summary.json", "metrics.jsonl")}

    assert train_result.steps == 2 and train_result.model_dir == out / "model"  # treerl's fields stay
    assert train_result.global_step == 4  # TRL counts optimizer steps
    metrics = train_result.metrics
    assert set(metrics) == {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss",
                            "epoch"}
    lines = [json.loads(line) for line in run_files["metrics.jsonl"].splitlines()]
    assert metrics["train_loss"] == pytest.approx(sum(m["loss/policy"] for m in lines) / 2)  # beta, entropy_coef 0
    assert train_result.training_loss == metrics["train_loss"]
    assert metrics["epoch"] == 2.0  # TRL's: an epoch of 3 rows is 1 step of 2 (its sampler leaves the third out)
    runtime = metrics["train_runtime"]
    assert 0 < runtime < 600
    assert metrics["train_steps_per_second"] == pytest.approx(4 / runtime, rel=1e-2)
    assert metrics["train_samples_per_second"] == pytest.approx(8 / runtime, rel=1e-2)  # 2 steps x 2 tasks x 2

    metrics["train_samples"] = len(rows)
    capsys.readouterr()
    trainer.log_metrics("train", metrics)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "***** train metrics *****" and len(printed) == 1 + len(metrics)
    assert any(line.split() == ["train_samples", "=", "3"] for line in printed)
    trainer.save_metrics("train", metrics)
    trainer.save_metrics("eval", {"eval_reward": -3.0})
    assert json.loads((out / "train_results.json").read_text()) == metrics
    assert json.loads((out / "all_results.json").read_text()) == {**metrics, "eval_reward": -3.0}
    trainer.save_state()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["max_steps"] == 4
    history = state["log_history"]
    assert [h["step"] for h in history] == [2, 4, 4]  # each step's line, then the run's figures, as TRL's
    for h, m in zip(history, lines):
        assert h["loss"] == pytest.approx(m["loss/policy"]) and h["reward"] == m["reward/mean"]
        assert h["rewards/reward_len/mean"] == m["reward_fn/reward_len_mean"] and h["learning_rate"] == m["lr"]
    assert history[-1]["train_loss"] == metrics["train_loss"]
    assert {name: (out / name).read_text() for name in run_files} == run_files  # treerl's run files untouched
    assert (out / "checkpoints" / "step-2" / "trainer_state.json").is_file()  # the checkpoint keeps its own


def test_the_accelerator_says_which_process_this_is_under_accelerate_launch(tmp_path, monkeypatch):
    """Before training starts the process group, the environment accelerate launch (torchrun) sets says it."""
    from treerl.trainer import Accelerator

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    accelerator = Accelerator()
    assert not accelerator.is_main_process and accelerator.is_local_main_process
    assert (accelerator.process_index, accelerator.num_processes) == (2, 4)
    accelerator.wait_for_everyone()  # no process group yet: nothing to wait for


def test_after_training_trainer_model_is_the_trained_model_and_its_card_sits_beside_it(tmp_path):
    """open-r1's trainer.model.config / generation_config and create_model_card(): the trained model, and the
    card in output_dir/model (what save_model(output_dir) points to) and in a directory save_model copied to."""
    from transformers import PreTrainedModel

    trainer = GRPOTrainer(model="tiny", reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=small(tmp_path), train_dataset=[{"prompt": "Say hi"}] * 2)
    assert trainer.model == "tiny"  # a name stays a name until training loads it
    with pytest.raises(ValueError, match="call train\\(\\) first"):
        trainer.create_model_card()
    trainer.train()
    model = trainer.model
    assert isinstance(model, PreTrainedModel) and trainer.model is model  # loaded once
    saved = load_file(trainer.result.model_dir / "model.safetensors")
    assert all(torch.equal(p.detach().cpu(), saved[k]) for k, p in model.state_dict().items() if k in saved)
    assert changed(trainer.result.model_dir)  # ... and those are the trained weights
    assert model.generation_config is not None and model.config.model_type
    trainer.save_model(str(tmp_path / "copy"))
    trainer.create_model_card(dataset_name="open-r1/OpenR1-Math-220k", tags=["open-r1"])
    for folder in (trainer.result.model_dir, tmp_path / "copy"):
        card = (folder / "README.md").read_text()
        assert "datasets:\n- open-r1/OpenR1-Math-220k" in card and "- open-r1\n" in card and "- grpo\n" in card
    assert not (tmp_path / "out" / "README.md").exists()


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
def test_a_model_config_saved_over_the_runs_config_json_leaves_resume_and_compare_working(tmp_path, capsys):
    """open-r1's trainer.model.config.save_pretrained(output_dir) replaces the run's config.json with the model's:
    the run's settings stay readable (summary.json keeps them), so treerl compare lists no model fields as
    settings and a resumed run compares its settings with the run's, not with the model's."""
    from treerl.learners.compare import compare_runs

    rows = [{"prompt": "Say hi"}] * 2
    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    runs = []
    for name in ("a", "b"):
        trainer = GRPOTrainer(model="tiny", reward_funcs=reward, train_dataset=rows,
                              args=small(tmp_path / name, save_steps=1))
        trainer.train()
        runs.append(tmp_path / name / "out")
    trainer.model.config.use_cache = True
    trainer.model.config.save_pretrained(trainer.args.output_dir)  # open-r1's last lines
    assert "model_type" in json.loads((runs[1] / "config.json").read_text())

    assert compare_runs(runs)["config_differences"].keys() == {"output_dir"}  # as before the model's config came
    capsys.readouterr()
    again = GRPOTrainer(model="tiny", reward_funcs=reward, train_dataset=rows,
                        args=small(tmp_path / "b", save_steps=1, max_steps=2, temperature=0.5))
    again.train(resume_from_checkpoint=str(latest_checkpoint(runs[1])))  # the latest's path, as TRL's is
    err = capsys.readouterr().err  # the change is compared with the run's settings (the model's have none)
    assert "resumed from" in err and "temperature 1.0 -> 0.5" in err and "dtype" not in err
    assert json.loads((runs[1] / "config.json").read_text())["learner"] == "grpo"  # the run's settings again


def test_open_r1s_grpo_script_runs_to_its_end(tmp_path, monkeypatch, capsys):
    """The end of open-r1's grpo.py, line for line after GRPOTrainer(...), with do_eval and push_to_hub on."""
    from _helpers import FakeHub

    hub = FakeHub(owner="me").install(monkeypatch)
    train_dataset = [{"prompt": f"What is {i} + {i}?"} for i in range(4)]
    eval_dataset = train_dataset[:2]

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    training_args = small(tmp_path, max_steps=2, do_eval=True, push_to_hub=True, hub_model_id="me/tiny-r1")
    trainer = GRPOTrainer(model="tiny", reward_funcs=[reward_len], args=training_args, train_dataset=train_dataset,
                          eval_dataset=eval_dataset)
    checkpoint = None
    # -- open-r1's grpo.py from here ----------------------------------------------------------------------------
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        trainer.create_model_card(dataset_name="open-r1/OpenR1-Math-220k", tags=["open-r1"])
        trainer.model.config.use_cache = True
        trainer.model.config.save_pretrained(training_args.output_dir)
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name="open-r1/OpenR1-Math-220k", tags=["open-r1"])
    # -- to here ------------------------------------------------------------------------------------------------
    out = tmp_path / "out"
    printed = capsys.readouterr().out
    assert "***** train metrics *****" in printed and "***** eval metrics *****" in printed
    results = json.loads((out / "all_results.json").read_text())
    assert results["train_samples"] == 4 and results["eval_samples"] == 2 and results["eval_reward"] <= 0
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    assert changed(out / "model") and json.loads((out / "config.json").read_text())["use_cache"] is True
    assert json.loads((out / "summary.json").read_text())["config"]["env"] == "GRPOTrainer.train_dataset"
    assert hub.uploads[-1]["repo_id"] == "me/tiny-r1" and "- open-r1\n" in hub.uploads[-1]["card"]
    assert "open-r1/OpenR1-Math-220k" in (out / "model" / "README.md").read_text()


def _logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer("What is 2 + 2?", return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits


def test_save_model_writes_a_model_that_from_pretrained_loads_from_output_dir(tmp_path):
    """TRL scripts end with trainer.save_model(training_args.output_dir) and load the model from there: the trained
    weights and the tokenizer, as transformers' Trainer writes them; the run's settings stay readable."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treerl.learners.checkpoints import run_settings

    trainer = GRPOTrainer(model="tiny", reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=small(tmp_path), train_dataset=[{"prompt": "Say hi"}] * 2)
    trainer.train()
    out = tmp_path / "out"
    trainer.save_model()  # args.output_dir, as save_model(training_args.output_dir)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert changed(out)  # the trained weights, ...
    trained, trained_tokenizer = load_model(str(out / "model"))
    assert torch.equal(_logits(model, tokenizer), _logits(trained, tokenizer))  # ... as output_dir/model holds them
    assert tokenizer.chat_template == trained_tokenizer.chat_template and tokenizer.chat_template
    assert run_settings(out)["env"] == "GRPOTrainer.train_dataset"  # summary.json keeps the run's settings
    trainer.save_model(str(tmp_path / "elsewhere"))  # another directory: the same files
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == sorted(
        p.name for p in (out / "model").iterdir())


def test_save_model_with_lora_writes_the_adapter_as_transformers_writes_a_peft_model(tmp_path):
    """With peft_config, transformers' Trainer.save_model writes the PeftModel's adapter (adapter_config.json,
    adapter_model.safetensors) and the tokenizer; from_pretrained(output_dir) puts it on the base model."""
    LoraConfig = pytest.importorskip("peft").LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = GRPOTrainer(model="tiny", reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=small(tmp_path, learning_rate=1e-2), train_dataset=[{"prompt": "Say hi"}] * 2,
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    out = tmp_path / "out"
    trainer.save_model(str(out))
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    from treerl.learners.checkpoints import run_settings

    assert run_settings(out)["lora_r"] == 4  # the run's settings, from summary.json
    tokenizer = AutoTokenizer.from_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out)  # the base model with the trained adapter on it
    merged, _ = load_model(str(out / "model"))
    base, _ = load_model(None)
    assert torch.allclose(_logits(loaded, tokenizer), _logits(merged, tokenizer), atol=1e-5)
    assert not torch.allclose(_logits(loaded, tokenizer), _logits(base, tokenizer), atol=1e-5)


def test_evaluate_takes_transformers_arguments_and_names_its_figures_with_the_prefix(tmp_path):
    """transformers' evaluate(eval_dataset, ignore_keys, metric_key_prefix): scripts that score a test split
    call evaluate(test_dataset, metric_key_prefix="test") and read test_reward."""
    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    rows = [{"prompt": "Say hi"}, {"prompt": "Count to 3."}]
    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=small(tmp_path), train_dataset=rows)
    figures = trainer.evaluate(rows, ignore_keys=["past_key_values"], metric_key_prefix="test")
    assert set(figures) == {"test_reward", "test_reward_std", "test_rewards/reward_len/mean",
                            "test_rewards/reward_len/std", "test_frac_reward_zero_std"}
    assert figures["test_reward"] == pytest.approx(figures["test_rewards/reward_len/mean"])
    assert figures["test_reward"] <= 0  # -|20 - length|


def test_reward_functions_get_transformers_trainer_state_with_its_epoch(tmp_path):
    """TRL passes its Trainer's state as trainer_state: a curriculum by epoch reads trainer_state.epoch (passes over
    train_dataset, a float), num_train_epochs, log_history and is_world_process_zero, as transformers sets them."""
    from transformers import TrainerState

    seen = []

    def curriculum(completions, trainer_state, **kwargs):
        assert isinstance(trainer_state, TrainerState)
        seen.append((trainer_state.global_step, trainer_state.epoch, trainer_state.num_train_epochs,
                     len(trainer_state.log_history), trainer_state.is_world_process_zero))
        return [float(len(c)) * (1.0 if trainer_state.epoch < 1 else 2.0) for c in completions]

    rows = [{"prompt": f"What is {i} + {i}?"} for i in range(4)]  # 2 steps of 2 rows a pass
    trainer = GRPOTrainer(model="tiny", reward_funcs=curriculum, args=small(tmp_path, max_steps=3), train_dataset=rows)
    trainer.train()
    assert seen == [(0, 0.0, 2, 0, True), (1, 0.5, 2, 1, True), (2, 1.0, 2, 2, True)]
    trainer.evaluate(rows[:1])  # after training: the finished run's state
    assert seen[-1][:3] == (3, 1.5, 2) and seen[-1][3] == len(trainer.state.log_history)
