"""Shared-prefix (cascade) decode attention and the policy's own vocabulary projection: the same
samples as the per-row path (token ids and candidate sets equal, log-probs within 1e-5), with the
shared prefix's keys and values held once while rows decode, join and leave."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_transformers_policy import VOCAB, one_thread, tiny_model  # noqa: F401 (one_thread: autouse)

from treerl.agents import cascade
from treerl.agents.cascade import CascadeState, cascade_attend, cascade_unsupported
from treerl.agents.decode import DecodeBatch, Row
from treerl.agents.policy import GenerationRequest, SamplingParams
from treerl.agents.transformers_policy import TransformersPolicy, _weight_stationary_head

PREFIX = [(13 + 7 * i) % (VOCAB - 10) + 10 for i in range(80)]
# The tiny model's layers hold 2 kv heads of 16: keep a prefix once from 4 rows of 64 tokens.
MIN_KV = 4 * 64 * 2 * 16


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def cascade_calls(monkeypatch):
    """Counts decode steps' attention calls that went through the shared prefix."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["layer_idx"])
        return attend(*args, **kwargs)

    attend = cascade.cascade_attend
    monkeypatch.setattr(cascade, "cascade_attend", counting)
    return calls


def question(k: int, n: int = 5) -> list[int]:
    return [(30 + 11 * k + 5 * i) % (VOCAB - 10) + 10 for i in range(n)]


def assert_same_samples(ours, reference) -> None:
    for a, b in zip(ours, reference, strict=True):
        assert a.token_ids == b.token_ids
        assert a.candidates == b.candidates
        assert a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_cascade_attend_equals_attention_over_per_row_copies():
    torch.manual_seed(0)
    batch, num_heads, num_kv, dim, num_prefix, own = 5, 6, 2, 16, 9, 7
    query = torch.randn(batch, num_heads, 1, dim)
    prefix_k, prefix_v = torch.randn(1, num_kv, num_prefix, dim), torch.randn(1, num_kv, num_prefix, dim)
    own_k, own_v = torch.randn(batch, num_kv, own, dim), torch.randn(batch, num_kv, own, dim)
    start = torch.tensor([0, 3, 6, 2, 0])  # left padding of each row's own columns
    valid = torch.arange(own) >= start[:, None]  # (B, t)
    out = cascade_attend(query, own_k, own_v, CascadeState([(prefix_k, prefix_v)], valid), layer_idx=0,
                         scaling=0.3)
    keys = torch.cat([prefix_k.expand(batch, -1, -1, -1), own_k], dim=2)
    values = torch.cat([prefix_v.expand(batch, -1, -1, -1), own_v], dim=2)
    mask = torch.cat([torch.ones(batch, num_prefix, dtype=torch.bool), valid], dim=1)[:, None, None, :]
    plain = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert out.shape == (batch, 1, num_heads, dim)
    torch.testing.assert_close(out.transpose(1, 2), plain, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(top_k=1, max_new_tokens=12),  # greedy
                                    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=12)],
                         ids=["greedy", "top-k-top-p"])
def test_group_decodes_over_one_prefix_with_the_same_samples(model, cascade_calls, params):
    policy = TransformersPolicy(model, None, max_prefixes=0, min_cascade_kv=MIN_KV)
    per_row = TransformersPolicy(model, None, max_prefixes=0, cascade_attention=False)
    assert policy.cascade_reason is None and per_row.cascade_reason == "cascade_attention=False"
    policy.stop_token_ids = per_row.stop_token_ids = frozenset()  # every row decodes all its steps
    prompt = PREFIX + question(0)
    requests = [GenerationRequest(prompt, params, seed=i, group="g") for i in range(6)]
    ours = policy.generate(requests)
    # 11 decode steps after the first sample, one call per layer each, all over the shared prefix.
    assert len(cascade_calls) == 11 * model.config.num_hidden_layers
    cascade_calls.clear()
    assert_same_samples(ours, per_row.generate(requests))
    assert not cascade_calls  # the reference really decoded per row


def requests_of(prompts: list[list[int]], params: SamplingParams, first_seed: int, session: str | None = None):
    return [GenerationRequest(p, params, seed=first_seed + i, session=None if session is None else f"{session}{i}")
            for i, p in enumerate(prompts)]


def decode_with_arrivals(policy: TransformersPolicy, waves: list[tuple[int, list[GenerationRequest]]]):
    """Continuous batching by hand: each wave's requests join the running batch after its step count."""
    batch, results, step, index = DecodeBatch(policy), {}, 0, 0
    prefix_lengths = []
    with torch.inference_mode():
        while waves or len(batch):
            while waves and waves[0][0] <= step:
                _, requests = waves.pop(0)
                units = policy._plan_units(requests)
                rows = [[Row(index + i, requests[i], frozenset(), policy.version) for i in unit.rows] for unit in units]
                index += len(requests)
                batch.admit(units, rows)
                prefix_lengths.append(len(batch.prefix_ids))
            for row in batch.step():
                results[row.index] = row.generation()
            step += 1
    return [results[i] for i in range(index)], prefix_lengths


def test_rows_that_join_cut_the_shared_prefix_to_what_they_share(model, cascade_calls):
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=10)
    group = [PREFIX + question(1)] * 4  # the whole prompt is shared
    same_system = [PREFIX[:70] + question(2, 8)]  # shares 70 tokens: the prefix is cut to them
    unrelated = [question(3, 30)]  # shares nothing: every row takes the prefix into its own columns
    later = [PREFIX + question(4)] * 3  # the batch stays per row until it empties

    def waves():
        return [(0, requests_of(group, params, 0)), (3, requests_of(same_system, params, 10)),
                (5, requests_of(unrelated, params, 20)), (7, requests_of(later, params, 30))]

    policy = TransformersPolicy(model, None, max_prefixes=0, min_cascade_kv=MIN_KV)
    per_row = TransformersPolicy(model, None, max_prefixes=0, cascade_attention=False)
    ours, prefix_lengths = decode_with_arrivals(policy, waves())
    assert prefix_lengths == [len(group[0]), 70, 0, 0]
    assert cascade_calls  # steps 0-4 ran over the shared prefix
    reference, _ = decode_with_arrivals(per_row, waves())
    assert_same_samples(ours, reference)


def test_sessions_saved_from_a_shared_prefix_continue_like_per_row_ones(model):
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=6)
    prompt = PREFIX + question(5)
    outs = []
    for cascade_attention in (True, False):
        policy = TransformersPolicy(model, None, max_prefixes=0, cascade_attention=cascade_attention,
                                    min_cascade_kv=MIN_KV)
        policy.stop_token_ids = frozenset()
        first = policy.generate(requests_of([prompt] * 3, params, 0, session="s"))
        # The next turn: each episode's context so far plus a tool result; only the new tokens are prefilled.
        turns = [prompt + g.token_ids + question(6 + i, 3) for i, g in enumerate(first)]
        second = policy.generate(requests_of(turns, params, 100, session="s"))
        assert [g.num_prompt_tokens_processed for g in second] == [len(t) - len(prompt) - 6 + 1 for t in turns]
        outs.append(first + second)
    assert_same_samples(*outs)


def test_short_or_unshared_prefixes_decode_per_row(model, cascade_calls):
    params = SamplingParams(top_k=5, max_new_tokens=4)
    policy = TransformersPolicy(model, None, max_prefixes=0, min_cascade_kv=MIN_KV)
    policy.generate([GenerationRequest(PREFIX[:40] + question(0), params, seed=i) for i in range(3)])  # 3 x 45
    policy.generate([GenerationRequest(PREFIX + question(0), params, seed=0)])  # one row: nothing to share
    default = TransformersPolicy(model, None, max_prefixes=0)  # the tiny model's prefixes are too small to split
    default.generate([GenerationRequest(PREFIX + question(0), params, seed=i) for i in range(8)])
    assert not cascade_calls
    # The default threshold: 8 rows of a 512-token prompt over 2 kv heads of 64 split, 256 tokens do not.
    keys = torch.empty(1, 2, 1, 64)
    assert DecodeBatch(default)._pays(8, 512, keys) and not DecodeBatch(default)._pays(8, 256, keys)


def test_models_the_cascade_cannot_serve_say_why():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    assert cascade_unsupported(tiny_model()) is None
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_sliding_window=True,
                         sliding_window=8, max_window_layers=1)
    sliding = Qwen3ForCausalLM(config)
    assert "other than full attention" in cascade_unsupported(sliding)
    policy = TransformersPolicy(sliding, None)
    assert "other than full attention" in policy.cascade_reason
    eager = tiny_model()
    eager.set_attn_implementation("eager")
    assert cascade_unsupported(eager) is None
    assert "not a transformers PreTrainedModel" in cascade_unsupported(torch.nn.Linear(2, 2))


def test_weight_stationary_head_gives_the_model_logits(model):
    choice, reason = _weight_stationary_head(model, torch.device("cpu"))
    assert choice is not None, reason
    decoder, head = choice
    ids = torch.tensor([[5, 9, 14, 3]])
    with torch.inference_mode():
        own = model(input_ids=ids, use_cache=False).logits[:, -1, :]
        ours = torch.mm(head.weight, decoder(input_ids=ids, use_cache=False).last_hidden_state[:, -1, :].t()).t()
    torch.testing.assert_close(ours, own, atol=1e-5, rtol=1e-5)

    class Scaled(type(model)):  # a subclass may transform its logits after the head: not trusted
        pass

    assert _weight_stationary_head(Scaled(model.config), torch.device("cpu"))[0] is None
    policy = TransformersPolicy(Scaled(model.config), None)
    assert "whose logits are their plain head's" in policy.head_reason
    assert "measured faster on CPU only" in _weight_stationary_head(model, torch.device("meta"))[1]
