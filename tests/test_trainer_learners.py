"""``treerl.SDPOTrainer`` and ``treerl.AsyncGRPOTrainer``: a script for TRL's experimental trainers of those names
runs with only its import changed (the shipped tiny model, one step of 2 tasks x 2 generations), the TRL options
whose meaning is treerl's are taken under TRL's names, and the others are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from treerl import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer, SDPOConfig, SDPOTrainer
from treerl.models import default_model_path

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
FAST = dict(max_new_tokens=8, progress=False, sample_groups=0)


def changed(model_dir) -> bool:
    before = load_file(default_model_path() / "model.safetensors")
    after = load_file(model_dir / "model.safetensors")
    return any(not torch.equal(before[k], after[k]) for k in before)


def odd_length(completions, **kwargs):
    """Reward 1 for about half the tiny model's replies: successes for SDPO's teacher to show."""
    return [float(len(c) % 2) for c in completions]


def test_a_trl_sdpo_script_trains_with_only_its_import_changed(tmp_path):
    from datasets import Dataset

    args = SDPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2, per_device_train_batch_size=4,
                      # TRL's names and values, read as treerl's
                      teacher_model_kind="base", distillation_mode="topk_logits", distillation_topk=20,
                      success_reward_threshold=0.5, include_environment_feedback=False, max_reprompt_len=512,
                      dont_reprompt_on_self_success=True, teacher_sync_steps=1,
                      distillation_gate_margin=None, eval_strategy="steps", eval_steps=1, eval_on_start=False,
                      **FAST)  # the tiny model's gate would close: distill anyway
    trainer = SDPOTrainer(model="tiny", reward_funcs=odd_length, args=args, train_dataset=Dataset.from_list(ROWS),
                          eval_dataset=ROWS[:2])
    result = trainer.train()

    assert result.steps == 1 and changed(result.model_dir)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["env"] == "SDPOTrainer.train_dataset" and config["tasks_per_step"] == 2
    assert (config["teacher"], config["distillation_mode"], config["distillation_topk"]) == ("initial", "topk", 20)
    assert (config["success_threshold"], config["use_feedback"], config["max_teacher_prompt_tokens"]) == (0.5, False,
                                                                                                          512)
    metrics = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["reward/mean"] == pytest.approx(metrics["reward_fn/odd_length_mean"])
    assert any(k.startswith("sdpo/") for k in metrics)  # the SDPO learner ran, not GRPO's
    assert metrics["eval_rewards/odd_length/mean"] == metrics["eval_reward"]  # eval_strategy="steps": eval_dataset's


@pytest.mark.slow  # generator processes: about 9 s
def test_a_trl_async_grpo_script_trains_with_only_its_import_changed(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2,
                           per_device_train_batch_size=4, max_staleness=0, heartbeat_stale_after_s=120.0,
                           token_budget=2048, weight_sync_steps=1, num_threads=1, generator_threads=1,
                           eval_strategy="steps", eval_steps=1, eval_on_start=False, **FAST)
    # TRL's argument order: processing_class is the fifth
    trainer = AsyncGRPOTrainer("tiny", odd_length, args, ROWS, None, eval_dataset=ROWS[:2])
    result = trainer.train()

    assert result.steps == 1 and changed(result.model_dir)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["env"] == "AsyncGRPOTrainer.train_dataset"
    assert (config["heartbeat_timeout"], config["max_tokens_per_row"], config["tasks_per_step"]) == (120.0, 2048, 2)
    metrics = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["reward/mean"] == pytest.approx(metrics["reward_fn/odd_length_mean"])
    assert "async/staleness_mean" in metrics  # the AsyncGRPO learner ran
    assert metrics["eval_rewards/odd_length/mean"] == metrics["eval_reward"]  # eval_strategy="steps": eval_dataset's


@pytest.mark.parametrize("trainer", [GRPOTrainer, SDPOTrainer,
                                     pytest.param(AsyncGRPOTrainer, marks=pytest.mark.slow)])  # its processes: 9 s
def test_mask_truncated_completions_trains_on_no_episode_a_token_limit_cut(tmp_path, trainer):
    """TRL's mask_truncated_completions, in the three learners (they share GRPO's packing): FAST's 8-token
    replies are all cut at max_new_tokens, so neither the policy loss nor SDPO's distillation trains on anything
    and the weights stay as they were; the rewards and advantages are those of the run without it."""
    learner = {GRPOTrainer: dict(skip_zero_advantage=False), SDPOTrainer: dict(distillation_gate_margin=None),
               AsyncGRPOTrainer: dict(max_staleness=0, num_threads=1, generator_threads=1)}[trainer]
    runs = {}
    for mask in (True, False) if trainer is GRPOTrainer else (True,):
        args = trainer.config(output_dir=str(tmp_path / str(mask)), max_steps=1, num_generations=2,
                              per_device_train_batch_size=4, mask_truncated_completions=mask, **learner, **FAST)
        result = trainer(model="tiny", reward_funcs=odd_length, args=args, train_dataset=ROWS).train()
        assert result.steps == 1
        runs[mask] = json.loads((tmp_path / str(mask) / "metrics.jsonl").read_text().splitlines()[0])
        runs[mask]["changed"] = changed(result.model_dir)

    masked = runs[True]
    assert masked["train/masked_episodes_frac"] == masked["episode/length_limit_frac"] == 1.0
    assert masked["loss/policy"] == 0.0 and masked.get("loss/distill", 0.0) == 0.0 and not masked["changed"]
    if trainer is GRPOTrainer:
        plain = runs[False]
        assert "train/masked_episodes_frac" not in plain and plain["adv/abs_mean"] > 0 and plain["changed"]
        for key in ("reward/mean", "adv/mean", "adv/std", "adv/abs_mean"):
            assert masked[key] == plain[key], key


def test_trl_sdpo_options_without_a_counterpart_are_refused_by_name(tmp_path):
    def refused(match, **kwargs):
        with pytest.raises(TypeError, match=match):
            SDPOConfig(output_dir=str(tmp_path), **kwargs)

    refused("dont_reprompt_on_self_success other than True: an episode is never its own",
            dont_reprompt_on_self_success=False)
    refused("teacher_sync_steps other than 1: the EMA teacher .* after every step", teacher_sync_steps=4)
    refused("use_teacher_server other than False: .* never by a vLLM server", use_teacher_server=True)
    refused("diagnostics_warning_interval: SDPO's diagnostics", diagnostics_warning_interval=5)
    refused("teacher_model_kind and teacher name the same option", teacher_model_kind="ema", teacher="ema")
    with pytest.raises(ValueError, match="distillation_topk=None: .* drop it or give one"):  # TRL's default value
        SDPOConfig(output_dir=str(tmp_path), distillation_mode="sampled_token", distillation_alpha=1.0,
                   distillation_topk=None)
    assert SDPOConfig(output_dir=str(tmp_path), distillation_mode="full_logits").distillation_mode == "full"
    assert SDPOConfig(output_dir=str(tmp_path), use_teacher_server=False).teacher == "initial"
    assert SDPOConfig(output_dir=str(tmp_path), environment_feedback_only_without_solution=True,
                      include_environment_feedback=True).feedback_only_without_solution


def test_trl_async_grpo_options_without_a_counterpart_are_refused_by_name(tmp_path):
    def refused(match, **kwargs):
        with pytest.raises(TypeError, match=match):
            AsyncGRPOConfig(output_dir=str(tmp_path), **kwargs)

    for name in ("vllm_server_base_url", "vllm_server_timeout", "request_timeout", "weight_sync_timeout"):
        refused(f"no option {name}: there is no vLLM server to connect to", **{name: 1})
    refused("queue_maxsize: --buffer-size", queue_maxsize=64)
    refused("max_inflight_tasks: --max-concurrency", max_inflight_tasks=8)
    refused("fork_threshold_tokens: .* never re-tokenizes", fork_threshold_tokens=512)
    refused("weight_sync_steps other than 1", weight_sync_steps=2)
    refused("token_budget=0 turns token budgeting off", token_budget=0)
    refused("token_budget and max_tokens_per_row name the same option", token_budget=1024, max_tokens_per_row=1024)
    assert AsyncGRPOConfig(output_dir=str(tmp_path), token_budget=None).max_tokens_per_row == 4096  # treerl's default


def test_the_trainers_refuse_what_their_learner_cannot_take(tmp_path):
    rows = [{"prompt": "Hi"}]

    class Env:
        def reset(self, **row):
            return None

    for kwargs, match in ((dict(rollout_worker=object()), r"AsyncGRPOTrainer\(rollout_worker=...\) is not supported"),
                          (dict(weight_transfer=object()), r"weight_transfer=...\) is not supported"),
                          (dict(environment_factory=Env), "environment_factory=.*use treerl.GRPOTrainer"),
                          (dict(tools=[lambda x: x]), "cannot be pickled.* module level")):
        with pytest.raises(ValueError, match=match):
            AsyncGRPOTrainer("tiny", odd_length, AsyncGRPOConfig(output_dir=str(tmp_path)), rows, **kwargs)
    # Each trainer takes its own learner's config: another's would train another algorithm.
    for trainer, args in ((SDPOTrainer, GRPOConfig(output_dir=str(tmp_path))),
                          (GRPOTrainer, SDPOConfig(output_dir=str(tmp_path))),
                          (AsyncGRPOTrainer, GRPOConfig(output_dir=str(tmp_path)))):
        with pytest.raises(TypeError, match=f"{trainer.__name__}.args=.... takes a treerl.{trainer.config.__name__}"):
            trainer(model="tiny", reward_funcs=odd_length, args=args, train_dataset=rows)
    with pytest.raises(ValueError, match=r"SDPOTrainer\(quantization_config=...\) is not supported"):
        SDPOTrainer(model="tiny", reward_funcs=odd_length, train_dataset=rows, quantization_config=object())
    # TRL's default output directories.
    assert SDPOTrainer(model="tiny", reward_funcs=odd_length, train_dataset=rows).args.output_dir == "tiny-SDPO"
    assert AsyncGRPOTrainer("tiny", odd_length, train_dataset=rows).args.output_dir == "tiny-AsyncGRPO"


def test_sdpo_teacher_reads_a_rows_privileged_context_as_feedback_as_in_trl(tmp_path):
    rows = [{**row, "privileged_context": f"The answer is {row['answer']}."} for row in ROWS[:2]]
    args = SDPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2, per_device_train_batch_size=4,
                      include_environment_feedback=True, success_reward_threshold=2.0, **FAST)  # no demonstrations
    SDPOTrainer(model="tiny", reward_funcs=odd_length, args=args, train_dataset=rows).train()

    metrics = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["sdpo/feedback_available_frac"] == 1.0 and metrics["sdpo/demonstration_frac"] == 0.0


def test_a_flag_overrides_the_config_files_token_budget_and_back(tmp_path):
    """--config's rule, flags override the file, holds for AsyncGRPO's TRL token_budget as for max_steps:
    the file's token_budget under --max-tokens-per-row, and the file's max_tokens_per_row under --token-budget."""
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    def cfg(text, *flags):
        (tmp_path / "c.yaml").write_text(text)
        args = build_parser("async_grpo").parse_args(["learn", "--learner", "async_grpo", "--output-dir", "x",
                                                      "--config", str(tmp_path / "c.yaml"), *flags])
        return config_from_args(AsyncGRPOConfig, args)

    assert cfg("token_budget: 2048\n", "--max-tokens-per-row", "3072").max_tokens_per_row == 3072
    assert cfg("max_tokens_per_row: 2048\n", "--token-budget", "3072").max_tokens_per_row == 3072


@pytest.mark.slow  # a script run in a child process: about 7 s
def test_an_async_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    """TRL's AsyncGRPOTrainer example trains at the script's top level (its rollouts run in a thread); here the
    generators are spawned processes that import the script again, so that is refused before any starts, with
    the fix, rather than each generator dying of multiprocessing's bootstrapping error."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "from treerl import AsyncGRPOConfig, AsyncGRPOTrainer\n\n"
        "def reward_len(completions, **kwargs):\n"
        "    return [0.0 for completion in completions]\n\n"
        f"args = AsyncGRPOConfig(output_dir={str(tmp_path / 'out')!r}, max_steps=1, num_generations=2, "
        "per_device_train_batch_size=2, max_new_tokens=4, progress=False)\n"
        "AsyncGRPOTrainer('tiny', reward_len, args, [{'prompt': 'Hi'}]).train()\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert 'outside `if __name__ == "__main__":`' in run.stderr and "bootstrapping" not in run.stderr
    from treerl.learners.async_pool import unguarded_script

    assert unguarded_script() is None  # pytest's own entry point is guarded
