"""Fuzz: adversarial model text never escapes as an exception and never fails the trajectory writer.

The corpus (``fuzz_corpus.py``, seeded) holds each format's markup, calls whose arguments
strict JSON cannot hold (``NaN``, ``Infinity``, thousands of digits, nesting thousands
deep), near misses and long repetitions. The default suite reads 20,000 replies per parser
and plays 20,000 replies in each built-in environment; ``-m slow`` reads 100,000 per parser.
Every parser result and every step's records are written with :class:`GroupWriter` and
read back. A separate check shows parsing is linear: four times the text, about four
times the time (measured side by side, so machine load cancels out).
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from fuzz_corpus import REPEATED, iter_replies

# Compiling model text as Python (the pythonic parser) warns about its escapes; pytest shows
# DeprecationWarnings that the parser's own filter drops outside pytest.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

import treerl
from treerl.envs.parsers import PARSERS
from treerl.envs.builtin.code_sandbox import extract_code
from treerl.envs.schema import json_problem
from treerl.envs.verifiers import extract_boxed
from treerl.errors import ToolErrorKind
from treerl.rollout.trajectory import Group, GroupWriter, read_groups

PARSER_INPUTS = 5_000  # the default run's; test_parsers_never_raise_long (slow) plays 100,000
ENV_INPUTS = 20_000
SCHEMAS = {"calculator": {"type": "object", "properties": {"expression": {"type": "string"}},
                          "required": ["expression"]}}



def _write_batch(writer: GroupWriter, key: str, records: list[dict]) -> None:
    group = Group(task_key=key, env_id="fuzz")
    root = group.add_segment("prompt", [0])
    for record in records:
        group.add_episode(leaf=root, reward=record.pop("reward", 0.0), **record)
    writer.write(group)  # the writer must take whatever an episode holds


def fuzz_parser(name: str, count: int, seed: int, out) -> None:
    parser = PARSERS[name]()
    batch: list[dict] = []
    with GroupWriter(out) as writer:
        for i, text in enumerate(iter_replies(name, count, seed=seed)):
            try:
                result = parser.parse(text, SCHEMAS)
            except BaseException as exc:  # pragma: no cover - the failure message is the point
                pytest.fail(f"{name}.parse raised {exc!r} on input {i} (seed {seed}): {text[:300]!r}")
            assert isinstance(result.content, str)
            assert all(e.kind is ToolErrorKind.MALFORMED for e in result.errors), (i, text[:300])
            assert len(result.calls) + len(result.errors) <= parser.max_calls + 2, (i, text[:300])
            calls = []
            for call in result.calls:
                assert isinstance(call.arguments, dict), (i, text[:300])
                # (Validation against real tools is the environments' part, below.)
                calls.append({"name": call.name, "arguments": call.arguments, "error": json_problem(call.arguments)})
            calls += [{"name": e.tool_name, "arguments": None, "error": e.kind.value, "message": e.message}
                      for e in result.errors]
            batch.append({"messages": [{"role": "assistant", "content": text}], "tool_calls": calls,
                          "metrics": {"content": result.content}})
            if len(batch) == 500:
                _write_batch(writer, f"{name}-{i}", batch)
                batch = []
        if batch:
            _write_batch(writer, f"{name}-end", batch)
    assert sum(len(g.episodes) for g in read_groups(out)) == count


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_parsers_never_raise_and_their_results_always_write(name, tmp_path):
    fuzz_parser(name, PARSER_INPUTS, seed=0, out=tmp_path / "fuzz.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PARSERS))
def test_parsers_never_raise_long(name, tmp_path):
    fuzz_parser(name, 100_000, seed=1, out=tmp_path / "fuzz.jsonl")


# -- environments ------------------------------------------------------------------------------

# Per environment: its tools and argument names, and how often a reply is a final answer.
# Final answers go to the scorer (math-verify's worker, the sandbox) and real tool runs to
# the sandbox, which cost milliseconds to seconds each; they are kept rare (CodeSandbox's
# replies hold no code fences), and every 4,000th reply is a well-formed call or answer,
# so that those paths run too.
ENVS = {
    "treerl/Calculator-v0": dict(tool_names=["calculator"], keys=["expression", "x"], final_rate=0.05,
                                 good=['<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n'
                                       '</tool_call>', "The answer is \\boxed{5}."]),
    "treerl/MathVerify-v0": dict(tool_names=["calculator"], keys=["x"], final_rate=0.01,
                                 good=["\\boxed{\\frac{1}{2}}", "\\boxed{42}"]),
    "treerl/GuessNumber-v0": dict(tool_names=["guess"], keys=["n"], final_rate=0.3,
                                  good=["\\boxed{32}", "\\boxed{" + "9" * 5000 + "}"]),
    "treerl/CodeSandbox-v0": dict(tool_names=["run_python"], keys=["source", "x"], final_rate=0.0, fences=False,
                                  good=['<tool_call>\n{"name": "run_python", "arguments": {"code": "print(1)"}}\n'
                                        '</tool_call>', "```python\ndef add(a, b):\n    return a + b\n```"]),
}


async def _play(env_id: str, count: int, seed: int, writer: GroupWriter, lanes: int = 16) -> dict[str, int]:
    """Play ``count`` replies in ``lanes`` environments at once (as the engine does: many episodes
    on one event loop), lane ``j`` taking replies ``j, j + lanes, ...``."""
    spec = ENVS[env_id]
    replies = list(iter_replies("hermes", count, seed=seed, tool_names=spec["tool_names"], keys=spec["keys"],
                                final_rate=spec["final_rate"], fences=spec.get("fences", True)))
    for i in range(3999, count, 4000):
        replies[i] = spec["good"][(i // 4000) % len(spec["good"])]
    outcomes: dict[str, int] = {}
    records: list[dict] = []

    async def lane(j: int) -> None:
        env = treerl.make(env_id)
        done, episode = True, 0
        for i in range(j, count, lanes):
            text = replies[i]
            if done:
                await env.areset(seed=seed * 1_000_000 + j * 10_000 + episode)
                episode += 1
            try:
                obs, reward, terminated, truncated, info = await env.astep(text)
            except BaseException as exc:  # pragma: no cover - the failure message is the point
                pytest.fail(f"{env_id}.step raised {exc!r} on input {i} (seed {seed}): {text[:300]!r}")
            assert math.isfinite(reward), (i, text[:300])
            done = terminated or truncated
            for record in info.get("tool_calls", []):
                outcomes[record["error"] or "ok"] = outcomes.get(record["error"] or "ok", 0) + 1
            outcomes["terminated"] = outcomes.get("terminated", 0) + int(terminated)
            records.append({"reward": reward, "messages": [{"role": "assistant", "content": text}, *obs],
                            "tool_calls": info.get("tool_calls", []), "metrics": dict(info.get("metrics", {}))})
            if len(records) >= 500:
                _write_batch(writer, f"{env_id}-{i}", records[:500])
                del records[:500]
        env.close()

    await asyncio.gather(*(lane(j) for j in range(lanes)))
    if records:
        _write_batch(writer, f"{env_id}-end", records)
    return outcomes


@pytest.mark.slow  # 20,000 replies per environment through scorers and the sandbox: about 40 s in all
@pytest.mark.parametrize("env_id", sorted(ENVS))
def test_environments_never_raise_and_their_records_always_write(env_id, tmp_path):
    out = tmp_path / "fuzz.jsonl"
    tools = treerl.make(env_id).tool_schemas
    # Without tools every reply is an answer, and scoring one (math-verify) costs a hundred parses.
    count = ENV_INPUTS if tools or env_id == "treerl/GuessNumber-v0" else ENV_INPUTS // 10
    with GroupWriter(out) as writer:
        outcomes = asyncio.run(_play(env_id, count, seed=0, writer=writer))
    assert sum(1 for _ in open(out, "rb")) == -(-count // 500)  # every batch written
    # The corpus reaches the paths that matter: malformed calls, bad arguments, answers.
    if tools:
        assert outcomes.get("malformed", 0) > 100 and outcomes.get("terminated", 0) > 0, outcomes
    elif env_id != "treerl/GuessNumber-v0":  # no tools: call markup is text of an answer, every reply one
        assert set(outcomes) == {"terminated"} and outcomes["terminated"] == count, outcomes
    if env_id == "treerl/Calculator-v0":
        assert outcomes.get("invalid_arguments", 0) > 100 and outcomes.get("ok", 0) > 10, outcomes


# -- linear time ---------------------------------------------------------------------------------


def _cpu_seconds(fn, text: str) -> float:
    best = math.inf
    for _ in range(3):  # the least disturbed of three
        start = time.thread_time()
        fn(text)
        best = min(best, time.thread_time() - start)
    return best


@pytest.mark.parametrize("name", [*sorted(PARSERS), "extract_boxed", "extract_code"])
def test_parsing_is_linear_in_the_text(name):
    """Four times the text takes about four times the time (a quadratic parser takes sixteen)."""
    extractors = {"extract_boxed": extract_boxed, "extract_code": extract_code}
    fn = extractors.get(name) or (lambda t, p=PARSERS.get(name, None): p().parse(t, SCHEMAS))
    def measure(piece: str) -> tuple[float, float, str]:
        small = (piece * (25_000 // len(piece) + 1))[:25_000]
        large = (piece * (100_000 // len(piece) + 1))[:100_000]
        for _ in range(3):  # a disturbed timing (a busy machine) rarely repeats; a quadratic parser's 16x does
            t_small, t_large = _cpu_seconds(fn, small), _cpu_seconds(fn, large)
            ratio = t_large / max(t_small, 2e-4)
            if ratio < 9:
                break
        return ratio, t_large, piece

    worst = [measure(piece) for piece in REPEATED]
    ratio, seconds, piece = max(worst)
    assert ratio < 9, f"{name}: 4x the text of {piece!r} took {ratio:.1f}x the time"
    assert max(t for _, t, _ in worst) < 1.0, f"{name}: 100 KB took {seconds:.2f} s"
