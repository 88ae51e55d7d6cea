"""Train the plain-``openai`` agent of ``openai_agent.py`` with treerl through ``treerl serve``; success before/after.

    pip install -e ".[serve]" openai   # the server, and the client the agent uses
    python examples/train_openai_agent.py --out runs/agent --steps 20

What it runs, each a separate process as it would be on a real setup (one machine here):

1. ``treerl serve --group-size 8 --out runs/agent/traffic.jsonl`` with a bearer token;
2. the agent's evaluation on 64 held-out Calculator tasks (``openai_agent.py eval``: served,
   not recorded);
3. ``treerl learn --from-server URL --steps N --tasks-per-step 8``: GRPO on the groups the
   agent's traffic makes, publishing each new weights version to the server;
4. the agent playing training tasks, 8 episodes each, a wave of 8 tasks per learner step
   (``openai_agent.py play --follow-learner``: it waits for the new weights after each wave);
5. the agent's evaluation again; both rates go to ``runs/agent/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import openai_agent  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, token: str, server: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"treerl serve exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {token}"}).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("treerl serve did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/agent")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-episodes", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads of the server and the learner "
                                                                    "(1: no oversubscription of a small CPU)")
    args = parser.parse_args()
    # `kill` or `timeout` stop us with SIGTERM, which by default skips the `finally` that stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    env = {**os.environ, "TREERL_SERVE_TOKEN": token}
    os.environ["TREERL_SERVE_TOKEN"] = token  # the agent's client sends it too
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    treerl = [sys.executable, "-m", "treerl.cli"]
    server = subprocess.Popen([*treerl, "serve", "--port", str(port), "--group-size", str(args.group_size),
                               "--out", str(out / "traffic.jsonl"), "--max-new-tokens", "64",
                               "--num-threads", str(args.num_threads)], env=env)
    learner = None
    try:
        wait_healthy(url, token, server)
        agent = ["--base-url", f"{url}/v1", "--concurrency", "64"]
        started = time.monotonic()
        before = openai_agent.evaluate(openai_agent.build_parser().parse_args(
            ["eval", *agent, "--episodes", str(args.eval_episodes)]))
        learner = subprocess.Popen([*treerl, "learn", "--from-server", url, "--steps", str(args.steps),
                                    "--tasks-per-step", str(args.tasks_per_step), "--group-size",
                                    str(args.group_size), "--eval-episodes", "0", "--seed", str(args.seed),
                                    "--output-dir", str(out / "learn"), "--progress", "false",
                                    "--num-threads", str(args.num_threads)], env=env)
        openai_agent.play(openai_agent.build_parser().parse_args(
            ["play", *agent, "--tasks", str(args.steps * args.tasks_per_step), "--group-size",
             str(args.group_size), "--wave", str(args.tasks_per_step), "--seed", str(args.seed),
             "--follow-learner"]), learner_running=lambda: learner.poll() is None)
        if learner.wait() != 0:
            raise RuntimeError(f"treerl learn exited with {learner.returncode}")
        after = openai_agent.evaluate(openai_agent.build_parser().parse_args(
            ["eval", *agent, "--episodes", str(args.eval_episodes)]))
        summary = {"success_before": before, "success_after": after, "eval_episodes": args.eval_episodes,
                   "steps": args.steps, "tasks_per_step": args.tasks_per_step, "group_size": args.group_size,
                   "wall_s": round(time.monotonic() - started, 1)}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"agent success rate over {args.eval_episodes} held-out tasks: {before:.1%} -> {after:.1%}")
    finally:
        for proc in (learner, server):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)


if __name__ == "__main__":
    main()
