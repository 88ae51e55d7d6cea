"""Streaming's cost and gain: the decode loop with and without a per-token callback, and ``treerl serve``
answering the same requests streamed and unstreamed.

    python benchmarks/bench_stream.py                 # writes the "## Streamed completions" section

Decode loop: the shipped tiny model's :class:`TransformersPolicy` (continuous batching, one
torch thread) samples ``--batch`` requests submitted together (fixed seeds, ``--max-tokens``
each), once with ``on_token=None`` (every unstreamed request) and once with the server's
callback on every request (:class:`treerl.serve.streaming.TokenRelay`: each id handed to
the event loop's queue); sampled tokens per second, the two alternated ``--runs`` times.

Server: ``treerl serve`` in its own process; ``--clients`` threads each send
``--requests`` chat requests (no tools, so every reply streams as it is sampled; seeds fixed,
so both modes sample the same tokens) with ``stream`` false, then true, alternated
``--runs`` times. Counted: sampled tokens per second over the run, the time to the first
content (streamed: the first content delta; unstreamed: the whole reply), and the time to the
whole reply.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_section  # noqa: E402
from bench_serve import load_average, percentile, start_server  # noqa: E402

from treerl.agents import ChatRenderer, SamplingParams, TransformersPolicy  # noqa: E402
from treerl.agents.policy import GenerationRequest  # noqa: E402
from treerl.serve.streaming import TokenRelay  # noqa: E402

SECTION = "## Streamed completions"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def decode_side(policy: TransformersPolicy, prompt: list[int], args, streamed: bool) -> dict:
    async def run() -> tuple[float, int, int]:
        queue: asyncio.Queue = asyncio.Queue()
        relay = TokenRelay(asyncio.get_running_loop())
        requests = [GenerationRequest(prompt, SamplingParams(max_new_tokens=args.max_tokens), seed=1000 + i,
                                      on_token=relay.sink(queue, i) if streamed else None)
                    for i in range(args.batch)]
        start = time.perf_counter()
        generations = await asyncio.gather(*(policy.agenerate(r) for r in requests))
        wall = time.perf_counter() - start
        await asyncio.sleep(0)  # the last ids handed over reach the queue
        return wall, sum(len(g.token_ids) for g in generations), queue.qsize()

    wall, tokens, reported = asyncio.run(run())
    assert reported == (tokens if streamed else 0), (reported, tokens)
    return {"tokens": tokens, "tokens_per_s": tokens / wall}


def server_side(url: str, args, streamed: bool, run: int) -> dict:
    import httpx
    import openai

    http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=args.clients * 2))
    client = openai.OpenAI(base_url=url, api_key="unused", http_client=http, max_retries=0)
    first, whole, tokens, lock = [], [], [0], threading.Lock()

    def one(worker: int) -> None:
        for k in range(args.requests):
            seed = worker * 1000 + k
            start = time.perf_counter()
            extra = {"extra_headers": {"X-Treerl-Record": "false"}}
            if streamed:
                ttfc, used = None, 0
                for c in client.chat.completions.create(model="treerl", messages=CHAT, max_tokens=args.max_tokens,
                                                        seed=seed, stream=True,
                                                        stream_options={"include_usage": True}, **extra):
                    if ttfc is None and c.choices and c.choices[0].delta.content:
                        ttfc = time.perf_counter() - start
                    if c.usage is not None:
                        used = c.usage.completion_tokens
            else:
                reply = client.chat.completions.create(model="treerl", messages=CHAT, max_tokens=args.max_tokens,
                                                       seed=seed, **extra)
                ttfc, used = None, reply.usage.completion_tokens
            done = time.perf_counter() - start
            with lock:
                first.append(done if ttfc is None else ttfc)
                whole.append(done)
                tokens[0] += used

    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(one, range(args.clients)))
    wall = time.perf_counter() - start
    http.close()
    return {"tokens": tokens[0], "tokens_per_s": tokens[0] / wall, "first_p50_s": percentile(first, 0.5),
            "whole_p50_s": percentile(whole, 0.5), "whole_p99_s": percentile(whole, 0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workdir", default="/tmp/treerl-bench-stream")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    from treerl.models import load_default_model

    torch.set_num_threads(1)  # as the server: one torch thread
    model, tok = load_default_model()
    policy = TransformersPolicy(model, tok)
    prompt = ChatRenderer(tok).prompt_ids(CHAT)
    loads = [load_average()]
    decode_rows = []
    decode_side(policy, prompt, args, False)  # warm-up: first-call costs land in neither column
    for run in range(args.runs):
        pair = (decode_side(policy, prompt, args, False), decode_side(policy, prompt, args, True))
        assert pair[0]["tokens"] == pair[1]["tokens"]  # the same seeds: the same tokens either way
        decode_rows.append(pair)
        print(json.dumps({"decode run": run, "plain": pair[0], "streamed": pair[1]}), flush=True)
    policy.close()
    loads.append(load_average())

    server = start_server(Path(args.workdir) / "unused.jsonl", 18100)
    serve_rows = []
    try:
        url = "http://127.0.0.1:18100/v1"
        server_side(url, argparse.Namespace(**{**vars(args), "requests": 1}), False, -1)  # warm-up
        for run in range(args.runs):
            pair = (server_side(url, args, False, run), server_side(url, args, True, run))
            serve_rows.append(pair)
            print(json.dumps({"serve run": run, "plain": pair[0], "streamed": pair[1]}), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    loads.append(load_average())

    def med(rows, side: int, key: str) -> float:
        return statistics.median(r[side][key] for r in rows)

    def ratio(rows, key: str) -> float:
        return statistics.median(b[key] / max(a[key], 1e-9) for a, b in rows)

    body = f"""`python benchmarks/bench_stream.py --batch {args.batch} --clients {args.clients} --requests {args.requests} \
--max-tokens {args.max_tokens} --runs {args.runs}`
({datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch
{torch.__version__}; the shipped tiny model, one torch thread; load average (1/5/15 min) before, between
and after: {', '.join(loads)}; a machine shared with other jobs, so only the ratios of runs side by side mean
something).

Decode loop: {args.batch} requests submitted together to `TransformersPolicy.agenerate` (continuous
batching), {args.max_tokens} tokens at most each, fixed seeds; without a callback (`on_token=None`, every
unstreamed request) and with the server's (`TokenRelay`: each id handed to the event loop's queue) on
every request; {args.runs} alternating runs, medians.

| decode loop | `on_token=None` | server callback on every request | with / without |
|---|---|---|---|
| sampled tokens/s | {med(decode_rows, 0, 'tokens_per_s'):.0f} | {med(decode_rows, 1, 'tokens_per_s'):.0f} | \
{ratio(decode_rows, 'tokens_per_s'):.3f}x |

`treerl serve` in its own process: {args.clients} client threads, {args.requests} chat requests each (no
tools, {args.max_tokens} tokens at most, fixed seeds: both modes sample the same tokens), unstreamed then
streamed, {args.runs} alternating runs, medians. Time to first content: the first content delta streamed;
the whole reply unstreamed.

| `treerl serve` | unstreamed | streamed | streamed / unstreamed |
|---|---|---|---|
| sampled tokens/s | {med(serve_rows, 0, 'tokens_per_s'):.0f} | {med(serve_rows, 1, 'tokens_per_s'):.0f} | \
{ratio(serve_rows, 'tokens_per_s'):.2f}x |
| time to first content, p50 | {med(serve_rows, 0, 'first_p50_s') * 1000:.0f} ms | \
{med(serve_rows, 1, 'first_p50_s') * 1000:.0f} ms | {ratio(serve_rows, 'first_p50_s'):.2f}x |
| time to the whole reply, p50 | {med(serve_rows, 0, 'whole_p50_s') * 1000:.0f} ms | \
{med(serve_rows, 1, 'whole_p50_s') * 1000:.0f} ms | {ratio(serve_rows, 'whole_p50_s'):.2f}x |
| time to the whole reply, p99 | {med(serve_rows, 0, 'whole_p99_s') * 1000:.0f} ms | \
{med(serve_rows, 1, 'whole_p99_s') * 1000:.0f} ms | |
"""
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
