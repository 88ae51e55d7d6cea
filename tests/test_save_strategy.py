"""TRL's save_strategy ("steps", "epoch", "no"; "best": tests/test_best_model.py) and eval_strategy="epoch",
with transformers' meaning: "epoch" saves and evaluates where its Trainer calls on_epoch_end, at the end of each
pass over the training rows and at the end of the run (the last pass's end, a short one included); "no" saves
nothing during the run. An epoch of GRPO is floor(rows / tasks_per_step) steps (TRL's sampler plays whole
batches)."""

from __future__ import annotations

import json

import pytest
from _helpers import OneParameterModel, one_parameter_rows, oracle_args, trainer_recorder

from treerl.errors import ConfigError
from treerl.learners.async_grpo import AsyncGRPOConfig
from treerl.learners.grpo import GRPOConfig


def transformers_saves_and_evals(tmp_path, rows, batch, max_steps=-1, epochs=3.0):
    """The optimizer steps at which transformers' own Trainer saves and evaluates with save_strategy and
    eval_strategy "epoch": a one-parameter model over ``rows`` rows, ``batch`` a step, the short last batch
    left out as GRPO's sampler does (dataloader_drop_last), so that an epoch is floor(rows / batch) steps."""
    from transformers import Trainer

    data, record = one_parameter_rows(rows), trainer_recorder()
    args = oracle_args(tmp_path, max_steps=max_steps, num_train_epochs=epochs, per_device_train_batch_size=batch,
                       dataloader_drop_last=True, save_strategy="epoch", eval_strategy="epoch", save_only_model=True)
    Trainer(model=OneParameterModel(), args=args, train_dataset=data, eval_dataset=data[:1], callbacks=[record]).train()
    return record.saves, record.evals


# (rows, tasks a step, max_steps, num_train_epochs, the steps that save and evaluate), worked out by hand: an
# epoch is floor(rows / tasks) steps; the run's end is the end of its last epoch, a short one too.
CASES = [
    (6, 2, -1, 2, [3, 6]),     # two epochs of 3 steps
    (6, 2, 4, 3, [3, 4]),      # max_steps wins: one epoch, then 1 step of the second, which ends the run
    (7, 2, -1, 1.5, [3, 5]),   # the seventh row left out: epochs of 3, 1.5 of them ceil(4.5) = 5 steps
    (6, 2, 2, 3, [2]),         # shorter than an epoch: the run's end only
    (5, 1, -1, 1, [5]),
]


@pytest.mark.parametrize("rows,tasks,max_steps,epochs,expected", CASES)
def test_epoch_saves_and_evaluates_at_each_epochs_end_and_the_runs(rows, tasks, max_steps, epochs, expected):
    length = {"max_steps": max_steps} if max_steps > 0 else {"num_train_epochs": epochs}
    cfg = GRPOConfig(output_dir="x", tasks_per_step=tasks, **length, save_strategy="epoch", eval_strategy="epoch",
                     save_steps=500, eval_steps=7)  # both ignored, as transformers does
    assert (cfg.save_every, cfg.eval_every, cfg.every_epoch) == (0, 0, ["eval_every", "save_every"])
    if cfg.num_train_epochs is not None:
        cfg.resolve_steps(rows)
    assert "save_strategy='epoch': every" in cfg.resolve_every_epoch(rows)
    assert cfg.save_every == cfg.eval_every == rows // tasks
    # What a run does with them (Run.end_step, then finish's checkpoint at the end)
    assert [s for s in range(1, cfg.steps + 1) if s % cfg.save_every == 0 or s == cfg.steps] == expected


def test_transformers_own_trainer_saves_and_evaluates_at_the_same_steps(tmp_path):
    pytest.importorskip("accelerate")
    for i, (rows, tasks, max_steps, epochs, expected) in enumerate(CASES):
        assert transformers_saves_and_evals(tmp_path / str(i), rows, tasks, max_steps, epochs) == (expected, expected)


def test_no_saves_nothing_during_the_run_and_steps_is_save_steps():
    """"no": save_every 0 (the end still writes the final checkpoint and model); save_steps beside "no" or "epoch"
    is ignored, as transformers does; save_every beside them sets the same thing twice."""
    from treerl.learners.sdpo import SDPOConfig

    for config in (GRPOConfig, SDPOConfig, AsyncGRPOConfig):  # the learners of one core take them alike
        assert config(output_dir="x", save_every=3, save_strategy="steps").save_every == 3
        assert config(output_dir="x", save_strategy="no", save_steps=5).save_every == 0
        assert config(output_dir="x", save_strategy="epoch").every_epoch == ["save_every"]
    assert GRPOConfig(output_dir="x", save_strategy="steps", save_steps=5).save_every == 5
    assert GRPOConfig(output_dir="x", save_strategy="steps", save_every=5).save_every == 5
    from transformers.trainer_utils import SaveStrategy

    assert GRPOConfig(output_dir="x", save_strategy=SaveStrategy.NO, save_steps=2).save_every == 0
    for strategy in ("no", "epoch"):
        with pytest.raises(TypeError, match=f"save_strategy='{strategy}' and save_every set the same thing"):
            GRPOConfig(output_dir="x", save_strategy=strategy, save_every=2)
    assert GRPOConfig(output_dir="x", save_strategy="best", save_steps=5, eval_strategy="steps", eval_steps=2,
                      metric_for_best_model="reward").save_every == 0  # see test_best_model.py
    with pytest.raises(ValueError, match="save_strategy='hourly': use steps"):
        GRPOConfig(output_dir="x", save_strategy="hourly")
    with pytest.raises(ValueError, match="eval_strategy='hourly': use steps"):
        GRPOConfig(output_dir="x", eval_strategy="hourly")
    with pytest.raises(TypeError, match="eval_strategy and eval_every set the same thing"):
        GRPOConfig(output_dir="x", eval_strategy="epoch", eval_every=2)


def test_epoch_needs_rows_a_step_long():
    cfg = GRPOConfig(output_dir="x", save_strategy="epoch", tasks_per_step=4)
    with pytest.raises(ConfigError, match="save_strategy='epoch' acts at the end of each pass over a training "
                                          "dataset, but the environment generates its tasks"):
        cfg.resolve_every_epoch(None)
    with pytest.raises(ConfigError, match=r"save_strategy='epoch': the dataset has 3 row\(s\), fewer than a step's "
                                          "tasks_per_step=4"):
        cfg.resolve_every_epoch(3)
    # TRL's AsyncGRPO streams its groups, which transformers' Trainer plays as one epoch: the run's end only.
    cfg = AsyncGRPOConfig(output_dir="x", steps=5, save_strategy="epoch", eval_strategy="epoch")
    cfg.resolve_every_epoch(None)
    assert (cfg.save_every, cfg.eval_every) == (5, 5)


def _rows(path, n):
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(n)))
    return path


SMALL = ["--tasks-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--progress", "false",
         "--num-threads", "1", "--sample-groups", "0"]


def test_learn_saves_and_evaluates_each_epoch(tmp_path, capsys):
    """treerl learn, save_strategy and eval_strategy "epoch" in its YAML, 2 epochs of 6 rows, 2 a step:
    checkpoints and evaluations at steps 3 and 6 (and the evaluation at the start); a --save-strategy flag
    overrides the file's save_every; an environment that generates its tasks refuses "epoch"."""
    from treerl.cli import main

    data, held_out = _rows(tmp_path / "train.jsonl", 6), _rows(tmp_path / "test.jsonl", 2)
    (tmp_path / "c.yaml").write_text(f"env: treerl/MathVerify-v0\nenv_kwargs:\n  data_path: {data}\n"
                                     f"eval_env_kwargs:\n  data_path: {held_out}\neval_episodes: 1\n"
                                     "num_train_epochs: 2\nsave_strategy: epoch\neval_strategy: epoch\n"
                                     "save_steps: 500\n")
    out = tmp_path / "run"
    assert main(["learn", "--config", str(tmp_path / "c.yaml"), "--output-dir", str(out), *SMALL]) == 0
    assert ("note: num_train_epochs=2: 6 steps (6 rows, 2 tasks a step); eval_strategy='epoch' and "
            "save_strategy='epoch': every 3 steps (an epoch) and at the run's end") in capsys.readouterr().err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3", "step-6"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "eval/success_rate" in m] == [0, 3, 6]
    settings = json.loads((out / "config.json").read_text())
    assert (settings["steps"], settings["save_every"], settings["eval_every"]) == (6, 3, 3)

    (tmp_path / "d.yaml").write_text("save_every: 1\n")
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    args = build_parser().parse_args(["learn", "--config", str(tmp_path / "d.yaml"), "--output-dir", "x",
                                      "--save-strategy", "no"])
    assert config_from_args(GRPOConfig, args).save_every == 0

    assert main(["learn", "--env", "treerl/Calculator-v0", "--save-strategy", "epoch", "--output-dir",
                 str(tmp_path / "calc"), *SMALL]) == 2
    assert ("save_strategy='epoch' acts at the end of each pass over a training dataset, but treerl/Calculator-v0 "
            "generates its tasks") in capsys.readouterr().err


def _reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def test_grpo_trainer_takes_open_r1s_epoch_saves(tmp_path):
    """open-r1's GRPO recipe: num_train_epochs=1, save_strategy="epoch" (save_total_limit=1). 6 rows, 2 prompts a
    step: one epoch of 3 steps, its end the run's: one checkpoint, at step 3, and the model."""
    from treerl import GRPOTrainer

    rows = [{"prompt": f"What is {i} + {i}?"} for i in range(6)]
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_train_epochs=1, save_strategy="epoch", save_total_limit=1,
                      per_device_train_batch_size=4, num_generations=2, max_new_tokens=8, progress=False,
                      sample_groups=0)
    result = GRPOTrainer(model="tiny", reward_funcs=_reward_len, args=args, train_dataset=rows).train()
    assert result.global_step == 3
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == ["step-3"]
    assert (tmp_path / "out" / "model" / "config.json").exists()


def test_grpo_trainer_saves_and_evaluates_at_epoch_ends_and_the_runs_end(tmp_path):
    """max_steps=4 over epochs of 3 steps: transformers' Trainer saves and evaluates at the end of the first epoch
    and at the end of the run, in the second; TRL callbacks see the evaluations then. eval_strategy="epoch"
    needs an eval_dataset, "epoch" needs a train_dataset."""
    from transformers import TrainerCallback

    from treerl import GRPOTrainer

    class Evaluations(TrainerCallback):
        steps: list[int] = []

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.steps.append(state.global_step)

    rows = [{"prompt": f"What is {i} + {i}?"} for i in range(6)]
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=4, save_strategy="epoch", eval_strategy="epoch",
                      per_device_train_batch_size=4, num_generations=2, max_new_tokens=8, progress=False,
                      sample_groups=0)
    trainer = GRPOTrainer(model="tiny", reward_funcs=_reward_len, args=args, train_dataset=rows,
                          eval_dataset=rows[:1], callbacks=[Evaluations()])
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["step-3", "step-4"]
    assert Evaluations.steps == [3, 4]
    assert [e["step"] for e in trainer.state.log_history if "eval_reward" in e] == [3, 4]

    with pytest.raises(ValueError, match="args.eval_strategy='epoch' scores an eval_dataset at the end of each epoch"):
        GRPOTrainer(model="tiny", reward_funcs=_reward_len, train_dataset=rows,
                    args=GRPOConfig(output_dir=str(tmp_path / "b"), eval_strategy="epoch"))

    class Game:
        def reset(self, **kwargs):
            return "Say hi."

        def get_reward(self):
            return 1.0

    with pytest.raises(ValueError, match="args.save_strategy / eval_strategy='epoch' act at the end of each pass over "
                                         "train_dataset, which GRPOTrainer was not given"):
        GRPOTrainer(model="tiny", args=GRPOConfig(output_dir=str(tmp_path / "game"), max_steps=2,
                                                  save_strategy="epoch"), environment_factory=Game)
