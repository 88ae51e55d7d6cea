"""The policy interface and the pure sampler, against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from treerl.agents.policy import Generation, GenerationRequest, Policy, SamplingParams
from treerl.agents.sampling import (
    ProcessedLogits,
    candidate_lists,
    draw_uniforms,
    process_logits,
    sample,
    sample_processed,
)


def logits_of(*probs: float) -> torch.Tensor:
    """(1, V) logits whose softmax is ``probs`` (which sum to 1)."""
    return torch.log(torch.tensor([probs], dtype=torch.float32))


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("field", ["top_p", "min_p"])
def test_top_p_or_min_p_without_top_k_names_field_reason_and_fix(field):
    value = 0.9 if field == "top_p" else 0.1
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert f"SamplingParams.{field}={value}" in message
    assert "needs top_k" in message and "candidate set" in message
    assert "top_k=50" in message


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0, "top_k": 5}, "top_p"),
        ({"top_p": 1.5, "top_k": 5}, "top_p"),
        ({"min_p": 1.0, "top_k": 5}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_sampling_params_rejects_bad_values_by_name(kwargs, needle):
    with pytest.raises(ValueError, match=f"SamplingParams.{needle}"):
        SamplingParams(**kwargs)


def test_greedy_hint_in_temperature_message():
    with pytest.raises(ValueError, match="top_k=1"):
        SamplingParams(temperature=0)


def test_sampling_params_are_hashable_with_stop_ids_as_tuple():
    a = SamplingParams(top_k=5, stop_token_ids=[4, 5])  # type: ignore[arg-type]
    b = SamplingParams(top_k=5, stop_token_ids=(4, 5))
    assert a.stop_token_ids == (4, 5) and hash(a) == hash(b) and a == b


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        GenerationRequest([], SamplingParams())


def test_protocol_is_runtime_checkable():
    class Stub:
        version = 0

        def generate(self, requests):
            return [Generation([1], [0.0], None, "length", 0, 1) for _ in requests]

        async def agenerate(self, request):
            return self.generate([request])[0]

        def set_weights(self, weights, version):
            self.version = version

        def end_session(self, session):
            pass

        def close(self):
            pass

    assert isinstance(Stub(), Policy)
    assert not isinstance(object(), Policy)

    class Unclosable(Stub):
        close = None  # close() is part of the protocol: a backend must say how it releases what it holds

    assert not isinstance(Unclosable(), Policy)


# ---------------------------------------------------------------- process_logits


def test_temperature_only_is_full_vocab_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    p = process_logits(logits, SamplingParams(temperature=2.0))
    assert p.candidate_ids is None and p.num_candidates is None
    z = [0.5, 1.0, 2.0]
    log_total = math.log(sum(math.exp(x) for x in z))
    assert p.logprobs[0].tolist() == pytest.approx([x - log_total for x in z], abs=1e-6)


def test_top_k_keeps_k_most_likely_renormalized():
    p = process_logits(logits_of(0.1, 0.4, 0.2, 0.3), SamplingParams(top_k=2))
    assert p.candidate_ids.tolist() == [[1, 3]] and p.num_candidates.tolist() == [2]
    # 0.4 / 0.7 and 0.3 / 0.7
    assert p.logprobs.exp()[0].tolist() == pytest.approx([4 / 7, 3 / 7], abs=1e-6)
    assert candidate_lists(p) == [[1, 3]]


def test_top_p_keeps_smallest_prefix_reaching_mass():
    # sorted: 0.4, 0.3, 0.2, 0.1 -> masses before: 0, 0.4, 0.7, 0.9
    params = SamplingParams(top_k=4, top_p=0.7)
    p = process_logits(logits_of(0.1, 0.4, 0.2, 0.3), params)
    assert candidate_lists(p) == [[1, 3]]  # mass 0.7 reached by two tokens (0.4 + 0.3)
    params = SamplingParams(top_k=4, top_p=0.71)
    p = process_logits(logits_of(0.1, 0.4, 0.2, 0.3), params)
    assert candidate_lists(p) == [[1, 3, 2]]
    assert p.logprobs.exp()[0, :3].tolist() == pytest.approx([4 / 9, 3 / 9, 2 / 9], abs=1e-6)
    assert p.logprobs[0, 3].item() == -math.inf


def test_top_p_always_keeps_the_most_likely_token():
    p = process_logits(logits_of(0.1, 0.9), SamplingParams(top_k=2, top_p=0.01))
    assert candidate_lists(p) == [[1]] and p.logprobs[0, 0].item() == 0.0


def test_min_p_drops_tokens_below_fraction_of_max():
    # max 0.4; min_p 0.45 -> threshold 0.18: keeps 0.4, 0.3, 0.2, drops 0.1
    p = process_logits(logits_of(0.1, 0.4, 0.2, 0.3), SamplingParams(top_k=4, min_p=0.45))
    assert candidate_lists(p) == [[1, 3, 2]]
    assert p.logprobs.exp()[0, :3].tolist() == pytest.approx([4 / 9, 3 / 9, 2 / 9], abs=1e-6)


def test_top_p_applies_after_min_p_on_renormalized_mass():
    # top-k 4 then min_p 0.6 keeps 0.4 and 0.3 (0.3 >= 0.24), renormalized to 4/7 and 3/7.
    # top_p 0.5: the mass before the second is 4/7 = 0.571 >= 0.5, so only the first survives,
    # although on the top-k mass (0.4 < 0.5) the second would have.
    params = SamplingParams(top_k=4, min_p=0.6, top_p=0.5)
    p = process_logits(logits_of(0.1, 0.4, 0.2, 0.3), params)
    assert candidate_lists(p) == [[1]] and p.logprobs[0, 0].item() == 0.0
    params = SamplingParams(top_k=4, min_p=0.6, top_p=0.6)  # 0.571 < 0.6: both
    p = process_logits(logits_of(0.1, 0.4, 0.2, 0.3), params)
    assert candidate_lists(p) == [[1, 3]]
    assert p.logprobs.exp()[0, :2].tolist() == pytest.approx([4 / 7, 3 / 7], abs=1e-6)


def test_top_k_then_temperature_order():
    # Temperature flattens before top-k; top-k itself does not depend on temperature.
    logits = torch.tensor([[0.0, 1.0, 3.0]])
    p = process_logits(logits, SamplingParams(top_k=2, temperature=0.5))
    assert candidate_lists(p) == [[2, 1]]
    assert p.logprobs.exp()[0].tolist() == pytest.approx(
        [1 / (1 + math.exp(-4)), math.exp(-4) / (1 + math.exp(-4))], abs=1e-6
    )


def test_top_k_larger_than_vocab_is_whole_vocab_with_ids():
    p = process_logits(logits_of(0.5, 0.5), SamplingParams(top_k=10))
    assert sorted(candidate_lists(p)[0]) == [0, 1]


def test_rows_are_processed_independently():
    logits = torch.cat([logits_of(0.1, 0.4, 0.2, 0.3), logits_of(0.7, 0.1, 0.1, 0.1)])
    p = process_logits(logits, SamplingParams(top_k=4, top_p=0.65))
    assert candidate_lists(p) == [[1, 3], [0]]


# ---------------------------------------------------------------- sample_processed


def test_inverse_cdf_picks_by_cumulative_mass():
    processed = process_logits(logits_of(0.5, 0.3, 0.2), SamplingParams())
    expected = {0.0: 0, 0.49: 0, 0.51: 1, 0.79: 1, 0.81: 2, 0.999999: 2}
    uniforms = torch.tensor(list(expected))
    token_ids, logprobs = sample_processed(
        ProcessedLogits(processed.logprobs.expand(len(expected), -1), None, None), uniforms
    )
    assert token_ids.tolist() == list(expected.values())
    assert logprobs.tolist() == pytest.approx([math.log([0.5, 0.3, 0.2][t]) for t in expected.values()], abs=1e-6)


def test_uniform_near_one_never_draws_a_zero_probability_token():
    p = process_logits(logits_of(0.6, 0.3, 0.1), SamplingParams(top_k=3, top_p=0.5))  # support: {0}
    almost_one = torch.tensor([1.0 - 2**-24, 1.0])  # even a uniform that rounded up to 1
    p2 = ProcessedLogits(p.logprobs.expand(2, -1), p.candidate_ids.expand(2, -1), p.num_candidates.expand(2))
    token_ids, logprobs = sample_processed(p2, almost_one)
    assert token_ids.tolist() == [0, 0] and logprobs.tolist() == [0.0, 0.0]


def test_sample_is_reproducible_per_generator_and_matches_empirical_distribution():
    logits = logits_of(0.5, 0.3, 0.2)
    params = SamplingParams()
    draws = [sample(logits, params, [torch.Generator().manual_seed(s)]).token_ids.item() for s in range(3000)]
    freq = [draws.count(t) / len(draws) for t in range(3)]
    assert freq == pytest.approx([0.5, 0.3, 0.2], abs=0.04)
    again = [sample(logits, params, [torch.Generator().manual_seed(s)]).token_ids.item() for s in range(50)]
    assert again == draws[:50]


def test_sample_checks_one_generator_per_row():
    with pytest.raises(ValueError, match="one generator per row"):
        sample(torch.zeros(2, 3), SamplingParams(), [torch.Generator()])


def test_draw_uniforms_rows_follow_their_own_generators():
    u = draw_uniforms([torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)], num=3)
    assert u.shape == (2, 3) and u.dtype == torch.float32
    alone = draw_uniforms([torch.Generator().manual_seed(2)], num=3)
    assert torch.equal(u[1], alone[0])
