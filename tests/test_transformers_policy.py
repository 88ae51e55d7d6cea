"""TransformersPolicy on a tiny Qwen3 built from a config: sharing, sessions, exact log-probs."""

from __future__ import annotations

import asyncio
import copy
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from treerl.agents.policy import GenerationRequest, Policy, SamplingParams
from treerl.agents.transformers_policy import TransformersPolicy, end_of_turn_ids

VOCAB = 128
EOS = 3
IM_END = 4

PARAMS = {
    "temperature": SamplingParams(temperature=0.8, max_new_tokens=10),
    "top_k": SamplingParams(top_k=12, max_new_tokens=10),
    "top_k_top_p": SamplingParams(temperature=1.3, top_k=20, top_p=0.8, max_new_tokens=10),
    "top_k_min_p": SamplingParams(top_k=20, min_p=0.2, max_new_tokens=10),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls on a shared 2-core machine are far faster without intra-op threads.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=EOS,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        # A freshly initialized head gives near-uniform next-token distributions; sharpen them
        # so top-p and min-p have something to cut.
        model.lm_head.weight.mul_(15.0)
    return model.eval()


class FakeTokenizer:
    """Only what the policy reads from a tokenizer: its eos and its vocabulary."""

    def __init__(self, eos_token_id: int | None = None, vocab: dict[str, int] | None = None):
        self.eos_token_id = eos_token_id
        self._vocab = vocab or {}

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def copy_model(model):
    return copy.deepcopy(model)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def policy(model):
    return TransformersPolicy(model, FakeTokenizer(vocab={"<|im_end|>": IM_END}))


class TokenCounter:
    """Counts the tokens the model runs, via a forward pre-hook."""

    def __init__(self, model):
        self.num_tokens = 0
        self.num_calls = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.num_tokens += kwargs["input_ids"].numel()
        self.num_calls += 1

    def close(self):
        self._handle.remove()


def prompt(n: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % (VOCAB - 10) + 10 for i in range(n)]


def processed_reference(logits: torch.Tensor, params: SamplingParams) -> tuple[list[float], list[int] | None]:
    """Written independently of treerl.agents.sampling, in float64: (log-probs over the vocab
    with -inf outside the support, the support ids most likely first or None)."""
    z = [x / params.temperature for x in logits.double().tolist()]
    if params.top_k is None:
        log_total = math.log(sum(math.exp(x - max(z)) for x in z)) + max(z)
        return [x - log_total for x in z], None
    order = sorted(range(len(z)), key=lambda i: -z[i])[: params.top_k]
    support = [i for i in order if math.exp(z[i] - z[order[0]]) >= params.min_p]
    total = sum(math.exp(z[i]) for i in support)
    kept, mass = [], 0.0
    for i in support:
        if mass >= params.top_p:
            break
        kept.append(i)
        mass += math.exp(z[i]) / total
    log_total = math.log(sum(math.exp(z[i]) for i in kept))
    logprobs = [-math.inf] * len(z)
    for i in kept:
        logprobs[i] = z[i] - log_total
    return logprobs, kept


# ---------------------------------------------------------------- shared prefill


def test_group_prompt_is_prefilled_once(model, policy):
    params = SamplingParams(top_k=10, max_new_tokens=1)  # one token: no decode forward at all
    counter = TokenCounter(model)
    try:
        group = policy.generate([GenerationRequest(prompt(12), params, seed=s, group="g") for s in range(4)])
        shared = counter.num_tokens
        counter.num_tokens = 0
        independent = policy.generate([GenerationRequest(prompt(12, start=s), params, seed=s) for s in range(4)])
        separate = counter.num_tokens
    finally:
        counter.close()
    assert shared == 12 and separate == 48
    assert [g.num_prompt_tokens_processed for g in group] == [12, 0, 0, 0]
    assert [g.num_prompt_tokens_processed for g in independent] == [12, 12, 12, 12]
    assert len({tuple(g.candidates[0]) for g in group}) == 1  # one prompt, one distribution


def test_group_decodes_in_one_batch_after_one_prefill(model, policy):
    params = SamplingParams(top_k=10, max_new_tokens=5, stop_token_ids=())
    policy.stop_token_ids = frozenset()  # let every row run to the length limit
    counter = TokenCounter(model)
    try:
        policy.generate([GenerationRequest(prompt(12), params, seed=s) for s in range(4)])
    finally:
        counter.close()
    # one prefill of 12 tokens, then 4 decode steps of 4 rows each
    assert counter.num_calls == 5 and counter.num_tokens == 12 + 4 * 4


# ---------------------------------------------------------------- exact log-probs and candidates


@pytest.mark.parametrize("name", list(PARAMS))
def test_logprobs_and_candidates_match_a_full_forward(model, policy, name):
    params = PARAMS[name]
    policy.stop_token_ids = frozenset()  # run to the length limit: more tokens checked
    # Different lengths (left padding), a shared group, and mixed params in one batch.
    requests = [
        GenerationRequest(prompt(9), params, seed=1, group="a"),
        GenerationRequest(prompt(9), params, seed=2, group="a"),
        GenerationRequest(prompt(4, start=30), params, seed=3),
        GenerationRequest(prompt(6, start=50), SamplingParams(top_k=5, max_new_tokens=3), seed=4),
    ]
    generations = policy.generate(requests)
    num_checked = 0
    for request, generation in zip(requests, generations):
        assert len(generation.token_ids) == len(generation.logprobs)
        context = torch.tensor([request.prompt_ids + generation.token_ids[:-1]])
        with torch.no_grad():
            logits = model(context).logits[0, len(request.prompt_ids) - 1 :]  # (T, V)
        for t, token in enumerate(generation.token_ids):
            ref_logprobs, ref_support = processed_reference(logits[t], request.params)
            assert generation.logprobs[t] == pytest.approx(ref_logprobs[token], abs=1e-5)
            if ref_support is None:
                assert generation.candidates is None
            else:
                assert generation.candidates[t] == ref_support
                assert token in ref_support
            num_checked += 1
    assert num_checked >= 30
    if PARAMS[name].top_p < 1 or PARAMS[name].min_p > 0:
        # The filters cut something: the test would notice a sampler that ignored them.
        assert any(len(c) < PARAMS[name].top_k for c in generations[0].candidates + generations[2].candidates)


# ---------------------------------------------------------------- sessions


def test_session_continues_from_its_cache_and_matches_a_fresh_prefill(model):
    params = SamplingParams(top_k=20, top_p=0.9, max_new_tokens=6)
    with_session = TransformersPolicy(model, None)
    with_session.stop_token_ids = frozenset()
    fresh = TransformersPolicy(model, None)
    fresh.stop_token_ids = frozenset()

    turn1 = with_session.generate([GenerationRequest(prompt(10), params, seed=5, session="ep")])[0]
    context = prompt(10) + turn1.token_ids + [7, 8, 9]  # the env's tool result
    counter = TokenCounter(model)
    try:
        turn2 = with_session.generate([GenerationRequest(context, params, seed=6, session="ep")])[0]
        continued = counter.num_tokens
    finally:
        counter.close()
    # The cache held the prompt and every sampled token but the last: run that one and the 3 env tokens.
    assert turn2.num_prompt_tokens_processed == 4
    assert continued == 4 + (len(turn2.token_ids) - 1)
    reference = fresh.generate([GenerationRequest(context, params, seed=6)])[0]
    assert reference.num_prompt_tokens_processed == len(context)
    assert turn2.token_ids == reference.token_ids and turn2.candidates == reference.candidates
    assert turn2.logprobs == pytest.approx(reference.logprobs, abs=1e-5)

    # A context that is not an extension (the template rewrote history) reuses what still matches.
    edited = context[:5] + [11] + context[6:]
    turn3 = with_session.generate([GenerationRequest(edited, params, seed=7, session="ep")])[0]
    assert turn3.num_prompt_tokens_processed == len(edited) - 5
    reference = fresh.generate([GenerationRequest(edited, params, seed=7)])[0]
    assert turn3.token_ids == reference.token_ids
    assert turn3.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def test_session_repeat_of_same_context_reruns_only_the_last_token(model, policy):
    params = SamplingParams(top_k=10, max_new_tokens=1)
    policy.generate([GenerationRequest(prompt(8), params, seed=1, session="s")])
    # The session saw prompt(8) (the single sampled token was never fed): rerun its last token.
    again = policy.generate([GenerationRequest(prompt(8), params, seed=1, session="s")])[0]
    assert again.num_prompt_tokens_processed == 1
    policy.end_session("s")
    policy.end_session("unknown")  # a no-op
    assert policy.generate([GenerationRequest(prompt(8), params, session="s")])[0].num_prompt_tokens_processed == 8


def test_group_members_with_their_own_sessions_share_the_first_prefill(model, policy):
    params = SamplingParams(top_k=10, max_new_tokens=3)
    first = policy.generate([GenerationRequest(prompt(8), params, seed=s, session=f"ep{s}") for s in range(3)])
    assert [g.num_prompt_tokens_processed for g in first] == [8, 0, 0]
    second = policy.generate([
        GenerationRequest(prompt(8) + g.token_ids + [5], params, seed=s, session=f"ep{s}")
        for s, g in enumerate(first)
    ])
    assert [g.num_prompt_tokens_processed for g in second] == [2, 2, 2]


def test_two_requests_of_one_session_in_a_call_are_rejected(policy):
    params = SamplingParams(max_new_tokens=1)
    with pytest.raises(ValueError, match="same session"):
        policy.generate([GenerationRequest([5], params, session="x"), GenerationRequest([6], params, session="x")])


def test_least_recently_used_sessions_are_dropped(model):
    policy = TransformersPolicy(model, None, max_sessions=1)
    params = SamplingParams(top_k=5, max_new_tokens=1)
    policy.generate([GenerationRequest(prompt(6), params, session="a")])
    policy.generate([GenerationRequest(prompt(6, start=40), params, session="b")])
    assert policy.generate([GenerationRequest(prompt(6), params, session="a")])[0].num_prompt_tokens_processed == 6


# ---------------------------------------------------------------- stopping


def greedy_tokens(model, context: list[int], n: int) -> list[int]:
    unstoppable = TransformersPolicy(model, None)
    unstoppable.stop_token_ids = frozenset()
    return unstoppable.generate([GenerationRequest(context, SamplingParams(top_k=1, max_new_tokens=n))])[0].token_ids


@pytest.mark.parametrize("source", ["generation_config_list", "tokenizer_eos", "template_end_of_turn", "params"])
def test_stops_on_each_declared_end_of_turn_id(model, source):
    context = prompt(7)
    tokens = greedy_tokens(model, context, 12)
    # The first token that was not sampled before, at position >= 2, becomes the stop id.
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stop = tokens[at]
    other = next(i for i in range(VOCAB) if i not in tokens)
    old_eos = model.generation_config.eos_token_id
    params = SamplingParams(top_k=1, max_new_tokens=12)
    try:
        if source == "generation_config_list":
            model.generation_config.eos_token_id = [other, stop]
            policy = TransformersPolicy(model, None)
        elif source == "tokenizer_eos":
            model.generation_config.eos_token_id = other
            policy = TransformersPolicy(model, FakeTokenizer(eos_token_id=stop))
        elif source == "template_end_of_turn":
            model.generation_config.eos_token_id = other
            policy = TransformersPolicy(model, FakeTokenizer(vocab={"<|im_end|>": stop, "x": other}))
        else:
            model.generation_config.eos_token_id = other
            policy = TransformersPolicy(model, None)
            params = SamplingParams(top_k=1, max_new_tokens=12, stop_token_ids=(stop,))
        generation = policy.generate([GenerationRequest(context, params)])[0]
    finally:
        model.generation_config.eos_token_id = old_eos
    assert generation.token_ids == tokens[: at + 1]  # the stop token is included ...
    assert generation.logprobs[-1] == 0.0  # ... with its log-prob (greedy: log 1)
    assert generation.finish_reason == "stop"


def test_length_limit_gives_length_and_rows_finish_independently(model):
    policy = TransformersPolicy(model, None)
    policy.stop_token_ids = frozenset()
    generations = policy.generate([
        GenerationRequest(prompt(5), SamplingParams(top_k=10, max_new_tokens=3), seed=0),
        GenerationRequest(prompt(9), SamplingParams(top_k=10, max_new_tokens=7), seed=0),
    ])
    assert [len(g.token_ids) for g in generations] == [3, 7]
    assert [g.finish_reason for g in generations] == ["length", "length"]


def test_end_of_turn_ids_collects_every_source():
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[1, 2]))
    tokenizer = FakeTokenizer(eos_token_id=5, vocab={"<|im_end|>": 6, "<|eot_id|>": 7, "hello": 8})
    assert end_of_turn_ids(model, tokenizer) == {1, 2, 5, 6, 7}
    model = SimpleNamespace(generation_config=None, config=SimpleNamespace(eos_token_id=9))
    assert end_of_turn_ids(model, None) == {9}


# ---------------------------------------------------------------- seeds


def test_seeded_results_are_reproducible_and_independent_of_the_batch(model, policy):
    params = SamplingParams(top_k=30, top_p=0.95, max_new_tokens=8)
    target = GenerationRequest(prompt(7), params, seed=42)
    alone = policy.generate([target])[0]
    crowd = policy.generate([
        GenerationRequest(prompt(12, start=3), SamplingParams(max_new_tokens=2), seed=1),
        GenerationRequest(prompt(7), params, seed=43),
        target,
        GenerationRequest(prompt(3, start=60), params, seed=2),
    ])
    assert crowd[2].token_ids == alone.token_ids and crowd[2].candidates == alone.candidates
    assert crowd[2].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert crowd[1].token_ids != alone.token_ids  # another seed, another sample
    small_batches = TransformersPolicy(model, None, max_batch_size=1)
    assert small_batches.generate([target])[0].token_ids == alone.token_ids


def test_unseeded_requests_differ(policy):
    params = SamplingParams(max_new_tokens=8)
    a, b = policy.generate([GenerationRequest(prompt(5), params), GenerationRequest(prompt(5), params)])
    assert a.token_ids != b.token_ids


def test_a_group_larger_than_max_batch_size_is_split_with_the_same_samples(model, policy):
    params = SamplingParams(top_k=10, max_new_tokens=4)
    requests = [GenerationRequest(prompt(6), params, seed=s) for s in range(5)]
    small = TransformersPolicy(model, None, max_batch_size=2)
    split = small.generate(requests)
    whole = policy.generate(requests)
    assert [g.token_ids for g in split] == [g.token_ids for g in whole]
    assert [g.num_prompt_tokens_processed for g in split] == [6, 0, 6, 0, 6]


# ---------------------------------------------------------------- weights


def test_set_weights_changes_outputs_version_and_drops_sessions(model, tmp_path):
    policy = TransformersPolicy(tiny_model(seed=0), None, version=3)
    params = SamplingParams(top_k=20, max_new_tokens=6)
    request = GenerationRequest(prompt(6), params, seed=9, session="s")
    before = policy.generate([request])[0]
    assert before.policy_version == 3

    other = tiny_model(seed=1)
    policy.set_weights(other.state_dict(), version=4)
    after = policy.generate([GenerationRequest(prompt(6), params, seed=9, session="s")])[0]
    assert after.policy_version == 4 and policy.version == 4
    assert after.num_prompt_tokens_processed == 6  # the session cache was dropped
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
    expected = TransformersPolicy(other, None).generate([GenerationRequest(prompt(6), params, seed=9)])[0]
    assert after.token_ids == expected.token_ids

    # From a checkpoint directory and from a safetensors file.
    back = tiny_model(seed=0)
    back.save_pretrained(tmp_path / "ckpt")
    policy.set_weights(tmp_path / "ckpt", version=5)
    assert policy.generate([GenerationRequest(prompt(6), params, seed=9)])[0].token_ids == before.token_ids
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(tmp_path / "w.safetensors"))
    policy.set_weights(str(tmp_path / "w.safetensors"), version=6)
    assert policy.generate([GenerationRequest(prompt(6), params, seed=9)])[0].token_ids == expected.token_ids
    assert policy.version == 6


def test_set_weights_rejects_foreign_or_partial_state_dicts(tmp_path):
    policy = TransformersPolicy(tiny_model(), None)
    state = policy.model.state_dict()
    with pytest.raises(ValueError, match="not in the model"):
        policy.set_weights({**state, "extra.weight": torch.zeros(1)}, version=1)
    partial = {k: v for k, v in state.items() if "layers.1." not in k}
    with pytest.raises(ValueError, match="missing"):
        policy.set_weights(partial, version=1)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        policy.set_weights(tmp_path, version=1)
    assert policy.version == 0


# ---------------------------------------------------------------- async


def test_agenerate_batches_concurrent_requests(model, policy):
    params = SamplingParams(top_k=10, max_new_tokens=4)
    policy.stop_token_ids = frozenset()  # every row runs to the length limit
    requests = [GenerationRequest(prompt(6), params, seed=s) for s in range(3)]
    requests.append(GenerationRequest(prompt(4, start=20), params, seed=7))

    async def main():
        return await asyncio.gather(*(policy.agenerate(r) for r in requests))

    counter = TokenCounter(model)
    try:
        results = asyncio.run(main())
    finally:
        counter.close()
    policy.close()
    # Two prefills (the group's prompt once, the other prompt), then 3 decode steps of all 4 rows.
    assert counter.num_calls == 2 + 3 and counter.num_tokens == 6 + 4 + 3 * 4
    expected = policy.generate(requests)
    assert [g.token_ids for g in results] == [g.token_ids for g in expected]
    assert isinstance(policy, Policy)


def test_static_batching_decodes_concurrent_requests_as_one_batch(model):
    policy = TransformersPolicy(model, None, continuous_batching=False)
    params = SamplingParams(top_k=10, max_new_tokens=4)
    requests = [GenerationRequest(prompt(6), params, seed=s) for s in range(3)]
    requests.append(GenerationRequest(prompt(4, start=20), params, seed=7))
    batches = []
    original = policy.generate

    def recording_generate(batch):
        batches.append(len(batch))
        return original(batch)

    policy.generate = recording_generate

    async def main():
        return await asyncio.gather(*(policy.agenerate(r) for r in requests))

    results = asyncio.run(main())
    policy.close()
    assert batches == [4]
    assert [g.token_ids for g in results] == [g.token_ids for g in original(requests)]


def test_a_request_joins_a_running_batch_and_samples_as_alone(model, policy):
    """Continuous batching: a request that arrives while others decode joins them at the next step."""
    policy.stop_token_ids = frozenset()
    long = [GenerationRequest(prompt(8, start=s), SamplingParams(top_k=10, max_new_tokens=12), seed=s)
            for s in range(2)]
    late = GenerationRequest(prompt(20, start=40), SamplingParams(top_k=10, max_new_tokens=5), seed=9)
    alone = policy.generate([late])[0].token_ids + [t for g in policy.generate(long) for t in g.token_ids]
    policy._prefixes.clear()  # the late prompt prefills afresh, not from the prefix kept just now

    async def main():
        first = [asyncio.ensure_future(policy.agenerate(r)) for r in long]
        while counter.num_calls < 3:  # the long rows are decoding
            await asyncio.sleep(0.001)
        joined = await policy.agenerate(late)
        return joined, await asyncio.gather(*first)

    counter = TokenCounter(model)
    try:
        joined, firsts = asyncio.run(main())
    finally:
        counter.close()
    policy.close()
    assert joined.token_ids + [t for g in firsts for t in g.token_ids] == alone
    # The late row decoded beside the long ones: fewer model calls than one batch after the other
    # (2 prefills + 11 steps, then 1 prefill + 4 steps = 18).
    assert counter.num_calls < 18, counter.num_calls
    assert joined.num_prompt_tokens_processed == 20


def test_set_weights_waits_for_rows_in_flight_and_stamps_one_version(model):
    policy = TransformersPolicy(copy_model(model), None)
    policy.stop_token_ids = frozenset()
    params = SamplingParams(top_k=10, max_new_tokens=60)
    request = GenerationRequest(prompt(8), params, seed=1)
    reference = TransformersPolicy(copy_model(model), None)
    reference.stop_token_ids = frozenset()
    old = reference.generate([request])[0]
    new_weights = {k: v + 0.01 for k, v in policy.model.state_dict().items()}

    async def main():
        running = asyncio.ensure_future(policy.agenerate(request))
        while counter.num_calls < 3:  # decoding has started
            await asyncio.sleep(0.001)
        update = asyncio.get_running_loop().run_in_executor(None, policy.set_weights, new_weights, 5)
        first = await running
        await update
        return first, await policy.agenerate(request)

    counter = TokenCounter(policy.model)
    try:
        first, second = asyncio.run(main())
    finally:
        counter.close()
    policy.close()
    assert counter.num_calls > 3 + 5  # the update really came while the first row was decoding
    # The row in flight finished on the old weights, all 60 tokens, and says so; the next one is new.
    assert first.token_ids == old.token_ids and first.logprobs == pytest.approx(old.logprobs, abs=1e-6)
    assert first.policy_version == 0 and second.policy_version == 5
    assert second.logprobs != pytest.approx(old.logprobs, abs=1e-6)


def test_agenerate_keeps_the_event_loop_free_and_propagates_errors(model):
    policy = TransformersPolicy(model, None)
    params = SamplingParams(top_k=10, max_new_tokens=4)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        generation = await policy.agenerate(GenerationRequest(prompt(6), params, seed=1))
        task.cancel()
        with pytest.raises(ValueError, match="same session"):
            await asyncio.gather(
                policy.agenerate(GenerationRequest([5], params, session="x")),
                policy.agenerate(GenerationRequest([6], params, session="x")),
            )
        return generation, ticks

    generation, ticks = asyncio.run(main())
    policy.close()
    assert len(generation.token_ids) >= 1 and ticks > 1
