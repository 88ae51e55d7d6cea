"""Prefix sharing in TransformersPolicy: prompts with one long system prompt and different questions.

    python benchmarks/bench_prefix.py             # writes the "## Shared prompt prefixes" section

A Qwen3 built from a config (no download), a ``--system``-token system prompt (default 1,024)
and ``--questions`` different questions (default 16, 24 to 40 tokens each), one sampled token
per request so the time measured is the prefill. Two cases, each with prefix sharing on
(``min_shared_prefix=16``) and off (``min_shared_prefix=0``), the two sides alternating
``--runs`` times after a warm-up; ratios are medians of the per-run ratios:

- one call: the 16 requests in one ``generate`` call (a rollout step's tasks, a burst of clients);
- one at a time: 16 calls of one request each (a server's clients arriving one by one), the
  kept prefixes emptied before each run so the first request pays the full prompt.

Both sides' sampled tokens are compared (they must agree), and the prompt tokens the model
ran are counted from ``Generation.num_prompt_tokens_processed``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_section  # noqa: E402

from treerl.agents import GenerationRequest, SamplingParams, TransformersPolicy  # noqa: E402

SECTION = "## Shared prompt prefixes"


def build_requests(args) -> list[GenerationRequest]:
    rng = torch.Generator().manual_seed(0)
    system = torch.randint(10, args.vocab, (args.system,), generator=rng).tolist()
    params = SamplingParams(top_k=50, max_new_tokens=1)
    requests = []
    for k in range(args.questions):
        n = int(torch.randint(24, 41, (1,), generator=rng))
        question = torch.randint(10, args.vocab, (n,), generator=rng).tolist()
        requests.append(GenerationRequest(system + question, params, seed=k))
    return requests


def timed(policy: TransformersPolicy, requests, one_call: bool):
    policy._prefixes.clear()  # every run starts cold: the first prompt pays for the prefix
    start = time.perf_counter()
    if one_call:
        generations = policy.generate(requests)
    else:
        generations = [policy.generate([r])[0] for r in requests]
    seconds = time.perf_counter() - start
    return seconds, generations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--system", type=int, default=1024)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="Print without updating BENCHMARKS.md.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=args.hidden // 8, max_position_embeddings=4096)
    model = Qwen3ForCausalLM(config).eval()
    requests = build_requests(args)
    sharing = TransformersPolicy(model, None, continuous_batching=False)
    unshared = TransformersPolicy(model, None, continuous_batching=False, min_shared_prefix=0)
    rows = []
    one_call_name, one_by_one_name = f"one call of {args.questions} requests", f"{args.questions} calls of one request"
    for name, one_call in ((one_call_name, True), (one_by_one_name, False)):
        timed(sharing, requests, one_call), timed(unshared, requests, one_call)  # warm-up
        on, off, ratios = [], [], []
        for _ in range(args.runs):
            t_on, g_on = timed(sharing, requests, one_call)
            t_off, g_off = timed(unshared, requests, one_call)
            if [g.token_ids for g in g_on] != [g.token_ids for g in g_off]:
                raise SystemExit(f"{name}: sharing changed the sampled tokens")
            on.append(t_on)
            off.append(t_off)
            ratios.append(t_off / t_on)
        tokens_on = sum(g.num_prompt_tokens_processed for g in g_on)
        tokens_off = sum(g.num_prompt_tokens_processed for g in g_off)
        rows.append((name, statistics.median(on), statistics.median(off), statistics.median(ratios), ratios,
                     tokens_on, tokens_off))
        print(f"{name}: shared {statistics.median(on) * 1e3:.0f} ms ({tokens_on} prompt tokens), "
              f"unshared {statistics.median(off) * 1e3:.0f} ms ({tokens_off}), "
              f"ratio {statistics.median(ratios):.2f}x (runs {', '.join(f'{r:.2f}' for r in ratios)})")

    num_params = sum(p.numel() for p in model.parameters())
    command = "python benchmarks/bench_prefix.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    table = "\n".join(
        f"| {name} | {t_on * 1e3:.0f} ms, {k_on:,} prompt tokens | {t_off * 1e3:.0f} ms, {k_off:,} prompt tokens "
        f"| **{ratio:.2f}x** | {', '.join(f'{r:.2f}' for r in ratios)} |"
        for name, t_on, t_off, ratio, ratios, k_on, k_off in rows)
    body = f"""Command: `{command}` (run {datetime.date.today()}, torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s), {platform.machine()}).
{args.questions} prompts: one {args.system}-token system prompt, then 24-40 question tokens each; one sampled token per request (the prefill is what is timed), a {num_params / 1e6:.1f}M-parameter Qwen3 from a config. `TransformersPolicy` with prefix sharing (`min_shared_prefix=16`) vs without (`min_shared_prefix=0`), alternating {args.runs} times after a warm-up; kept prefixes emptied before every run. Both sides sampled the same tokens in every run (checked).

| case | prefix shared | no sharing | speed-up (median) | per-run speed-ups |
|---|---:|---:|---:|---|
{table}

"{one_call_name.capitalize()}" is a rollout step's prompts, or a burst of clients admitted together; "{one_by_one_name}" is a server's clients arriving one by one (the second cuts the first's kept prompt to the shared system prompt, later ones reuse it). The prompt tokens run fall {rows[0][6] / rows[0][5]:.1f}x; the time less, as each question still runs its own forward over the {args.system:,} cached positions.
This machine is shared with other jobs: absolute times are noise, the ratios are the figures."""
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
