"""Agent frameworks against ``treerl serve`` over loopback: LangChain's ``ChatOpenAI``, smolagents and LiteLLM.

Each drives a multi-turn tool-use episode with the shipped tiny model; the test keeps every
request body the framework sent (an httpx hook) and checks that each recorded sampled turn's
context decodes to the chat template's rendering of that request.
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch

pytest.importorskip("fastapi", reason="treerl serve needs the serve extra (fastapi, uvicorn)")

from _serve_helpers import Exchanges, assert_recorded_exactly, running_server  # noqa: E402

import treerl  # noqa: E402
from treerl.envs.builtin.calculator_tasks import calculator  # noqa: E402


@pytest.fixture(scope="module")
def served():
    torch.set_num_threads(1)
    from treerl.models import load_default_model

    model, tok = load_default_model()
    with running_server(model, tok, max_new_tokens=48) as (url, recorder):
        yield url, recorder, tok


def finish(url: str, episode_id: str, task_id: str, reward: float) -> None:
    import httpx

    httpx.post(f"{url}/episodes/{episode_id}/reward", json={"reward": reward}).raise_for_status()
    httpx.post(f"{url}/tasks/{task_id}/finish", json={})


def test_langchain_chat_openai_tool_loop(served):
    pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    url, recorder, tok = served
    env = treerl.make("treerl/Calculator-v0")
    opening, _ = env.reset(seed=11)
    exchanges = Exchanges()
    episode_id, task_id = f"lc-{uuid.uuid4().hex[:8]}", "lc-task"
    llm = ChatOpenAI(model="treerl", base_url=url, api_key="unused", max_tokens=48, temperature=1.0, max_retries=0,
                     http_client=exchanges.http_client(),
                     default_headers={"X-Episode-Id": episode_id, "X-Task-Id": task_id}).bind_tools(env.tool_schemas)
    messages = [SystemMessage(opening[0]["content"]), HumanMessage(opening[1]["content"])]
    for _ in range(3):
        ai = llm.invoke(messages)
        messages.append(ai)
        if not ai.tool_calls:
            break
        for call in ai.tool_calls:
            messages.append(ToolMessage(content=calculator(**call["args"]), tool_call_id=call["id"]))
    finish(url, episode_id, task_id, env.score(env.task, messages[-1].content or ""))
    group = next(g for g in recorder.finished if g.task_key == task_id)
    assert len(exchanges.pairs) >= 2, "the tiny model calls the calculator first: at least two turns"
    assert_recorded_exactly(tok, group, exchanges.pairs)
    [episode] = group.episodes
    assert not episode.extra_leaves  # LangChain echoes the replies: one path, no rewrite
    assert [s.kind for s in episode.path()][::2] == ["prompt"] + ["env"] * (len(exchanges.pairs) - 1)


def test_smolagents_tool_calling_agent(served):
    pytest.importorskip("smolagents", reason="smolagents is not installed")
    from smolagents import OpenAIServerModel, Tool, ToolCallingAgent

    url, recorder, tok = served

    class CalculatorTool(Tool):
        name = "calculator"
        description = "Evaluate an arithmetic expression."
        inputs = {"expression": {"type": "string", "description": "Arithmetic, e.g. (3 + 4) * 2."}}
        output_type = "string"

        def forward(self, expression: str) -> str:
            return calculator(expression)

    exchanges = Exchanges()
    episode_id, task_id = f"smol-{uuid.uuid4().hex[:8]}", "smol-task"
    model = OpenAIServerModel(model_id="treerl", api_base=url, api_key="unused", max_tokens=48,
                              client_kwargs={"http_client": exchanges.http_client(), "max_retries": 0,
                                             "default_headers": {"X-Episode-Id": episode_id, "X-Task-Id": task_id}})
    agent = ToolCallingAgent(tools=[CalculatorTool()], model=model, max_steps=2, verbosity_level=0)
    # smolagents' own system prompt is longer than the tiny model's 1024 positions: a short one.
    agent.prompt_templates["system_prompt"] = "Use the calculator tool, then give the final answer."
    agent.run("Tom has 3 apples and buys 4 more. How many apples does he have?")
    finish(url, episode_id, task_id, 0.0)
    group = next(g for g in recorder.finished if g.task_key == task_id)
    assert len(exchanges.pairs) >= 2
    # smolagents rewrites its history into its own text format between steps: every later turn
    # is a new branch rendered from what it sent, and still exactly what the model saw.
    assert_recorded_exactly(tok, group, exchanges.pairs)


@pytest.mark.filterwarnings("ignore::UserWarning:pydantic")  # litellm's own response models, serialized
def test_litellm_completion_tool_loop(served, monkeypatch):
    # LiteLLM is large (tens of MB), so it is not a test dependency: installed, it is tested here.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list at import
    litellm = pytest.importorskip("litellm", reason="litellm is not installed (pip install litellm to test it)")
    import openai

    url, recorder, tok = served
    env = treerl.make("treerl/Calculator-v0")
    messages, _ = env.reset(seed=12)
    exchanges = Exchanges()
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, http_client=exchanges.http_client())
    episode_id, task_id = f"llm-{uuid.uuid4().hex[:8]}", "litellm-task"
    for _ in range(3):
        response = litellm.completion(model="openai/treerl", messages=messages, tools=env.tool_schemas, client=client,
                                      api_base=url, api_key="unused", max_tokens=48, temperature=1.0,
                                      extra_headers={"X-Episode-Id": episode_id, "X-Task-Id": task_id})
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(**json.loads(call.function.arguments))})
    finish(url, episode_id, task_id, env.score(env.task, messages[-1].get("content") or ""))
    group = next(g for g in recorder.finished if g.task_key == task_id)
    assert len(exchanges.pairs) >= 2, "the tiny model calls the calculator first: at least two turns"
    assert_recorded_exactly(tok, group, exchanges.pairs)
    [episode] = group.episodes
    assert episode.metrics["episode_id"] == episode_id
    assert not episode.extra_leaves  # the replies came back as they were given: one path, no rewrite
