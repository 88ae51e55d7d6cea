"""TRL's best-model options with transformers' meaning: metric_for_best_model (a name of the evaluation's figures,
with or without eval_, in TRL's names or treerl's), greater_is_better (by default: unless the name ends in loss),
save_strategy="best" (a checkpoint after each evaluation that improves on the best so far), save_total_limit
never removing the best checkpoint, load_best_model_at_end (its weights become output_dir/model, the adapter and
the trainer's model), the best kept across --resume. transformers' own Trainer is the oracle of which steps save,
which checkpoints are left and which is the best, given the same sequence of evaluation figures."""

from __future__ import annotations

import json

import pytest
import torch
from _helpers import OneParameterModel, one_parameter_rows, oracle_args, scripted_eval_reward, trainer_recorder

import treerl
from treerl.envs.builtin.math_verify import MathVerifyEnv
from treerl.errors import ConfigError
from treerl.learners.grpo import GRPOConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def transformers_best(tmp_path, values, **options):
    """What transformers' own Trainer does over ``len(values)`` optimizer steps of a one-parameter model,
    evaluating after each (eval_strategy "steps", eval_steps 1) with ``eval_reward`` = ``values[step - 1]`` and
    ``options`` (save_strategy, save_total_limit, load_best_model_at_end, ...): the steps it saved at, the
    checkpoints left at the end, the best checkpoint's step, the best metric, and whether the model ends with the
    best checkpoint's weight."""
    from transformers import Trainer

    class Oracle(Trainer):  # the figures given, as an evaluation would return them
        def evaluate(self, *args, **kwargs):
            return {"eval_reward": values[self.state.global_step - 1]}

    options = {"metric_for_best_model": "reward", **options}  # treerl's default; transformers' is loss
    data, record = one_parameter_rows(len(values), start=1), trainer_recorder()
    args = oracle_args(tmp_path, max_steps=len(values), per_device_train_batch_size=1, eval_strategy="steps",
                       eval_steps=1, learning_rate=0.1, **options)
    trainer = Oracle(model=OneParameterModel(), args=args, train_dataset=data, eval_dataset=data[:1],
                     callbacks=[record])
    trainer.train()
    kept = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*"))
    best = trainer.state.best_model_checkpoint
    best_step = int(best.rsplit("-", 1)[1]) if best is not None else None
    loaded = best_step is not None and trainer.model.w.item() == record.weights[best_step]
    return record.saves, kept, best_step, trainer.state.best_metric, loaded


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path))


CASES = {
    # the checkpoints of improvements only; a limit of 1 keeps the best alone at the end, as transformers
    "best, limit 1, loaded": ([1.0, 3.0, 2.0, 5.0, 4.0, 4.5],
                              {"save_strategy": "best", "save_total_limit": 1, "load_best_model_at_end": True}),
    # every 2 steps, evaluations every step: the best of step 1 has no checkpoint, so none is best until step 4's
    "steps, limit 1, loaded": ([5.0, 3.0, 4.0, 6.0, 1.0, 2.0],
                               {"save_strategy": "steps", "save_steps": 2, "save_total_limit": 1,
                                "load_best_model_at_end": True}),
    "best, lower is better": ([3.0, 1.0, 2.0, 0.5, 0.75, 4.0],
                              {"save_strategy": "best", "metric_for_best_model": "reward",
                               "greater_is_better": False}),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if i else c for i, c in enumerate(CASES)])
def test_checkpoints_and_the_best_as_transformers_trainer_keeps_them(case, tmp_path, monkeypatch):
    """treerl.GRPOTrainer with TRL's options, evaluating an eval_dataset after each step, against transformers'
    Trainer given the same figures: the same saves (and the last step's, which every run here writes for
    --resume), the same checkpoints left, the same best; load_best_model_at_end puts the best checkpoint's weights
    in output_dir/model and trainer.model, and trainer.state says which it is."""
    pytest.importorskip("accelerate")
    import treerl.learners.core as core
    from treerl import GRPOTrainer

    values, options = CASES[case]
    saves, kept, best, best_metric, loaded = transformers_best(tmp_path / "transformers", values, **options)
    written = {}  # step: the weights its checkpoint holds
    save = core.save_checkpoint

    def spy(path, model, *args, **kwargs):
        written[int(path.name[len("step-"):])] = {k: v.clone() for k, v in model.state_dict().items()}
        save(path, model, *args, **kwargs)

    monkeypatch.setattr(core, "save_checkpoint", spy)
    out, last = tmp_path / "treerl", len(values)
    rows = [{"prompt": f"What is {i} + {i}?", "split": "train"} for i in range(4)]
    args = GRPOConfig(output_dir=str(out), max_steps=last, eval_strategy="steps", eval_steps=1,
                      per_device_train_batch_size=4, num_generations=4, num_generations_eval=1, max_new_tokens=6,
                      progress=False, sample_groups=0, learning_rate=1e-3, **options)
    trainer = GRPOTrainer(model="tiny", reward_funcs=scripted_eval_reward(values), args=args, train_dataset=rows,
                          eval_dataset=[{"prompt": "What is 1 + 1?", "split": "eval"}])
    result = trainer.train()
    logged = [m["eval_reward"] for m in trainer.state.log_history if "eval_reward" in m]
    assert logged == values
    assert sorted(written) == sorted({*saves, last})
    assert sorted(int(p.name[len("step-"):]) for p in (out / "checkpoints").iterdir()) == (
        kept if options.get("save_total_limit") == 1 or last in saves else sorted({*kept, last}))
    assert (result.best_step, result.best_metric) == (best, best_metric)
    assert trainer.state.best_global_step == best and trainer.state.best_metric == best_metric
    assert trainer.state.best_model_checkpoint == str(out / "checkpoints" / f"step-{best}")
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["best_step"], summary["best_model_checkpoint"]) == (best, trainer.state.best_model_checkpoint)
    model = _weights(out / "model" / "model.safetensors")
    assert _same(model, written[best]) == loaded == options.get("load_best_model_at_end", False)
    assert _same(model, written[last]) != loaded  # the weights moved after the best step
    trained = trainer.model.state_dict()  # TRL's trainer.model after train(): what output_dir/model holds
    assert _same(model, trained)


def _same(weights, other):
    return all(torch.equal(v, other[k]) for k, v in weights.items())


class _Scripted(MathVerifyEnv):
    """MathVerify rows; an episode of the held-out evaluation (given ``values``) scores the next of ``values``,
    counted in the ``counter`` file across the run's evaluations; training's, the completion's length."""

    def __init__(self, *, values=None, counter=None, **kwargs):
        super().__init__(**kwargs)
        self.values, self.counter = values, counter

    def score(self, task, completion):
        if self.values is None:
            return float(len(completion))
        with open(self.counter, "a+") as f:
            f.seek(0)
            n = len(f.read().splitlines())
            f.write("scored\n")
        return self.values[n]


def _math_rows(path, n):
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(n)))
    return path


def test_learn_keeps_the_best_checkpoint_loads_its_adapter_and_resumes_with_it(tmp_path, capsys):
    """treerl learn with LoRA, held-out episodes after every step whose rewards follow a script, save_strategy
    best, the default metric (reward: eval/reward/mean here) and a limit of 2: the best checkpoint stays beside
    the latest, and its adapter is the run's adapter and model; --resume for two more steps keeps that best (an
    evaluation below it saves nothing). A metric the evaluation lacks is said before the first step, with the
    figures it has."""
    from safetensors.torch import load_file

    from treerl.cli import main

    treerl.register("tests/Scripted-v0", _Scripted, override=True)
    counter = tmp_path / "evaluations.txt"
    # the evaluation before the first step, steps 1-4, the end's (of the best weights, loaded from step 2); then
    # the resumed run's steps 5 and 6 and its end
    values = [0.5, 1.0, 3.0, 2.0, 2.5, 0.0, 0.5, 1.0, 0.0]
    data, held_out = _math_rows(tmp_path / "train.jsonl", 4), _math_rows(tmp_path / "test.jsonl", 1)
    out = tmp_path / "run"
    flags = ["--env", "tests/Scripted-v0",
             "--env-kwargs", json.dumps({"data_path": str(data)}),
             "--eval-env-kwargs", json.dumps({"data_path": str(held_out), "values": values, "counter": str(counter)}),
             "--eval-episodes", "1", "--tasks-per-step", "1", "--group-size", "4", "--max-new-tokens", "6",
             "--progress", "false", "--num-threads", "1", "--sample-groups", "0", "--lora-r", "2",
             "--learning-rate", "1e-2", "--output-dir", str(out), "--eval-every", "1", "--save-strategy", "best",
             "--save-total-limit", "2", "--load-best-model-at-end", "true"]
    assert main(["learn", *flags, "--steps", "4", "--metric-for-best-model", "eval_loss"]) == 2
    err = capsys.readouterr().err
    assert "metric_for_best_model='eval_loss' is not among the evaluation's figures: " in err
    assert "eval/reward/mean" in err and "eval/success_rate" in err
    assert not (out / "checkpoints").exists()
    counter.unlink()

    assert main(["learn", *flags, "--steps", "4", "--overwrite-output-dir", "true"]) == 0
    assert "loaded the best model, " + str(out / "checkpoints" / "step-2") in capsys.readouterr().err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["best_step"], summary["best_metric"]) == (2, 3.0)
    assert summary["eval_end"]["reward/mean"] == 0.0  # evaluated again: the best weights are not the last step's
    assert summary["config"]["metric_for_best_model"] == "reward" and summary["config"]["save_on_best"]

    def lora(path):  # a checkpoint's LoRA weights under the adapter file's names
        return {k.replace(".default", ""): v for k, v in load_file(str(path)).items() if "lora_" in k}

    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    best, last = (lora(out / "checkpoints" / f"step-{step}" / "model.safetensors") for step in (2, 4))
    assert adapter.keys() == best.keys() and _same(adapter, best) and not _same(adapter, last)
    state = json.loads((out / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert (state["best_step"], state["best_metric"]) == (2, 3.0)
    assert state["best_model_checkpoint"] == str(out / "checkpoints" / "step-2")

    assert main(["learn", *flags, "--steps", "6", "--resume", "true"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-6"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["eval/reward/mean"] for m in lines if "eval/reward/mean" in m] == [0.5, 1.0, 3.0, 2.0, 2.5, 0.5, 1.0]
    assert json.loads((out / "summary.json").read_text())["best_step"] == 2
    assert _same(load_file(str(out / "adapter" / "adapter_model.safetensors")), best)


def test_metric_for_best_model_defaults_as_transformers_and_names_the_evaluations_figures():
    cfg = GRPOConfig(output_dir="x", load_best_model_at_end=True, eval_strategy="steps", eval_steps=2, save_steps=4)
    assert (cfg.metric_for_best_model, cfg.greater_is_better, cfg.eval_every, cfg.save_every) == ("reward", True, 2, 4)
    assert GRPOConfig(output_dir="x", metric_for_best_model="eval_loss").greater_is_better is False
    assert GRPOConfig(output_dir="x", metric_for_best_model="success_rate").greater_is_better is True
    given = GRPOConfig(output_dir="x", metric_for_best_model="reward", greater_is_better=False)
    assert given.greater_is_better is False
    assert GRPOConfig(output_dir="x").metric_for_best_model is None  # no best tracked unless asked, as transformers
    from treerl.learners.evaluation import metric_key

    trl = ["eval_reward", "eval_reward_std", "eval_rewards/f/mean", "eval_frac_reward_zero_std"]
    ours = ["eval/reward/mean", "eval/reward/std", "eval/reward_fn/f_mean", "eval/success_rate"]
    for name, in_trl, in_ours in (("reward", "eval_reward", "eval/reward/mean"),
                                  ("eval_reward", "eval_reward", "eval/reward/mean"),
                                  ("eval/reward/mean", "eval_reward", "eval/reward/mean"),
                                  ("reward/mean", "eval_reward", "eval/reward/mean"),
                                  ("eval_reward_std", "eval_reward_std", "eval/reward/std"),
                                  ("rewards/f/mean", "eval_rewards/f/mean", "eval/reward_fn/f_mean"),
                                  ("eval/reward_fn/f_mean", "eval_rewards/f/mean", "eval/reward_fn/f_mean")):
        assert (metric_key(name, trl), metric_key(name, ours)) == (in_trl, in_ours)
    assert metric_key("success_rate", ours) == metric_key("eval_success_rate", ours) == "eval/success_rate"
    with pytest.raises(ConfigError, match=r"metric_for_best_model='loss' is not among the evaluation's figures: "
                                          r"eval/reward/mean, eval/reward/std, eval/reward_fn/f_mean, "
                                          r"eval/success_rate; name one of them"):
        metric_key("loss", ours)


# (eval_strategy, save_strategy, eval_steps, save_steps): whether transformers' TrainingArguments takes
# load_best_model_at_end with them is whether GRPOConfig does
STRATEGIES = [("steps", "steps", 2, 4), ("steps", "steps", 2, 3), ("steps", "steps", 4, 2),
              ("epoch", "epoch", None, None), ("epoch", "steps", None, 4), ("steps", "epoch", 2, None),
              ("steps", "no", 2, None), ("steps", "best", 2, None), ("epoch", "best", None, None)]


@pytest.mark.parametrize("eval_strategy,save_strategy,eval_steps,save_steps", STRATEGIES)
def test_load_best_model_at_end_takes_the_strategies_transformers_takes(eval_strategy, save_strategy, eval_steps,
                                                                         save_steps):
    from transformers import TrainingArguments

    options = {"eval_strategy": eval_strategy, "save_strategy": save_strategy, "load_best_model_at_end": True,
               **({"eval_steps": eval_steps} if eval_steps else {}),
               **({"save_steps": save_steps} if save_steps else {})}
    try:
        TrainingArguments(output_dir="x", report_to=[], use_cpu=True, **options)
        taken = True
    except ValueError as exc:
        assert "--load_best_model_at_end requires" in str(exc)
        taken = False
    if taken:
        GRPOConfig(output_dir="x", **options)
    else:
        with pytest.raises(ValueError, match="load_best_model_at_end needs a checkpoint at each evaluation"):
            GRPOConfig(output_dir="x", **options)


def test_best_model_options_say_what_is_missing():
    with pytest.raises(ValueError, match="save_strategy='best' saves after each evaluation that improves on "
                                         "metric_for_best_model, which is unset"):
        GRPOConfig(output_dir="x", save_strategy="best", eval_strategy="steps", eval_steps=2)
    for options in ({"save_strategy": "best", "metric_for_best_model": "reward"},
                    {"load_best_model_at_end": True, "save_every": 2}, {"load_best_model_at_end": True,
                                                                         "eval_strategy": "no"}):
        with pytest.raises(ValueError, match="compares the evaluations during training, but there are none"):
            GRPOConfig(output_dir="x", **options)
    with pytest.raises(ValueError, match="save_every=0 .* writes none during the run"):
        GRPOConfig(output_dir="x", load_best_model_at_end=True, eval_every=2)
    with pytest.raises(TypeError, match="save_strategy='best' and save_every set the same thing"):
        GRPOConfig(output_dir="x", save_strategy="best", save_every=2, metric_for_best_model="reward")
    with pytest.raises(ValueError, match="metric_for_best_model='' must name an evaluation figure"):
        GRPOConfig(output_dir="x", metric_for_best_model="")
    # fractions of a run that num_train_epochs sets: checked once the steps are known (10 steps: eval every 5)
    cfg = GRPOConfig(output_dir="x", num_train_epochs=1, tasks_per_step=1, load_best_model_at_end=True,
                     eval_strategy="steps", eval_steps=0.5, save_steps=0.3)
    with pytest.raises(ValueError, match="save_every=3 is not a multiple of eval_every=5"):
        cfg.resolve_steps(10)
    cfg = GRPOConfig(output_dir="x", num_train_epochs=1, tasks_per_step=1, load_best_model_at_end=True,
                     eval_strategy="steps", eval_steps=0.2, save_steps=0.4)
    cfg.resolve_steps(10)
    assert (cfg.eval_every, cfg.save_every) == (2, 4)


def test_the_options_are_flags_and_yaml_keys(tmp_path):
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    (tmp_path / "c.yaml").write_text("eval_strategy: steps\neval_steps: 2\nsave_strategy: best\n"
                                     "metric_for_best_model: success_rate\n")
    args = build_parser("grpo").parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml"),
                                            "--greater-is-better", "false", "--load-best-model-at-end", "true"])
    cfg = config_from_args(GRPOConfig, args)
    assert (cfg.save_on_best, cfg.save_every, cfg.eval_every, cfg.metric_for_best_model, cfg.greater_is_better,
            cfg.load_best_model_at_end) == (True, 0, 2, "success_rate", False, True)
    (tmp_path / "d.yaml").write_text("save_strategy: best\nload_best_model_at_end: true\n")
    args = build_parser("grpo").parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "d.yaml"),
                                            "--eval-every", "3", "--save-strategy", "steps", "--save-steps", "6"])
    cfg = config_from_args(GRPOConfig, args)  # flags override the file's save_strategy
    assert (cfg.save_on_best, cfg.save_every, cfg.eval_every) == (False, 6, 3)


def test_grpo_trainer_says_a_metric_its_evaluation_lacks_when_made(tmp_path):
    from treerl import GRPOTrainer

    def accuracy(completions, **kwargs):
        return [1.0] * len(completions)

    rows = [{"prompt": "What is 1 + 1?"}]
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, eval_strategy="steps", eval_steps=1,
                      metric_for_best_model="accuracy")
    with pytest.raises(ConfigError, match="metric_for_best_model='accuracy' is not among the evaluation's figures: "
                                          "eval_frac_reward_zero_std, eval_reward, eval_reward_std, "
                                          "eval_rewards/accuracy/mean, eval_rewards/accuracy/std"):
        GRPOTrainer(model="tiny", reward_funcs=accuracy, args=args, train_dataset=rows, eval_dataset=rows)
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, eval_strategy="steps", eval_steps=1,
                      metric_for_best_model="rewards/accuracy/mean")
    GRPOTrainer(model="tiny", reward_funcs=accuracy, args=args, train_dataset=rows, eval_dataset=rows)
