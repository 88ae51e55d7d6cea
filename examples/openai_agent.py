"""A tool-using agent written with the plain ``openai`` client, played against ``treerl serve`` and trained by it.

The agent knows nothing of treerl's engine: it sends chat requests with a ``calculator`` tool
in OpenAI's format, runs the tool calls it gets back itself, appends the results, and stops
at the first reply without a tool call, which it grades (``\\boxed{}`` against the task's
answer). The Calculator tasks and grader come from ``treerl/Calculator-v0``. With
``X-Episode-Id`` / ``X-Task-Id`` headers the server ties its requests into episodes and
groups; the reward is posted to ``/v1/episodes/{id}/reward``.

    # evaluate (requests marked X-Treerl-Record: false are served, not recorded)
    python examples/openai_agent.py eval --base-url http://127.0.0.1:8000/v1 --episodes 64
    # generate training traffic: each task played --group-size times; with --follow-learner the
    # agent waits, after each wave of --wave tasks, until the learner published new weights
    python examples/openai_agent.py play --base-url http://127.0.0.1:8000/v1 --tasks 320 --group-size 8 \\
        --wave 8 --follow-learner

See the README section "Plug in an agent: `treerl serve`" for the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import treerl
from treerl.envs.builtin.calculator_tasks import calculator

MAX_TURNS = 4


@dataclass
class EpisodeResult:
    episode_id: str
    reward: float
    messages: list[dict[str, Any]]
    requests: list[list[dict[str, Any]]] = field(default_factory=list)
    """The messages each request sent, in order."""
    responses: list[Any] = field(default_factory=list)


def run_episode(client: Any, seed: int, *, task_id: str | None = None, record: bool = True, temperature: float = 1.0,
                max_tokens: int = 64, episode_id: str | None = None, post_reward: bool = True,
                sampling_seed: int | None = None) -> EpisodeResult:
    """Play one Calculator task (``seed``) with ``client`` (an ``openai.OpenAI``); returns what happened.

    ``sampling_seed`` seeds every request (an evaluation that repeats); None samples afresh.
    """
    env = treerl.make("treerl/Calculator-v0")
    messages, _ = env.reset(seed=seed)
    tools = env.tool_schemas
    episode_id = episode_id or f"agent-{uuid.uuid4().hex[:12]}"
    headers = {"X-Episode-Id": episode_id, "X-Treerl-Record": "true" if record else "false"}
    if task_id is not None:
        headers["X-Task-Id"] = task_id
    result = EpisodeResult(episode_id=episode_id, reward=0.0, messages=messages)
    for _ in range(MAX_TURNS):
        result.requests.append(json.loads(json.dumps(messages)))
        response = client.chat.completions.create(model="treerl", messages=messages, tools=tools,
                                                  temperature=temperature, max_tokens=max_tokens,
                                                  seed=sampling_seed, extra_headers=headers)
        result.responses.append(response)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:  # the final answer
            result.reward = env.score(env.task, message.content or "")
            break
        for call in message.tool_calls:
            try:
                output = calculator(**json.loads(call.function.arguments))
            except Exception as exc:  # the agent reports a bad call back to the model, as an agent would
                output = f"Error: {type(exc).__name__}: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(output)})
    env.close()
    if record and post_reward:
        client.post(f"/episodes/{episode_id}/reward", body={"reward": result.reward}, cast_to=object)
    return result


def _client(args: argparse.Namespace) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=args.base_url, api_key=os.environ.get("TREERL_SERVE_TOKEN") or "unused",
                  timeout=600.0, max_retries=0)


def evaluate(args: argparse.Namespace) -> float:
    client = _client(args)
    first = args.seed if args.seed is not None else 10_000  # held-out: training tasks use seeds from 0
    seeds = range(first, first + args.episodes)
    with ThreadPoolExecutor(args.concurrency) as pool:
        # Each task's requests are seeded by the task: the same weights give the same rate.
        rewards = list(pool.map(lambda s: run_episode(client, s, record=False, sampling_seed=s).reward, seeds))
    rate = sum(r >= 1.0 for r in rewards) / len(rewards)
    print(json.dumps({"success_rate": rate, "episodes": len(rewards), "seeds": [seeds.start, seeds.stop - 1]}))
    return rate


def _policy_version(args: argparse.Namespace) -> int:
    import httpx

    token = os.environ.get("TREERL_SERVE_TOKEN")
    response = httpx.get(args.base_url.rstrip("/").removesuffix("/v1") + "/health",
                         headers={"Authorization": f"Bearer {token}"} if token else {})
    response.raise_for_status()
    return response.json()["policy_version"]


def play(args: argparse.Namespace, learner_running: Callable[[], bool] = lambda: True) -> None:
    """Play ``args.tasks`` tasks in waves; with ``--follow-learner``, wait for new weights after each wave.

    The wait ends early, and so does the play, once ``learner_running()`` is false: a learner that
    died publishes nothing, and waiting for it would hang.
    """
    client = _client(args)
    seed = args.seed or 0
    version = _policy_version(args)
    with ThreadPoolExecutor(args.concurrency) as pool:
        for wave_start in range(0, args.tasks, args.wave):
            tasks = range(wave_start, min(wave_start + args.wave, args.tasks))
            jobs = [(t, g) for t in tasks for g in range(args.group_size)]
            rewards = list(pool.map(lambda job: run_episode(client, seed + job[0],
                                                            task_id=f"calc-{seed + job[0]}").reward, jobs))
            print(f"tasks {tasks.start}-{tasks.stop - 1}: success {sum(r >= 1 for r in rewards) / len(rewards):.1%} "
                  f"(policy version {version})", file=sys.stderr, flush=True)
            if args.follow_learner:  # on-policy: the next wave samples the weights trained on this one
                while (now := _policy_version(args)) == version:
                    if not learner_running():
                        print("the learner stopped before publishing new weights: play ends", file=sys.stderr)
                        return
                    time.sleep(0.5)
                version = now


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["eval", "play"])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--episodes", type=int, default=64, help="eval: held-out episodes")
    parser.add_argument("--seed", type=int, default=None, help="first task seed (eval: 10000, play: 0)")
    parser.add_argument("--tasks", type=int, default=320, help="play: tasks")
    parser.add_argument("--group-size", type=int, default=8, help="play: episodes per task")
    parser.add_argument("--wave", type=int, default=8, help="play: tasks per wave")
    parser.add_argument("--follow-learner", action="store_true", help="play: wait for new weights after each wave")
    parser.add_argument("--concurrency", type=int, default=32)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    evaluate(args) if args.mode == "eval" else play(args)


if __name__ == "__main__":
    main()
