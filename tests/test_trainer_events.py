"""The TrainerCallback events treerl.GRPOTrainer calls, in transformers' Trainer's order and at its global steps:
``on_epoch_begin``/``on_epoch_end`` around each pass over the rows, ``on_step_begin``, ``on_pre_optimizer_step`` and
``on_optimizer_step`` around each optimizer step, ``on_save`` after each checkpoint. transformers' own Trainer, on a
one-parameter model over the same number of rows, steps and epochs, is the oracle of the sequence."""

from __future__ import annotations

import warnings

import pytest
from _helpers import OneParameterModel, one_parameter_rows, oracle_args

from treerl.learners.grpo import GRPOConfig

pytestmark = pytest.mark.usefixtures("one_thread")

EVENTS = ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step",
          "on_step_end", "on_evaluate", "on_save", "on_epoch_end", "on_train_end")


def recorder():
    """A TrainerCallback that records ``(event, state.global_step)`` of each of :data:`EVENTS`, and the list."""
    from transformers import TrainerCallback

    seen = []

    def record(name):
        def method(self, args, state, control, **kwargs):
            seen.append((name, state.global_step))
        return method

    return type("Record", (TrainerCallback,), {name: record(name) for name in EVENTS})(), seen


def test_events_and_their_global_steps_are_transformers_trainers(tmp_path):
    """Two epochs of 3 steps, a checkpoint every 2 steps, an evaluation every 4: the same events at the same
    global steps as transformers' Trainer (the final checkpoint's on_save included), and no warning."""
    from transformers import Trainer

    from treerl import GRPOTrainer

    options = {"num_train_epochs": 2, "save_strategy": "steps", "save_steps": 2, "eval_strategy": "steps",
               "eval_steps": 4}
    callback, oracle = recorder()

    class Oracle(Trainer):  # an evaluation's figures, without evaluating
        def evaluate(self, *args, **kwargs):
            metrics = {"eval_reward": 1.0}
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

    data = one_parameter_rows(3)
    Oracle(model=OneParameterModel(), args=oracle_args(tmp_path / "transformers", per_device_train_batch_size=1,
                                                       learning_rate=0.1, **options),
           train_dataset=data, eval_dataset=data[:1], callbacks=[callback]).train()

    callback, seen = recorder()
    rows = [{"prompt": f"What is {i} + {i}?"} for i in range(3)]
    args = GRPOConfig(output_dir=str(tmp_path / "treerl"), per_device_train_batch_size=4, num_generations=4,
                      num_generations_eval=1, max_new_tokens=4, progress=False, sample_groups=0, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # none of its events is left uncalled
        trainer = GRPOTrainer(model="tiny", reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                              args=args, train_dataset=rows, eval_dataset=rows[:1], callbacks=[callback])
    assert args.tasks_per_step == 1
    trainer.train()
    assert ("on_epoch_end", 3) in seen and ("on_save", 6) in seen
    assert seen == oracle


def test_optimizer_events_count_each_optimizer_step_of_a_step():
    """num_iterations=2: each step's two optimizer steps each have on_pre_optimizer_step and on_optimizer_step, at
    the global steps transformers' Trainer has then (those done before); the step begins and ends once."""
    import tempfile

    from treerl import GRPOTrainer

    callback, seen = recorder()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, max_steps=4, num_iterations=2, per_device_train_batch_size=4,
                          num_generations=4, max_new_tokens=4, progress=False, sample_groups=0, save_strategy="no")
        GRPOTrainer(model="tiny", reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                    args=args, train_dataset=[{"prompt": "What is 1 + 1?"}], callbacks=[callback]).train()
    assert [e for e in seen if e[0] not in ("on_save", "on_epoch_begin", "on_epoch_end")] == [
        ("on_train_begin", 0),
        ("on_step_begin", 0), ("on_pre_optimizer_step", 0), ("on_optimizer_step", 0), ("on_pre_optimizer_step", 1),
        ("on_optimizer_step", 1), ("on_step_end", 2),
        ("on_step_begin", 2), ("on_pre_optimizer_step", 2), ("on_optimizer_step", 2), ("on_pre_optimizer_step", 3),
        ("on_optimizer_step", 3), ("on_step_end", 4),
        ("on_train_end", 4)]

