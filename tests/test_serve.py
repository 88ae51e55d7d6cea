"""``treerl serve`` driven by the real ``openai`` client over loopback HTTP, with the shipped tiny model.

Every test checks the recorded tree against what the client sent: each sampled turn's
context decodes to the chat template's rendering of that request's messages (the server's
own replies rendered from their raw sampled text), token for token what the model saw.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi", reason="treerl serve needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency")

from _serve_helpers import running_server, seen_contexts  # noqa: E402

from treerl.agents import ChatRenderer  # noqa: E402
from treerl.errors import ConfigError  # noqa: E402
from treerl.envs.parsers import get_parser  # noqa: E402
from treerl.rollout import read_groups  # noqa: E402
from treerl.serve.config import ServeConfig  # noqa: E402
from treerl.serve.openai_format import call_opening, message_key, parse_request, template_messages  # noqa: E402
from treerl.serve.recorder import Recorder  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from openai_agent import build_parser, play, run_episode  # noqa: E402

import treerl  # noqa: E402

TOOLS = treerl.make("treerl/Calculator-v0").tool_schemas


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    from treerl.models import load_default_model

    return load_default_model()


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "traffic.jsonl"
    with running_server(*tiny, out=str(out), group_size=2, max_new_tokens=48) as (url, recorder):
        yield url, recorder, out


def make_client(url: str, key: str = "unused"):
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


def expected_context(tokenizer, request_messages, raw_texts) -> str:
    """The template's rendering of one request: the client's messages, the server's replies as raw text."""
    checked = parse_request({"messages": request_messages}).messages
    return ChatRenderer(tokenizer, tools=TOOLS).render(template_messages(checked, raw_texts))


def group_of(recorder, task_key):
    return next(g for g in recorder.finished if g.task_key == task_key)


def assert_exact(tokenizer, episode, result):
    """Each sampled turn saw exactly the rendering of the request that asked for it."""
    contexts = seen_contexts(episode.group, episode, tokenizer, TOOLS)
    assert len(contexts) == len(result.requests)
    raw_texts, parser = {}, get_parser(tokenizer=tokenizer)
    for (context, raw), request, response in zip(contexts, result.requests, result.responses):
        assert tokenizer.decode(context, skip_special_tokens=False) == expected_context(tokenizer, request, raw_texts)
        message = response.choices[0].message
        if message.tool_calls:  # the calls came from the template's parser reading the raw text
            calls = parser.parse(raw).calls
            assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
                   [(c.name, c.arguments) for c in calls]
        else:
            assert message.content == raw
        reply = parse_request({"messages": [message.model_dump(exclude_none=True)]}).messages[0]
        raw_texts[message_key(reply)] = raw


def test_tool_loop_records_an_exact_tree_grouped_by_task(server, tiny):
    url, recorder, out = server
    _, tok = tiny
    client = make_client(url)
    results = [run_episode(client, seed=7, task_id="calc-7", max_tokens=48) for _ in range(2)]
    group = group_of(recorder, "calc-7")
    assert len(group.episodes) == 2 and group.info["task_id"] == "calc-7"
    assert group.episodes[0].path()[0] is group.episodes[1].path()[0]  # one shared prompt segment
    by_id = {r.episode_id: r for r in results}
    for episode in group.episodes:
        result = by_id[episode.metrics["episode_id"]]
        assert episode.reward == result.reward
        kinds = [s.kind for s in episode.path()]
        assert kinds == ["prompt"] + ["sampled", "env"] * (len(result.requests) - 1) + ["sampled"]
        assert not episode.extra_leaves  # the openai client echoes replies exactly: one path
        assert_exact(tok, episode, result)
        assert {v for v in episode.policy_versions if v is not None} == {0}
        assert len(episode.sampler_logprobs) == len(episode.token_ids)
    # The group is in the trajectory file, in today's format.
    assert "calc-7" in [g.task_key for g in read_groups(out)]


def test_the_agent_stops_waiting_for_a_learner_that_died(server, monkeypatch):
    """examples/train_openai_agent.py hung forever, its server running, once `treerl learn` died mid-run."""
    url, recorder, _ = server
    monkeypatch.delenv("TREERL_SERVE_TOKEN", raising=False)
    args = build_parser().parse_args(["play", "--base-url", url, "--tasks", "2", "--wave", "1", "--group-size", "2",
                                      "--seed", "600", "--concurrency", "2", "--follow-learner"])
    player = threading.Thread(target=play, args=(args,), kwargs={"learner_running": lambda: False}, daemon=True)
    player.start()
    player.join(timeout=120)
    assert not player.is_alive(), "play still waits for weights no learner will publish"
    played = {g.task_key for g in recorder.finished}
    assert "calc-600" in played and "calc-601" not in played  # the first wave only


def test_served_episodes_read_like_the_engines(server, tiny):
    """Call records name the sampled segment that made them, feedback is kept, the file has a header.

    So `treerl view` shows served traffic as it shows the engine's.
    """
    from treerl.rollout.trajectory import read_header
    from treerl.rollout.view import group_payload

    url, recorder, out = server
    _, tok = tiny
    client = make_client(url)
    result = run_episode(client, seed=7, max_tokens=48, post_reward=False, sampling_seed=7)
    assert any(r.choices[0].message.tool_calls for r in result.responses), "the tiny model calls the calculator first"
    with pytest.raises(openai.BadRequestError) as info:
        client.post(f"/episodes/{result.episode_id}/reward", body={"reward": 0.0, "feedback": 3}, cast_to=object)
    assert info.value.body["param"] == "feedback"
    client.post(f"/episodes/{result.episode_id}/reward", body={"reward": 0.0, "feedback": "7 * 8 is 56, not 54."},
                cast_to=object)
    [group] = [g for g in read_groups(out) if g.task_key == result.episode_id]  # from the file, as `view` reads it
    [episode] = group.episodes
    assert episode.metrics["feedback"] == "7 * 8 is 56, not 54."
    # Each sampled turn's records: all well formed, they are the calls the client got for that turn;
    # any malformed (the model may write one), the client got the turn as plain text.
    on_path = group.path_indices(episode.leaf)
    sampled = [i for i in on_path if group.segments[i].kind == "sampled"]
    assert len(sampled) == len(result.responses)
    assert {r["segment"] for r in episode.tool_calls} <= set(sampled)
    for index, response in zip(sampled, result.responses):
        records = [r for r in episode.tool_calls if r["segment"] == index]
        calls = response.choices[0].message.tool_calls or []
        if any(r["error"] for r in records):
            assert not calls
        else:
            assert [(r["name"], r["arguments"]) for r in records] == \
                   [(c.function.name, json.loads(c.function.arguments)) for c in calls]
            text = tok.decode(group.segments[index].token_ids)
            assert all(r["name"] in text for r in records)  # the turn that wrote this call
    assert [c[0] for c in group_payload(group)["e"][0]["c"]] == [r["segment"] for r in episode.tool_calls]
    header = read_header(out)
    assert header["run"]["env_id"] == "treerl-serve" and header["run"]["group_size"] == 2


def test_seed_stop_tool_choice_and_schema_checks(server, tiny):
    url, recorder, _ = server
    _, tok = tiny
    client = make_client(url)
    ask, unrecorded = [{"role": "user", "content": "Tell me about apples."}], {"X-Treerl-Record": "false"}
    full = [client.chat.completions.create(model="treerl", messages=ask, max_tokens=24, temperature=1.0, seed=11,
                                           logprobs=True, extra_headers=unrecorded) for _ in range(2)]
    text = full[0].choices[0].message.content
    assert text == full[1].choices[0].message.content and len(text) >= 6  # the same seed, the same sample
    logprobs = [t.logprob for t in full[0].choices[0].logprobs.content]
    # stop: the reply ends before the stop string; the recording keeps the sampled tokens up to
    # the one that completed it (a prefix of the sample, so its log-probs are still exact).
    stop = text[len(text) // 2:len(text) // 2 + 3]
    before = text[:text.find(stop)]
    stopped = client.chat.completions.create(model="treerl", messages=ask, max_tokens=24, temperature=1.0, seed=11,
                                             stop=[stop], extra_headers={"X-Episode-Id": "stopped"})
    assert stopped.choices[0].message.content == before and stopped.choices[0].finish_reason == "stop"
    client.post("/episodes/stopped/reward", body={"reward": 0.0}, cast_to=object)
    [segment] = [s for s in group_of(recorder, "stopped").segments if s.kind == "sampled"]
    raw = ChatRenderer(tok).completion_text(segment.token_ids)
    assert raw.startswith(before + stop) and text.startswith(raw)
    assert segment.logprobs == pytest.approx(logprobs[:len(segment.logprobs)], abs=1e-4)
    # tool_choice none: the model's call stays text; a call whose arguments break the request's
    # schema comes back as content too, counted as invalid_arguments.
    messages, _ = treerl.make("treerl/Calculator-v0").reset(seed=1)
    reply = client.chat.completions.create(model="treerl", messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=48, extra_headers=unrecorded).choices[0]
    assert "<tool_call>" in reply.message.content and not reply.message.tool_calls
    integer_tools = json.loads(json.dumps(TOOLS))
    integer_tools[0]["function"]["parameters"]["properties"]["expression"] = {"type": "integer"}
    invalid = recorder.metrics["tool_calls/invalid_arguments"]
    reply = client.chat.completions.create(model="treerl", messages=messages, tools=integer_tools, temperature=0,
                                           max_tokens=48, extra_headers=unrecorded).choices[0]
    assert "<tool_call>" in reply.message.content and not reply.message.tool_calls
    assert recorder.metrics["tool_calls/invalid_arguments"] == invalid + 1


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice_forces_the_call_opening_unsampled(server, tiny, choice):
    """tool_choice required or a named function: the reply opens a call whatever the model would
    write. The opening is recorded as an env segment (never trained on), the model's tokens after
    it as the sampled segment; the next turn continues the same path, token-exact."""
    url, recorder, _ = server
    _, tok = tiny
    client = make_client(url)
    name = TOOLS[0]["function"]["name"]
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": name}}
    opening = "<tool_call>\n" if choice == "required" else '<tool_call>\n{"name": "' + name + '", "arguments":'
    ask = [{"role": "user", "content": "Tell me about apples."}]  # no reason to call a calculator
    headers = {"X-Episode-Id": f"forced-{choice}"}  # no task: a group of one
    reply = client.chat.completions.create(model="treerl", messages=ask, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=48, seed=3, extra_headers=headers).choices[0]
    message = reply.message
    if message.tool_calls:
        assert reply.finish_reason == "tool_calls"
        assert choice == "required" or {c.function.name for c in message.tool_calls} == {name}
        result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"}
    else:  # the model broke the call's format after the opening: the text comes back as content
        assert message.content.startswith(opening)
        result = {"role": "user", "content": "Go on."}
    follow = [*ask, message.model_dump(exclude_none=True), result]
    branches = recorder.metrics["episodes/template_branches"]
    client.chat.completions.create(model="treerl", messages=follow, tools=TOOLS, max_tokens=8, extra_headers=headers)
    assert recorder.metrics["episodes/template_branches"] == branches  # the forced turn bridges like any other
    client.post(f"/episodes/forced-{choice}/reward", body={"reward": 1.0}, cast_to=object)
    group = group_of(recorder, f"forced-{choice}")
    [episode] = group.episodes
    path = episode.path()
    assert [s.kind for s in path][:3] == ["prompt", "env", "sampled"] and not episode.extra_leaves
    assert tok.decode(path[1].token_ids, skip_special_tokens=False) == opening
    (context1, raw1), (context2, _) = seen_contexts(group, episode, tok, TOOLS)
    assert tok.decode(context1, skip_special_tokens=False) == expected_context(tok, ask, {}) + opening
    checked = parse_request({"messages": [message.model_dump(exclude_none=True)]}).messages[0]
    assert tok.decode(context2, skip_special_tokens=False) == \
        expected_context(tok, follow, {message_key(checked): opening + raw1})


def test_a_named_tool_choice_gets_its_call(server, tiny):
    """The forced opening ends where the model's own call tokens end (after '":', not after its space:
    the model writes ' {"' as one token), so the model goes on writing arguments as it learned to."""
    url, _, _ = server
    _, tok = tiny
    name = TOOLS[0]["function"]["name"]
    request = parse_request({"messages": [{"role": "user", "content": "Hi."}], "tools": TOOLS,
                             "tool_choice": {"type": "function", "function": {"name": name}}})
    opening = call_opening(get_parser(tokenizer=tok), request)
    forced = tok.encode(opening)  # the model's own tokens of a whole call begin with the forced ones
    assert tok.encode(opening + ' {"expression": "2 + 2"}}\n</tool_call>')[:len(forced)] == forced
    response = make_client(url).chat.completions.create(
        model="treerl", messages=[{"role": "user", "content": "Tell me about apples."}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": name}}, n=8, seed=0, max_tokens=32,
        extra_headers={"X-Treerl-Record": "false"})
    calls = [c.message.tool_calls for c in response.choices]
    assert sum(bool(c) for c in calls) >= 6, [c.message.content for c in response.choices]
    assert {call.function.name for c in calls if c for call in c} == {name}


def test_tool_choice_for_a_format_without_a_known_opening_is_refused(tiny):
    model, tok = tiny
    with running_server(model, tok, max_new_tokens=4) as (url, recorder):
        recorder.parser = get_parser("mistral")
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            make_client(url).chat.completions.create(model="treerl", messages=[{"role": "user", "content": "Hi."}],
                                                     tools=TOOLS, tool_choice="required", max_tokens=4)


class WritesText:
    """A policy that writes ``text`` (then the end of turn) as a sampling policy would: token by token to
    ``on_token``, ending at the request's stop ids or ``max_new_tokens``; each token's log-prob is its own."""

    def __init__(self, tokenizer, text: str):
        self.ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.version = 0

    async def agenerate(self, request):
        from treerl.agents.policy import Generation, StreamedToken

        ids, logprobs = [], []
        for k, token_id in enumerate(self.ids[:request.params.max_new_tokens]):
            ids.append(token_id)
            logprobs.append(-0.01 * (k + 1))
            if request.on_token is not None:
                request.on_token(StreamedToken(token_id, logprobs[-1]))
            if token_id in request.params.stop_token_ids or token_id == self.ids[-1]:
                break
        stopped = ids[-1] in request.params.stop_token_ids or ids[-1] == self.ids[-1]
        return Generation(token_ids=ids, logprobs=logprobs, candidates=None,
                          finish_reason="stop" if stopped else "length", policy_version=self.version,
                          num_prompt_tokens_processed=len(request.prompt_ids))

    def end_session(self, session: str) -> None:
        pass

    def close(self) -> None:
        pass


CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reasoning", [False, True])
def test_parallel_tool_calls_false_ends_the_sample_at_the_first_call(tiny, stream, reasoning):
    """parallel_tool_calls false: the reply holds the first call only, and so does the recording: the
    sample ends where that call closes (a stop at </tool_call>, or, after reasoning, a cut of the sample
    there), so the model's turn is what the client got, and the next request closes it and goes on."""
    model, tok = tiny
    thought = "<think>Maybe " + CALL.format("0 + 0") + " twice.</think>\n\n" if reasoning else ""
    text = thought + "Both.\n" + CALL.format("1 + 2") + "\n" + CALL.format("3 + 4")
    policy = WritesText(tok, text)
    with running_server(model, tok, policy=policy, max_new_tokens=200) as (url, recorder):
        if reasoning:
            recorder.parser = get_parser("hermes", reasoning=("<think>", "</think>"))
        client = make_client(url)
        ask = [{"role": "user", "content": "Add 1 + 2 and 3 + 4."}]

        def create(messages, **options):
            headers = {"X-Episode-Id": "single"}
            if not stream:
                return client.chat.completions.create(model="treerl", messages=messages, tools=TOOLS,
                                                      extra_headers=headers, **options).choices[0]
            chunks = list(client.chat.completions.create(model="treerl", messages=messages, tools=TOOLS, stream=True,
                                                         logprobs=True, extra_headers=headers, **options))
            deltas = [c.choices[0].delta for c in chunks]
            calls = [call for d in deltas for call in d.tool_calls or []]
            assert [c.index for c in calls] == list(range(len(calls)))
            streamed_logprobs = [t.logprob for c in chunks if c.choices[0].logprobs
                                 for t in c.choices[0].logprobs.content]
            return "".join(d.content or "" for d in deltas), calls, chunks[-1].choices[0].finish_reason, \
                streamed_logprobs

        both = client.chat.completions.create(model="treerl", messages=ask, tools=TOOLS,
                                              extra_headers={"X-Treerl-Record": "false"}).choices[0]
        assert [json.loads(c.function.arguments)["expression"] for c in both.message.tool_calls] == ["1 + 2", "3 + 4"]
        if stream:
            content, calls, finish, logprobs = create(ask, parallel_tool_calls=False)
            message = {"role": "assistant", "content": content or None,
                       "tool_calls": [{"id": c.id, "type": "function",
                                       "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                      for c in calls]}
        else:
            reply = create(ask, parallel_tool_calls=False)
            finish, message = reply.finish_reason, reply.message.model_dump(exclude_none=True)
        assert finish == "tool_calls"
        assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"expression": "1 + 2"}]
        assert message.get("content") == "Both."
        follow = [*ask, message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "3"}]
        branches = recorder.metrics["episodes/template_branches"] + recorder.metrics["episodes/history_rewrites"]
        create(follow)
        assert recorder.metrics["episodes/template_branches"] + recorder.metrics["episodes/history_rewrites"] == \
            branches
        client.post("/episodes/single/reward", body={"reward": 1.0}, cast_to=object)
    [episode] = group_of(recorder, "single").episodes
    first, env = episode.path()[1:3]
    one_call = text[:text.index("</tool_call>", len(thought)) + len("</tool_call>")]
    assert first.kind == "sampled" and first.token_ids == tok.encode(one_call, add_special_tokens=False)
    assert first.logprobs == pytest.approx([-0.01 * (k + 1) for k in range(len(first.token_ids))])
    assert first.finish_reason == "stop"
    # The turn ends where the model stopped; the environment closes it (an unsampled end of turn).
    assert tok.decode(env.token_ids, skip_special_tokens=False).startswith("<|im_end|>")
    (context1, raw1), (context2, _) = seen_contexts(episode.group, episode, tok, TOOLS)
    assert raw1 == one_call
    checked = parse_request({"messages": [message]}).messages[0]
    assert tok.decode(context2, skip_special_tokens=False) == \
        expected_context(tok, follow, {message_key(checked): one_call})
    if stream:  # the streamed log-probs are the recorded turn's, not the rest of the sample's
        assert logprobs == pytest.approx(first.logprobs)


def test_parallel_tool_calls_false_stops_the_model_at_the_end_of_its_call(server, tiny):
    """With the real model: its one call ends the sample (the stop is at </tool_call>, so it never writes
    its end of turn), its tokens the same as without the flag up to there."""
    url, recorder, _ = server
    _, tok = tiny
    client = make_client(url)
    messages, _ = treerl.make("treerl/Calculator-v0").reset(seed=1)
    replies = {}
    for parallel in (True, False):
        headers = {"X-Episode-Id": f"parallel-{parallel}"}
        replies[parallel] = client.chat.completions.create(model="treerl", messages=messages, tools=TOOLS,
                                                           temperature=0, max_tokens=48, extra_headers=headers,
                                                           parallel_tool_calls=parallel).choices[0]
        client.post(f"/episodes/parallel-{parallel}/reward", body={"reward": 0.0}, cast_to=object)
    assert replies[False].finish_reason == "tool_calls" and len(replies[False].message.tool_calls) == 1
    [free], [single] = ([s for s in group_of(recorder, f"parallel-{p}").segments if s.kind == "sampled"]
                        for p in (True, False))
    end = tok.convert_tokens_to_ids("</tool_call>")
    assert single.token_ids[-1] == end and free.token_ids[:len(single.token_ids)] == single.token_ids
    assert free.token_ids[len(single.token_ids):] == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_parallel_tool_calls_false_is_refused_where_it_cannot_be_enforced(tiny):
    model, tok = tiny
    with running_server(model, tok, max_new_tokens=4) as (url, recorder):
        client = make_client(url)
        hi = [{"role": "user", "content": "Hi."}]
        with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
            client.chat.completions.create(model="treerl", messages=hi, tools=TOOLS, max_tokens=4,
                                           extra_body={"parallel_tool_calls": "false"})
        recorder.parser = get_parser("pythonic")  # calls in one Python list: no place to end after the first
        with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
            client.chat.completions.create(model="treerl", messages=hi, tools=TOOLS, max_tokens=4,
                                           parallel_tool_calls=False)
        client.chat.completions.create(model="treerl", messages=hi, tools=TOOLS, max_tokens=4,
                                       parallel_tool_calls=True)  # nothing to enforce


def test_episode_and_task_ids_from_the_body(server):
    url, recorder, _ = server
    client = make_client(url)
    hi = [{"role": "user", "content": "Hi."}]
    by_user = client.chat.completions.create(model="treerl", messages=hi, max_tokens=8, user="user-7")
    by_metadata = client.chat.completions.create(model="treerl", messages=hi, max_tokens=8,
                                                 extra_body={"metadata": {"episode_id": "meta-1",
                                                                          "task_id": "meta-task"}})
    assert by_user.model_extra["episode_id"] == "user-7" and by_metadata.model_extra["episode_id"] == "meta-1"
    for episode_id in ("user-7", "meta-1"):
        client.post(f"/episodes/{episode_id}/reward", body={"reward": 1.0}, cast_to=object)
    client.post("/tasks/meta-task/finish", body={}, cast_to=object)  # the server's groups are of 2
    assert group_of(recorder, "user-7").episodes[0].metrics["episode_id"] == "user-7"
    assert group_of(recorder, "meta-task").episodes[0].metrics["episode_id"] == "meta-1"


def test_concurrent_requests_decode_together_and_share_a_prefill(tiny, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    model, tok = tiny
    rows, forward = [], model.forward

    def counted(*args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    # A burst that arrives within batch_wait_s starts as one batch.
    with running_server(model, tok, batch_wait_s=1.0, group_size=4, max_new_tokens=8) as (url, recorder):
        monkeypatch.setattr(model, "forward", counted)  # after the policy read the forward's signature
        client = make_client(url)
        ask = [{"role": "user", "content": "Name a colour."}]

        def one(k: int):
            return client.chat.completions.create(model="treerl", messages=ask, max_tokens=8,
                                                  extra_headers={"X-Episode-Id": f"burst-{k}", "X-Task-Id": "burst"})

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(one, range(4)))
        assert max(rows) == 4  # four episodes' turns decoded as one batch
        # Four episodes of one prompt: it ran through the model once.
        assert recorder.metrics["requests/prompt_tokens_processed"] == replies[0].usage.prompt_tokens
        for k in range(4):
            client.post(f"/episodes/burst-{k}/reward", body={"reward": float(k)}, cast_to=object)
        group = group_of(recorder, "burst")
        assert len(group.episodes) == 4 and sum(s.kind == "prompt" for s in group.segments) == 1


def test_clients_with_one_system_prompt_prefill_it_once(tiny):
    """Clients one after another, one long system prompt, different questions: after the first,
    each request runs only what follows the shared prefix, and the prefill counter says so."""
    model, tok = tiny
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    questions = ["What is two plus two?", "Name a colour.", "Why is the sky blue?", "Count to three."]
    conversations = [[system, {"role": "user", "content": q}] for q in questions]
    ids = [ChatRenderer(tok).prompt_ids(m) for m in conversations]
    common = min(next(j for j, (a, b) in enumerate(zip(ids[0], other)) if a != b) for other in ids[1:])
    assert common > 100
    with running_server(model, tok, max_new_tokens=4) as (url, recorder):
        client = make_client(url)
        processed = []
        for k, messages in enumerate(conversations):
            before = recorder.metrics["requests/prompt_tokens_processed"]
            reply = client.chat.completions.create(model="treerl", messages=messages, max_tokens=4, seed=k,
                                                   extra_headers={"X-Task-Id": "system-prompt"})
            assert reply.usage.prompt_tokens == len(ids[k])
            processed.append(recorder.metrics["requests/prompt_tokens_processed"] - before)
    assert processed == [len(ids[0])] + [len(x) - common for x in ids[1:]]


def test_streaming_and_usage(server, tiny):
    url, recorder, _ = server
    _, tok = tiny
    client = make_client(url)
    env = treerl.make("treerl/Calculator-v0")
    messages, _ = env.reset(seed=3)
    raw = client.chat.completions.with_raw_response.create(
        model="treerl", messages=messages, tools=TOOLS, max_tokens=48, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Task-Id": "stream-3"})
    episode_id = raw.headers["x-episode-id"]
    chunks = list(raw.parse())
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert finish and finish[-1] in ("stop", "length", "tool_calls")
    assert usage.completion_tokens > 0 and usage.prompt_tokens > 0
    client.post(f"/episodes/{episode_id}/reward", body={"reward": 0.5}, cast_to=object)
    client.post("/tasks/stream-3/finish", body={}, cast_to=object)  # a group of one, closed by the client
    group = group_of(recorder, "stream-3")
    sampled = [s for s in group.segments if s.kind == "sampled"]
    assert len(sampled) == 1 and len(sampled[0].token_ids) == usage.completion_tokens
    text = ChatRenderer(tok).completion_text(sampled[0].token_ids)
    if calls:
        assert finish[-1] == "tool_calls"
        parsed = get_parser(tokenizer=tok).parse(text).calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
               [(c.name, c.arguments) for c in parsed]
    else:
        assert content == text
    assert group.episodes[0].reward == 0.5


def test_n_choices_fork_the_episode_and_one_continues(server, tiny):
    url, recorder, _ = server
    _, tok = tiny
    client = make_client(url)
    messages = [{"role": "user", "content": "Say something."}]
    headers = {"X-Episode-Id": "fan", "X-Task-Id": "fan-task"}
    processed = recorder.metrics["requests/prompt_tokens_processed"]
    response = client.chat.completions.create(model="treerl", messages=messages, n=4, max_tokens=16, seed=5,
                                              extra_headers=headers)
    assert len(response.choices) == 4
    prompt_len = response.usage.prompt_tokens
    assert recorder.metrics["requests/prompt_tokens_processed"] - processed == prompt_len  # one shared prefill
    ids = [c.model_extra["episode_id"] for c in response.choices]
    assert ids == ["fan.0", "fan.1", "fan.2", "fan.3"]
    # The client continues the third choice with the parent's id: its messages pick the fork.
    chosen = response.choices[2].message
    follow = [*messages, chosen.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
    processed = recorder.metrics["requests/prompt_tokens_processed"]
    second = client.chat.completions.create(model="treerl", messages=follow, max_tokens=16, extra_headers=headers)
    assert second.model_extra["episode_id"] == "fan.2"
    processed_second = recorder.metrics["requests/prompt_tokens_processed"] - processed
    results = client.post("/rewards", cast_to=object,
                          body={"rewards": [{"episode_id": i, "reward": float(k)} for k, i in enumerate(ids)]})
    assert all(r.get("finished") for r in results["results"])
    group = group_of(recorder, "fan-task")
    assert sorted(e.reward for e in group.episodes) == [0.0, 1.0, 2.0, 3.0]
    roots = [s for s in group.segments if s.parent is None]
    assert len(roots) == 1  # the four choices share the prompt
    assert sum(s.kind == "sampled" and s.parent == 0 for s in group.segments) == 4
    longest = max(group.episodes, key=lambda e: len(e.token_ids))
    assert longest.reward == 2.0 and longest.metrics["turns"] == 2
    context, _ = seen_contexts(group, longest, tok, None)[1]
    # The fork's session cache held its context: only the bridge and the last sampled token ran again.
    first_sampled = longest.path()[1].token_ids
    assert processed_second == second.usage.prompt_tokens - prompt_len - len(first_sampled) + 1
    raw0 = ChatRenderer(tok).completion_text(first_sampled)
    expected = ChatRenderer(tok).render([*messages, {"role": "assistant", "content": raw0},
                                         {"role": "user", "content": "More."}])
    assert tok.decode(context, skip_special_tokens=False) == expected


def test_rewritten_history_starts_a_branch(server, tiny):
    url, recorder, _ = server
    _, tok = tiny
    client = make_client(url)
    headers = {"X-Episode-Id": "rewrite", "X-Task-Id": "rewrite-task"}
    first = [{"role": "user", "content": "What is 2 + 2?"}]
    reply = client.chat.completions.create(model="treerl", messages=first, max_tokens=12, extra_headers=headers)
    # The client edits its first message before going on: the old path cannot be extended.
    edited = [{"role": "user", "content": "What is 3 + 3?"}, reply.choices[0].message.model_dump(exclude_none=True),
              {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model="treerl", messages=edited, max_tokens=12, extra_headers=headers)
    client.post("/episodes/rewrite/reward", body={"reward": 1.0}, cast_to=object)
    client.post("/tasks/rewrite-task/finish", body={}, cast_to=object)
    group = group_of(recorder, "rewrite-task")
    [episode] = group.episodes
    assert len(episode.extra_leaves) == 1 and episode.metrics["template/branch_reason"] == "history_rewritten"
    old_path = group.path(episode.extra_leaves[0])
    assert [s.kind for s in old_path] == ["prompt", "sampled"]
    branch_root = episode.path()[0]
    assert branch_root.kind == "env" and branch_root.parent is None
    raw = ChatRenderer(tok).completion_text(old_path[1].token_ids)
    expected = ChatRenderer(tok).render([edited[0], {"role": "assistant", "content": raw}, edited[2]])
    assert tok.decode(branch_root.token_ids, skip_special_tokens=False) == expected


def test_bad_requests_get_4xx_naming_the_field(server):
    url, recorder, _ = server
    client = make_client(url)
    cases = [
        (dict(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
        (dict(messages=[{"role": "user", "content": "hi"}], temperature=3.0), "temperature"),
        (dict(messages=[{"role": "user", "content": "hi"}], n=99), "n"),
        (dict(messages=[{"role": "user", "content": "hi"}],
              tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}]),
         "tools[0].function"),
        (dict(messages=[{"role": "user", "content": "hi"}], max_tokens=10**6), "max_tokens"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages[0].content[0]"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="treerl", **kwargs)
        assert info.value.body["param"] == param, info.value.body
        assert info.value.body["message"].startswith(param)
    with pytest.raises(openai.APIStatusError) as info:  # oversize
        client.chat.completions.create(model="treerl", messages=[{"role": "user", "content": "x" * (5 * 2**20)}])
    assert info.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        client.post("/episodes/nobody/reward", body={"reward": 1.0}, cast_to=object)
    with pytest.raises(openai.PermissionDeniedError):  # control endpoints need a token, even on loopback
        client.post("/control/pause", body={}, cast_to=object)
    assert recorder.metrics["http/400"] >= len(cases)


def test_malformed_and_unsupported_requests_get_a_400_naming_the_field(server):
    """Bodies OpenAI refuses are refused here too (never a 500, never served as something else)."""
    import httpx

    url, recorder, _ = server
    hi = [{"role": "user", "content": "hi"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    named = {"type": "function", "function": {"name": "calculator"}}
    cases = [
        ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
         "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "calculator"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": named}, "tool_choice"),
        ({"stream_options": "x"}, "stream_options"),
        ({"stream_options": [1]}, "stream_options"),
        ({"stream": "false"}, "stream"),
        ({"logprobs": "false"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # only with logprobs
        ({"logit_bias": {"100": -100}}, "logit_bias"),
        # Served unconstrained, these would hand back text the client was promised is JSON.
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}},
         "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"functions": [{"name": "calculator", "parameters": {"type": "object"}}]}, "functions"),  # unseen tools
        ({"function_call": "auto"}, "function_call"),
        ({"messages": [{"role": "tool", "tool_call_id": "call_1", "content": "4"}]}, "messages[0]"),
        ({"messages": [*hi, {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_2", "content": "4"}]}, "messages[2].tool_call_id"),
        ({"messages": [*hi, {"role": "assistant", "content": "", "tool_calls": [call]}, *hi,
                       {"role": "tool", "tool_call_id": "call_1", "content": "4"}]}, "messages[3]"),
    ]
    before = recorder.metrics["http/400"]
    with httpx.Client(base_url=url, timeout=60) as http:
        for fields, param in cases:
            reply = http.post("/chat/completions", json={"model": "treerl", "messages": hi, "max_tokens": 4, **fields})
            assert reply.status_code == 400, (fields, reply.text)
            error = reply.json()["error"]
            assert error["param"] == param and error["message"].startswith(param + ": "), (fields, error)
            assert error["type"] == "invalid_request_error"
        deep = "[" * 100_000 + "]" * 100_000  # a decoder that recurses per level would overflow
        reply = http.post("/chat/completions", content=deep, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400 and "nested too deeply" in reply.json()["error"]["message"]
        # A tool result that answers the call before it is served.
        ok = http.post("/chat/completions", json={
            "model": "treerl", "max_tokens": 2, "stream": False, "logprobs": False, "logit_bias": {},
            "response_format": {"type": "text"},
            "messages": [*hi, {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "4"}]},
            headers={"X-Treerl-Record": "false"})
        assert ok.status_code == 200, ok.text
    assert recorder.metrics["http/400"] == before + len(cases) + 1


def test_top_logprobs_are_the_sampling_distributions_head(server, tiny):
    """Per token, the top_logprobs most likely tokens of the distribution it was drawn from (all of
    them under top_k), most likely first, the sampled token among them when it is that likely."""
    url, recorder, _ = server
    _, tok = tiny
    client = make_client(url)
    ask = [{"role": "user", "content": "Tell me about apples."}]
    unrecorded = {"X-Treerl-Record": "false"}
    for top_k, expected in ((None, 5), (3, 3)):
        extra = {"top_k": top_k} if top_k else {}
        reply = client.chat.completions.create(model="treerl", messages=ask, max_tokens=12, seed=11, logprobs=True,
                                               top_logprobs=5, extra_headers=unrecorded, extra_body=extra)
        content = reply.choices[0].logprobs.content
        assert len(content) == reply.usage.completion_tokens
        for token in content:
            top = [t.logprob for t in token.top_logprobs]
            assert len(top) == expected and top == sorted(top, reverse=True)
            assert sum(math.exp(x) for x in top) <= 1 + 1e-4
            if token.logprob >= top[-1] + 1e-4:
                assert token.token in [t.token for t in token.top_logprobs]
    plain = client.chat.completions.create(model="treerl", messages=ask, max_tokens=4, logprobs=True,
                                           extra_headers=unrecorded)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)
    # Cut at a stop string, the recorded turn keeps its tokens' heads and nothing more.
    text = reply.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopped = client.chat.completions.create(model="treerl", messages=ask, max_tokens=12, seed=11, logprobs=True,
                                             top_logprobs=2, stop=[stop], extra_body={"top_k": 3},
                                             extra_headers={"X-Episode-Id": "top-stopped"})
    assert stopped.choices[0].finish_reason == "stop"
    client.post("/episodes/top-stopped/reward", body={"reward": 0.0}, cast_to=object)
    [segment] = [s for s in group_of(recorder, "top-stopped").segments if s.kind == "sampled"]
    assert len(segment.top_logprobs) == len(segment.token_ids) == len(stopped.choices[0].logprobs.content)


def test_the_group_records_the_temperatures_its_turns_were_sampled_at(server):
    """What a learner recomputes the log-probs at (greedy turns are the same at any temperature)."""
    url, recorder, _ = server
    client = make_client(url)
    for episode, temperature in (("warm-0", 0.7), ("warm-1", 0.0)):
        client.chat.completions.create(model="treerl", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=temperature, extra_headers={"X-Episode-Id": episode})
        client.post(f"/episodes/{episode}/reward", body={"reward": 0.0}, cast_to=object)
    assert group_of(recorder, "warm-0").info["temperatures"] == [0.7]
    assert "temperatures" not in group_of(recorder, "warm-1").info


def test_a_prompt_longer_than_the_models_positions_is_refused(server, tiny):
    """--max-episode-tokens is 2048 by default; the shipped model has 1024 positions: the limit is 1024."""
    url, recorder, _ = server
    model, _ = tiny
    assert model.config.max_position_embeddings == 1024 < recorder.cfg.max_episode_tokens
    with pytest.raises(openai.BadRequestError) as info:
        make_client(url).chat.completions.create(model="treerl", messages=[{"role": "user", "content": "apple " * 400}],
                                                 max_tokens=4, extra_headers={"X-Treerl-Record": "false"})
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "messages"
    assert "maximum context length is 1024 tokens" in info.value.body["message"]


def test_the_model_is_retrieved_and_unknown_paths_answer_in_openais_shape(server):
    import httpx

    url, _, _ = server
    client = make_client(url)
    assert client.models.retrieve("treerl").id == "treerl"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"
    for method, path in (("GET", "/nothing"), ("POST", "/models"), ("GET", "/groups?start=abc")):
        reply = httpx.request(method, url + path, timeout=60)
        assert reply.status_code in (400, 404, 405) and set(reply.json()["error"]) == {"message", "type", "param",
                                                                                      "code"}, reply.text
    assert httpx.get(url + "/groups?start=abc", timeout=60).json()["error"]["param"] == "start"


def test_a_call_the_request_has_no_tool_for_comes_back_as_content(server, tiny):
    url, recorder, _ = server
    env = treerl.make("treerl/Calculator-v0")
    messages, _ = env.reset(seed=1)
    other = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                               "parameters": {"type": "object", "properties": {
                                                   "word": {"type": "string"}}, "required": ["word"]}}}]
    before = dict(recorder.metrics)
    response = make_client(url).chat.completions.create(model="treerl", messages=messages, tools=other, max_tokens=48,
                                                        temperature=0, extra_headers={"X-Treerl-Record": "false"})
    choice = response.choices[0]
    # The tiny model calls `calculator`, which this request does not offer: content plus a metric, never a 500.
    assert "<tool_call>" in choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    bad = sum(v for k, v in recorder.metrics.items() if k in ("tool_calls/unknown_tool", "tool_calls/malformed"))
    assert bad > sum(v for k, v in before.items() if k in ("tool_calls/unknown_tool", "tool_calls/malformed"))


def test_token_is_required_everywhere_when_set(tiny):
    with running_server(*tiny, token="s3cret", max_new_tokens=8) as (url, recorder):
        with pytest.raises(openai.AuthenticationError):
            make_client(url, key="wrong").models.list()
        client = make_client(url, key="s3cret")
        assert [m.id for m in client.models.list()] == ["treerl"]
        assert client.post("/control/pause", body={}, cast_to=object) == {"paused": True}
        assert client.post("/control/resume", body={}, cast_to=object) == {"paused": False}
    with pytest.raises(ValueError, match="bearer token"):
        ServeConfig(host="0.0.0.0", token=None)


def test_the_trajectory_file_resumes(tiny, tmp_path):
    model, tok = tiny
    out = tmp_path / "t.jsonl"
    with running_server(model, tok, out=str(out), max_new_tokens=8) as (url, recorder):
        client = make_client(url)
        for k in range(2):
            r = client.chat.completions.create(model="treerl", messages=[{"role": "user", "content": f"hi {k}"}],
                                               extra_headers={"X-Task-Id": "same"})
            client.post(f"/episodes/{r.model_extra['episode_id']}/reward", body={"reward": 1.0}, cast_to=object)
    with open(out, "a") as f:
        f.write('{"schema_version": 1, "task_key": "torn')  # a writer killed mid-line
    recorder = Recorder(None, tok, ServeConfig(out=str(out)))
    assert [g.task_key for g in recorder.finished] == ["same", "same#1"]
    assert recorder.task_counts["same"] == 2  # the next group of the task is "same#2"
    recorder.close()
    assert [g.task_key for g in read_groups(out)] == ["same", "same#1"]
    with pytest.raises(ConfigError, match="group_size"):  # groups of another size would mix in the file
        Recorder(None, tok, ServeConfig(out=str(out), group_size=4))


def test_without_an_id_the_conversation_finds_its_episode(server):
    url, recorder, _ = server
    client = make_client(url)
    first = [{"role": "user", "content": "Count to three."}]
    a = client.chat.completions.create(model="treerl", messages=first, max_tokens=8)
    follow = [*first, a.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    b = client.chat.completions.create(model="treerl", messages=follow, max_tokens=8)
    c = client.chat.completions.create(model="treerl", messages=first, max_tokens=8)  # a new conversation
    assert a.model_extra["episode_id"] == b.model_extra["episode_id"] != c.model_extra["episode_id"]
    episode_id = b.model_extra["episode_id"]
    client.post(f"/episodes/{episode_id}/reward", body={"reward": 1.0}, cast_to=object)
    [group] = [g for g in recorder.finished if g.task_key == episode_id]  # no task id: a group of one
    assert [s.kind for s in group.episodes[0].path()] == ["prompt", "sampled", "env", "sampled"]


@pytest.mark.slow  # a fresh interpreter loading torch and the model: the benchmark and the example start it too
def test_the_command_line_serves(tmp_path):
    import subprocess

    import httpx

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "treerl.cli", "serve", "--port", "0", "--num-threads", "1"],
                            cwd=root, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # "treerl serve: http://127.0.0.1:PORT/v1 (...)"
        assert line.startswith("treerl serve: http://127.0.0.1:"), line
        base = line.split()[2]
        for _ in range(300):
            try:
                health = httpx.get(base.removesuffix("/v1") + "/health")
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert health.json()["status"] == "ok"
        assert httpx.get(base + "/models").json()["data"][0]["id"] == "treerl"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_chat_template_and_its_variables_as_treerl_learn_takes_them(tiny, tmp_path):
    """--chat-template (a .jinja file here) and --chat-template-kwargs: served traffic is rendered, parsed
    and recorded with that template and its fixed variables, as `treerl learn` renders its episodes."""
    import copy

    from treerl.cli import build_parser
    from treerl.config import config_from_args

    model, tok = tiny
    tok = copy.deepcopy(tok)  # the template becomes the tokenizer's own: keep the module's tokenizer as it was
    path = tmp_path / "greeting.jinja"
    path.write_text("{{- '<|im_start|>system\\n' + greeting + '<|im_end|>\\n' }}" + tok.chat_template)
    argv = ["serve", "--chat-template", str(path), "--chat-template-kwargs", '{"greeting": "Ahoy"}']
    args = build_parser().parse_args(argv)
    cfg = config_from_args(ServeConfig, args)
    assert (cfg.chat_template, cfg.chat_template_kwargs) == (str(path), {"greeting": "Ahoy"})
    with pytest.raises(ValueError, match="chat_template='chatml' is not a template choice"):
        ServeConfig(chat_template="chatml")
    with running_server(model, tok, chat_template=str(path), chat_template_kwargs={"greeting": "Ahoy"},
                        max_new_tokens=8) as (url, recorder):
        client = make_client(url)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        reply = client.chat.completions.with_raw_response.create(model="treerl", messages=messages, max_tokens=8,
                                                                  extra_headers={"X-Task-Id": "template"})
        client.post(f"/episodes/{reply.headers['x-episode-id']}/reward", body={"reward": 1.0}, cast_to=object)
        [group] = recorder.finished
    prompt = tok.decode(group.segments[0].token_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nAhoy<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?")
    assert prompt == ChatRenderer(tok).render(messages)
