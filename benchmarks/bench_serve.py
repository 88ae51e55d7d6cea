"""``treerl serve`` under load, side by side with the same load through the rollout engine directly.

    python benchmarks/bench_serve.py                 # writes the "## treerl serve under load" section

Server side: ``treerl serve`` in its own process (the shipped tiny model, the trajectory file
on), and 64 concurrent clients for ``--seconds`` (default 60) in this process, each the
plain-``openai`` Calculator agent of ``examples/openai_agent.py`` playing episodes back to
back (chat requests with the calculator tool, tool results sent back, a reward posted).
Counted: HTTP statuses (every 5xx), chat-request latency as the client sees it, sampled
tokens per second, and that every rewarded episode is in the trajectory file exactly once.

Engine side: the rollout engine on the same model and sampling parameters, playing the same
episodes (Calculator tasks, at most 4 turns, the first reply without a tool call is the answer,
as the agent plays them; 64 episodes in flight, group size 1, the server's 2048-token episode
limit) for the same time, in this process; latency is one generation request as the engine
awaits it, tokens/s the sampled tokens.
The two alternate ``--runs`` times; the ratios are medians.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _common import write_section  # noqa: E402
from openai_agent import run_episode  # noqa: E402

from treerl.agents import SamplingParams, TransformersPolicy  # noqa: E402
from treerl.envs import ToolEnv  # noqa: E402
from treerl.envs.builtin.calculator import CalculatorEnv  # noqa: E402
from treerl.rollout import read_groups  # noqa: E402
from treerl.rollout.engine import RolloutEngine  # noqa: E402

SECTION = "## treerl serve under load"
ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def own_cpu_s() -> float:
    """CPU seconds (user + system) this process has used so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) another process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def start_server(out: Path, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "treerl.cli", "serve", "--port", str(port), "--out", str(out),
                               "--max-new-tokens", "64", "--log-level", "error", "--num-threads", "1"], cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.5)
    server.kill()
    raise TimeoutError("treerl serve did not start")


def server_side(args, run: int) -> dict:
    import openai

    out = Path(args.workdir) / f"serve-{run}.jsonl"
    out.unlink(missing_ok=True)
    port = 18000 + run
    server = start_server(out, port)
    latencies, statuses, lock = [], {}, threading.Lock()

    def on_request(request):
        request.extensions["start"] = time.perf_counter()

    def on_response(response):
        with lock:
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.request.url.path.endswith("/chat/completions"):
                latencies.append(time.perf_counter() - response.request.extensions["start"])

    http = httpx.Client(event_hooks={"request": [on_request], "response": [on_response]}, timeout=600,
                        limits=httpx.Limits(max_connections=args.clients * 2, max_keepalive_connections=args.clients))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", http_client=http, max_retries=0)
    rewarded, tokens, errors = [], [0], []
    deadline = time.monotonic() + args.seconds

    def agent(worker: int) -> None:
        k = 0
        while time.monotonic() < deadline:  # episodes started before the deadline are played to the end
            try:
                result = run_episode(client, seed=worker * 100_000 + k, max_tokens=64,
                                     episode_id=f"w{worker}-{k}-{uuid.uuid4().hex[:6]}")
            except Exception as exc:  # a failed request is counted (its status is in `statuses`), not fatal
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                k += 1
                continue
            with lock:
                rewarded.append(result.episode_id)
                tokens[0] += sum(r.usage.completion_tokens for r in result.responses)
            k += 1

    start, cpu_start = time.monotonic(), own_cpu_s() + process_cpu_s(server.pid)
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(agent, range(args.clients)))
    wall = time.monotonic() - start
    cpu = own_cpu_s() + process_cpu_s(server.pid) - cpu_start  # the server's and the clients'
    stats = httpx.get(f"http://127.0.0.1:{port}/v1/stats").json()
    server.terminate()
    server.wait(timeout=60)
    recorded = [e.metrics["episode_id"] for g in read_groups(out) for e in g.episodes]
    return {
        "requests": len(latencies), "episodes": len(rewarded), "statuses": statuses,
        "status_5xx": sum(n for s, n in statuses.items() if s >= 500), "errors": errors[:3],
        "recorded_once": sorted(recorded) == sorted(rewarded) and len(set(recorded)) == len(recorded),
        "recorded": len(recorded), "p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99),
        "tokens_per_s": tokens[0] / wall, "wall_s": wall, "tokens_per_cpu_s": tokens[0] / cpu, "cpu_s": cpu,
        "server_metrics": stats["metrics"],
    }


class AgentRulesCalculator(CalculatorEnv):
    """Calculator played by the agent's rule: the first reply without a tool call is the final answer."""

    is_final = ToolEnv.is_final


class TimedPolicy:
    """The engine's policy, with each generation request timed and its sampled tokens counted."""

    def __init__(self, policy):
        self.policy, self.latencies, self.tokens = policy, [], 0
        self.version = policy.version

    async def agenerate(self, request):
        start = time.perf_counter()
        gen = await self.policy.agenerate(request)
        self.latencies.append(time.perf_counter() - start)
        self.tokens += len(gen.token_ids)
        return gen

    def end_session(self, session):
        self.policy.end_session(session)


def engine_side(args, model, tok) -> dict:
    policy = TimedPolicy(TransformersPolicy(model, tok))
    engine = RolloutEngine(policy, tok, params=SamplingParams(max_new_tokens=64), max_concurrency=args.clients,
                           max_episode_tokens=2048, seed=int(time.time()))

    async def for_a_while() -> tuple[float, int, list[float]]:
        # More tasks than the window can play (the engine starts them as slots free up); stopped at the deadline.
        start, cpu_start = time.monotonic(), own_cpu_s()
        job = asyncio.create_task(engine.run(AgentRulesCalculator, "treerl/Calculator-v0", range(20_000), 1))
        await asyncio.wait({job}, timeout=args.seconds)
        wall, tokens, latencies = time.monotonic() - start, policy.tokens, list(policy.latencies)
        cpu = own_cpu_s() - cpu_start
        job.cancel()
        try:
            await job
        except asyncio.CancelledError:
            pass
        return wall, tokens, latencies, cpu

    wall, tokens, latencies, cpu = asyncio.run(for_a_while())
    policy.policy.close()
    return {"requests": len(latencies), "p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99),
            "tokens_per_s": tokens / wall, "wall_s": wall, "tokens_per_cpu_s": tokens / cpu, "cpu_s": cpu}


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/treerl-bench-serve")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    from treerl.models import load_default_model

    torch.set_num_threads(1)  # as the server: one torch thread each (a shared 2-core CPU thrashes with more)
    model, tok = load_default_model()
    rows, loads = [], [load_average()]
    for run in range(args.runs):
        s = server_side(args, run)
        loads.append(load_average())
        e = engine_side(args, model, tok)
        loads.append(load_average())
        rows.append((s, e))
        print(json.dumps({"run": run, "serve": {k: v for k, v in s.items() if k != "server_metrics"}, "engine": e}),
              flush=True)

    def med(side: int, key: str) -> float:
        return statistics.median(r[side][key] for r in rows)

    tps_ratio = statistics.median(s["tokens_per_s"] / max(e["tokens_per_s"], 1e-9) for s, e in rows)
    p50_ratio = statistics.median(s["p50_s"] / max(e["p50_s"], 1e-9) for s, e in rows)
    cpu_ratio = statistics.median(s["tokens_per_cpu_s"] / max(e["tokens_per_cpu_s"], 1e-9) for s, e in rows)
    total_5xx = sum(s["status_5xx"] for s, _ in rows)
    body = f"""`python benchmarks/bench_serve.py --clients {args.clients} --seconds {args.seconds:g} --runs {args.runs}`
({datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch
{torch.__version__}; the shipped tiny model; load average (1/5/15 min) over the runs: {', '.join(loads)}).

{args.clients} concurrent clients (the plain-`openai` Calculator agent of `examples/openai_agent.py`, episodes
back to back, a reward posted after each) against `treerl serve` in its own process for {args.seconds:g} s, then
the rollout engine on the same model with {args.clients} of the same episodes in flight for {args.seconds:g} s
(Calculator tasks, at most 4 turns, the first reply without a tool call is the answer; one torch thread on
each side); {args.runs} alternating runs, medians. Latency: a chat request as the client sees it (HTTP, JSON,
rendering, recording, batching) vs. a generation request as the engine awaits it. The clients share the
machine's {os.cpu_count()} cores with the server, and the server's tokens/s counts the tail after the deadline
in which the started episodes finish with fewer clients left (so it is, if anything, low). On a machine
shared with other jobs the serve side's two processes (server and clients) get a larger share of the
cores than the engine's one process, which favours serve in the tokens/s row; tokens per CPU-second
(all processes of a side, user + system) is the comparison that does not depend on that share.

| | `treerl serve` (HTTP) | engine directly | serve / engine |
|---|---|---|---|
| requests (median per run) | {med(0, 'requests'):.0f} | {med(1, 'requests'):.0f} | |
| p50 latency | {med(0, 'p50_s') * 1000:.0f} ms | {med(1, 'p50_s') * 1000:.0f} ms | {p50_ratio:.2f}x |
| p99 latency | {med(0, 'p99_s') * 1000:.0f} ms | {med(1, 'p99_s') * 1000:.0f} ms | |
| sampled tokens/s | {med(0, 'tokens_per_s'):.0f} | {med(1, 'tokens_per_s'):.0f} | {tps_ratio:.2f}x |
| sampled tokens per CPU-second | {med(0, 'tokens_per_cpu_s'):.0f} | {med(1, 'tokens_per_cpu_s'):.0f} | {cpu_ratio:.2f}x |
| CPU seconds used (median per run) | {med(0, 'cpu_s'):.0f} | {med(1, 'cpu_s'):.0f} | |

Server side over all runs: {sum(s['requests'] for s, _ in rows)} chat requests, **{total_5xx} responses 5xx**
(statuses of all its responses per run, chat requests and reward posts: {', '.join(str(s['statuses']) for s, _ in rows)});
{sum(s['episodes'] for s, _ in rows)} episodes
rewarded, and each is in the trajectory file exactly once: {all(s['recorded_once'] for s, _ in rows)}.
"""
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
