"""An LLM judge as a reward function: an OpenAI-compatible chat endpoint grades each completion.

:class:`JudgeReward` is a reward function with TRL's signature (``f(prompts, completions, **kwargs)``, one
reward per completion), so ``treerl.GRPOTrainer(reward_funcs=[JudgeReward(...)])``, TRL's own ``GRPOTrainer``
and ``treerl learn --judge '{...}'`` take it as they take any other. For each completion it fills a prompt
template with the question (the last user message of the prompt), the response (the completion's final
answer text: the last assistant message, reasoning before ``</think>`` left out) and the gold answer (the
``answer`` column, when the row has one), asks the judge model, and reads its verdict: ``yes``/``no``
(1.0/0.0, as the ``verifiers`` library's ``JudgeRubric`` prompt asks), or a number in ``score_range``
scaled to [0, 1].

The judge is any OpenAI-compatible server: ``vllm serve``, ``treerl serve``, a hosted API. The ``openai``
client is imported when the first judge is built (the extra ``treerl[judge]``).

A judge that fails is data, not a crash (DESIGN: a bad rollout is data): a timeout, a connection error, an
HTTP error, or an answer that holds no verdict gives ``failure_reward`` (0.0; ``None`` leaves the episode out
of the weighted sum, as a reward function's ``None`` does), and the reason is recorded: per completion with
``log_extra("judge/reason", ...)`` (``reward_extras.jsonl`` in treerl, the completions table in TRL), as
counts with ``log_metric`` (``reward_fn/judge/failed``, ``reward_fn/judge/retries``), and in
:attr:`JudgeReward.last_results`. Transport errors (timeouts, connection errors, 429 and 5xx replies) are
retried up to ``max_retries`` times; other HTTP errors (400, 401, 404: the request itself is wrong) are not.
At most ``max_concurrency`` requests are in flight per judge, across concurrent calls too; identical
requests are answered from a cache of the last ``cache_size`` verdicts (failures are not cached).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import math
import os
import re
import string
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["JudgeReward", "JudgeResult", "DEFAULT_JUDGE_PROMPT", "DEFAULT_JUDGE_PROMPT_NO_ANSWER",
           "parse_yes_no", "parse_score"]

logger = logging.getLogger(__name__)

DEFAULT_JUDGE_PROMPT = """Given a ground truth answer and a response, determine if the response is correct.

Question:
```
{question}
```

Ground truth answer:
```
{answer}
```

Response:
```
{response}
```

Respond either "yes" or "no" only."""
"""The prompt of the ``verifiers`` library's ``JudgeRubric``: the question, the gold answer and the response."""

DEFAULT_JUDGE_PROMPT_NO_ANSWER = """Determine if the response is a correct and complete answer to the question.

Question:
```
{question}
```

Response:
```
{response}
```

Respond either "yes" or "no" only."""
"""The prompt for rows without a gold answer."""

_FIELDS = {"question", "answer", "response"}
_THINK_END = re.compile(r"</think>", re.IGNORECASE)
_WORD = re.compile(r"[a-z]+")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _strip_reasoning(text: str) -> str:
    """``text`` after its last ``</think>`` (a reasoning model's answer), or all of it."""
    parts = _THINK_END.split(text)
    return parts[-1].strip()


def parse_yes_no(text: str) -> float | None:
    """1.0 for a "yes" verdict, 0.0 for "no", ``None`` when the text says neither (or both).

    The first word decides ("Yes, because ..."); otherwise the text must hold exactly one of the two words.

    >>> parse_yes_no("Yes."), parse_yes_no("**no**"), parse_yes_no("The answer is: yes")
    (1.0, 0.0, 1.0)
    >>> parse_yes_no("I cannot tell") is None, parse_yes_no("Either yes or no") is None
    (True, True)
    """
    words = _WORD.findall(_strip_reasoning(text).lower())
    if words and words[0] in ("yes", "no"):
        return 1.0 if words[0] == "yes" else 0.0
    found = {w for w in words if w in ("yes", "no")}
    if len(found) == 1:
        return 1.0 if found == {"yes"} else 0.0
    return None


def parse_score(text: str, low: float, high: float) -> float | None:
    """The last number in ``text`` scaled from ``[low, high]`` to [0, 1]; ``None`` when there is none or it is
    outside the range.

    >>> parse_score("Score: 7/10", 0, 10)  # (the last number is 10: write the range in the prompt instead)
    1.0
    >>> parse_score("I'd give it 7", 0, 10), parse_score("11", 0, 10) is None
    (0.7, True)
    """
    numbers = _NUMBER.findall(_strip_reasoning(text))
    if not numbers:
        return None
    value = float(numbers[-1])
    if not (math.isfinite(value) and low <= value <= high):
        return None
    return (value - low) / (high - low)


@dataclass(frozen=True)
class JudgeResult:
    """One completion's judgement: its reward, the judge's text, and why it failed (``None`` when it did not)."""

    reward: float | None
    text: str | None
    reason: str | None = None
    retries: int = 0
    cached: bool = False


def _message_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return ""


def _question(prompt: Any) -> str:
    """The question: a text prompt itself, or the last user message of a list of messages."""
    if isinstance(prompt, str):
        return prompt.strip()
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        if users:
            return _message_text(users[-1].get("content")).strip()
    return ""


def _response(completion: Any) -> str:
    """The final answer text: a text completion, or the last assistant message's, reasoning left out."""
    if isinstance(completion, list):
        replies = [m for m in completion if isinstance(m, Mapping) and m.get("role") == "assistant"]
        completion = _message_text(replies[-1].get("content")) if replies else ""
    return _strip_reasoning(completion) if isinstance(completion, str) else ""


class JudgeReward:
    """A reward function that asks an LLM judge at an OpenAI-compatible endpoint.

    >>> judge = JudgeReward(base_url="http://127.0.0.1:8000/v1", model="judge")  # doctest: +SKIP
    >>> judge(prompts=[[{"role": "user", "content": "Capital of France?"}]],
    ...       completions=[[{"role": "assistant", "content": "Paris"}]], answer=["Paris"])  # doctest: +SKIP
    [1.0]
    """

    def __init__(self, *, base_url: str = "http://127.0.0.1:8000/v1", model: str = "judge",
                 api_key_env: str | None = "OPENAI_API_KEY", prompt: str = DEFAULT_JUDGE_PROMPT,
                 prompt_no_answer: str = DEFAULT_JUDGE_PROMPT_NO_ANSWER, system_prompt: str | None = None,
                 verdict: str = "yes_no", score_range: Sequence[float] = (0.0, 10.0),
                 failure_reward: float | None = 0.0, timeout_s: float = 60.0, max_retries: int = 2,
                 retry_backoff_s: float = 0.5, max_concurrency: int = 8, cache_size: int = 4096,
                 sampling_args: Mapping[str, Any] | None = None, answer_key: str = "answer", name: str = "judge"):
        """``base_url``: the endpoint, ending in ``/v1``. ``model``: the judge model's name there.
        ``api_key_env``: the environment variable holding the API key (unset or empty: ``"EMPTY"``, what local
        servers without a key accept). ``prompt`` / ``prompt_no_answer``: templates with ``{question}``,
        ``{response}`` and (the first) ``{answer}``, for rows with and without a gold answer.
        ``verdict``: ``"yes_no"`` or ``"score"`` (a number in ``score_range``, scaled to [0, 1]).
        ``failure_reward``: the reward of a failed or unparseable judgement (``None``: not applicable).
        ``timeout_s``: per request. ``max_retries``: extra tries after a transport error, ``retry_backoff_s``
        apart, doubling. ``max_concurrency``: requests in flight at once. ``cache_size``: verdicts kept
        (0: none). ``sampling_args``: more request fields (default ``{"temperature": 0.0}``). ``answer_key``:
        the dataset column with the gold answer. ``name``: what metrics call it (``reward_fn/NAME_mean``)."""
        try:
            import openai
        except ImportError:
            raise ImportError("JudgeReward needs the openai client: pip install 'treerl[judge]' "
                              "(or pip install openai).") from None
        if verdict not in ("yes_no", "score"):
            raise ValueError(f"JudgeReward.verdict must be 'yes_no' or 'score', got {verdict!r}.")
        low, high = (float(v) for v in score_range)
        if not low < high:
            raise ValueError(f"JudgeReward.score_range must be (low, high) with low < high, got {score_range!r}.")
        for field, template, needed in (("prompt", prompt, {"question", "response"}),
                                        ("prompt_no_answer", prompt_no_answer, {"question", "response"})):
            try:
                names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
            except ValueError as exc:
                raise ValueError(f"JudgeReward.{field} is not a format template ({exc}); write literal braces "
                                 "as {{ and }}.") from None
            if names - _FIELDS or not needed <= names:
                raise ValueError(f"JudgeReward.{field} has the fields {sorted(names)}; it takes {{question}}, "
                                 f"{{response}} and {{answer}} (needs {sorted(needed)}); write literal braces as "
                                 "{{ and }}.")
        if not timeout_s > 0:
            raise ValueError(f"JudgeReward.timeout_s must be > 0 seconds, got {timeout_s!r}.")
        for field, value, least in (("max_retries", max_retries, 0), ("max_concurrency", max_concurrency, 1),
                                    ("cache_size", cache_size, 0)):
            if not value >= least:
                raise ValueError(f"JudgeReward.{field} must be >= {least}, got {value!r}.")
        self.__name__ = name
        self.base_url, self.model = base_url, model
        self.prompt, self.prompt_no_answer, self.system_prompt = prompt, prompt_no_answer, system_prompt
        self.verdict, self.score_range = verdict, (low, high)
        self.failure_reward = failure_reward
        self.timeout_s, self.max_retries, self.retry_backoff_s = float(timeout_s), int(max_retries), retry_backoff_s
        self.max_concurrency, self.cache_size = int(max_concurrency), int(cache_size)
        self.sampling_args = dict({"temperature": 0.0} if sampling_args is None else sampling_args)
        self.answer_key = answer_key
        api_key = (os.environ.get(api_key_env) if api_key_env else None) or "EMPTY"
        # Retries are ours (counted and recorded), so the client's own are off.
        self._client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=self.timeout_s, max_retries=0)
        self._openai = openai
        self._slots = threading.BoundedSemaphore(self.max_concurrency)
        self._cache: collections.OrderedDict[str, tuple[float, str]] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self.last_results: list[JudgeResult] = []
        """The last call's judgements, one per completion."""

    def messages(self, question: str, response: str, answer: Any = None) -> list[dict[str, str]]:
        """The chat messages the judge is sent for one completion."""
        if answer is None:
            content = self.prompt_no_answer.format(question=question, response=response)
        else:
            content = self.prompt.format(question=question, response=response, answer=answer)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": content}]

    def judge(self, question: str, response: str, answer: Any = None) -> JudgeResult:
        """One completion's judgement (never raises for what the judge or the network did)."""
        messages = self.messages(question, response, answer)
        key = json.dumps(messages, sort_keys=True)
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                reward, text = self._cache[key]
                return JudgeResult(reward, text, cached=True)
        retries, reason = 0, None
        while True:
            try:
                with self._slots:
                    reply = self._client.chat.completions.create(model=self.model, messages=messages,
                                                                 **self.sampling_args)
                break
            except (self._openai.APIConnectionError, self._openai.RateLimitError,
                    self._openai.InternalServerError) as exc:  # (APITimeoutError is a connection error)
                reason = _reason(exc)
                if retries >= self.max_retries:
                    return JudgeResult(self.failure_reward, None, f"{reason} (after {retries} retries)", retries)
                time.sleep(self.retry_backoff_s * 2 ** retries)
                retries += 1
            except self._openai.APIStatusError as exc:
                return JudgeResult(self.failure_reward, None, _reason(exc), retries)
            except self._openai.APIError as exc:  # an unreadable reply body, ...
                return JudgeResult(self.failure_reward, None, _reason(exc), retries)
        try:
            text = reply.choices[0].message.content
        except (AttributeError, IndexError, TypeError):
            text = None
        if not isinstance(text, str):
            return JudgeResult(self.failure_reward, None, "the judge's reply has no message text", retries)
        if self.verdict == "yes_no":
            reward = parse_yes_no(text)
            wanted = 'a "yes" or "no"'
        else:
            reward = parse_score(text, *self.score_range)
            wanted = f"a number in [{self.score_range[0]:g}, {self.score_range[1]:g}]"
        if reward is None:
            return JudgeResult(self.failure_reward, text, f"no verdict: the judge did not answer {wanted}: "
                                                          f"{text[:200]!r}", retries)
        if self.cache_size:
            with self._cache_lock:
                self._cache[key] = (reward, text)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return JudgeResult(reward, text, None, retries)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        answers = kwargs.get(self.answer_key)
        if answers is None:
            answers = [None] * len(completions)
        jobs = [(_question(p), _response(c), a) for p, c, a in zip(prompts, completions, answers)]
        with concurrent.futures.ThreadPoolExecutor(min(self.max_concurrency, max(1, len(jobs)))) as pool:
            results = list(pool.map(lambda job: self.judge(*job), jobs))
        self.last_results = results
        failed = [r for r in results if r.reason is not None]
        name = self.__name__
        if callable(kwargs.get("log_extra")):
            kwargs["log_extra"](f"{name}/reason", [r.reason for r in results])
            kwargs["log_extra"](f"{name}/verdict", [r.text for r in results])
        if callable(kwargs.get("log_metric")):
            kwargs["log_metric"](f"{name}/failed", len(failed) / max(1, len(results)))
            kwargs["log_metric"](f"{name}/retries", sum(r.retries for r in results))
            kwargs["log_metric"](f"{name}/cache_hits", sum(r.cached for r in results))
        if failed:
            logger.warning("judge %s at %s: %d of %d judgements failed (reward %s); the first: %s", self.model,
                           self.base_url, len(failed), len(results), self.failure_reward, failed[0].reason)
        return [r.reward for r in results]

    def close(self) -> None:
        """Close the HTTP client's connections."""
        self._client.close()

    def __repr__(self) -> str:
        return f"JudgeReward(base_url={self.base_url!r}, model={self.model!r}, verdict={self.verdict!r})"


def _reason(exc: Exception) -> str:
    """A failed request, in one line: its kind and, for an HTTP error, the status."""
    status = getattr(exc, "status_code", None)
    kind = type(exc).__name__
    detail = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{kind}" + (f" (HTTP {status})" if status else "") + (f": {detail}" if detail else "")
