"""transformers' ``TrainerControl`` read after each step, as its Trainer reads it: a TrainerCallback that sets
``should_training_stop`` (transformers' ``EarlyStoppingCallback``: after ``early_stopping_patience`` evaluations
without improving on ``metric_for_best_model``) ends treerl.GRPOTrainer's run after that step, as a run ends
(final checkpoint, output_dir/model, the best loaded with ``load_best_model_at_end``); ``should_evaluate`` and
``should_save`` evaluate and checkpoint at the step. transformers' own Trainer, on a one-parameter model given
the same evaluation figures, is the oracle of where the run stops, which steps evaluate and which save."""

from __future__ import annotations

import json

import pytest
import torch
from _helpers import OneParameterModel, one_parameter_rows, oracle_args, scripted_eval_reward, trainer_recorder

from treerl.learners.grpo import GRPOConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def transformers_run(tmp_path, values, callbacks, max_steps, **options):
    """transformers' Trainer over ``max_steps`` optimizer steps of a one-parameter model, each evaluation
    returning the next of ``values`` as ``eval_reward``, with ``callbacks`` and ``options``: the steps it ran, the
    steps it evaluated at, the steps it saved at, and its best step and metric."""
    from transformers import Trainer

    record = trainer_recorder()

    class Oracle(Trainer):  # the figures given, as an evaluation would return them
        def evaluate(self, *args, **kwargs):
            metrics = {"eval_reward": values[len(record.evals)]}
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

    data = one_parameter_rows(max_steps, start=1)
    args = oracle_args(tmp_path, max_steps=max_steps, per_device_train_batch_size=1, learning_rate=0.1, **options)
    trainer = Oracle(model=OneParameterModel(), args=args, train_dataset=data, eval_dataset=data[:1],
                     callbacks=[*callbacks, record])
    trainer.train()
    best = trainer.state.best_model_checkpoint
    return (trainer.state.global_step, record.evals, record.saves,
            int(best.rsplit("-", 1)[1]) if best is not None else None, trainer.state.best_metric)


def _treerl_run(tmp_path, values, callbacks, max_steps, monkeypatch, **options):
    """treerl.GRPOTrainer on the tiny model with the same evaluation figures, ``callbacks`` and ``options``: the
    trainer, its result, the steps evaluated at (from the log) and the steps whose checkpoints were written."""
    import treerl.learners.core as core
    from treerl import GRPOTrainer

    written = {}  # step: the weights its checkpoint holds, in the order written
    save = core.save_checkpoint

    def spy(path, model, *args, **kwargs):
        written[int(path.name[len("step-"):])] = {k: v.clone() for k, v in model.state_dict().items()}
        save(path, model, *args, **kwargs)

    monkeypatch.setattr(core, "save_checkpoint", spy)
    rows = [{"prompt": f"What is {i} + {i}?", "split": "train"} for i in range(4)]
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4, num_generations=4,
                      num_generations_eval=1, max_new_tokens=4, progress=False, sample_groups=0, learning_rate=1e-3,
                      **options)
    trainer = GRPOTrainer(model="tiny", reward_funcs=scripted_eval_reward(values), args=args, train_dataset=rows,
                          eval_dataset=[{"prompt": "What is 1 + 1?", "split": "eval"}], callbacks=callbacks)
    result = trainer.train()
    evaluations = [m["step"] for m in trainer.state.log_history if "eval_reward" in m]
    return trainer, result, evaluations, written


def test_early_stopping_callback_stops_the_run_as_transformers_trainer(tmp_path, monkeypatch):
    """transformers' EarlyStoppingCallback (patience 1) with metric_for_best_model eval_reward, evaluations after
    every step whose figures stop improving after step 2: the run stops after step 3 of 5, where transformers'
    Trainer stops, with its best (step 2) loaded into output_dir/model; the run ends as a run ends (its last
    checkpoint, summary.json, TRL's global_step)."""
    from safetensors.torch import load_file
    from transformers import EarlyStoppingCallback

    values, max_steps = [1.0, 3.0, 2.0, 4.0, 5.0], 5
    options = {"eval_strategy": "steps", "eval_steps": 1, "save_strategy": "steps", "save_steps": 1,
               "metric_for_best_model": "eval_reward", "load_best_model_at_end": True}
    steps, evaluations, saves, best, best_metric = transformers_run(
        tmp_path / "transformers", values, [EarlyStoppingCallback(early_stopping_patience=1)], max_steps, **options)
    assert steps < max_steps  # the oracle stopped early

    out = tmp_path / "treerl"
    trainer, result, evaluated, written = _treerl_run(out, values, [EarlyStoppingCallback(early_stopping_patience=1)],
                                                      max_steps, monkeypatch, **options)
    assert result.global_step == trainer.state.global_step == result.steps == steps
    assert evaluated == evaluations
    assert list(written) == saves
    assert (result.best_step, result.best_metric) == (best, best_metric)
    assert json.loads((out / "summary.json").read_text())["steps"] == steps
    assert max(json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()) == steps
    model = load_file(str(out / "model" / "model.safetensors"))
    assert all(torch.equal(v, written[best][k]) for k, v in model.items())
    assert not all(torch.equal(v, written[steps][k]) for k, v in model.items())  # the weights moved after it


class _Asks:
    """A TrainerCallback that sets ``should_evaluate``, ``should_save`` or ``should_training_stop`` at the end of
    the optimizer steps named."""

    def __init__(self, evaluate=(), save=(), stop=()):
        self.evaluate, self.save, self.stop = evaluate, save, stop

    def on_step_end(self, args, state, control, **kwargs):
        control.should_evaluate |= state.global_step in self.evaluate
        control.should_save |= state.global_step in self.save
        control.should_training_stop |= state.global_step in self.stop

    def on_log(self, args, state, control, logs, **kwargs):
        pass


def test_a_callbacks_evaluate_save_and_stop_act_at_its_step_as_in_transformers_trainer(tmp_path, monkeypatch):
    """A callback that asks, at the end of a step, for an evaluation (step 1), a checkpoint (steps 1 and 2) and
    the end of training (step 2) of a run of 4 steps that neither evaluates nor saves on its own: the same
    evaluations, saves and last step as transformers' Trainer. A plain function callback may ask the same by
    returning a StepControl."""
    from transformers import TrainerCallback

    class Asks(_Asks, TrainerCallback):
        pass

    values, max_steps = [2.0, 1.0], 4
    options = {"eval_strategy": "no", "save_strategy": "no"}
    asks = {"evaluate": (1,), "save": (1, 2), "stop": (2,)}
    steps, evaluations, saves, _, _ = transformers_run(tmp_path / "transformers", values, [Asks(**asks)], max_steps,
                                                       **options)
    trainer, result, evaluated, written = _treerl_run(tmp_path / "treerl", values, [Asks(**asks)], max_steps,
                                                      monkeypatch, **options)
    assert result.global_step == steps == 2
    assert evaluated == evaluations == [1]
    assert list(written) == saves == [1, 2]

    from treerl.learners.core import StepControl

    stopped = []

    def stop_at_one(step, metrics):
        stopped.append(step)
        return StepControl(stop=step == 1)

    trainer, result, evaluated, written = _treerl_run(tmp_path / "function", values, [stop_at_one], max_steps,
                                                      monkeypatch, **options)
    assert result.global_step == 1 and stopped == [1] and list(written) == [1] and evaluated == []
