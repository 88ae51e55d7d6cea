"""VLLMPolicy: the glue is tested with a fake engine; the real engine only where vllm and a GPU exist."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import _vllm_fake_engine as _fake
import pytest
import torch
from _helpers import assert_drawn_from, processed_forward
from _vllm_fake_engine import install_fake_vllm, lp

from treerl.agents.policy import GenerationRequest, Policy, SamplingParams
from treerl.agents.vllm_policy import VLLMPolicy, to_generation, to_vllm_sampling_kwargs

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed, so the missing-extra error cannot be shown")
def test_missing_vllm_says_which_extra_to_install():
    with pytest.raises(ImportError, match=r"pip install 'treerl\[vllm\]'"):
        VLLMPolicy("some/model")


def test_sampling_kwargs_ask_for_exact_candidates():
    request = GenerationRequest([1, 2, 3], SamplingParams(temperature=0.7, top_k=5, min_p=0.1, max_new_tokens=9,
                                                          stop_token_ids=(11,)), seed=4)
    kwargs = to_vllm_sampling_kwargs(request, frozenset({7}))
    assert kwargs["logprobs"] == 5 and kwargs["top_k"] == 5 and kwargs["min_p"] == 0.1
    assert kwargs["stop_token_ids"] == [7, 11] and kwargs["seed"] == 4 and kwargs["max_tokens"] == 9
    assert kwargs["detokenize"] is False
    full_vocab = to_vllm_sampling_kwargs(GenerationRequest([1], SamplingParams()), frozenset())
    assert full_vocab["top_k"] == -1 and full_vocab["logprobs"] == 0


def test_to_generation_keeps_finite_ids_most_likely_first():
    completion = SimpleNamespace(
        token_ids=[8, 2],
        logprobs=[
            {8: lp(-0.5), 3: lp(-1.0), 5: lp(-math.inf)},
            {2: lp(0.0), 8: lp(-math.inf), 3: lp(-math.inf)},
        ],
        finish_reason="stop",
    )
    g = to_generation(completion, SamplingParams(top_k=3), num_prompt_tokens=10, num_cached_tokens=8, version=7)
    assert g.token_ids == [8, 2] and g.logprobs == [-0.5, 0.0]
    assert g.candidates == [[8, 3], [2]]
    assert g.finish_reason == "stop" and g.policy_version == 7 and g.num_prompt_tokens_processed == 2
    no_k = to_generation(completion, SamplingParams(), num_prompt_tokens=10, num_cached_tokens=None, version=0)
    assert no_k.candidates is None and no_k.num_prompt_tokens_processed == 10


def test_to_generation_rejects_missing_logprobs_and_aborts():
    with pytest.raises(RuntimeError, match="no per-token log-probs"):
        to_generation(SimpleNamespace(token_ids=[1], logprobs=None, finish_reason="length"), SamplingParams(),
                      num_prompt_tokens=1, num_cached_tokens=None, version=0)
    with pytest.raises(RuntimeError, match="abort"):
        to_generation(SimpleNamespace(token_ids=[1], logprobs=[{1: lp(0.0)}], finish_reason="abort"),
                      SamplingParams(), num_prompt_tokens=1, num_cached_tokens=None, version=0)


class FakeLLM(_fake.FakeLLM):
    """Answers each prompt with its last token + 1, one token, one prompt token cached."""

    def get_tokenizer(self):
        return SimpleNamespace(eos_token_id=2, get_vocab=lambda: {"<|im_end|>": 6})

    def complete(self, prompt_ids, sp):
        token = prompt_ids[-1] + 1
        return SimpleNamespace(token_ids=[token], logprobs=[{token: lp(-0.25)}], finish_reason="length"), 1


@pytest.fixture
def fake_vllm(monkeypatch):
    return install_fake_vllm(monkeypatch, FakeLLM)


def test_policy_builds_a_processed_logprobs_engine_and_keeps_request_order(fake_vllm):
    policy = VLLMPolicy("tiny/model", max_candidates=16, dtype="float32")
    assert policy.llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert policy.llm.kwargs["max_logprobs"] == 16 and policy.llm.kwargs["dtype"] == "float32"
    assert policy.stop_token_ids == {2, 6}
    requests = [GenerationRequest([1, 2, i], SamplingParams(max_new_tokens=3), seed=i) for i in range(3)]
    generations = policy.generate(requests)
    assert [g.token_ids for g in generations] == [[1], [2], [3]]
    assert [g.num_prompt_tokens_processed for g in generations] == [2, 2, 2]
    (prompts, sampling), = policy.llm.calls
    assert [p["prompt_token_ids"] for p in prompts] == [r.prompt_ids for r in requests]
    assert [s.seed for s in sampling] == [0, 1, 2] and sampling[0].stop_token_ids == [2, 6]
    assert isinstance(policy, Policy)


def test_policy_rejects_top_k_beyond_max_candidates(fake_vllm):
    policy = VLLMPolicy("tiny/model", max_candidates=8)
    with pytest.raises(ValueError, match="max_candidates>=9"):
        policy.generate([GenerationRequest([1], SamplingParams(top_k=9))])


def test_policy_refuses_an_engine_with_raw_logprobs(fake_vllm):
    with pytest.raises(ValueError, match="processed_logprobs"):
        VLLMPolicy(FakeLLM(logprobs_mode="raw_logprobs"))


def test_set_weights_reaches_workers_and_resets_prefix_cache(fake_vllm, tmp_path):
    policy = VLLMPolicy("tiny/model")
    policy.set_weights({"w": torch.ones(2)}, version=3)
    assert policy.version == 3 and policy.llm.resets == 1
    assert torch.equal(policy.llm.loaded[0]["w"], torch.ones(2))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    policy.set_weights(tmp_path / "w.safetensors", version=4)
    assert policy.version == 4 and torch.equal(policy.llm.loaded[1]["w"], torch.zeros(2))
    assert policy.generate([GenerationRequest([1], SamplingParams())])[0].policy_version == 4


def test_agenerate_batches_through_one_engine_call(fake_vllm):
    import asyncio

    policy = VLLMPolicy("tiny/model")

    async def main():
        return await asyncio.gather(*(policy.agenerate(GenerationRequest([i], SamplingParams())) for i in range(4)))

    generations = asyncio.run(main())
    policy.close()
    assert [g.token_ids for g in generations] == [[1], [2], [3], [4]] and len(policy.llm.calls) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the vLLM engine test needs a CUDA GPU")
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (pip install 'treerl[vllm]')")
def test_real_engine_logprobs_match_a_transformers_forward(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=3)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)
    model.save_pretrained(tmp_path)
    policy = VLLMPolicy(str(tmp_path), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2,
                        skip_tokenizer_init=True, max_model_len=128)
    params = SamplingParams(top_k=20, top_p=0.9, max_new_tokens=8)
    prompt = list(range(10, 20))
    g = policy.generate([GenerationRequest(prompt, params, seed=0)])[0]
    assert_drawn_from(g, processed_forward(model, prompt, g.token_ids, params), abs_tol=1e-3, ordered=False)
