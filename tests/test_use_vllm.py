"""``treerl learn --use-vllm`` (colocated): the learner builds a processed-log-prob vLLM engine on the
model's directory, samples through it, and loads every step's weights into it in place. The logic
runs on CPU with a fake engine that follows ``vllm.LLM``'s interface; the real engine runs only
where CUDA and vllm exist."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import _vllm_fake_engine as _fake
import pytest
import torch
from _vllm_fake_engine import install_fake_vllm, lp

from treerl.learners.grpo import GRPOConfig, train
from treerl.models import load_default_model

HAS_VLLM = importlib.util.find_spec("vllm") is not None


class FakeLLM(_fake.FakeLLM):
    """Reads the model directory's tokenizer and answers two tokens and the end of turn."""

    def get_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.kwargs["model"])

    def complete(self, prompt_ids, sp):
        # A short answer ending in the end-of-turn token, with processed log-probs of every candidate.
        ids = [33, 34, sorted(sp.stop_token_ids)[0]][:sp.max_tokens]
        steps = [{t: lp(-0.5), t + 1: lp(-1.0)} for t in ids]
        return SimpleNamespace(token_ids=ids, logprobs=steps, finish_reason="stop"), 0


@pytest.fixture
def fake_vllm(monkeypatch):
    return install_fake_vllm(monkeypatch, FakeLLM)


def test_learn_samples_with_a_colocated_engine_and_updates_it_in_place(fake_vllm, tmp_path):
    from treerl.models import default_model_path
    from treerl.rollout.trajectory import read_groups

    cfg = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, steps=2, tasks_per_step=1, group_size=2,
                     max_new_tokens=8, eval_episodes=0, progress=False, sample_every=1, top_k=4,
                     vllm_kwargs={"enforce_eager": True}, skip_zero_advantage=False)
    model, tok = load_default_model()
    train(cfg, model=model, tokenizer=tok)
    (llm,) = FakeLLM.instances
    assert llm.kwargs["model"] == str(default_model_path()) and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["dtype"] == "float32" and llm.kwargs["gpu_memory_utilization"] == 0.3
    assert llm.kwargs["enforce_eager"] is True and llm.kwargs["max_logprobs"] >= 4
    assert llm.kwargs["max_model_len"] == 1024  # the shipped model's positions: vLLM refuses a longer context
    # Each step's weights reached the workers, under the transformers names, and the prefix cache was dropped.
    assert len(llm.loaded) == 2 and llm.resets == 2
    assert set(llm.loaded[-1]) == set(model.state_dict())
    assert torch.equal(llm.loaded[-1]["model.norm.weight"], model.state_dict()["model.norm.weight"])
    # The engine's processed log-probs and candidate sets are what the trees recorded.
    groups = list(read_groups(tmp_path / "trajectories" / "step-000001.jsonl"))
    sampled = [s for g in groups for s in g.segments if s.kind == "sampled"]
    assert sampled and all(s.logprobs == [-0.5] * len(s.token_ids) for s in sampled)
    assert all(c == [t, t + 1] for s in sampled for t, c in zip(s.token_ids, s.candidates))
    assert [json.loads(line)["policy/version"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2]


def test_use_vllm_options_are_validated():
    with pytest.raises(ValueError, match="vllm_gpu_memory_utilization=0"):
        GRPOConfig(output_dir="x", use_vllm=True, vllm_gpu_memory_utilization=0)
    with pytest.raises(ValueError, match="drop --use-vllm"):
        GRPOConfig(output_dir="x", use_vllm=True, from_rollouts="groups.jsonl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="--use-vllm needs a CUDA GPU")
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (pip install 'treerl[vllm]')")
def test_real_colocated_engine_trains_the_shipped_model(tmp_path):
    cfg = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, device="cuda", steps=2, tasks_per_step=2,
                     group_size=4, max_new_tokens=32, eval_episodes=4, progress=False,
                     vllm_gpu_memory_utilization=0.2, vllm_kwargs={"enforce_eager": True})
    result = train(cfg)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy/version"] for m in lines] == [1, 2]
    assert result.eval_end is not None
    # Sampler and trainer compute nearly the same distribution: importance ratios near 1.
    for m in lines:
        if "is/ratio_mean" in m:
            assert abs(m["is/ratio_mean"] - 1.0) < 0.1
