"""transformers' TrainingArguments options that the learners take with their meaning there: each one as a
``treerl learn`` flag, a YAML key and a keyword argument of the Python configs (TRL's name), and what a run
does with it."""

from __future__ import annotations

import pytest
import torch
from _helpers import OneParameterModel, one_parameter_rows, oracle_args, trainer_recorder

from treerl.learners.grpo import GRPOConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(tasks_per_step=1, group_size=2, max_new_tokens=8, temperature=1.5, eval_episodes=0, progress=False,
            sample_groups=0, learning_rate=5e-3)


def alternate(completions, **kwargs):
    """Rewards 0, 1, 0, 1, ...: every group has advantages, so every step trains."""
    return [float(i % 2) for i in range(len(completions))]


def _load():
    from treerl.models import load_default_model

    return load_default_model()


def from_command_line(flags, yaml_text=None, tmp_path=None, learner="grpo"):
    """The config ``treerl learn`` builds from ``flags`` (and a ``--config`` file holding ``yaml_text``)."""
    from treerl.cli import build_parser
    from treerl.config import config_from_args
    from treerl.learners.core import LEARNERS

    argv = ["learn", "--learner", learner, "--output-dir", "out", *flags]
    if yaml_text is not None:
        (tmp_path / "run.yaml").write_text(yaml_text)
        argv += ["--config", str(tmp_path / "run.yaml")]
    return config_from_args(LEARNERS[learner].config, build_parser(learner).parse_args(argv))


# -- torch_empty_cache_steps ------------------------------------------------------------------------------------


def test_torch_empty_cache_steps_is_a_flag_a_yaml_key_and_trls_keyword(tmp_path):
    assert GRPOConfig(output_dir="x").torch_empty_cache_steps is None
    assert GRPOConfig(output_dir="x", torch_empty_cache_steps=4).torch_empty_cache_steps == 4
    assert from_command_line(["--torch-empty-cache-steps", "3"]).torch_empty_cache_steps == 3
    assert from_command_line([], "torch_empty_cache_steps: 5\n", tmp_path).torch_empty_cache_steps == 5
    for value in (0, -2, True, 2.5):  # transformers: "must be an integer bigger than 0"
        with pytest.raises(ValueError, match=f"torch_empty_cache_steps={value!r} must be a whole number > 0"):
            GRPOConfig(output_dir="x", torch_empty_cache_steps=value)


def test_the_cache_is_emptied_after_every_nth_optimizer_step_of_the_run(tmp_path, monkeypatch):
    """Two steps of num_iterations=3 optimizer steps each: every 2nd optimizer step of the run empties the cache
    (transformers' global_step), the 2nd and 4th in the middle of a step, the 6th at the end of the last."""
    import accelerate.utils.memory

    taken = []

    class Counted(torch.optim.AdamW):
        def step(self, *args, **kwargs):
            taken.append(None)
            return super().step(*args, **kwargs)

    emptied = []
    monkeypatch.setattr(accelerate.utils.memory, "clear_device_cache", lambda: emptied.append(len(taken)))
    model, tok = _load()
    train(GRPOConfig(output_dir=str(tmp_path), steps=2, num_iterations=3, torch_empty_cache_steps=2, **TINY),
          model=model, tokenizer=tok, reward_funcs=[alternate], optimizer=lambda params: Counted(params, lr=5e-3))
    assert len(taken) == 6 and emptied == [2, 4, 6]


# -- full_determinism -------------------------------------------------------------------------------------------

DETERMINISM_VARIABLES = ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "ASCEND_LAUNCH_BLOCKING",
                         "HCCL_DETERMINISTIC", "FLASH_ATTENTION_DETERMINISTIC")


@pytest.fixture
def torch_determinism(monkeypatch):
    """torch's deterministic-algorithms switch, cuDNN's flags and the environment variables that transformers'
    enable_full_determinism sets, as they were before the test, after it."""
    for name in DETERMINISM_VARIABLES:
        monkeypatch.delenv(name, raising=False)  # restored (or removed) at the end, whoever set it meanwhile
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2:]


def test_full_determinism_is_a_flag_a_yaml_key_and_trls_keyword(tmp_path):
    assert GRPOConfig(output_dir="x").full_determinism is False
    assert GRPOConfig(output_dir="x", full_determinism=True).full_determinism is True
    assert from_command_line(["--full-determinism"]).full_determinism is True
    assert from_command_line([], "full_determinism: true\n", tmp_path).full_determinism is True


def test_full_determinism_seeds_with_transformers_enable_full_determinism_and_trains(tmp_path, torch_determinism):
    """The run is seeded as transformers' Trainer seeds with full_determinism: deterministic algorithms only (a
    step of training runs under them on the CPU), cuDNN's deterministic mode and CUDA's variables; the default
    seeds without them."""
    import os

    model, tok = _load()
    train(GRPOConfig(output_dir=str(tmp_path / "plain"), steps=1, **TINY), model=model, tokenizer=tok,
          reward_funcs=[alternate])
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    model, tok = _load()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train(GRPOConfig(output_dir=str(tmp_path / "full"), steps=1, full_determinism=True, **TINY), model=model,
          tokenizer=tok, reward_funcs=[alternate])
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and os.environ["CUDA_LAUNCH_BLOCKING"] == "1"
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # it trained


def test_asyncgrpos_generators_sample_under_full_determinism_too(torch_determinism):
    """A generator is a process of its own: it applies full_determinism to its sampler as the trainer does."""
    from treerl import AsyncGRPOConfig
    from treerl.learners.async_generator import GeneratorCore, GeneratorSpec

    cfg = AsyncGRPOConfig(output_dir="x", full_determinism=True, max_new_tokens=4)
    core = GeneratorCore(GeneratorSpec(cfg=cfg, max_staleness=2), generator_id=0)
    try:
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    finally:
        core.policy.close()


# -- save_only_model --------------------------------------------------------------------------------------------


def test_save_only_model_is_a_flag_a_yaml_key_and_trls_keyword(tmp_path):
    assert GRPOConfig(output_dir="x").save_only_model is False
    assert GRPOConfig(output_dir="x", save_only_model=True).save_only_model is True
    assert from_command_line(["--save-only-model"]).save_only_model is True
    assert from_command_line([], "save_only_model: true\n", tmp_path, learner="sdpo").save_only_model is True


def test_a_model_only_checkpoint_holds_the_weights_and_state_alone(tmp_path):
    """The same trained weights saved both ways: the model-only checkpoint lacks the optimizer's and scheduler's
    states and the random generators (AdamW's two moments: a third of the whole), and loads back its weights
    and state, leaving the optimizer as it is."""
    from safetensors.torch import load_file

    from treerl.learners.checkpoints import TrainerState, is_model_only, load_checkpoint, save_checkpoint

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(1, 64)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = TrainerState(step=3, policy_version=3, next_task=6)
    save_checkpoint(tmp_path / "whole", model, optimizer, scheduler, state)
    save_checkpoint(tmp_path / "model", model, optimizer, scheduler, state, model_only=True)
    files = {p.name: p.stat().st_size for p in (tmp_path / "model").iterdir()}
    assert sorted(files) == ["model.safetensors", "trainer_state.json"]
    whole = sum(p.stat().st_size for p in (tmp_path / "whole").iterdir())
    assert {"optimizer.pt", "rng.pt"} <= {p.name for p in (tmp_path / "whole").iterdir()}
    assert sum(files.values()) < 0.4 * whole
    assert is_model_only(tmp_path / "model") and not is_model_only(tmp_path / "whole")
    for key, value in load_file(str(tmp_path / "model" / "model.safetensors")).items():
        assert torch.equal(value, model.state_dict()[key])

    fresh = torch.nn.Linear(64, 64)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda step: 1.0)
    assert load_checkpoint(tmp_path / "model", fresh, fresh_optimizer, fresh_scheduler) == state
    assert torch.equal(fresh.weight, model.weight) and not fresh_optimizer.state
    assert fresh_scheduler.last_epoch == 0


def test_resume_refuses_a_model_only_checkpoint_while_steps_remain(tmp_path, capsys):
    """A run of save_only_model checkpoints: each has no optimizer, and --resume with steps left is refused with
    why and what to do; with none left it writes the checkpoint's weights to output_dir/model."""
    from safetensors.torch import load_file

    from treerl.errors import ConfigError

    out = tmp_path / "run"
    model, tok = _load()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = GRPOConfig(output_dir=str(out), steps=2, save_every=1, save_only_model=True, **TINY)
    train(cfg, model=model, tokenizer=tok, reward_funcs=[alternate])
    for step in (1, 2):
        assert sorted(p.name for p in (out / "checkpoints" / f"step-{step}").iterdir()) == [
            "model.safetensors", "trainer_state.json"]
    model, tok = _load()
    with pytest.raises(ConfigError, match=r"--resume: .*step-2 holds the model only \(save_only_model wrote it\): "
                                          r"no optimizer state.*--overwrite-output-dir.*--resume --steps 2"):
        train(GRPOConfig(output_dir=str(out), steps=3, resume=True, **TINY), model=model, tokenizer=tok,
              reward_funcs=[alternate])
    saved = load_file(str(out / "checkpoints" / "step-2" / "model.safetensors"))
    (out / "model" / "model.safetensors").unlink()
    train(GRPOConfig(output_dir=str(out), steps=2, resume=True, **TINY), model=model, tokenizer=tok,
          reward_funcs=[alternate])
    assert "resumed from" in capsys.readouterr().err
    written = load_file(str(out / "model" / "model.safetensors"))
    assert any(not torch.equal(saved[k], start[k]) for k in saved)  # it trained
    common = saved.keys() & written.keys()  # tied embeddings are saved under one name or the other
    assert len(common) >= len(saved) - 1
    for key in common:
        assert torch.equal(written[key], saved[key]), key


# -- eval_delay -------------------------------------------------------------------------------------------------


def transformers_evals(tmp_path, rows, strategy, delay, max_steps=-1, epochs=3.0, eval_steps=None):
    """The optimizer steps at which transformers' own Trainer evaluates with ``eval_strategy`` and ``eval_delay``:
    a one-parameter model over ``rows`` rows, one a step."""
    from transformers import Trainer

    data, record = one_parameter_rows(rows), trainer_recorder()
    args = oracle_args(tmp_path, max_steps=max_steps, num_train_epochs=epochs, per_device_train_batch_size=1,
                       eval_strategy=strategy, eval_steps=eval_steps, eval_delay=delay, save_strategy="no")
    Trainer(model=OneParameterModel(), args=args, train_dataset=data, eval_dataset=data[:1], callbacks=[record]).train()
    return record.evals


# (rows, eval_strategy, eval_delay, max_steps, num_train_epochs, eval_steps, the steps that evaluate), by hand
EVAL_DELAY_CASES = [
    (20, "steps", 3, 7, 3.0, 2, [4, 6, 7]),   # every 2 optimizer steps from the 3rd on, and at the end
    (20, "steps", 0, 7, 3.0, 2, [2, 4, 6, 7]),
    (20, "steps", 8, 7, 3.0, 2, []),          # later than the run: none, not even at its end
    (3, "epoch", 2, -1, 3.0, None, [6, 9]),   # epochs of 3 steps: from the end of the 2nd
    (3, "epoch", 1.5, 7, 3.0, None, [6, 7]),  # the run ends at epoch 2.33, a short last epoch
    (3, "epoch", 2.5, 7, 3.0, None, []),
]


@pytest.mark.parametrize("rows,strategy,delay,max_steps,epochs,eval_steps,expected", EVAL_DELAY_CASES)
def test_eval_delay_holds_the_evaluations_back_as_transformers_does(rows, strategy, delay, max_steps, epochs,
                                                                   eval_steps, expected, tmp_path):
    """The steps that evaluate, here (a step of one task, one optimizer step) and in transformers' Trainer."""
    assert transformers_evals(tmp_path, rows, strategy, delay, max_steps, epochs, eval_steps) == expected
    length = {"max_steps": max_steps} if max_steps > 0 else {"num_train_epochs": epochs}
    steps = {"eval_steps": eval_steps} if eval_steps else {}
    cfg = GRPOConfig(output_dir="x", tasks_per_step=1, eval_strategy=strategy, eval_delay=delay, **length, **steps)
    if cfg.num_train_epochs is not None:
        cfg.resolve_steps(rows)
    if cfg.every_epoch:
        cfg.resolve_every_epoch(rows)
    assert [step for step in range(1, cfg.steps + 1) if cfg.evaluates_after(step)] == expected


def test_eval_delay_counts_the_runs_optimizer_steps(tmp_path):
    """Three steps of num_iterations=2 optimizer steps, evaluated every step from the 3rd optimizer step on:
    after steps 2 and 3 (optimizer steps 4 and 6), not after step 1 (optimizer step 2); the evaluation before
    the first step (eval_on_start) is not eval_every's."""
    import json

    evaluated = []

    def evaluate(policy, tokenizer, trainer_state):
        evaluated.append(None)
        return {"eval_x": float(len(evaluated))}

    model, tok = _load()
    cfg = GRPOConfig(output_dir=str(tmp_path), steps=3, num_iterations=2, eval_every=1, eval_delay=3,
                     eval_on_start=True, **TINY)
    train(cfg, model=model, tokenizer=tok, reward_funcs=[alternate], evaluate=evaluate)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m.get("eval_x")) for m in lines] == [(0, 1.0), (1, None), (2, 2.0), (3, 3.0)]


def test_eval_delay_is_a_flag_a_yaml_key_and_trls_keyword(tmp_path):
    assert GRPOConfig(output_dir="x").eval_delay == 0
    assert GRPOConfig(output_dir="x", eval_strategy="steps", eval_steps=5, eval_delay=50).eval_delay == 50
    assert from_command_line(["--eval-delay", "2.5"]).eval_delay == 2.5
    assert from_command_line([], "eval_delay: 7\n", tmp_path).eval_delay == 7
    for value in (-1, True, float("inf")):
        with pytest.raises(ValueError, match=f"eval_delay={value!r} must be a number >= 0"):
            GRPOConfig(output_dir="x", eval_delay=value)


# -- data_seed --------------------------------------------------------------------------------------------------


def test_data_seed_seeds_the_rows_order_apart_from_seed(tmp_path):
    """With --shuffle-dataset the passes over the rows are drawn with data_seed where it is set, else with seed
    (transformers' default); seed still seeds the tasks' resets and sampling. AsyncGRPO's generators build
    their engine from the same config."""
    from transformers import AutoTokenizer

    from treerl import AsyncGRPOConfig
    from treerl.models import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    for config in (GRPOConfig, AsyncGRPOConfig):
        engine = config(output_dir="x", seed=3, data_seed=11, shuffle_dataset=True).engine(None, tokenizer, seed=3)
        assert (engine.shuffle_seed, engine.seed) == (11, 3)
        assert config(output_dir="x", seed=3, shuffle_dataset=True).engine(None, tokenizer, seed=3).shuffle_seed == 3
        assert config(output_dir="x", data_seed=11).engine(None, tokenizer, seed=0).shuffle_seed is None  # as written
    assert GRPOConfig(output_dir="x").data_seed is None
    assert from_command_line(["--data-seed", "11"]).data_seed == 11
    assert from_command_line([], "data_seed: 12\nseed: 4\n", tmp_path).data_seed == 12
    with pytest.raises(ValueError, match="data_seed=True must be a whole number"):
        GRPOConfig(output_dir="x", data_seed=True)


def test_a_trl_script_with_data_seed_plays_the_rows_in_its_order(tmp_path):
    """treerl.GRPOTrainer shuffles the rows (TRL's default): with data_seed, the passes torch.randperm draws from a
    generator seeded with it, not with seed."""
    from treerl import GRPOTrainer

    rows = [{"prompt": f"Row {i}"} for i in range(4)]

    def drawn(seed):
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(4, generator=generator).tolist()

    seen = []

    def reward(prompts, **kwargs):
        seen.extend(int(p.split()[1]) for p in prompts[::2])  # a group's two generations share their prompt
        return [0.0] * len(prompts)

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=2, seed=5, data_seed=9, progress=False, sample_groups=0,
                      learning_rate=1e-4)
    GRPOTrainer(model="tiny", reward_funcs=reward, train_dataset=rows, args=args).train()
    assert drawn(9)[:3] != drawn(5)[:3]
    assert seen == drawn(9)[:3]


# -- include_num_input_tokens_seen ------------------------------------------------------------------------------


def test_include_num_input_tokens_seen_takes_transformers_values(tmp_path):
    for value, meant in (("no", "no"), (False, "no"), ("all", "all"), (True, "all"), ("non_padding", "non_padding")):
        assert GRPOConfig(output_dir="x", include_num_input_tokens_seen=value).include_num_input_tokens_seen == meant
    assert from_command_line(["--include-num-input-tokens-seen", "non_padding"]).include_num_input_tokens_seen == \
        "non_padding"
    assert from_command_line(["--include-num-input-tokens-seen", "true"]).include_num_input_tokens_seen == "all"
    for text, meant in (("true", "all"), ("no", "no"), ("non_padding", "non_padding")):  # YAML reads no as false
        cfg = from_command_line([], f"include_num_input_tokens_seen: {text}\n", tmp_path)
        assert cfg.include_num_input_tokens_seen == meant
    with pytest.raises(ValueError, match="include_num_input_tokens_seen='some': use no, all"):
        GRPOConfig(output_dir="x", include_num_input_tokens_seen="some")


def test_num_input_tokens_seen_counts_every_training_forwards_inputs(tmp_path, monkeypatch):
    """Each of num_iterations=2 passes over a step's packed rows counts again, as transformers counts every training
    forward; the count goes on from step to step and the checkpoint keeps it for a resumed run. The rows the
    learners train on hold no padding, so "all" counts their tokens."""
    import json

    import treerl.learners.grpo as grpo

    forwarded = {"all": 0, "non_padding": 0}
    optimize = grpo.optimize

    def counted(model, optimizer, scheduler, batches, *args, **kwargs):
        forwarded["all"] += sum(b.input_ids.numel() for b in batches)
        forwarded["non_padding"] += sum(b.num_tokens for b in batches)
        return optimize(model, optimizer, scheduler, batches, *args, **kwargs)

    monkeypatch.setattr(grpo, "optimize", counted)
    after_steps = []
    model, tok = _load()
    cfg = GRPOConfig(output_dir=str(tmp_path), steps=2, num_iterations=2, include_num_input_tokens_seen="all", **TINY)
    train(cfg, model=model, tokenizer=tok, reward_funcs=[alternate],
          callbacks=[lambda step, metrics: after_steps.append(forwarded["all"])])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["num_input_tokens_seen"] for m in lines] == after_steps
    assert 0 < after_steps[0] < after_steps[1] == forwarded["non_padding"]
    state = json.loads((tmp_path / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["extra"]["num_input_tokens_seen"] == after_steps[1]


def test_all_counts_the_padding_non_padding_does_not():
    """Two paths of 5 and 9 tokens padded into one micro-batch (18 slots, 14 tokens), forwarded twice, after
    100 tokens counted before: transformers' input_ids.numel() and its attention mask's sum."""
    import types

    from treerl.learners.checkpoints import TrainerState
    from treerl.learners.core import Run
    from treerl.learners.distributed import Ranks
    from treerl.learners.packing import PackingConfig, pack_groups
    from treerl.rollout.trajectory import Group

    def chain(n):  # one episode: a prompt and a reply, n tokens in all
        group = Group(task_key=f"chain{n}", env_id="test")
        root = group.add_segment("prompt", [1] * (n // 2))
        leaf = group.add_segment("sampled", [2] * (n - n // 2), parent=root, logprobs=[-0.1] * (n - n // 2))
        group.add_episode(leaf=leaf, reward=1.0)
        return group

    batches = pack_groups([chain(5), chain(9)], torch.zeros(2), PackingConfig(16, mode="padded", rows_per_batch=2))
    assert [(b.batch_size, b.length, b.num_tokens) for b in batches] == [(2, 9, 14)]
    for count, expected in (("all", 100 + 2 * 18), ("non_padding", 100 + 2 * 14)):
        run = types.SimpleNamespace(cfg=GRPOConfig(output_dir="x", include_num_input_tokens_seen=count),
                                    state=TrainerState(extra={"num_input_tokens_seen": 100}), ranks=Ranks())
        assert Run._count_input_tokens(run, batches, passes=2) == expected
        assert run.state.extra["num_input_tokens_seen"] == expected


def test_a_trl_script_reads_num_input_tokens_seen_in_its_logs_state_and_result(tmp_path):
    from transformers import TrainerCallback

    from treerl import GRPOTrainer

    class Record(TrainerCallback):
        seen: list[tuple[int, int]] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append((logs["num_input_tokens_seen"], state.num_input_tokens_seen))

    record = Record()
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=2, include_num_input_tokens_seen=True, progress=False, sample_groups=0,
                      learning_rate=1e-4)
    trainer = GRPOTrainer(model="tiny", reward_funcs=alternate, train_dataset=[{"prompt": "1 + 1?"}], args=args,
                          callbacks=[record])
    result = trainer.train()
    assert len(record.seen) == 2 and all(logged == state > 0 for logged, state in record.seen)
    assert record.seen[0][0] < record.seen[1][0]
    assert result.metrics["num_input_tokens_seen"] == trainer.state.num_input_tokens_seen == record.seen[1][0]
