"""TRL's num_train_epochs: without max_steps, the run's length is that many passes over the training rows, as
TRL's Trainer counts them (transformers' set_initial_training_values over GRPO's RepeatSampler dataloader)."""

from __future__ import annotations

import json
import math

import pytest

import treerl
from treerl.envs.registry import make_group
from treerl.errors import ConfigError
from treerl.learners.async_grpo import AsyncGRPOConfig
from treerl.learners.grpo import GRPOConfig, train


def trl_max_steps(rows, per_device, accumulation, generations, iterations, epochs, processes=1):
    """TRL's max_steps for num_train_epochs (its default steps_per_generation, gradient_accumulation_steps),
    step by step as its code computes it, one process's view; None where TRL's Trainer refuses max_steps=-1."""
    generation_batch = per_device * accumulation * processes  # TRL's default generation_batch_size
    prompts = generation_batch // generations  # a generation's prompts, the sampler's batch_size
    sampled = rows // prompts * prompts * generations * iterations * accumulation  # len(RepeatSampler)
    batches = math.ceil(sampled / (per_device * accumulation))  # its DataLoader: per_device x steps_per_generation
    per_process = math.ceil(batches / processes)  # accelerate's even shards of the batches
    if per_process == 0:
        return None
    updates_per_epoch = max(math.ceil(per_process / accumulation), 1)
    return math.ceil(epochs * updates_per_epoch)


# (rows, per_device_train_batch_size, gradient_accumulation_steps, num_generations, num_iterations, epochs,
#  processes, the steps here), each worked out by hand: P = per_device x accumulation x processes / generations
# prompts a step, floor(rows / P) steps an epoch, each num_iterations optimizer steps.
CASES = [
    (10, 8, 1, 4, 1, 1, 1, 5),     # P 2: 5 steps
    (10, 4, 2, 2, 1, 1, 1, 2),     # P 4: 2 steps, rows 9 and 10 of each pass left out
    (10, 4, 2, 2, 1, 3, 1, 6),     # 3 epochs of 2
    (9, 6, 1, 3, 2, 1, 1, 4),      # P 2: 4 steps, 8 optimizer steps
    (9, 6, 1, 3, 2, 0.5, 1, 2),    # half: 4 optimizer steps, 2 steps
    (7, 4, 1, 2, 2, 0.5, 1, 2),    # 3 steps of 2 an epoch: TRL's ceil(0.5 x 6) = 3 optimizer steps, 2 steps
    (50, 4, 1, 2, 1, 0.28, 1, 8),  # P 2, 25 steps an epoch: 0.28 x 25 is 7.000000000000001, TRL's ceil 8
    (10, 4, 1, 4, 1, 1, 2, 5),     # 2 processes: P 2 (each process plays 1 prompt a step), 5 steps
    (8, 16, 1, 8, 1, 1, 1, 4),     # TRL's default batch with 8 generations: P 2
]


@pytest.mark.parametrize("rows,per_device,accumulation,generations,iterations,epochs,processes,steps", CASES)
def test_the_steps_of_num_train_epochs_are_trls(rows, per_device, accumulation, generations, iterations, epochs,
                                                  processes, steps, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(processes))
    cfg = GRPOConfig(output_dir="x", num_train_epochs=epochs, per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=accumulation, num_generations=generations, num_iterations=iterations)
    assert cfg.steps == -1 and cfg.num_train_epochs == epochs  # not known before the rows are
    cfg.resolve_steps(rows)
    assert cfg.steps == steps
    assert cfg.steps == -(-trl_max_steps(rows, per_device, accumulation, generations, iterations, epochs,
                                          processes) // iterations)
    assert cfg.num_train_epochs is None  # it reads as a run given its steps now


def test_trls_own_trainer_computes_the_same_max_steps():
    """TRL's RepeatSampler in a DataLoader as GRPOTrainer builds it, and transformers' own
    set_initial_training_values, against the reference above (one process)."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from torch.utils.data import DataLoader
    from transformers import Trainer
    from trl.trainer.utils import RepeatSampler

    for rows, per_device, accumulation, generations, iterations, epochs, processes, _ in CASES:
        if processes > 1:
            continue
        sampler = RepeatSampler(list(range(rows)), mini_repeat_count=generations,
                                batch_size=per_device * accumulation // generations,
                                repeat_count=iterations * accumulation)
        loader = DataLoader(list(range(rows)), batch_size=per_device * accumulation, sampler=sampler)
        stub = SimpleNamespace(get_total_train_batch_size=lambda args: per_device * accumulation,
                               get_sp_size=lambda: 1, num_examples=lambda dl: rows)
        args = SimpleNamespace(max_steps=-1, num_train_epochs=epochs, gradient_accumulation_steps=accumulation)
        max_steps = Trainer.set_initial_training_values(stub, args, loader)[-1]
        assert max_steps == trl_max_steps(rows, per_device, accumulation, generations, iterations, epochs)


def test_rows_fewer_than_a_step_and_bad_epochs_are_refused():
    cfg = GRPOConfig(output_dir="x", num_train_epochs=1, tasks_per_step=4)
    assert trl_max_steps(3, 8, 1, 2, 1, 1) is None  # TRL's dataloader is empty: its Trainer refuses max_steps=-1
    with pytest.raises(ConfigError, match=r"num_train_epochs=1: the dataset has 3 row\(s\), fewer than a step's "
                                          r"tasks_per_step=4, so an epoch has no step"):
        cfg.resolve_steps(3)
    with pytest.raises(ValueError, match="num_train_epochs=0 must be a number > 0: passes over the training dataset"):
        GRPOConfig(output_dir="x", num_train_epochs=0)
    # AsyncGRPO's TRL trainer stops after ceil(E x rows) groups trained, every row: a small dataset is a step.
    assert AsyncGRPOConfig(output_dir="x", num_train_epochs=1, tasks_per_step=4).steps_for_epochs(3) == 1
    assert AsyncGRPOConfig(output_dir="x", num_train_epochs=2.5, tasks_per_step=4).steps_for_epochs(10) == 7


def test_max_steps_wins_and_its_minus_one_is_trls_three_epochs(tmp_path):
    """Beside max_steps (or steps) num_train_epochs changes nothing, as in TRL; max_steps=-1 is TRL's "run by
    num_train_epochs" (alone: TRL's default, 3). The options given as fractions of the run wait for its length."""
    with pytest.warns(UserWarning, match="num_train_epochs=1 changes nothing beside max_steps, as in TRL"):
        cfg = GRPOConfig(output_dir="x", max_steps=5, num_train_epochs=1)
    assert (cfg.steps, cfg.num_train_epochs) == (5, None)
    cfg = GRPOConfig(output_dir="x", max_steps=-1, tasks_per_step=2, warmup_ratio=0.1, save_steps=0.5,
                     eval_strategy="steps", eval_steps=0.25)
    assert (cfg.steps, cfg.num_train_epochs, cfg.warmup_steps, cfg.save_every) == (-1, 3.0, 0, 0)
    assert "num_train_epochs=3: 15 steps (10 rows, 2 tasks a step)" in cfg.resolve_steps(10)
    assert (cfg.steps, cfg.warmup_steps, cfg.save_every, cfg.eval_every, cfg.fractions_of_run) == (15, 2, 8, 4, {})
    # A resolved config copied (dataclasses.replace, as a resume does) keeps its steps, without a note.
    import dataclasses
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dataclasses.replace(cfg, resume=True).steps == 15
    assert dataclasses.replace(GRPOConfig(output_dir="x", num_train_epochs=2), seed=1).num_train_epochs == 2


def test_the_rows_of_an_environment_and_of_a_group():
    from treerl.envs.task_order import num_rows

    rows = [{"question": f"{i} + 1 = ?", "answer": str(i + 1)} for i in range(5)]
    assert num_rows(treerl.make("treerl/MathVerify-v0", dataset=rows)) == 5
    assert num_rows(treerl.make("treerl/Calculator-v0")) is None
    mixed = [{"env_class": "math", "question": "What is 1 + 1?", "answer": "2"},
             {"env_class": "calc", "prompt": "What is 6 * 7?", "answer": "42"},
             {"env_class": "math", "question": "What is 2 + 5?", "answer": "7"}]  # SkyRL-Gym's form
    assert num_rows(make_group("calc=treerl/Calculator-v0,math=treerl/MathVerify-v0", dataset=mixed)) == 3
    assert num_rows(treerl.make("calc=treerl/Calculator-v0,math=treerl/MathVerify-v0")) is None


SMALL = ["--tasks-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--eval-episodes", "0",
         "--progress", "false", "--num-threads", "1", "--sample-groups", "0"]


def _rows(path, n):
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(n)))
    return path


def test_learn_runs_the_epochs_of_an_environments_data_path(tmp_path, capsys):
    """treerl learn with num_train_epochs in its YAML on a data_path environment: floor(5 / 2) = 2 steps an epoch,
    config.json recording them; an environment that generates its tasks refuses it with what to do."""
    from treerl.cli import main

    data = _rows(tmp_path / "train.jsonl", 5)
    (tmp_path / "c.yaml").write_text(f"env: treerl/MathVerify-v0\nenv_kwargs:\n  data_path: {data}\n"
                                     "num_train_epochs: 1\nwarmup_ratio: 0.5\nlr_scheduler_type: linear\n")
    out = tmp_path / "run"
    assert main(["learn", "--config", str(tmp_path / "c.yaml"), "--output-dir", str(out), *SMALL]) == 0
    assert "note: num_train_epochs=1: 2 steps (5 rows, 2 tasks a step)" in capsys.readouterr().err
    settings = json.loads((out / "config.json").read_text())
    assert (settings["steps"], settings["warmup_steps"], settings["num_train_epochs"]) == (2, 1, None)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2

    assert main(["learn", "--env", "treerl/Calculator-v0", "--num-train-epochs", "1", "--output-dir",
                 str(tmp_path / "calc"), *SMALL]) == 2
    assert ("num_train_epochs=1 counts passes over a training dataset, but treerl/Calculator-v0 generates its "
            "tasks (no data_path or dataset): give the run's length in steps, --steps N") in capsys.readouterr().err
    assert main(["learn", "--env", "calc=treerl/Calculator-v0,math=treerl/MathVerify-v0", "--env-kwargs",
                 json.dumps({"math": {"data_path": str(data)}}), "--max-steps", "-1", "--output-dir",
                 str(tmp_path / "group"), *SMALL]) == 2
    assert "num_train_epochs=3 counts passes over a training dataset, but the group" in capsys.readouterr().err


def test_a_resumed_epochs_run_keeps_its_length(tmp_path):
    """Stopped after step 2 of the 4 that 2 epochs of 5 rows are, it resumes from its checkpoint to step 4."""
    data = _rows(tmp_path / "train.jsonl", 5)
    options = dict(output_dir=str(tmp_path / "run"), env="treerl/MathVerify-v0", env_kwargs={"data_path": str(data)},
                   num_train_epochs=2, tasks_per_step=2, group_size=2, max_new_tokens=8, eval_episodes=0,
                   progress=False, num_threads=1, sample_groups=0, save_steps=1)

    def stop(step, metrics):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(GRPOConfig(**options), callbacks=[stop])
    out = tmp_path / "run"
    assert json.loads((out / "config.json").read_text())["steps"] == 4
    result = train(GRPOConfig(**options, resume=True))
    assert result.steps == 4
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert json.loads((out / "config.json").read_text())["steps"] == 4


def test_grpo_trainer_runs_floor_rows_over_a_steps_prompts(tmp_path):
    """TRL's GRPOConfig(num_train_epochs=1) without max_steps: 5 rows, 2 prompts a step, is 2 steps (TRL's
    sampler leaves the fifth row out), TRL's epoch 1.0 at the end; an environment_factory without rows refuses it."""
    from treerl import GRPOTrainer

    rows = [{"prompt": f"What is {i} + {i}?"} for i in range(5)]

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_train_epochs=1, per_device_train_batch_size=4,
                      num_generations=2, max_new_tokens=8, progress=False, sample_groups=0)
    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=args, train_dataset=rows)
    assert (trainer.args.steps, trainer.state.max_steps) == (2, 2)
    result = trainer.train()
    assert (result.steps, result.global_step) == (2, 2)
    assert result.metrics["epoch"] == 1.0
    assert [entry["epoch"] for entry in trainer.state.log_history[:-1]] == [0.5, 1.0]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["steps"] == 2

    class Game:
        def reset(self, **kwargs):
            return "Say hi."

        def get_reward(self):
            return 1.0

    with pytest.raises(ValueError, match="args.num_train_epochs=1 counts passes over train_dataset, which GRPOTrainer "
                                         "was not given"):
        GRPOTrainer(model="tiny", args=GRPOConfig(output_dir=str(tmp_path / "game"), num_train_epochs=1),
                    environment_factory=Game)


def test_epochs_count_the_minibatch_updates_of_trls_steps_per_generation():
    """TRL's steps_per_generation=4 with gradient_accumulation_steps=2: a generation of 8 x 4 / 4 = 8 prompts
    takes 2 optimizer steps (num_minibatches 2), so an epoch of 20 rows is floor(20 / 8) = 2 generations,
    4 optimizer steps (TRL's max_steps), 2 steps here; 1.5 epochs ceil(1.5 x 4) = 6 optimizer steps, 3 steps."""
    from treerl.learners.grpo import GRPOConfig

    for epochs, steps in ((1, 2), (1.5, 3)):
        cfg = GRPOConfig(output_dir="x", per_device_train_batch_size=8, gradient_accumulation_steps=2,
                         steps_per_generation=4, num_generations=4, num_train_epochs=epochs)
        assert (cfg.tasks_per_step, cfg.num_minibatches, cfg.optimizer_steps_per_step()) == (8, 2, 2)
        cfg.resolve_steps(20)
        assert cfg.steps == steps
