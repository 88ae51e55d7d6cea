"""A TRL ``GRPOConfig`` written out in full runs here: every field of TRL's at its default is taken (those of
transformers' ``TrainingArguments`` too), TRL's names of what treerl sets otherwise do what they say, and the
other values are refused with what to use instead."""

from __future__ import annotations

import dataclasses
import sys
import time
import types
import warnings

import pytest
import torch

from treerl import GRPOConfig
from treerl.learners.sdpo import SDPOConfig

# Every field of TRL 1.16's GRPOConfig at its default (output_dir aside), as a script or YAML file writes them out.
TRL_GRPO_DEFAULTS = {
    'per_device_train_batch_size': 8, 'num_train_epochs': 3.0, 'max_steps': -1, 'learning_rate': 1e-06,
    'lr_scheduler_type': 'linear', 'lr_scheduler_kwargs': None, 'warmup_steps': 0, 'optim': 'adamw_torch_fused',
    'optim_args': None, 'weight_decay': 0.0, 'adam_beta1': 0.9, 'adam_beta2': 0.999, 'adam_epsilon': 1e-08,
    'optim_target_modules': None, 'gradient_accumulation_steps': 1, 'average_tokens_across_devices': True,
    'max_grad_norm': 1.0, 'label_smoothing_factor': 0.0, 'bf16': None, 'fp16': False, 'bf16_full_eval': False,
    'fp16_full_eval': False, 'tf32': None, 'activation_checkpointing': None, 'activation_checkpointing_kwargs':
    None, 'gradient_checkpointing': True, 'gradient_checkpointing_kwargs': None, 'torch_compile': False,
    'torch_compile_backend': None, 'torch_compile_mode': None, 'use_liger_kernel': False, 'liger_kernel_config':
    None, 'use_cache': False, 'neftune_noise_alpha': None, 'torch_empty_cache_steps': None,
    'auto_find_batch_size': False, 'logging_strategy': 'steps', 'logging_steps': 10, 'logging_first_step': False,
    'log_on_each_node': True, 'logging_nan_inf_filter': True, 'include_num_input_tokens_seen': 'no', 'log_level':
    'passive', 'log_level_replica': 'warning', 'disable_tqdm': None, 'report_to': 'none', 'run_name': None,
    'project': 'huggingface', 'trackio_space_id': None, 'trackio_bucket_id': None, 'trackio_static_space_id':
    None, 'eval_strategy': 'no', 'eval_steps': None, 'eval_delay': 0, 'per_device_eval_batch_size': 8,
    'prediction_loss_only': False, 'eval_on_start': False, 'eval_do_concat_batches': True,
    'eval_use_gather_object': False, 'eval_accumulation_steps': None, 'include_for_metrics': [],
    'batch_eval_metrics': False, 'save_only_model': False, 'save_strategy': 'steps', 'save_steps': 500,
    'save_on_each_node': False, 'save_total_limit': None, 'enable_jit_checkpoint': False, 'push_to_hub': False,
    'hub_token': None, 'hub_private_repo': None, 'hub_model_id': None, 'hub_strategy': 'every_save',
    'hub_always_push': False, 'hub_revision': None, 'load_best_model_at_end': False, 'metric_for_best_model':
    None, 'greater_is_better': None, 'ignore_data_skip': False, 'restore_callback_states_from_checkpoint': False,
    'full_determinism': False, 'seed': 42, 'data_seed': None, 'use_cpu': False, 'accelerator_config': None,
    'parallelism_config': None, 'dataloader_drop_last': False, 'dataloader_num_workers': 0,
    'dataloader_pin_memory': True, 'dataloader_persistent_workers': False, 'dataloader_prefetch_factor': None,
    'dataloader_multiprocessing_context': None, 'dataloader_in_order': True, 'remove_unused_columns': False,
    'label_names': None, 'train_sampling_strategy': 'random', 'length_column_name': 'length',
    'ddp_find_unused_parameters': None, 'ddp_bucket_cap_mb': None, 'ddp_broadcast_buffers': None,
    'ddp_static_graph': None, 'ddp_backend': None, 'ddp_timeout': 1800, 'fsdp': None, 'fsdp_config': None,
    'deepspeed': None, 'debug': '', 'skip_memory_metrics': True, 'do_train': False, 'do_eval': False,
    'do_predict': False, 'resume_from_checkpoint': None, 'local_rank': -1, 'model_init_kwargs': None,
    'trust_remote_code': False, 'router_aux_loss_coef': None, 'disable_dropout': False, 'cast_lm_head_to_fp32':
    False, 'num_generations': 8, 'num_generations_eval': None, 'max_completion_length': 512,
    'ds3_gather_for_generation': True, 'shuffle_dataset': True, 'pad_to_multiple_of': 'auto',
    'generation_batch_size': None, 'steps_per_generation': None, 'temperature': 1.0, 'top_p': 1.0, 'top_k': 0,
    'min_p': None, 'generation_kwargs': None, 'chat_template_kwargs': None, 'repetition_penalty': 1.0,
    'cache_implementation': None, 'use_vllm': False, 'vllm_mode': 'colocate', 'vllm_model_impl': 'vllm',
    'vllm_enable_sleep_mode': False, 'vllm_structured_outputs_regex': None, 'vllm_server_base_url': None,
    'vllm_server_host': '0.0.0.0', 'vllm_server_port': 8000, 'vllm_server_timeout': 240.0, 'vllm_group_port':
    51216, 'vllm_gpu_memory_utilization': 0.3, 'vllm_max_model_length': None, 'vllm_tensor_parallel_size': 1,
    'beta': 0.0, 'num_iterations': 1, 'epsilon': 0.2, 'delta': None, 'epsilon_high': None, 'sapo_temperature_neg':
    1.05, 'sapo_temperature_pos': 1.0, 'vespo_k_pos': 2.0, 'vespo_lambda_pos': 3.0, 'vespo_k_neg': 3.0,
    'vespo_lambda_neg': 2.0, 'importance_sampling_level': 'token', 'reward_weights': None,
    'multi_objective_aggregation': 'sum_then_normalize', 'scale_rewards': 'group', 'loss_type': 'dapo',
    'mask_truncated_completions': False, 'sync_ref_model': False, 'ref_model_mixup_alpha': 0.6,
    'ref_model_sync_steps': 512, 'top_entropy_quantile': 1.0, 'entropy_coef': 0.0, 'use_adaptive_entropy': False,
    'entropy_coef_min': 0.0, 'entropy_coef_max': 1.0, 'entropy_coef_delta': 0.005, 'entropy_target': 0.2,
    'max_tool_calling_iterations': None, 'vllm_importance_sampling_correction': True,
    'vllm_importance_sampling_mode': 'sequence_mask', 'vllm_importance_sampling_clip_max': 3.0,
    'vllm_importance_sampling_clip_min': None, 'off_policy_mask_threshold': None, 'use_bias_correction_kl': True,
    'log_completions': False, 'log_multimodal': True, 'num_completions_to_print': None, 'log_unique_prompts':
    False, 'log_completions_hub_repo': None, 'use_transformers_continuous_batching': False,
    'transformers_continuous_batching_config': None, 'use_transformers_paged': False,
    'vllm_importance_sampling_cap': None
}

def make(cls=GRPOConfig, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notes of TRL's options that change nothing (logging_steps, ...)
        return cls(output_dir="out", **kwargs)


@pytest.mark.parametrize("name", sorted(TRL_GRPO_DEFAULTS))
def test_each_trl_field_at_its_default_is_taken(name):
    make(**{name: TRL_GRPO_DEFAULTS[name]})


@pytest.mark.parametrize("cls", [GRPOConfig, SDPOConfig])
def test_a_trl_config_written_out_in_full_is_taken(cls, tmp_path):
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    cfg = make(cls, **TRL_GRPO_DEFAULTS)
    assert (cfg.tasks_per_step, cfg.group_size, cfg.save_every) == (1, 8, 500)  # TRL's batch of 8, one group
    assert (cfg.device, cfg.progress, cfg.resume, cfg.vllm_server_url, cfg.vllm_kwargs) == (
        "cpu", True, False, "http://127.0.0.1:8000", {})  # treerl's defaults, which TRL's mean here
    assert cfg.gradient_checkpointing and cfg.project == "huggingface" and cfg.tf32 is None
    assert cfg.is_ratio_high == 3.0  # vllm_importance_sampling_cap=None is TRL's unset, not "no bound"

    import yaml

    (tmp_path / "trl.yaml").write_text(yaml.safe_dump(TRL_GRPO_DEFAULTS))
    learner = {GRPOConfig: "grpo", SDPOConfig: "sdpo"}[cls]
    args = build_parser(learner).parse_args(["learn", "--learner", learner, "--output-dir", "out",
                                             "--config", str(tmp_path / "trl.yaml")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert config_from_args(cls, args) == cfg


def test_against_installed_trl_every_field_at_its_default_is_taken():
    trl = pytest.importorskip("trl")
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(trl.GRPOConfig) if f.name != "output_dir"}
    refused = {}
    for name, value in defaults.items():
        try:
            make(**{name: value})
        except (TypeError, ValueError) as exc:
            refused[name] = str(exc)
    assert not refused
    make(**defaults)


def test_trls_names_of_treerl_settings_set_them():
    assert make(use_cpu=True).device == "cpu" and make(use_cpu=False, device="cuda:1").device == "cuda:1"
    assert make(disable_tqdm=True).progress is False and make(disable_tqdm=False).progress is True
    assert make(activation_checkpointing=True).gradient_checkpointing is True  # transformers 5's name
    assert make(vllm_server_timeout=240).vllm_server_wait_s == 240
    assert make(vllm_server_port=9000).vllm_server_url == "http://0.0.0.0:9000"  # TRL's host default
    assert make(vllm_server_host="10.0.0.2").vllm_server_url == "http://10.0.0.2:8000"
    assert make(vllm_server_host="h", vllm_server_url="http://u:1").vllm_server_url == "http://u:1"  # TRL: URL wins
    cfg = make(vllm_max_model_length=512, vllm_model_impl="transformers", vllm_kwargs={"enforce_eager": True})
    assert cfg.vllm_kwargs == {"enforce_eager": True, "max_model_len": 512, "model_impl": "transformers"}
    from treerl.learners.vllm_colocate import vllm_engine_kwargs

    engine = vllm_engine_kwargs(cfg, torch.bfloat16, max_positions=1024)
    assert engine["max_model_len"] == 512 and engine["model_impl"] == "transformers"
    for kwargs, message in (({"use_cpu": True, "device": "cuda"}, "use_cpu and device set the same thing"),
                            ({"disable_tqdm": True, "progress": True}, "disable_tqdm and progress"),
                            ({"vllm_max_model_length": 512, "vllm_kwargs": {"max_model_len": 256}}, "max_model_len"),
                            ({"activation_checkpointing": True, "gradient_checkpointing": False}, "keep one")):
        with pytest.raises(TypeError, match=message):
            make(**kwargs)


def test_resume_from_checkpoint_resumes_from_the_latest_only(tmp_path):
    out = tmp_path / "run"
    assert GRPOConfig(output_dir=str(out), resume_from_checkpoint=True).resume is True
    assert GRPOConfig(output_dir=str(out)).resume_from_checkpoint is None  # what open-r1's script reads
    for step in (2, 4):
        (out / "checkpoints" / f"step-{step}").mkdir(parents=True)
    cfg = GRPOConfig(output_dir=str(out), resume_from_checkpoint=str(out / "checkpoints" / "step-4"))
    assert cfg.resume is True and cfg.resume_from_checkpoint is True
    with pytest.raises(ValueError, match="resumes from the latest checkpoint in its output_dir .*step-4"):
        GRPOConfig(output_dir=str(out), resume_from_checkpoint=str(out / "checkpoints" / "step-2"))


def test_tf32_sets_torchs_cuda_matmuls_and_leaves_the_cpu_alone(monkeypatch):
    from treerl.learners.precision import set_tf32

    before = torch.backends.fp32_precision
    try:
        set_tf32(True, "cpu")
        assert torch.backends.fp32_precision == before
        set_tf32(True, "cuda:0")  # a flag: it can be set without a GPU
        assert torch.backends.cuda.matmul.fp32_precision == "tf32" and torch.backends.cudnn.conv.fp32_precision == "tf32"
        set_tf32(False, torch.device("cuda"))
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        set_tf32(None, "cuda")
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.fp32_precision = before


def test_refused_trl_options_say_what_to_do():
    for kwargs, hint in (({"torch_compile": True}, "runs uncompiled"),
                         ({"ddp_backend": "nccl"}, "accelerate launch or torchrun"),
                         ({"fsdp": "full_shard"}, "no FSDP or DeepSpeed"),
                         ({"vllm_tensor_parallel_size": 2}, "--vllm-mode server"),
                         ({"use_transformers_paged": True}, "--continuous-batching"),
                         ({"activation_checkpointing_kwargs": {"every_n_layers": 2}}, "takes no other options")):
        with pytest.raises(TypeError, match=f"has no option {next(iter(kwargs))}: .*{hint}"):
            make(**kwargs)


def test_an_unknown_keyword_gets_did_you_mean_as_on_the_command_line():
    with pytest.raises(TypeError, match=r"^GRPOConfig\(\) has no option lerning_rate: did you mean learning_rate\?$"):
        GRPOConfig(output_dir="x", lerning_rate=1e-5)
    with pytest.raises(TypeError, match=r"^GRPOConfig\(\) has no option zzzq\.$"):
        GRPOConfig(output_dir="x", zzzq=1)


def test_the_vllm_server_is_waited_for_as_long_as_vllm_server_timeout_says():
    import socket

    from treerl.agents.vllm_server_policy import VLLMServerError, VLLMServerPolicy

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    for wait_s, at_least in ((0.0, 0.0), (1.5, 1.5)):
        started = time.monotonic()
        with pytest.raises(VLLMServerError, match="no vLLM server answers there"):
            VLLMServerPolicy(url, "m", weights_dir=".", timeout_s=1.0, wait_s=wait_s)
        assert at_least <= time.monotonic() - started < at_least + 1.0


def test_a_trl_script_with_hub_revision_project_and_tf32_trains_and_pushes_to_the_branch(tmp_path, monkeypatch):
    from _helpers import FakeHub

    import treerl.learners.core as core
    from treerl import GRPOTrainer

    hub = FakeHub(owner="me").install(monkeypatch)
    inits = []
    trackio = types.SimpleNamespace(init=lambda **kwargs: inits.append(kwargs), log=lambda *a, **k: None,
                                    finish=lambda: None)
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    tf32 = []
    monkeypatch.setattr(core, "set_tf32", lambda value, device: tf32.append((value, str(device))))
    options = {**TRL_GRPO_DEFAULTS, "max_steps": 1, "num_generations": 2, "per_device_train_batch_size": 2,
               "max_completion_length": 8, "gradient_checkpointing": False, "eval_strategy": "no",
               "push_to_hub": True, "hub_model_id": "me/calc", "hub_revision": "dev", "hub_strategy": "end",
               "report_to": ["trackio"], "project": "calc", "tf32": True, "use_cpu": True, "disable_tqdm": True,
               "optim": "adamw_torch", "learning_rate": 1e-4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = GRPOConfig(output_dir=str(tmp_path / "out"), sample_groups=0, **options)
    trainer = GRPOTrainer(model="tiny", reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=[{"prompt": "1 + 1?"}, {"prompt": "2 + 2?"}])
    trainer.train()
    assert hub.branches == [("me/calc", "dev")]
    assert [(u["message"], u["revision"]) for u in hub.uploads] == [("End of training, step 1", "dev")]
    assert inits[0]["project"] == "calc" and tf32 == [(True, "cpu")]
    trainer.push_to_hub()  # TRL's push_to_hub: args.hub_revision too, as transformers' Trainer
    assert hub.uploads[-1]["revision"] == "dev" and hub.branches[-1] == ("me/calc", "dev")


def test_a_config_as_transformers_writes_it_out_with_both_checkpointing_names_is_taken():
    # transformers 5 mirrors gradient_checkpointing into activation_checkpointing (its new name) in __post_init__,
    # so TrainingArguments.to_dict() and every YAML dumped from it hold both, at one value.
    for value in (True, False):
        cfg = make(activation_checkpointing=value, gradient_checkpointing=value)
        assert cfg.gradient_checkpointing is value
    with pytest.raises(TypeError, match="activation_checkpointing and gradient_checkpointing set the same thing"):
        make(activation_checkpointing=True, gradient_checkpointing=False)
    trl = pytest.importorskip("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dumped = trl.GRPOConfig(output_dir="out", report_to="none", use_cpu=True, bf16=False).to_dict()
    assert dumped["activation_checkpointing"] is dumped["gradient_checkpointing"] is True
    assert make(**{k: dumped[k] for k in ("activation_checkpointing", "gradient_checkpointing")}).gradient_checkpointing


@pytest.mark.parametrize("in_file, flags, expected", [
    ("disable_tqdm: false\n", ["--progress", "false"], {"progress": False}),
    ("use_cpu: true\n", ["--device", "cuda:1"], {"device": "cuda:1"}),
    ("resume_from_checkpoint: false\n", ["--resume"], {"resume": True}),
    ("activation_checkpointing: true\n", ["--gradient-checkpointing", "false"], {"gradient_checkpointing": False}),
    ("vllm_server_base_url: http://a:1\n", ["--vllm-server-host", "b"], {"vllm_server_url": "http://b:8000"}),
    ("progress: false\n", ["--disable-tqdm", "false"], {"progress": True}),
    ("vllm_server_host: a\n", ["--vllm-server-port", "9"], {"vllm_server_url": "http://a:9"}),  # TRL's pair combines
])
def test_a_flag_overrides_the_trl_name_of_its_option_in_the_config_file(in_file, flags, expected, tmp_path):
    from treerl.cli import build_parser
    from treerl.config import config_from_args

    (tmp_path / "trl.yaml").write_text(in_file)
    args = build_parser("grpo").parse_args(["learn", "--output-dir", str(tmp_path / "out"),
                                            "--config", str(tmp_path / "trl.yaml"), *flags])
    cfg = config_from_args(GRPOConfig, args)
    assert {k: getattr(cfg, k) for k in expected} == expected


def test_async_grpo_refuses_a_vllm_server_address_as_it_refuses_its_url():
    from treerl import AsyncGRPOConfig

    make(AsyncGRPOConfig, vllm_server_host="0.0.0.0", vllm_server_port=8000)  # TRL's defaults: nothing to refuse
    for kwargs in ({"vllm_server_host": "10.0.0.2"}, {"vllm_server_port": 9000},
                   {"vllm_server_base_url": "http://10.0.0.2:8000"}):
        with pytest.raises(TypeError, match=f"has no option {next(iter(kwargs))}: there is no vLLM server"):
            make(AsyncGRPOConfig, **kwargs)
