"""TRL's repetition_penalty: transformers' and vLLM's penalty on every id of the context, applied before the
temperature, and recorded as part of the distribution each token was drawn from.

The references here are written independently of :mod:`treerl.agents.sampling`, in float64: for every
id v in the context (the whole prompt, earlier turns, tool results, the turn so far), the logit z_v
becomes z_v / p if z_v > 0 else z_v * p; then the temperature divides, then top-k keeps its ids.
"""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from treerl.agents.policy import GenerationRequest, SamplingOptions, SamplingParams
from treerl.agents.sampling import penalize_repetitions, process_logits, sample
from treerl.agents.transformers_policy import TransformersPolicy

VOCAB = 64


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                         eos_token_id=3)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # sharp distributions: repeats are likely unless penalized
    return model.eval()


def reference_logprobs(logits: list[float], context: list[int],
                       params: SamplingParams) -> tuple[dict[int, float], list[int] | None]:
    """{id: log-prob} of the penalized, tempered distribution (restricted to the top-k ids when set), and the
    top-k ids most likely first (None without top-k)."""
    seen = set(context)
    p = params.repetition_penalty
    z = [((x / p if x > 0 else x * p) if i in seen else x) / params.temperature for i, x in enumerate(logits)]
    support = sorted(range(len(z)), key=lambda i: -z[i])[: params.top_k] if params.top_k else list(range(len(z)))
    top = max(z[i] for i in support)
    log_total = top + math.log(sum(math.exp(z[i] - top) for i in support))
    return {i: z[i] - log_total for i in support}, (support if params.top_k else None)


def assert_penalized_records(model, prompt: list[int], generation, params: SamplingParams) -> int:
    """Every recorded log-prob (and candidate set) is the penalized distribution's over the whole context."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generation.token_ids[:-1]])).logits[0, len(prompt) - 1:].double()
    for t, token in enumerate(generation.token_ids):
        want, support = reference_logprobs(logits[t].tolist(), prompt + generation.token_ids[:t], params)
        assert generation.logprobs[t] == pytest.approx(want[token], abs=1e-5)
        if support is not None:
            assert generation.candidates[t] == support
    return len(generation.token_ids)


# ---------------------------------------------------------------- the sampler


def test_penalty_is_transformers_repetition_penalty_logits_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(1)
    scores = torch.randn(3, 20) * 4
    input_ids = torch.randint(0, 20, (3, 7))
    seen = torch.zeros(3, 20, dtype=torch.bool).scatter_(1, input_ids, True)
    want = RepetitionPenaltyLogitsProcessor(penalty=1.7)(input_ids, scores.clone())
    assert torch.equal(penalize_repetitions(scores, seen, 1.7), want)


def test_sampled_frequencies_follow_the_penalized_tempered_distribution():
    # Ids 1 and 2 are in the context: z = [1, 2, -1, 0.5] -> [1, 1, -2, 0.5], then / 0.5 -> [2, 2, -4, 1].
    params = SamplingParams(temperature=0.5, repetition_penalty=2.0)
    z = [2.0, 2.0, -4.0, 1.0]
    want = [math.exp(x) / sum(map(math.exp, z)) for x in z]
    n = 4000
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]]).expand(n, -1)
    seen = torch.tensor([[False, True, True, False]]).expand(n, -1)
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    out = sample(logits, params, generators, seen)
    counts = torch.bincount(out.token_ids, minlength=4).double() / n
    assert counts.tolist() == pytest.approx(want, abs=0.025)  # about 3.5 standard errors
    assert out.logprobs.tolist() == pytest.approx([math.log(want[t]) for t in out.token_ids.tolist()], abs=1e-6)


def test_the_penalty_applies_before_top_k_and_needs_the_context():
    # 2.0 in the context falls to 0.5 / 0.25 below the unseen 1.0: top-1 picks id 1, log-prob 0.
    logits = torch.tensor([[2.0, 1.0]])
    processed = process_logits(logits, SamplingParams(top_k=1, repetition_penalty=4.0), torch.tensor([[True, False]]))
    assert processed.candidate_ids.tolist() == [[1]] and processed.logprobs.tolist() == [[0.0]]
    with pytest.raises(ValueError, match="needs `seen`"):
        process_logits(logits, SamplingParams(repetition_penalty=1.2))
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="repetition_penalty=.* must be a finite number > 0"):
            SamplingParams(repetition_penalty=bad)


# ---------------------------------------------------------------- the transformers policy


def test_policy_records_the_penalized_tempered_logprobs(model):
    """A group (its shared prompt read once, cascade attention on), a lone prompt (left padding) and an
    unpenalized row in one batch: each records the distribution it was drawn from."""
    policy = TransformersPolicy(model, None, min_cascade_kv=1, min_shared_prefix=0)
    policy.stop_token_ids = frozenset()
    assert policy.cascade_reason is None
    penalized = SamplingParams(temperature=0.7, repetition_penalty=1.8, max_new_tokens=12)
    top_k = SamplingParams(temperature=1.3, top_k=8, repetition_penalty=0.6, max_new_tokens=12)
    group = [10, 11, 12, 10, 11, 12, 10, 11]
    requests = [GenerationRequest(group, penalized, seed=1, group="g"),
                GenerationRequest(group, penalized, seed=2, group="g"), GenerationRequest([20, 21, 22], top_k, seed=3),
                GenerationRequest([30, 31, 32, 33], SamplingParams(temperature=0.7, max_new_tokens=12), seed=4)]
    generations = policy.generate(requests)
    checked = sum(assert_penalized_records(model, r.prompt_ids, g, r.params) for r, g in zip(requests, generations))
    assert checked == 48
    # The penalty changed the distributions: the same seed without it samples other tokens or log-probs.
    plain = dict(vars(penalized), repetition_penalty=1.0)
    again = policy.generate([GenerationRequest(group, SamplingParams(**plain), seed=1)])[0]
    assert (again.token_ids, again.logprobs) != (generations[0].token_ids, generations[0].logprobs)


def test_a_session_turn_penalizes_earlier_turns_and_tool_results(model):
    """The context of a later turn is everything the model sees: the prompt, the first turn, the tool result."""
    policy = TransformersPolicy(model, None)
    policy.stop_token_ids = frozenset()
    params = SamplingParams(top_k=16, repetition_penalty=2.5, max_new_tokens=6)
    first = policy.generate([GenerationRequest([5, 6, 7], params, seed=0, session="ep")])[0]
    context = [5, 6, 7] + first.token_ids + [40, 41, 42]  # the tool result
    second = policy.generate([GenerationRequest(context, params, seed=1, session="ep")])[0]
    assert second.num_prompt_tokens_processed < len(context)  # continued from the session's cache
    assert_penalized_records(model, context, second, params)


def test_a_penalized_request_joining_a_running_batch_samples_as_alone(model):
    """Continuous batching: the batch builds its context mask when the first penalized row joins."""
    policy = TransformersPolicy(model, None)
    policy.stop_token_ids = frozenset()
    long = [GenerationRequest([8 + s, 9, 10], SamplingParams(top_k=10, max_new_tokens=14), seed=s) for s in range(2)]
    late = GenerationRequest([50, 51, 52, 50], SamplingParams(top_k=10, repetition_penalty=3.0, max_new_tokens=6),
                             seed=9)
    alone = policy.generate([late])[0]
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))

    async def main():
        first = [asyncio.ensure_future(policy.agenerate(r)) for r in long]
        while len(calls) < 3:  # the long rows are decoding
            await asyncio.sleep(0.001)
        joined = await policy.agenerate(late)
        return joined, await asyncio.gather(*first)

    try:
        joined, firsts = asyncio.run(main())
    finally:
        handle.remove()
        policy.close()
    assert len(calls) < 2 + 13 + 1 + 5  # the late row decoded beside the long ones
    assert (joined.token_ids, joined.candidates) == (alone.token_ids, alone.candidates)
    assert joined.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    for request, generation in zip(long, firsts):
        assert_penalized_records(model, request.prompt_ids, generation, request.params)


def test_an_unpenalized_row_joining_after_the_penalized_ones_left_keeps_the_context_mask_whole(model):
    """The batch's mask outlives its penalized rows (until the batch empties): rows that join later, with no
    penalty of their own, still need their mask rows, or the next step indexes past the mask."""
    from treerl.agents.decode import DecodeBatch, Row

    policy = TransformersPolicy(model, None)
    policy.stop_token_ids = frozenset()
    plain = SamplingParams(top_k=10, max_new_tokens=12)
    waves = [[GenerationRequest([8, 9, 10], plain, seed=0),
              GenerationRequest([5, 6, 7, 5], SamplingParams(top_k=10, repetition_penalty=2.0, max_new_tokens=2),
                                seed=1)],
             [GenerationRequest([20, 21], SamplingParams(top_k=10, max_new_tokens=4), seed=2)]]
    alone = [policy.generate([r])[0] for wave in waves for r in wave]
    batch, results, index = DecodeBatch(policy), {}, 0
    with torch.inference_mode():
        for step in range(20):
            if step in (0, 4) and waves:  # the second wave joins after the penalized row stopped
                requests = waves.pop(0)
                units = policy._plan_units(requests)
                batch.admit(units, [[Row(index + i, requests[i], frozenset(), policy.version) for i in unit.rows]
                                    for unit in units])
                index += len(requests)
            if len(batch):
                results.update((row.index, row.generation()) for row in batch.step())
    assert sorted(results) == [0, 1, 2]
    for i, want in enumerate(alone):
        assert results[i].token_ids == want.token_ids and results[i].candidates == want.candidates
        assert results[i].logprobs == pytest.approx(want.logprobs, abs=1e-5)


# ---------------------------------------------------------------- vLLM


def test_vllm_policies_pass_the_penalty_to_vllm(monkeypatch):
    import _vllm_fake_engine as fake

    from treerl.agents.vllm_policy import VLLMPolicy, to_vllm_sampling_kwargs
    from treerl.agents.vllm_server_policy import completion_request

    request = GenerationRequest([1, 2], SamplingParams(top_k=4, repetition_penalty=1.3), seed=0)
    assert to_vllm_sampling_kwargs(request, frozenset())["repetition_penalty"] == 1.3
    assert completion_request(request, "m", frozenset())["repetition_penalty"] == 1.3

    class LLM(fake.FakeLLM):
        def get_tokenizer(self):
            return SimpleNamespace(eos_token_id=2, get_vocab=lambda: {})

        def complete(self, prompt_ids, sp):
            return SimpleNamespace(token_ids=[9], logprobs=[{9: fake.lp(0.0)}], finish_reason="length"), 0

    fake.install_fake_vllm(monkeypatch, LLM)
    policy = VLLMPolicy("tiny/model")
    policy.generate([GenerationRequest([1], SamplingParams(repetition_penalty=1.15))])
    (_, [sp]), = policy.llm.calls
    assert sp.repetition_penalty == 1.15


# ---------------------------------------------------------------- serve


def test_serve_takes_repetition_penalty_as_vllms_extra_body_field(tmp_path):
    """``treerl serve`` reads ``repetition_penalty`` from a request as vLLM's server does (``extra_body``), the
    server's --repetition-penalty otherwise, and records the penalized distribution over the conversation."""
    pytest.importorskip("fastapi", reason="treerl serve needs the serve extra (fastapi, uvicorn)")
    openai = pytest.importorskip("openai", reason="the openai client is a test dependency")
    from _serve_helpers import running_server

    from treerl.models import load_default_model

    model, tokenizer = load_default_model()
    messages = [{"role": "user", "content": "Say apple apple apple."}]
    with running_server(model, tokenizer, group_size=1, max_new_tokens=16, top_k=20,
                        repetition_penalty=1.2) as (url, recorder):
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        for episode, extra in (("asked", {"repetition_penalty": 1.7}), ("default", {})):
            client.chat.completions.create(model="treerl", messages=messages, max_tokens=12, seed=1, extra_body=extra,
                                           extra_headers={"X-Episode-Id": episode})
            client.post(f"/episodes/{episode}/reward", body={"reward": 0.0}, cast_to=object)
        with pytest.raises(openai.BadRequestError, match="repetition_penalty"):
            client.chat.completions.create(model="treerl", messages=messages, max_tokens=2,
                                           extra_body={"repetition_penalty": 0})
        groups = {g.task_key: g for g in recorder.finished}
    for episode, penalty in (("asked", 1.7), ("default", 1.2)):
        [path] = [e.path() for e in groups[episode].episodes]  # an episode without a task id is its own group
        context = [t for s in path[:-1] for t in s.token_ids]
        assert path[-1].kind == "sampled"
        assert_penalized_records(model, context, path[-1], SamplingParams(top_k=20, repetition_penalty=penalty))


# ---------------------------------------------------------------- options: learn, rollout, eval, serve


def test_grpo_config_and_every_command_take_repetition_penalty(tmp_path):
    from treerl.cli import build_parser
    from treerl.config import config_from_args
    from treerl.learners.async_grpo import AsyncGRPOConfig
    from treerl.learners.grpo import GRPOConfig
    from treerl.learners.sdpo import SDPOConfig
    from treerl.rollout.evaluate import EvalConfig
    from treerl.rollout.record import RolloutConfig
    from treerl.serve.config import ServeConfig

    for config in (GRPOConfig, SDPOConfig, AsyncGRPOConfig):
        cfg = config(output_dir="x", repetition_penalty=1.1)
        assert cfg.sampling().repetition_penalty == 1.1
        assert cfg.sampling(temperature=cfg.eval_temperature).repetition_penalty == 1.1  # TRL's eval samples alike
    assert SamplingOptions().sampling().repetition_penalty == 1.0
    parser = build_parser()
    args = parser.parse_args(["learn", "--output-dir", "x", "--repetition-penalty", "1.2"])
    assert config_from_args(GRPOConfig, args).sampling().repetition_penalty == 1.2
    (tmp_path / "c.yaml").write_text("repetition_penalty: 1.3\n")
    args = parser.parse_args(["learn", "--output-dir", "x", "--config", str(tmp_path / "c.yaml")])
    assert config_from_args(GRPOConfig, args).repetition_penalty == 1.3
    args = parser.parse_args(["rollout", "--out", "r.jsonl", "--repetition-penalty", "1.4"])
    assert config_from_args(RolloutConfig, args).sampling().repetition_penalty == 1.4
    args = parser.parse_args(["eval", "--repetition-penalty", "1.5"])
    assert config_from_args(EvalConfig, args).sampling().repetition_penalty == 1.5
    assert ServeConfig(repetition_penalty=1.6).sampling().repetition_penalty == 1.6
    with pytest.raises(ValueError, match="repetition_penalty=0.0 must be a finite number > 0"):
        GRPOConfig(output_dir="x", repetition_penalty=0.0)


def test_a_rollout_records_the_penalized_distribution_over_the_whole_episode(tmp_path):
    """``treerl rollout --repetition-penalty``: every sampled turn of a multi-turn episode (tool results
    between turns) records the log-probs of the penalty over everything before it."""
    from treerl.cli import main
    from treerl.models import load_default_model
    from treerl.rollout import read_groups

    out = tmp_path / "r.jsonl"
    assert main(["rollout", "--out", str(out), "--num-tasks", "1", "--group-size", "2", "--max-new-tokens", "24",
                 "--top-k", "20", "--repetition-penalty", "1.5", "--progress", "false", "--seed", "3"]) == 0
    model, _ = load_default_model()
    groups = list(read_groups(out))
    params = SamplingParams(top_k=20, repetition_penalty=1.5)
    checked = 0
    for group in groups:
        assert group.info["sampling"]["repetition_penalty"] == 1.5
        for episode in group.episodes:
            context = []
            for segment in episode.path():
                if segment.kind == "sampled":
                    checked += assert_penalized_records(model, context, segment, params)
                context += segment.token_ids
    assert checked > 24


def test_grpo_trains_on_penalized_samples_with_importance_weights_that_see_the_penalty(tmp_path):
    """The trainer's log-probs are the model's (unpenalized, as TRL's): the ratios to the recorded penalized
    log-probs are no longer 1 (they are at penalty 1, see test_learn), and what they correct stays finite."""
    from treerl.learners.grpo import GRPOConfig, train
    from treerl.models import load_default_model

    model, tok = load_default_model()
    cfg = GRPOConfig(output_dir=str(tmp_path), steps=1, tasks_per_step=2, group_size=2, max_new_tokens=24, top_k=20,
                     repetition_penalty=1.3, skip_zero_advantage=False, eval_episodes=0, progress=False, num_threads=1)
    train(cfg, model=model, tokenizer=tok)
    [m] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(m["loss/policy"]) and math.isfinite(m["is/ratio_mean"])
    assert abs(m["is/ratio_mean"] - 1.0) > 1e-3
