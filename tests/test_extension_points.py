"""What a user reaches without editing the library: their loss, policy, environment factory,
optimizer, and environment keyword arguments, from Python and from the command line."""

from __future__ import annotations

import copy
import inspect
import json
import math

import pytest
import torch

import treerl
from treerl.agents.policy import Generation, Policy
from treerl.agents.transformers_policy import end_of_turn_ids
from treerl.cli import main
from treerl.learners import POLICY_LOSSES, GRPOConfig, build, train
from treerl.models import load_default_model
from treerl.rollout import read_groups

SMALL = dict(steps=2, tasks_per_step=2, group_size=4, max_new_tokens=24, eval_episodes=0, progress=False,
             num_threads=1)

CUSTOM_LOSS = '''
import torch

from treerl.learners import finish_policy_loss, register_loss


def scaled_reinforce(inputs, cfg, normalizer):
    """REINFORCE on the trained log-probs, scaled by a coefficient of its own."""
    scale = cfg.loss_kwargs.get("scale", 1.0)
    terms = -scale * inputs.adv * inputs.logp
    metrics = {"custom/scale": torch.tensor(float(scale))}
    return finish_policy_loss(terms, inputs, cfg, normalizer, loss_name="scaled_reinforce", metrics=metrics)


register_loss("scaled_reinforce", scaled_reinforce, default_aggregation="token_mean")
'''


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_registered_loss_trains_from_the_command_line(tmp_path):
    module = tmp_path / "my_losses.py"
    module.write_text(CUSTOM_LOSS)
    out = tmp_path / "run"
    try:
        code = main(["learn", "--import", str(module), "--loss", "scaled_reinforce", "--loss-kwargs",
                     '{"scale": 2.0}', "--output-dir", str(out), "--steps", "1", "--tasks-per-step", "4",
                     "--group-size", "4", "--max-new-tokens", "24", "--eval-episodes", "0", "--progress", "false",
                     "--num-threads", "1", "--skip-zero-advantage", "false"])
    finally:
        POLICY_LOSSES.pop("scaled_reinforce", None)
    assert code == 0
    [m] = _metrics(out)
    assert m["custom/scale"] == 2.0  # the user's function computed the loss, with its own coefficient
    assert math.isfinite(m["loss/policy"]) and m["grad/norm"] > 0
    assert json.loads((out / "config.json").read_text())["loss"] == "scaled_reinforce"


def test_an_unknown_loss_names_the_way_to_add_one(capsys, tmp_path):
    assert main(["learn", "--loss", "nope", "--output-dir", str(tmp_path)]) == 2
    assert "register_loss" in capsys.readouterr().err


def test_every_loss_coefficient_is_a_flag_and_a_yaml_key(tmp_path):
    from dataclasses import fields

    from treerl.cli import build_parser
    from treerl.config import config_from_args
    from treerl.learners.losses import LossCoefficients

    names = [f.name for f in fields(LossCoefficients)]
    assert {"gspo_epsilon_low", "cispo_ratio_max", "sapo_tau_neg", "vespo_lambda_pos", "dppo_delta_high"} <= set(names)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("sapo_tau_neg: 1.5\nloss: sapo\n")
    args = build_parser().parse_args(["learn", "--output-dir", "x", "--gspo-epsilon-low", "1e-4",
                                      "--config", str(yaml_file)])
    cfg = config_from_args(GRPOConfig, args)
    loss_cfg = cfg.loss_config()
    assert loss_cfg.gspo_epsilon_low == 1e-4 and loss_cfg.sapo_tau_neg == 1.5 and loss_cfg.policy_loss == "sapo"


class PlainSamplingPolicy:
    """A policy written from scratch against the Policy protocol: one request at a time, the
    whole vocabulary, transformers' own cache; it records what the learner asks of it."""

    def __init__(self, model, tokenizer):
        self.model = copy.deepcopy(model).eval()
        self.stop = end_of_turn_ids(model, tokenizer)
        # transformers 5 renamed the forward's `past_key_values` to `cache`.
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.version = 0
        self.published: list[int] = []
        self.requests = 0
        self.closed = False

    @torch.no_grad()
    def generate(self, requests):
        out = []
        for r in requests:
            self.requests += 1
            gen = torch.Generator().manual_seed(r.seed or 0)
            tokens, logprobs = [], []
            step = self.model(torch.tensor([r.prompt_ids]), use_cache=True)
            for _ in range(r.params.max_new_tokens):
                logp = (step.logits[0, -1] / r.params.temperature).log_softmax(-1)
                token = int(torch.multinomial(logp.exp(), 1, generator=gen))
                tokens.append(token)
                logprobs.append(float(logp[token]))
                if token in self.stop:
                    break
                step = self.model(torch.tensor([[token]]), use_cache=True, **{self.cache_kwarg: step.past_key_values})
            out.append(Generation(token_ids=tokens, logprobs=logprobs, candidates=None,
                                  finish_reason="stop" if tokens[-1] in self.stop else "length",
                                  policy_version=self.version, num_prompt_tokens_processed=len(r.prompt_ids)))
        return out

    async def agenerate(self, request):
        return self.generate([request])[0]

    def set_weights(self, weights, version):
        self.model.load_state_dict(weights)
        self.version = version
        self.published.append(version)

    def end_session(self, session):
        pass

    def close(self):
        self.closed = True


def test_a_custom_policy_env_factory_and_optimizer_drive_train(tmp_path):
    torch.set_num_threads(1)
    model, tok = load_default_model()
    policy = PlainSamplingPolicy(model, tok)
    assert isinstance(policy, Policy)
    made = []

    def env_factory():
        made.append(1)
        return treerl.make("treerl/Calculator-v0")

    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(GRPOConfig(output_dir=str(tmp_path), **SMALL), model=model, tokenizer=tok, policy=policy,
                   env_factory=env_factory, optimizer=lambda params: torch.optim.SGD(params, lr=0.05))
    assert policy.requests > 0 and made, "the user's policy and environment factory played the episodes"
    assert policy.published == [1, 2] and result.policy_version == 2 and policy.closed
    lines = _metrics(tmp_path)
    assert [m["lr"] for m in lines] == [0.05, 0.05]  # the user's optimizer took the steps
    for m in lines:
        if m["train/skipped_groups_frac"] < 1.0:  # the sampler's log-probs are the trainer's: ratio 1
            assert abs(m["is/ratio_mean"] - 1.0) < 1e-3
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # The exported model holds the trained weights although the learner kept no policy copy of its own.
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(result.model_dir)
    for k, v in saved.state_dict().items():
        assert torch.allclose(v, model.state_dict()[k]), k


def _problems(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_env_kwargs_reach_the_environment_of_learn_and_eval(tmp_path, capsys):
    data = _problems(tmp_path / "problems.jsonl", [
        {"id": f"user-{i}", "problem": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(6)
    ])
    env_kwargs = {"data_path": str(data), "prompt_key": "problem"}
    # The learner's rollouts come from the user's file.
    cfg = GRPOConfig(output_dir=str(tmp_path / "probe"), env="treerl/MathVerify-v0", env_kwargs=env_kwargs, **SMALL)
    run = build(cfg)
    with run:
        groups, _ = run.rollout()
    run.policy.close()
    assert [g.info["task_id"] for g in groups] == ["user-0", "user-1"]
    assert groups[0].episodes[0].messages[1] == {"role": "user", "content": "What is 0 plus 0?"}

    # From the command line: it trains on the file...
    out = tmp_path / "run"
    code = main(["learn", "--env", "treerl/MathVerify-v0", "--env-kwargs", json.dumps(env_kwargs), "--output-dir",
                 str(out), "--steps", "1", "--tasks-per-step", "2", "--group-size", "2", "--max-new-tokens", "16",
                 "--eval-episodes", "2", "--progress", "false", "--num-threads", "1"])
    assert code == 0 and [m["step"] for m in _metrics(out)] == [1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_end"]["env"] == "treerl/MathVerify-v0" and summary["eval_end"]["episodes"] == 2
    # ... and a file without the column the kwargs name fails with the environment's message, in one
    # line and before any model loads; so do a keyword the environment does not take and a missing file.
    bad = _problems(tmp_path / "bad.jsonl", [{"question": "1 + 1?", "answer": "2"}])
    for kwargs, says in (({**env_kwargs, "data_path": str(bad)}, "no ['problem'] column"),
                         ({**env_kwargs, "bogus": 1}, "unexpected keyword argument 'bogus'"),
                         ({**env_kwargs, "data_path": str(tmp_path / "nope.jsonl")}, "No such file")):
        capsys.readouterr()
        assert main(["learn", "--env", "treerl/MathVerify-v0", "--env-kwargs", json.dumps(kwargs), "--output-dir",
                     str(tmp_path / "bad"), "--steps", "1", "--eval-episodes", "0", "--progress", "false"]) == 2
        err = capsys.readouterr().err
        assert says in err and "--env-kwargs" in err and "Traceback" not in err
    assert main(["learn", "--env", "treerl/Calculator-v0", "--eval-env-kwargs", '{"bogus": 1}', "--output-dir",
                 str(tmp_path / "bad")]) == 2
    assert "--eval-env-kwargs" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # refused before the run began


def test_eval_and_rollout_take_env_kwargs_and_import(tmp_path, capsys):
    data = _problems(tmp_path / "problems.jsonl", [{"id": "only", "question": "What is 2 plus 2?", "answer": "4"}])
    code = main(["eval", "--env", "treerl/MathVerify-v0", "--env-kwargs", json.dumps({"data_path": str(data)}),
                 "--num-episodes", "2", "--max-new-tokens", "16", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["env"] == "treerl/MathVerify-v0" and report["episodes"] == 1  # the file's one row, once
    out = tmp_path / "r.jsonl"
    code = main(["rollout", "--env", "treerl/MathVerify-v0", "--env-kwargs", json.dumps({"data_path": str(data)}),
                 "--num-tasks", "1", "--group-size", "2", "--max-new-tokens", "16", "--out", str(out),
                 "--progress", "false"])
    assert code == 0
    [group] = read_groups(out)
    assert group.info["task_id"] == "only" and len(group.episodes) == 2
    capsys.readouterr()
    # Rerun with nothing left: said so, not a summary of zero episodes.
    assert main(["rollout", "--env", "treerl/MathVerify-v0", "--env-kwargs", json.dumps({"data_path": str(data)}),
                 "--num-tasks", "1", "--group-size", "2", "--max-new-tokens", "16", "--out", str(out),
                 "--progress", "false"]) == 0
    assert capsys.readouterr().out.startswith(f"all 1 tasks are already in {out}: nothing to play")


CUSTOM_LEARNER = '''
from dataclasses import dataclass

from treerl.config import field_help
from treerl.learners import GRPOConfig, register_learner, train


@dataclass
class NotedConfig(GRPOConfig):
    note: str = field_help("", "Written to note.txt in the output directory.")


def noted_train(cfg, **extension_points):
    result = train(cfg, **extension_points)
    (result.output_dir / "note.txt").write_text(cfg.note)
    return result


register_learner("noted", NotedConfig, noted_train, "GRPO that leaves a note.")
'''


def test_a_registered_learner_runs_with_its_own_flags(tmp_path, capsys):
    from treerl.learners import LEARNERS

    module = tmp_path / "my_learner.py"
    module.write_text(CUSTOM_LEARNER)
    config = tmp_path / "c.yaml"
    config.write_text("learner: noted\nnote: from yaml\nsteps: 1\ntasks_per_step: 1\ngroup_size: 2\n"
                      "max_new_tokens: 16\neval_episodes: 0\nprogress: false\n")
    try:
        assert main(["learn", "--import", str(module), "--learner", "noted", "--note", "hello", "--output-dir",
                     str(tmp_path / "a"), "--config", str(config)]) == 0
        assert (tmp_path / "a" / "note.txt").read_text() == "hello"  # the flag overrides the file
        assert main(["learn", "--import", str(module), "--output-dir", str(tmp_path / "b"), "--config",
                     str(config)]) == 0  # the learner named by the config file
        assert (tmp_path / "b" / "note.txt").read_text() == "from yaml"
    finally:
        LEARNERS.pop("noted", None)
    assert main(["learn", "--learner", "nope", "--output-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "no such learner; choose one of [" in err and "'grpo'" in err  # every registered learner is listed


def test_an_env_factory_names_its_own_environment_and_refuses_eval_env_kwargs(tmp_path):
    data = _problems(tmp_path / "problems.jsonl", [{"id": f"p-{i}", "problem": f"{i} + 1?", "answer": str(i + 1)}
                                                   for i in range(4)])

    def env_factory():
        return treerl.make("treerl/MathVerify-v0", data_path=str(data), prompt_key="problem")

    # cfg.env keeps its default (Calculator): the groups and the held-out figures are the factory's environment's.
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), **{**SMALL, "eval_episodes": 2})
    run = build(cfg, env_factory=env_factory)
    with run:
        groups, _ = run.rollout()
    run.policy.close()
    assert {g.env_id for g in groups} == {"treerl/MathVerify-v0"}
    assert run.eval_start["env"] == "treerl/MathVerify-v0"
    # eval_env_kwargs describe make(cfg.env, ...): with a factory they would evaluate another environment.
    cfg = GRPOConfig(output_dir=str(tmp_path / "other"), eval_env_kwargs={"data_path": str(data)}, **SMALL)
    with pytest.raises(treerl.errors.ConfigError, match="env_factory"):
        build(cfg, env_factory=env_factory)


def test_treerl_make_sets_the_spec_as_gymnasium_make_does():
    env = treerl.make("treerl/Calculator-v0", max_turns=3)
    assert env.spec.id == "treerl/Calculator-v0" and env.spec.kwargs["max_turns"] == 3
