"""Held-out evaluation: play a policy in an environment and measure how often it succeeds.

Each episode re-renders the conversation with the chat template at every turn, which is
what a deployed chat model sees; the rollout engine (token-exact trees) is for training data.
Episodes run concurrently; the policy batches their generation requests.

An episode *succeeds* when its final reward reaches ``success_threshold`` (1.0: a correct
answer in Calculator and MathVerify, all hidden tests in CodeSandbox, the secret found in
GuessNumber).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from treerl.agents.chat import ChatRenderer
from treerl.agents.policy import GenerationRequest, Policy, SamplingParams
from treerl.config import SamplingOptions, field_help

__all__ = ["EvalConfig", "EpisodeResult", "EvalReport", "evaluate", "aevaluate"]


@dataclass
class EvalConfig(SamplingOptions):
    """Options of ``treerl eval``."""

    env: str = field_help("treerl/Calculator-v0", "Registered environment id (see `treerl envs`).")
    model: str | None = field_help(None, "A transformers model directory; default: the shipped tiny model.")
    num_episodes: int = field_help(64, "How many episodes (one task each, seeds seed..seed+N-1).")
    seed: int = field_help(10_000, "First task seed; the default keeps evaluation tasks apart from small training seeds.")
    max_concurrency: int = field_help(32, "Episodes in flight at once.")
    success_threshold: float = field_help(1.0, "Final reward at or above which an episode counts as solved.")
    device: str = field_help("cpu", "Torch device of the policy.")
    json: bool = field_help(False, "Print the report as JSON.")

    def __post_init__(self) -> None:
        if self.num_episodes < 1:
            raise ValueError(f"num_episodes={self.num_episodes} must be >= 1: evaluate at least one episode.")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency} must be >= 1.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1.")
        self.sampling()  # validates the sampling options with SamplingParams' own messages


@dataclass
class EpisodeResult:
    seed: int
    task_id: str | None
    total_reward: float
    final_reward: float
    turns: int
    termination: str | None
    tool_calls: Counter = field(default_factory=Counter)
    completion_tokens: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class EvalReport:
    env: str
    num_episodes: int
    success_rate: float
    reward_mean: float
    reward_std: float
    tool_calls: dict[str, int]
    terminations: dict[str, int]
    completion_tokens: int
    tokens_per_s: float
    wall_s: float
    episodes: list[EpisodeResult] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("episodes")
        return d

    def table(self) -> str:
        rows = [
            ("environment", self.env),
            ("episodes", str(self.num_episodes)),
            ("success rate", f"{self.success_rate:.1%}"),
            ("reward mean / std", f"{self.reward_mean:.3f} / {self.reward_std:.3f}"),
            ("tool calls", ", ".join(f"{k}={v}" for k, v in sorted(self.tool_calls.items())) or "none"),
            ("terminations", ", ".join(f"{k}={v}" for k, v in sorted(self.terminations.items()))),
            ("tokens/s", f"{self.tokens_per_s:.0f}"),
            ("wall time", f"{self.wall_s:.1f} s"),
        ]
        return two_column_table(rows)


def two_column_table(rows: list[tuple[str, str]]) -> str:
    """Label/value rows, labels padded to one width (the summaries the commands print)."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


async def _episode(env_factory, policy: Policy, tokenizer, params: SamplingParams, seed: int,
                   slots: asyncio.Semaphore) -> EpisodeResult:
    async with slots:
        env = env_factory()
        try:
            if hasattr(env, "use_parser_of"):
                env.use_parser_of(tokenizer)
            obs, info = await env.areset(seed=seed)
            messages = list(obs)
            renderer = ChatRenderer(tokenizer, tools=env.tool_schemas or None)
            result = EpisodeResult(seed=seed, task_id=info.get("task_id"), total_reward=0.0, final_reward=0.0,
                                   turns=0, termination=None)
            session = f"eval-{seed}-{id(env)}"
            terminated = truncated = False
            while not (terminated or truncated):
                prompt_ids = renderer.prompt_ids(messages)
                gen = await policy.agenerate(GenerationRequest(prompt_ids=prompt_ids, params=params,
                                                               seed=seed * 1000 + result.turns, session=session))
                result.completion_tokens += len(gen.token_ids)
                text = renderer.completion_text(gen.token_ids)
                obs, reward, terminated, truncated, info = await env.astep(text)
                messages.append({"role": "assistant", "content": text})
                messages.extend(obs)
                result.turns += 1
                result.total_reward += float(reward)
                result.final_reward = float(reward)
                for record in info.get("tool_calls", []):
                    result.tool_calls[record.get("error") or "ok"] += 1
                result.termination = info.get("termination") or ("max_turns" if truncated else None)
            result.messages = messages
            policy.end_session(session)
            return result
        finally:
            env.close()


async def aevaluate(env_factory, policy: Policy, tokenizer, *, env_id: str = "", num_episodes: int = 64,
                    seed: int = 10_000, params: SamplingParams | None = None, max_concurrency: int = 32,
                    success_threshold: float = 1.0) -> EvalReport:
    """Play ``num_episodes`` episodes (task seeds ``seed..seed+N-1``) concurrently; see :func:`evaluate`."""
    params = params or SamplingParams(max_new_tokens=96)
    sem = asyncio.Semaphore(max_concurrency)
    start = time.perf_counter()
    results = await asyncio.gather(*(
        _episode(env_factory, policy, tokenizer, params, seed + i, sem) for i in range(num_episodes)
    ))
    wall = time.perf_counter() - start
    rewards = [r.total_reward for r in results]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
    tool_calls: Counter = Counter()
    for r in results:
        tool_calls.update(r.tool_calls)
    tokens = sum(r.completion_tokens for r in results)
    return EvalReport(
        env=env_id,
        num_episodes=num_episodes,
        success_rate=sum(r.final_reward >= success_threshold for r in results) / num_episodes,
        reward_mean=mean,
        reward_std=std,
        tool_calls=dict(tool_calls),
        terminations=dict(Counter(str(r.termination) for r in results)),
        completion_tokens=tokens,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        wall_s=wall,
        episodes=list(results),
    )


def evaluate(env_id: str, policy: Policy, tokenizer, **kwargs: Any) -> EvalReport:
    """Evaluate ``policy`` on the registered environment ``env_id``.

    >>> from treerl.models import load_default_model            # doctest: +SKIP
    >>> from treerl.agents import TransformersPolicy            # doctest: +SKIP
    >>> model, tok = load_default_model()                       # doctest: +SKIP
    >>> evaluate("treerl/Calculator-v0", TransformersPolicy(model, tok), tok, num_episodes=8).success_rate  # doctest: +SKIP
    """
    import treerl

    env_kwargs = kwargs.pop("env_kwargs", {})
    return asyncio.run(aevaluate(lambda: treerl.make(env_id, **env_kwargs), policy, tokenizer, env_id=env_id, **kwargs))
