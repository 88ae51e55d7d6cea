"""Learning from groups recorded elsewhere: ``--from-rollouts FILE`` and ``--from-server URL`` on the learner core.

The importance ratio between the trainer and the sampler is 1 on groups sampled with the
trainer's own weights only if every recorded token, context and log-prob is exact, so these
tests also check that what the server records is what the model saw and sampled.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest
import torch

import treerl
from treerl.agents import SamplingParams, TransformersPolicy
from treerl.learners.grpo import GRPOConfig, train
from treerl.rollout import GroupWriter, read_groups
from treerl.rollout.engine import RolloutEngine

# Groups whose advantages are all 0 are trained on too, so that every step measures the importance ratio.
SMALL = dict(steps=2, tasks_per_step=2, group_size=2, max_new_tokens=48, eval_episodes=0, progress=False,
             num_threads=1, skip_zero_advantage=False)


def _load():
    from treerl.models import load_default_model

    return load_default_model()


def no_environment():
    raise AssertionError("a learner that takes its groups from a source must not play the environment")


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_learn_from_a_trajectory_file(tmp_path):
    model, tok = _load()
    path = tmp_path / "r.jsonl"
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=24), seed=3)
    groups, _ = asyncio.run(engine.run(lambda: treerl.make("treerl/Calculator-v0"), "treerl/Calculator-v0",
                                       range(3), 2))
    with GroupWriter(path) as writer:
        for g in groups:
            writer.write(g)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(GRPOConfig(output_dir=str(tmp_path / "run"), from_rollouts=str(path), **SMALL),
                   model=model, tokenizer=tok, env_factory=no_environment)
    assert result.policy_version == 2
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    lines = _metrics(tmp_path / "run")
    stored = list(read_groups(path))
    # Step 1 takes the file's groups 0 and 1, step 2 groups 2 and 0 (the file cycles).
    for m, picked in zip(lines, ([0, 1], [2, 0])):
        rewards = [e.reward for i in picked for e in stored[i].episodes]
        assert m["reward/mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert abs(lines[0]["is/ratio_mean"] - 1.0) < 1e-3  # sampled by these very weights: ratio 1


@pytest.mark.slow  # a whole run (processes or a model forward): CI's slow tier
def test_length_limit_on_recorded_groups_names_the_limit_they_were_sampled_with(tmp_path):
    # --max-new-tokens does not reach groups recorded elsewhere: the diagnostic must not tell the user to raise it.
    model, tok = _load()
    path = tmp_path / "r.jsonl"
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=SamplingParams(max_new_tokens=2), seed=3)
    groups, _ = asyncio.run(engine.run(lambda: treerl.make("treerl/Calculator-v0"), "treerl/Calculator-v0", [0], 2))
    with GroupWriter(path) as writer:
        writer.write(groups[0])
    one_step = {**SMALL, "steps": 1, "tasks_per_step": 1}
    train(GRPOConfig(output_dir=str(tmp_path / "run"), from_rollouts=str(path), **one_step),
          model=model, tokenizer=tok, env_factory=no_environment)
    [report] = [json.loads(line) for line in (tmp_path / "run" / "diagnostics.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "length_limit"]
    assert "max_tokens" in report["action"] and "raise --max-new-tokens" not in report["action"]


def test_groups_sampled_at_another_temperature_are_refused(tmp_path):
    """The trainer recomputes log-probs at its --temperature: groups drawn at another one would be
    weighted and trained against a distribution that did not draw them."""
    from treerl.errors import ConfigError
    from treerl.learners.core import check_sampling_temperature
    from treerl.rollout.trajectory import Group

    model, tok = _load()
    path = tmp_path / "r.jsonl"
    params = SamplingParams(temperature=0.6, max_new_tokens=24)
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=params, seed=3)
    groups, _ = asyncio.run(engine.run(lambda: treerl.make("treerl/Calculator-v0"), "treerl/Calculator-v0",
                                       range(1), 2))
    with GroupWriter(path) as writer:
        writer.write(groups[0])
    one_step = {**SMALL, "steps": 1, "tasks_per_step": 1}
    with pytest.raises(ConfigError, match="sampled at temperature 0.6.*--temperature 0.6"):
        train(GRPOConfig(output_dir=str(tmp_path / "default"), from_rollouts=str(path), **one_step),
              model=model, tokenizer=tok, env_factory=no_environment)
    train(GRPOConfig(output_dir=str(tmp_path / "same"), from_rollouts=str(path), temperature=0.6, **one_step),
          model=model, tokenizer=tok, env_factory=no_environment)
    assert abs(_metrics(tmp_path / "same")[0]["is/ratio_mean"] - 1.0) < 1e-3
    # treerl serve records its turns' temperatures; greedy turns (top_k=1) are the same at any.
    served = Group(task_key="served", env_id="treerl-serve", info={"temperatures": [1.0, 0.7]})
    with pytest.raises(ConfigError, match="sampled at temperature 0.7"):
        check_sampling_temperature([served], 1.0)
    greedy = Group(task_key="greedy", env_id="x", info={"sampling": {"temperature": 0.5, "top_k": 1}})
    check_sampling_temperature([greedy, Group(task_key="old", env_id="x")], 1.0)


def test_from_rollouts_and_from_server_are_checked():
    with pytest.raises(ValueError, match="from one source"):
        GRPOConfig(output_dir="x", from_rollouts="a.jsonl", from_server="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="must be an http"):
        GRPOConfig(output_dir="x", from_server="127.0.0.1:8000")
    with pytest.raises(FileNotFoundError, match="no such trajectory file"):
        GRPOConfig(output_dir="x", from_rollouts="missing.jsonl").group_source()


def test_from_server_without_publishing_rights_is_refused_before_the_first_step(monkeypatch):
    """A server that would refuse the learner's weights (no token on either side, or only on the learner's)
    is said at the start, in the server's words: found at the first upload, after a step's work, the
    refusal reset the connection mid-body and read as a server that could not be reached."""
    pytest.importorskip("fastapi", reason="treerl serve needs the serve extra (fastapi, uvicorn)")
    from _serve_helpers import running_server

    from treerl.serve.client import ServerError

    model, tok = _load()
    with running_server(model, tok, max_new_tokens=8) as (url, _):
        for token in (None, "tkn"):
            if token:
                monkeypatch.setenv("TREERL_SERVE_TOKEN", token)
            else:
                monkeypatch.delenv("TREERL_SERVE_TOKEN", raising=False)
            with pytest.raises(ServerError, match="HTTP 403: .*control endpoints need a bearer token"):
                GRPOConfig(output_dir="x", from_server=url.removesuffix("/v1")).group_source()


@pytest.mark.slow  # a whole run (processes or a model forward): CI's slow tier
def test_learn_from_server_publishes_versioned_weights(tmp_path, monkeypatch):
    pytest.importorskip("fastapi", reason="treerl serve needs the serve extra (fastapi, uvicorn)")
    openai = pytest.importorskip("openai", reason="the openai client is a test dependency")
    from _serve_helpers import running_server

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from openai_agent import run_episode

    torch.set_num_threads(1)
    server_model, tok = _load()  # the server's own copy: the learner publishes into it
    monkeypatch.setenv("TREERL_SERVE_TOKEN", "tkn")
    with running_server(server_model, tok, token="tkn", group_size=2, max_new_tokens=48) as (url, recorder):
        client = openai.OpenAI(base_url=url, api_key="tkn", max_retries=0, timeout=120)
        stop = threading.Event()

        def agents() -> None:  # an outside agent keeps playing tasks, two episodes each
            task = 0
            while not stop.is_set():
                for _ in range(2):
                    run_episode(client, seed=task, task_id=f"calc-{task}", max_tokens=48)
                task += 1

        traffic = threading.Thread(target=agents, daemon=True)
        traffic.start()
        try:
            result = train(GRPOConfig(output_dir=str(tmp_path), from_server=url.removesuffix("/v1"),
                                      server_timeout_s=300, **SMALL), env_factory=no_environment)
        finally:
            stop.set()
            traffic.join(timeout=120)
        assert result.policy_version == 2
        assert recorder.policy.version == 2 and recorder.metrics["weights/updates"] == 2
        # Requests after the update sample the new weights and record their version.
        run_episode(client, seed=999, task_id="after", max_tokens=48)
        run_episode(client, seed=999, task_id="after", max_tokens=48)
        after = next(g for g in recorder.finished if g.task_key == "after")
        assert {s.policy_version for s in after.segments if s.kind == "sampled"} == {2}
        first_groups = recorder.finished[:2]
        assert {s.policy_version for g in first_groups for s in g.segments if s.kind == "sampled"} == {0}
    lines = _metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2]
    # The first step's groups were sampled by the server with the learner's starting weights:
    # the trainer recomputes exactly the recorded log-probs on the recorded tokens.
    assert abs(lines[0]["is/ratio_mean"] - 1.0) < 1e-3


@pytest.mark.slow  # a whole run (processes or a model forward): CI's slow tier
def test_sdpo_learns_from_served_traffic_and_its_feedback(tmp_path):
    """SDPO's teacher reads the feedback agents post with their rewards (as the engine records Env.feedback)."""
    pytest.importorskip("fastapi", reason="treerl serve needs the serve extra (fastapi, uvicorn)")
    openai = pytest.importorskip("openai", reason="the openai client is a test dependency")
    from _serve_helpers import running_server

    from treerl.learners.sdpo import SDPOConfig
    from treerl.learners.sdpo import train as train_sdpo

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from openai_agent import run_episode

    torch.set_num_threads(1)
    model, tok = _load()
    path = tmp_path / "served.jsonl"
    with running_server(model, tok, out=str(path), group_size=2, max_new_tokens=32) as (url, recorder):
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        for _ in range(2):
            r = run_episode(client, seed=5, task_id="calc-5", max_tokens=32, post_reward=False)
            client.post(f"/episodes/{r.episode_id}/reward", cast_to=object,
                        body={"reward": r.reward, "feedback": "Compute it with the calculator, then answer."})
    assert all(e.metrics["feedback"] for g in read_groups(path) for e in g.episodes)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # The environment is only asked for its tool schemas (the teacher's prompt renders them, as the agent's did).
    cfg = SDPOConfig(output_dir=str(tmp_path / "run"), from_rollouts=str(path), steps=1, tasks_per_step=1,
                     group_size=2, max_new_tokens=32, eval_episodes=0, progress=False, num_threads=1,
                     distillation_gate_margin=None)  # distil even where the tiny teacher is gated
    result = train_sdpo(cfg, model=model, tokenizer=tok)
    assert result.policy_version == 1
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    [m] = _metrics(tmp_path / "run")
    assert m["sdpo/distill_terms"] > 0 and m["sdpo/no_teacher_group_frac"] == 0.0


def test_async_grpo_refuses_recorded_groups():
    from treerl.learners.async_grpo import AsyncGRPOConfig

    for flag in (dict(from_rollouts="r.jsonl"), dict(from_server="http://127.0.0.1:8000")):
        with pytest.raises(ValueError, match="--learner grpo or --learner sdpo"):
            AsyncGRPOConfig(output_dir="x", **flag)
