"""Bad command lines end in one line that names the field and the fix (exit status 2), never a traceback.

Each row runs ``treerl.cli.main`` in process on a command line a user could type (with a
YAML ``--config`` where the issue came from a file) and checks the message. Rows that
reach the model loader fail before any weights are read.
"""

from __future__ import annotations

import importlib.util

import json
import shutil
from pathlib import Path

import pytest
import torch

from treerl.cli import main
from treerl.config import config_from_args
from treerl.learners.grpo import GRPOConfig
from treerl.models import DEFAULT_MODEL_PATH
from treerl.rollout.trajectory import Group, GroupWriter, make_header

LEARN = ["learn", "--output-dir", "{out}"]
ROLLOUT = ["rollout", "--out", "{tmp}/r.jsonl"]

# (id, command line, YAML for --config or None, what the one-line message must say)
CASES = [
    ("learning-rate-nan", [*LEARN, "--learning-rate", "nan"], None, "learning_rate=nan: expected a finite number"),
    ("max-episode-seconds-nan", [*LEARN, "--max-episode-seconds", "nan"], None, "max_episode_seconds=nan"),
    ("temperature-inf", ["eval", "--temperature", "inf"], None, "temperature=inf: expected a finite number"),
    ("device-bogus", [*LEARN, "--device", "bogus"], None, "device='bogus' is not a torch device"),
    ("device-bogus-eval", ["eval", "--device", "bogus"], None, "is not a torch device"),
    ("attention-impl-bogus", [*LEARN, "--attention-impl", "bogus"], None, "attention_impl='bogus'"),
    ("attention-impl-flex-on-cpu", [*LEARN, "--attention-impl", "flex", "--device", "cpu", "--eval-episodes", "0"],
     None, "attention_impl='flex' cannot train on cpu: FlexAttention has no backward pass on cpu"),
    ("output-dir-is-a-file", ["learn", "--output-dir", "{file}"], None, "cannot create a directory there"),
    ("yaml-seed-abc", LEARN, "seed: abc\n", "seed='abc': expected a whole number"),
    ("yaml-group-size-2.5", LEARN, "group_size: 2.5\n", "group_size=2.5: expected a whole number"),
    ("yaml-resume-maybe", LEARN, "resume: maybe\n", "resume='maybe': expected true or false"),
    ("yaml-alias-and-field", LEARN, "num_generations: 4\ngroup_size: 8\n",
     "num_generations and group_size name the same option; keep one"),
    ("steps-per-generation-not-a-multiple", [*LEARN, "--gradient-accumulation-steps", "2", "--steps-per-generation",
                                             "3"], None,
     "steps_per_generation=3 is not a multiple of gradient_accumulation_steps=2"),
    ("num-minibatches-not-a-divisor", [*LEARN, "--num-minibatches", "3"], None,
     "num_minibatches=3 must be a whole number >= 1 that divides tasks_per_step x group_size = 64"),
    ("yaml-generation-batch-size-and-steps", LEARN, "generation_batch_size: 16\nsteps_per_generation: 2\n",
     "generation_batch_size and steps_per_generation set the same thing"),
    ("yaml-progress-maybe", LEARN, "progress: maybe\n", "progress='maybe': expected true or false"),
    ("yaml-pack-mode-no", LEARN, "pack_mode: no\n", "pack_mode=False: expected text"),
    ("yaml-learning-rate-nan", LEARN, "learning_rate: .nan\n", "learning_rate=nan"),
    ("yaml-env-kwargs-list", LEARN, "env_kwargs: [1, 2]\n", "env_kwargs=[1, 2]: expected a mapping"),
    ("yaml-env-kwargs-unknown", LEARN, "env: treerl/Calculator-v0\nenv_kwargs: {bogus: 1}\n",
     "env_kwargs in --config "),
    ("yaml-eval-env-kwargs-unknown", LEARN, "env: treerl/Calculator-v0\neval_env_kwargs: {bogus: 1}\n",
     "eval_env_kwargs in --config "),
    ("env-kwargs-unknown", [*LEARN, "--env", "treerl/Calculator-v0", "--env-kwargs", '{{"bogus": 1}}'], None,
     'treerl: --env-kwargs '),
    ("yaml-unknown-key", LEARN, "learning_rat: 0.1\n", "unknown option(s) ['learning_rat']"),
    ("yaml-trl-torch-compile", LEARN, "torch_compile: true\n",
     "(torch_compile: not supported: the model runs uncompiled, with treerl's tree attention (--attention-impl))"),
    ("yaml-trl-resume-from-an-earlier-checkpoint", LEARN, "resume_from_checkpoint: out/checkpoint-500\n",
     "resume_from_checkpoint='out/checkpoint-500': a run resumes from the latest checkpoint in its output_dir"),
    ("yaml-not-a-mapping", LEARN, "- 1\n- 2\n", "expected a mapping of option: value"),
    ("yaml-invalid", LEARN, "a: [1\n", "not valid YAML"),
    ("config-missing", [*LEARN, "--config", "{tmp}/none.yaml"], None, "no such file"),
    ("model-without-chat-template", [*LEARN, "--model", "{no_template}"], None, "has no chat template"),
    ("model-not-a-dir", [*LEARN, "--model", "{tmp}/nothing"], None, "is not a directory"),
    ("model-broken", [*LEARN, "--model", "{broken}"], None, "could not load a causal LM"),
    ("multi-objective-aggregation-bogus", [*LEARN, "--multi-objective-aggregation", "max"], None,
     "multi_objective_aggregation='max': use sum_then_normalize or normalize_then_sum"),
    ("normalize-then-sum-rloo", [*LEARN, "--multi-objective-aggregation", "normalize_then_sum",
                                 "--advantage-estimator", "rloo"], None,
     "advantage_estimator='rloo': multi_objective_aggregation='normalize_then_sum' centres each reward"),
    ("model-is-a-lora-adapter", ["eval", "--model", "{adapter}"], None, "is a LoRA adapter, not a whole model: pass "
     "the merged model (treerl learn saved it merged beside it: --model"),
    ("model-is-a-learn-output-dir", ["eval", "--model", "{lora_run}"], None, "is the output directory of treerl "
     "learn, not a model: its trained model is in"),
    ("model-is-a-checkpoint", ["eval", "--model", "{checkpoint}"], None, "is a checkpoint of treerl learn (what "
     "--resume continues from), not a transformers model: the run writes its trained model at its end to"),
    ("env-unknown", [*LEARN, "--env", "nope/Nothing-v0"], None, "nope/Nothing-v0"),
    ("env-group-member-unknown", [*LEARN, "--env", "treerl/Calculator-v0,nope/Nothing-v0"], None, "nope/Nothing-v0"),
    ("env-group-kwargs-not-by-name", [*ROLLOUT, "--env", "treerl/Calculator-v0,guess=treerl/GuessNumber-v0",
                                      "--env-kwargs", '{{"high": 8}}'], None, "'high' names no environment of the group"),
    ("env-group-member-kwargs-bad", [*ROLLOUT, "--env", "treerl/Calculator-v0,guess=treerl/GuessNumber-v0",
                                     "--env-kwargs", '{{"guess": {{"high": 1}}}}'], None, "high=1 must be >= 2"),
    ("yaml-env-group-weights-bad", ROLLOUT, "env: treerl/Calculator-v0,treerl/GuessNumber-v0\n"
     "env_kwargs: {weights: [1]}\n", "has 1 numbers for 2 environments"),
    ("learner-unknown", [*LEARN, "--learner", "bogus"], None, "no such learner"),
    ("loss-unknown", [*LEARN, "--loss", "bogus"], None, "bogus"),
    ("steps-0", [*LEARN, "--steps", "0"], None, "steps=0 must be >= 1"),
    ("group-size-negative", [*LEARN, "--group-size", "-1"], None, "group_size=-1 must be >= 1"),
    ("temperature-0", [*LEARN, "--temperature", "0"], None, "temperature=0"),
    ("top-entropy-quantile-above-1", [*LEARN, "--top-entropy-quantile", "1.5"], None,
     "top_entropy_quantile=1.5 must be in [0, 1]"),
    ("top-p-without-top-k", [*LEARN, "--top-p", "0.9"], None, "needs top_k"),
    ("repetition-penalty-0", [*LEARN, "--repetition-penalty", "0"], None,
     "repetition_penalty=0.0 must be a finite number > 0"),
    ("yaml-repetition-penalty-negative", ROLLOUT, "repetition_penalty: -1.1\n", "repetition_penalty=-1.1 must be"),
    ("report-to-unknown", [*LEARN, "--report-to", "mlflow"], None, "report_to='mlflow'"),
    ("eval-episodes-negative", [*LEARN, "--eval-episodes", "-1"], None,
     "eval_episodes, eval_every and save_every must be >= 0"),
    ("save-strategy-best", [*LEARN, "--save-strategy", "best"], None,
     "save_strategy='best' saves after each evaluation that improves on metric_for_best_model, which is unset"),
    ("save-strategy-epoch-without-rows", [*LEARN, "--save-strategy", "epoch", "--eval-episodes", "0"], None,
     "save_strategy='epoch' acts at the end of each pass over a training dataset, but treerl/Calculator-v0 "
     "generates its tasks"),
    ("yaml-save-strategy-no-and-save-every", LEARN, "save_strategy: 'no'\nsave_every: 2\n",
     "save_strategy='no' and save_every set the same thing; keep one"),
    ("num-generations-eval-0", [*LEARN, "--num-generations-eval", "0"], None, "num_generations_eval=0 must be >= 1"),
    ("yaml-num-generations-eval-negative", LEARN, "num_generations_eval: -2\n", "num_generations_eval=-2 must be >= 1"),
    ("sync-ref-model-without-beta", [*LEARN, "--sync-ref-model", "true"], None,
     "sync_ref_model=True with beta=0: the KL term is off"),
    ("sync-ref-model-with-lora", [*LEARN, "--sync-ref-model", "true", "--beta", "0.1", "--lora-r", "4"], None,
     "sync_ref_model=True with LoRA (lora_r=4)"),
    ("adaptive-entropy-min-above-max", [*LEARN, "--use-adaptive-entropy", "--entropy-coef-min", "0.5",
                                        "--entropy-coef-max", "0.1"], None,
     "entropy_coef_min=0.5, entropy_coef_max=0.1: the adaptive entropy coefficient stays in [min, max]"),
    ("yaml-adaptive-entropy-negative-delta", LEARN, "use_adaptive_entropy: true\nentropy_coef_delta: -0.01\n",
     "entropy_coef_delta=-0.01 must be a finite number >= 0"),
    ("import-missing", [*LEARN, "--import", "{tmp}/none.py"], None, "no such file"),
    ("no-output-dir", ["learn"], None, "output_dir is required"),
    ("rollout-no-out", ["rollout"], None, "--out is required"),
    ("from-server-unreachable", [*LEARN, "--from-server", "http://127.0.0.1:9", "--eval-episodes", "0"], None,
     "cannot reach the server"),
    ("rollout-out-is-a-dir", ["rollout", "--out", "{tmp}"], None, "cannot write there"),
    ("rollout-out-under-a-file", ["rollout", "--out", "{file}/r.jsonl"], None, "cannot write there"),
    ("rollout-num-tasks-0", [*ROLLOUT, "--num-tasks", "0"], None, "--num-tasks=0 must be >= 1"),
    ("rollout-corrupt-line", ["rollout", "--out", "{corrupt}"], None, ":2: not a valid trajectory line"),
    ("rollout-other-env", ["rollout", "--out", "{other_env}", "--env", "treerl/Calculator-v0"], None,
     "holds trajectories of another setup (env_id: file has 'treerl/GuessNumber-v0'"),
    ("rollout-old-file-other-env", ["rollout", "--out", "{old_other_env}"], None,
     "holds trajectories of 'treerl/GuessNumber-v0', not 'treerl/Calculator-v0'"),
    ("rollout-not-a-trajectory-file", ["rollout", "--out", "{readme}", "--repair"], None,
     "is not a treerl trajectory file"),
    ("rollout-foreign-file", ["rollout", "--out", "{readme}"], None,  # --repair would not help: no advice to pass it
     "is not a treerl trajectory file (no line of it is a trajectory group); pass another --out."),
    ("eval-num-episodes-0", ["eval", "--num-episodes", "0"], None, "num_episodes=0 must be >= 1"),
    ("envs-import-missing", ["envs", "--import", "{tmp}/none.py"], None, "no such file"),
]
# Malformed values argparse itself refuses: usage and one error line, exit status 2.
ARGPARSE_CASES = [
    ("seed-abc", [*LEARN, "--seed", "abc"], "argument --seed: invalid int value: 'abc'"),
    ("unknown-flag", [*LEARN, "--learnin-rate", "0.1"], "unrecognized arguments: --learnin-rate"),
    ("trl-ddp-backend", [*LEARN, "--ddp-backend", "nccl"], "--ddp-backend: processes come from accelerate launch"),
    ("env-kwargs-not-json", [*LEARN, "--env-kwargs", "[1"], "argument --env-kwargs"),
    ("resume-maybe", [*LEARN, "--resume", "maybe"], "argument --resume: expected true or false"),
    ("no-command", [], "the following arguments are required: COMMAND"),
]
if torch.cuda.is_available():
    CUDA_CASES = []
else:
    CUDA_CASES = [("device-cuda-on-cpu", [*LEARN, "--device", "cuda"], None, "sees no CUDA GPU on this machine"),
                  ("device-cuda-on-cpu-rollout", [*ROLLOUT, "--device", "cuda"], None, "sees no CUDA GPU")]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "a_file").write_text("not a directory\n")
    no_template = tmp / "no_template"
    shutil.copytree(DEFAULT_MODEL_PATH, no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (no_template / extra).unlink(missing_ok=True)
    broken = tmp / "broken"
    shutil.copytree(DEFAULT_MODEL_PATH, broken)
    (broken / "config.json").write_text("{not json")
    corrupt = tmp / "corrupt.jsonl"
    with GroupWriter(corrupt) as writer:
        for key in ("seed-0", "seed-1"):
            group = Group(task_key=key, env_id="treerl/Calculator-v0")
            group.add_episode(leaf=group.add_segment("prompt", [1, 2]), reward=0.0)
            writer.write(group)
    lines = corrupt.read_text().splitlines(keepends=True)
    corrupt.write_text(lines[0] + '{"schema_version": 1, "task_k\n' + lines[1])
    other = tmp / "other.jsonl"
    GroupWriter(other, header=make_header({"env_id": "treerl/GuessNumber-v0"})).close()
    old_other = tmp / "old_other.jsonl"
    with GroupWriter(old_other) as writer:
        group = Group(task_key="seed-0", env_id="treerl/GuessNumber-v0")
        group.add_episode(leaf=group.add_segment("prompt", [1]), reward=0.0)
        writer.write(group)
    (tmp / "README.md").write_text("# notes\n\nnot trajectories\n")
    run = tmp / "lora_run"  # what `treerl learn --lora-r` leaves: adapter/ and the merged model/
    shutil.copytree(DEFAULT_MODEL_PATH, run / "model")
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (run / "config.json").write_text(json.dumps({"learner": "grpo", "lora_r": 4}))  # the run's options, not a model's
    (run / "metrics.jsonl").write_text("")
    checkpoint = run / "checkpoints" / "step-2"  # a checkpoint: weights and training state, no config or tokenizer
    checkpoint.mkdir(parents=True)
    shutil.copy(DEFAULT_MODEL_PATH / "model.safetensors", checkpoint / "model.safetensors")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 2, "policy_version": 2, "next_task": 4}))
    return {"tmp": str(tmp), "out": str(tmp / "run"), "file": str(tmp / "a_file"), "no_template": str(no_template),
            "broken": str(broken), "corrupt": str(corrupt), "other_env": str(other), "old_other_env": str(old_other),
            "readme": str(tmp / "README.md"), "adapter": str(run / "adapter"),
            "lora_run": str(run), "checkpoint": str(checkpoint)}


def _run(argv: list[str], paths: dict[str, str], capsys) -> tuple[int, str]:
    try:
        code = main([a.format(**paths) for a in argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.err


# Where vLLM is not installed (CI, any CPU machine), asking for it is a setting that cannot work.
NO_VLLM_CASES = [] if importlib.util.find_spec("vllm") else [
    ("vllm-not-installed", [*LEARN, "--use-vllm", "true", "--eval-episodes", "0"], None, "pip install 'treerl[vllm]'"),
    ("async-vllm-generators-not-installed", [*LEARN, "--learner", "async_grpo", "--generator-policy", "vllm"], None,
     "pip install 'treerl[vllm]'"),
]
# A tracker that is not installed is said before the model loads (one line: no "precision: ..." of a loaded model).
NO_TRACKER_CASES = [
    (f"report-to-{name}-not-installed{'-async' if learner else ''}", [*LEARN, *learner, "--report-to", name], None, f"pip install {name}")
    for name, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")) if not importlib.util.find_spec(module)
    for learner in ([], ["--learner", "async_grpo"])
]
ALL_CASES = CASES + CUDA_CASES + NO_VLLM_CASES + NO_TRACKER_CASES


@pytest.mark.parametrize("case", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_bad_command_line_gives_one_line(case, paths, capsys, tmp_path):
    _, argv, yaml_text, expected = case
    if yaml_text is not None:
        config = tmp_path / "config.yaml"
        config.write_text(yaml_text)
        argv = [*argv, "--config", str(config)]
    code, err = _run(argv, paths, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treerl: "), err
    assert expected in lines[0], err


@pytest.mark.parametrize("case", ARGPARSE_CASES, ids=[c[0] for c in ARGPARSE_CASES])
def test_malformed_flag_gives_usage_and_one_error(case, paths, capsys):
    _, argv, expected = case
    code, err = _run(argv, paths, capsys)
    assert code == 2 and "Traceback" not in err
    assert expected in err.strip().splitlines()[-1], err


def test_yaml_quirks_are_read_as_meant(tmp_path):
    """YAML reads 1e-4 as a string and 'no' quoted as a string: both mean what the user wrote."""
    config = tmp_path / "c.yaml"
    config.write_text("learning_rate: 1e-4\nskip_zero_advantage: 'no'\nresume: yes\ngroup_size: 4.0\ntop_k: null\n")
    from argparse import Namespace

    cfg = config_from_args(GRPOConfig, Namespace(__config__=str(config), output_dir=str(tmp_path / "run")))
    assert cfg.learning_rate == 1e-4 and isinstance(cfg.learning_rate, float)
    assert cfg.skip_zero_advantage is False and cfg.resume is True
    assert cfg.group_size == 4 and isinstance(cfg.group_size, int) and cfg.top_k is None


def test_ctrl_c_in_learn_says_how_to_resume(tmp_path, monkeypatch, capsys):
    """Ctrl-C ends with exit status 130 and one line naming the checkpoint to resume from, not a traceback."""
    from treerl.learners import LEARNERS
    from treerl.learners.checkpoints import checkpoint_path

    out = tmp_path / "run"

    def interrupted(cfg):
        raise KeyboardInterrupt

    import dataclasses

    monkeypatch.setitem(LEARNERS, "grpo", dataclasses.replace(LEARNERS["grpo"], train=interrupted))
    assert main(["learn", "--output-dir", str(out)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no checkpoint yet" in err and "--save-every" in err, err
    checkpoint_path(out, 4).mkdir(parents=True)
    assert main(["learn", "--output-dir", str(out)]) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("treerl: interrupted") and "--resume true" in err and "step-4" in err, err


def test_async_generators_leave_ctrl_c_to_the_trainer(monkeypatch):
    """Ctrl-C reaches every process of the group: a generator ignores it (the trainer stops it), rather
    than dying with a traceback and being restarted by the supervisor."""
    import signal
    import types

    from treerl.learners import async_generator

    class Stop(Exception):
        pass

    def core(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(async_generator, "GeneratorCore", core)
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(Stop):
            async_generator.generator_main(types.SimpleNamespace(imports=()), 0, None)  # no user modules
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the signal disposition from /proc")
def test_async_generators_ignore_ctrl_c_from_their_first_instruction(tmp_path):
    """A spawned generator imports torch and treerl for seconds before generator_main runs: Ctrl-C in that
    window killed it with a KeyboardInterrupt traceback from inside the import. It starts with SIGINT ignored."""
    import signal

    from treerl.learners.async_generator import GeneratorSpec
    from treerl.learners.async_grpo import AsyncGRPOConfig
    from treerl.learners.async_pool import ProcessPool

    pool = ProcessPool(GeneratorSpec(cfg=AsyncGRPOConfig(output_dir=str(tmp_path)), max_staleness=0),
                       num_generators=1, heartbeat_timeout=60.0)
    before = signal.getsignal(signal.SIGINT)
    pool.launch()
    try:
        (pid,) = pool.pids.values()
        ignored = next(int(line.split()[1], 16) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("SigIgn:"))
        assert ignored & (1 << (signal.SIGINT - 1)), "the generator must ignore SIGINT while it still imports"
        assert signal.getsignal(signal.SIGINT) == before, "the trainer keeps its own Ctrl-C"
    finally:
        pool.kill(0)
        pool.close()


def test_output_piped_into_a_reader_that_stops_early_ends_quietly():
    """`treerl compare ... | head`: the closed pipe ends the command without a BrokenPipeError traceback."""
    import subprocess
    import sys

    code = ("import sys, treerl.cli as cli\n"
            "cli.cmd_envs = lambda args: print('x' * 10_000_000)\n"
            "sys.exit(cli.main(['envs']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()  # as `head` does once it has its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err
