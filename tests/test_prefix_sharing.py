"""Prefix sharing in TransformersPolicy: fresh prompts that share a long prefix (one system
prompt, different questions) prefill it once, with the same samples as prefilling each alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from test_transformers_policy import VOCAB, TokenCounter, one_thread, tiny_model  # noqa: F401 (one_thread: autouse)

from treerl.agents.policy import GenerationRequest, SamplingParams
from treerl.agents.transformers_policy import TransformersPolicy

SYSTEM = [(11 + 5 * i) % (VOCAB - 10) + 10 for i in range(40)]  # a 40-token "system prompt"


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def question(k: int, n: int = 6) -> list[int]:
    return [(20 + 13 * k + 3 * i) % (VOCAB - 10) + 10 for i in range(n)]


def requests(num: int, params: SamplingParams) -> list[GenerationRequest]:
    # Questions of different lengths, and one prompt twice (a group inside the shared run).
    prompts = [SYSTEM + question(k, 4 + k % 3) for k in range(num)] + [SYSTEM + question(0, 4)]
    return [GenerationRequest(p, params, seed=100 + i) for i, p in enumerate(prompts)]


def generate(policy: TransformersPolicy, reqs: list[GenerationRequest], model) -> tuple[list, int]:
    counter = TokenCounter(model)
    try:
        return policy.generate(reqs), counter.num_tokens
    finally:
        counter.close()


def assert_same_samples(shared, unshared) -> None:
    for a, b in zip(shared, unshared, strict=True):
        assert a.token_ids == b.token_ids
        assert a.candidates == b.candidates
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


@pytest.mark.parametrize("continuous", [False, True])
def test_shared_system_prompt_is_prefilled_once_with_the_same_samples(model, continuous):
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=8)
    num = 6
    reqs = requests(num, params)
    sharing = TransformersPolicy(model, None, continuous_batching=continuous)
    unshared_policy = TransformersPolicy(model, None, continuous_batching=continuous, min_shared_prefix=0)
    sharing.stop_token_ids = unshared_policy.stop_token_ids = frozenset()  # every row decodes 8 tokens
    shared, shared_tokens = generate(sharing, reqs, model)
    unshared, unshared_tokens = generate(unshared_policy, reqs, model)
    assert_same_samples(shared, unshared)
    suffixes = sum(len(r.prompt_ids) - len(SYSTEM) for r in reqs[:num])  # the repeated prompt runs once
    decode = sum(len(g.token_ids) - 1 for g in shared)
    # Prefix once + each distinct prompt's remainder, then the decode steps' tokens.
    assert sum(g.num_prompt_tokens_processed for g in shared) == len(SYSTEM) + suffixes
    assert sum(g.num_prompt_tokens_processed for g in unshared) == num * len(SYSTEM) + suffixes
    assert shared_tokens == len(SYSTEM) + suffixes + decode
    assert unshared_tokens - shared_tokens == (num - 1) * len(SYSTEM)
    if continuous:  # agenerate joins the same path: a burst shares its prefix too
        sharing.close()
        unshared_policy.close()


def test_kept_prefix_serves_later_calls_until_new_weights(model):
    params = SamplingParams(top_k=20, max_new_tokens=2)
    policy = TransformersPolicy(model, None, continuous_batching=False)
    reference = TransformersPolicy(model, None, continuous_batching=False, min_shared_prefix=0)
    policy.generate(requests(3, params))  # the system prompt is now a kept prefix
    later = [GenerationRequest(SYSTEM + question(9), params, seed=7)]
    [alone] = policy.generate(later)
    assert alone.num_prompt_tokens_processed == len(question(9))
    assert_same_samples([alone], reference.generate(later))
    policy.set_weights(model.state_dict(), version=1)  # new weights: kept prefixes are stale
    [after] = policy.generate(later)
    assert after.num_prompt_tokens_processed == len(SYSTEM) + len(question(9))


def test_one_request_at_a_time_shares_the_system_prompt_with_the_previous_one(model):
    # A server's clients arrive one by one: the first prompt is kept, the second cuts it to
    # what they share (the system prompt), and every later one prefills only its question.
    params = SamplingParams(top_k=20, max_new_tokens=3)
    policy = TransformersPolicy(model, None, continuous_batching=False)
    reference = TransformersPolicy(model, None, continuous_batching=False, min_shared_prefix=0)
    for k in range(4):
        request = [GenerationRequest(SYSTEM + question(k), params, seed=k)]
        [g] = policy.generate(request)
        assert g.num_prompt_tokens_processed == (len(SYSTEM) + 6 if k == 0 else 6)
        assert_same_samples([g], reference.generate(request))
    assert list(policy._prefixes) == [tuple(SYSTEM)]


def test_short_common_prefixes_are_not_shared(model):
    params = SamplingParams(top_k=20, max_new_tokens=2)
    policy = TransformersPolicy(model, None, continuous_batching=False, min_shared_prefix=16)
    short = [GenerationRequest(SYSTEM[:10] + question(k, 10), params, seed=k) for k in range(3)]
    assert [g.num_prompt_tokens_processed for g in policy.generate(short)] == [20, 20, 20]
    with pytest.raises(ValueError, match="min_shared_prefix"):
        TransformersPolicy(model, None, min_shared_prefix=-1)
