"""Rollout throughput, measured side by side in one run.

    python benchmarks/bench_rollout.py            # writes the "## Rollout" section of BENCHMARKS.md

1. Generation: treerl's policy (the engine's generation path: the group's prompt prefilled
   once, batched decoding with a KV cache) vs ``model.generate(num_return_sequences=G)`` on the
   same model, prompt and sampling parameters: single turn, G=8, a 512-token prompt, 128 new
   tokens, a Qwen3-architecture model of about 13M parameters built from a config. Tokens/s.
   Every run draws a new prompt (the same for both sides), so the policy's kept prefixes cannot
   spare it the prefill. The policy is also timed with its shared-prefix (cascade) decode
   attention off, to show what that part is worth.
2. Multi-turn Calculator episodes with a simulated 100 ms tool latency: the concurrent engine
   (32 episodes in flight) vs the same engine one episode at a time (a sequential loop).
   Episodes/s. Both replay the same seeds, so they produce the same trajectories.
3. Mixed turn lengths: the engine (32 episodes in flight, tool latency drawn per call between
   0 and 200 ms, turns of up to 96 tokens) with continuous batching (requests join the running
   batch between decode steps) vs static batches (a batch decodes until its longest row stops,
   then the next one starts). Episodes/s; the share of identical trajectories is reported
   (the samples are seeded per request, so only float-order differences of the batch can change
   a token).

Each comparison alternates the two sides and reports the median ratio of several runs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_section  # noqa: E402

import treerl  # noqa: E402
from treerl.agents import GenerationRequest, SamplingParams, TransformersPolicy  # noqa: E402
from treerl.envs.builtin.calculator import CalculatorEnv  # noqa: E402
from treerl.envs.builtin.calculator_tasks import calculator  # noqa: E402
from treerl.envs.tools import tool  # noqa: E402
from treerl.rollout.engine import RolloutEngine  # noqa: E402

SECTION = "## Rollout"


def build_model(vocab: int, hidden: int, layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=None, bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def bench_generation(args) -> dict:
    model = build_model(args.vocab, args.hidden, args.layers)
    num_params = sum(p.numel() for p in model.parameters())
    params = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=args.new_tokens)
    policy = TransformersPolicy(model, None)
    per_row_policy = TransformersPolicy(model, None, cascade_attention=False)
    tokens = args.group_size * args.new_tokens

    def ours(policy=policy) -> float:
        requests = [GenerationRequest(prompt_ids=prompt[0].tolist(), params=params, seed=i, group="p")
                    for i in range(args.group_size)]
        start = time.perf_counter()
        out = policy.generate(requests)
        elapsed = time.perf_counter() - start
        assert sum(len(g.token_ids) for g in out) == tokens, "every sample must run the full length"
        return elapsed

    def baseline() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, do_sample=True, temperature=1.0, top_k=50, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, num_return_sequences=args.group_size,
                                 attention_mask=torch.ones_like(prompt), pad_token_id=0)
        elapsed = time.perf_counter() - start
        assert out.shape == (args.group_size, args.prompt_len + args.new_tokens)
        return elapsed

    ratios, t_ours, t_base, per_row_ratios = [], [], [], []
    for run in range(args.runs + 1):  # run 0 warms up: allocator, kernels, caches
        prompt = torch.randint(1, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(run))
        a, b, c = ours(), baseline(), ours(per_row_policy)
        if run:
            t_ours.append(a)
            t_base.append(b)
            ratios.append(b / a)
            per_row_ratios.append(b / c)
    policy.close()
    per_row_policy.close()
    return {
        "num_params": num_params,
        "ours_tps": tokens / statistics.median(t_ours),
        "base_tps": tokens / statistics.median(t_base),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "per_row_ratio": statistics.median(per_row_ratios),
        "per_row_ratios": per_row_ratios,
    }


class SlowToolCalculatorEnv(CalculatorEnv):
    """Calculator whose tool takes ``latency`` seconds (or, with ``jitter``, up to twice that, drawn
    from the expression so that a run repeats), as a remote tool would."""

    latency = 0.1
    jitter = False

    def __init__(self, **kwargs):
        latency, jitter = self.latency, self.jitter

        @tool(name="calculator", timeout=5.0)
        async def slow_calculator(expression: str) -> str:
            """Evaluate an arithmetic expression.

            Args:
                expression: Arithmetic using numbers, + - * / and parentheses, e.g. "(3 + 4) * 2".
            """
            await asyncio.sleep(latency * (2 * (sum(map(ord, expression)) % 101) / 100 if jitter else 1.0))
            return calculator(expression)

        super().__init__(tools=[slow_calculator], **kwargs)


class JitteryToolCalculatorEnv(SlowToolCalculatorEnv):
    jitter = True


def bench_multi_turn(args) -> dict:
    from treerl.models import load_default_model

    model, tok = load_default_model()
    params = SamplingParams(max_new_tokens=64)

    def play(concurrency: int) -> tuple[float, list[list[int]], int]:
        engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=params, max_concurrency=concurrency, seed=0)
        start = time.perf_counter()
        groups, stats = asyncio.run(engine.run(SlowToolCalculatorEnv, "bench/SlowCalculator", range(args.tasks), 4))
        elapsed = time.perf_counter() - start
        tool_calls = sum(stats.tool_calls.values())
        return elapsed, [e.token_ids for g in groups for e in g.episodes], tool_calls

    play(32)  # warm-up
    ratios, t_conc, t_seq = [], [], []
    tool_calls = 0
    for _ in range(args.runs):
        a, paths_a, tool_calls = play(32)
        b, paths_b, _ = play(1)
        assert paths_a == paths_b, "the concurrent and sequential runs must produce the same trajectories"
        t_conc.append(a)
        t_seq.append(b)
        ratios.append(b / a)
    episodes = args.tasks * 4
    return {
        "episodes": episodes,
        "tool_calls": tool_calls,
        "conc_eps": episodes / statistics.median(t_conc),
        "seq_eps": episodes / statistics.median(t_seq),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
    }


def bench_continuous(args) -> dict:
    from treerl.models import load_default_model

    model, tok = load_default_model()
    params = SamplingParams(max_new_tokens=96)

    def play(continuous: bool) -> tuple[float, list[list[int]]]:
        policy = TransformersPolicy(model, tok, continuous_batching=continuous)
        engine = RolloutEngine(policy, tok, params=params, max_concurrency=32, seed=0)
        start = time.perf_counter()
        groups, _ = asyncio.run(engine.run(JitteryToolCalculatorEnv, "bench/JitteryCalculator", range(args.tasks), 4))
        elapsed = time.perf_counter() - start
        policy.close()
        return elapsed, [e.token_ids for g in groups for e in g.episodes]

    play(True), play(False)  # warm-up
    ratios, t_cont, t_static, same = [], [], [], []
    for _ in range(args.runs):
        a, paths_a = play(True)
        b, paths_b = play(False)
        t_cont.append(a)
        t_static.append(b)
        ratios.append(b / a)
        same.append(sum(x == y for x, y in zip(paths_a, paths_b)) / len(paths_a))
    episodes = args.tasks * 4
    return {
        "episodes": episodes,
        "cont_eps": episodes / statistics.median(t_cont),
        "static_eps": episodes / statistics.median(t_static),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "same": min(same),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=16, help="Calculator tasks (x4 generations) for part 2.")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both sides (1: steadiest on a shared 2-core machine).")
    parser.add_argument("--no-write", action="store_true", help="Print without updating BENCHMARKS.md.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    gen = bench_generation(args)
    print(f"generation: ours {gen['ours_tps']:.0f} tok/s, model.generate {gen['base_tps']:.0f} tok/s, "
          f"ratio {gen['ratio']:.2f}x (runs {', '.join(f'{r:.2f}' for r in gen['ratios'])})")
    mt = bench_multi_turn(args)
    print(f"multi-turn: concurrent {mt['conc_eps']:.2f} ep/s, sequential {mt['seq_eps']:.2f} ep/s, "
          f"ratio {mt['ratio']:.2f}x (runs {', '.join(f'{r:.2f}' for r in mt['ratios'])})")
    cb = bench_continuous(args)
    print(f"continuous batching: {cb['cont_eps']:.2f} ep/s, static {cb['static_eps']:.2f} ep/s, "
          f"ratio {cb['ratio']:.2f}x (runs {', '.join(f'{r:.2f}' for r in cb['ratios'])}); "
          f"identical trajectories {cb['same']:.0%}")

    command = "python benchmarks/bench_rollout.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    body = f"""Command: `{command}` (run {datetime.date.today()}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {platform.machine()}).
Each line alternates the two sides {args.runs} times after a warm-up; the ratio is the median of the per-run ratios.

| comparison | treerl | baseline | ratio | target |
|---|---:|---:|---:|---:|
| single turn, G={args.group_size}, prompt {args.prompt_len}, {args.new_tokens} new tokens, top-k 50, {gen['num_params'] / 1e6:.1f}M-parameter Qwen3 from a config: policy (prompt prefilled once) vs `model.generate(num_return_sequences={args.group_size})` | {gen['ours_tps']:.0f} tok/s | {gen['base_tps']:.0f} tok/s | **{gen['ratio']:.2f}x** | >= 2x |
| multi-turn Calculator, shipped tiny model, 100 ms per tool call, {mt['episodes']} episodes ({mt['tool_calls']} tool calls): engine with 32 episodes in flight vs one at a time | {mt['conc_eps']:.2f} episodes/s | {mt['seq_eps']:.2f} episodes/s | **{mt['ratio']:.2f}x** | >= 3x |
| mixed turn lengths: Calculator, shipped tiny model, 0-200 ms per tool call, turns up to 96 tokens, {cb['episodes']} episodes, 32 in flight: continuous batching vs static batches | {cb['cont_eps']:.2f} episodes/s | {cb['static_eps']:.2f} episodes/s | **{cb['ratio']:.2f}x** | > 1x |

Per-run ratios: generation {', '.join(f'{r:.2f}' for r in gen['ratios'])} (a new prompt each run; the same policy with its shared-prefix decode attention off, `cascade_attention=False`: {gen['per_row_ratio']:.2f}x, per run {', '.join(f'{r:.2f}' for r in gen['per_row_ratios'])}); multi-turn {', '.join(f'{r:.2f}' for r in mt['ratios'])}; continuous batching {', '.join(f'{r:.2f}' for r in cb['ratios'])} (identical trajectories in every run: at least {cb['same']:.0%}; the rest differ by float order only, the samples being seeded per request).
Both multi-turn sides replay the same seeds and produce identical trajectories (checked by the script).
This machine is shared with other jobs: absolute rates are noise, the ratios are the figures."""
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
