"""Streamed chat completions of ``treerl serve``: tokens go out as they are sampled, and the stream,
its finish reason, its usage and the recorded tree are those of the same request unstreamed.

The server's decode loop is slowed (a sleep in each sampling step) so that a reply takes long
enough to see its chunks arrive one by one and to hang up in its middle; the tokens sampled
do not depend on it.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch

pytest.importorskip("fastapi", reason="treerl serve needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency")

from _serve_helpers import running_server  # noqa: E402

import treerl  # noqa: E402
from treerl.agents import ChatRenderer  # noqa: E402
from treerl.envs.parsers import get_parser  # noqa: E402
from treerl.serve.openai_format import ChatRequest, call_markers, tool_reply  # noqa: E402
from treerl.serve.streaming import ChoiceText  # noqa: E402

TOOLS = treerl.make("treerl/Calculator-v0").tool_schemas
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
STEP_S = 0.015  # added to each decode step


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    from treerl.models import load_default_model

    return load_default_model()


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(*tiny, max_new_tokens=64) as (url, recorder):
        policy, sample_step = recorder.policy, recorder.policy._sample_step

        def slow_step(*args):
            time.sleep(STEP_S)
            return sample_step(*args)

        policy._sample_step = slow_step
        yield url, recorder


def client_of(url: str):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def sampled_segments(recorder, task_key):
    group = next(g for g in recorder.finished if g.task_key == task_key)
    return [s for s in group.segments if s.kind == "sampled"]


def warm(client, messages, **extra) -> None:
    """An unrecorded request first: the policy keeps this prompt's keys and values, and the requests
    compared after it all start from them (one prefilled afresh differs in the last float bits)."""
    client.chat.completions.create(model="treerl", messages=messages, max_tokens=1,
                                   extra_headers={"X-Treerl-Record": "false"}, **extra)


def reward(client, episode_id: str) -> None:
    client.post(f"/episodes/{episode_id}/reward", body={"reward": 1.0}, cast_to=object)


# -- text: piece by piece, only what is certain -----------------------------------------------------


def test_text_stream_is_completion_text_piece_by_piece(tiny):
    """Multi-byte characters split over byte tokens come out whole, never as U+FFFD; a final special
    token (the stop token) is dropped, one in the middle kept: the pieces join to completion_text."""
    _, tok = tiny
    renderer = ChatRenderer(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("café 😀 中文, ok", add_special_tokens=False) + [end] + tok.encode(" é", add_special_tokens=False)
    for completion in (ids, ids + [end]):
        stream, pieces = renderer.text_stream(), []
        for k, token in enumerate(completion):
            pieces.append(stream.push(token))
            assert "\ufffd" not in pieces[-1]
            assert renderer.completion_text(completion).startswith("".join(pieces))
        assert "".join(pieces) == renderer.completion_text(completion)
        assert "" in pieces[3:6]  # the bytes of é: held until the character is whole


def final_content(text: str, request: ChatRequest) -> str | None:
    """The reply's content as the recorder makes it: cut at a stop string, then read for calls."""
    for s in request.stop:
        if s in text:
            text = text[:text.find(s)]
    parser = get_parser("hermes")
    parsed = None
    if request.tools and request.tool_choice != "none":
        parsed = parser.parse(text, {t["function"]["name"]: t["function"].get("parameters") for t in request.tools})
    return tool_reply(text, parsed, request.tools)[0].get("content")


@pytest.mark.parametrize("text", [
    "The answer is 4.",
    "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2+2\"}}\n</tool_call>",
    "  <tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1\"}}\n</tool_call>",
    " Leading space, then a call <tool_call>{\"name\": \"calculator\", \"arguments\": {}}</tool_call> and prose",
    "Broken <tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\"</tool_call> after",
    "stray </tool_call> tag",
    "wait for it <tool_ca",
    "stop here STOP and not this",
    "almost ST",
])
@pytest.mark.parametrize("with_tools", [True, False])
def test_streamed_content_is_always_a_prefix_of_the_final_content(tiny, text, with_tools):
    """Whatever the text turns out to be (calls, malformed calls, stop strings, whitespace), what was
    sent while it was sampled is where the final content begins."""
    _, tok = tiny
    request = ChatRequest(messages=[], tools=TOOLS if with_tools else None, stop=["STOP"])
    text_of = ChoiceText(ChatRenderer(tok), [], stops=request.stop, markers=call_markers(get_parser("hermes"),
                                                                                           request))
    sent = "".join(text_of.push(t) for t in tok.encode(text, add_special_tokens=False))
    content = final_content(text, request) or ""
    assert sent + text_of.rest(content) == content
    if not with_tools and "ST" not in text:
        assert sent == text  # no calls read, no stop in sight: everything streams


# -- the real openai client ---------------------------------------------------------------------------


def test_openai_client_gets_tokens_as_they_are_sampled(server):
    url, recorder = server
    client = client_of(url)
    t0 = time.perf_counter()
    arrivals, content = [], []
    stream = client.chat.completions.create(model="treerl", messages=CHAT, max_tokens=64, seed=5, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_headers={"X-Task-Id": "stream-timing"})
    for c in stream:
        if c.choices and c.choices[0].delta.content:
            arrivals.append(time.perf_counter() - t0)
            content.append(c.choices[0].delta.content)
        if c.usage is not None:
            usage = c.usage
    assert usage.completion_tokens >= 40  # a long reply (seed 5: 64 tokens), so the timing below means something
    # Chunks come as tokens are sampled: many of them, the first long before the last.
    assert len(content) >= usage.completion_tokens // 2
    assert arrivals[0] < arrivals[-1] - 0.4 * usage.completion_tokens * STEP_S, arrivals
    assert recorder.metrics["requests/streamed"] >= 1


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["chat", "tools"])
def test_streamed_equals_unstreamed_with_the_same_seed(server, tiny, tools):
    """Content (joined deltas), tool calls, finish reason, log-probs, usage and the recorded turn are identical."""
    url, recorder = server
    _, tok = tiny
    client = client_of(url)
    messages = CHAT if tools is None else treerl.make("treerl/Calculator-v0").reset(seed=3)[0]
    extra = {"tools": tools} if tools else {}
    name = "tools" if tools else "chat"
    warm(client, messages, **extra)
    plain = client.chat.completions.with_raw_response.create(
        model="treerl", messages=messages, max_tokens=48, seed=11, n=2, logprobs=True, top_logprobs=2,
        extra_headers={"X-Task-Id": f"plain-{name}"}, **extra)
    streamed = client.chat.completions.with_raw_response.create(
        model="treerl", messages=messages, max_tokens=48, seed=11, n=2, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Task-Id": f"streamed-{name}"}, **extra)
    plain_body, chunks = plain.parse(), list(streamed.parse())
    for index, choice in enumerate(plain_body.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        content = "".join(c.delta.content or "" for c in mine)
        calls = [tc for c in mine for tc in c.delta.tool_calls or []]
        assert content == (choice.message.content or "")
        assert [(tc.function.name, tc.function.arguments) for tc in calls] == \
               [(tc.function.name, tc.function.arguments) for tc in choice.message.tool_calls or []]
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        streamed_logprobs = [t for c in mine if c.logprobs for t in c.logprobs.content]
        assert [(t.token, t.logprob, [x.logprob for x in t.top_logprobs]) for t in streamed_logprobs] == \
               [(t.token, t.logprob, [x.logprob for x in t.top_logprobs]) for t in choice.logprobs.content]
        assert choice.logprobs.content and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
        if choice.message.tool_calls:  # calls come whole, after the content
            assert all(c.delta.tool_calls is None for c in mine[:-1 - len(calls)])
    assert chunks[-1].usage == plain_body.usage
    # The recorded trees hold the same turns: tokens, log-probs, versions.
    plain_ids = [c.model_extra["episode_id"] for c in plain_body.choices]
    streamed_ids = sorted({c.choices[0].model_extra["episode_id"] for c in chunks if c.choices})
    for episode_id in plain_ids + streamed_ids:
        reward(client, episode_id)
    plain_turns, streamed_turns = (sampled_segments(recorder, f"{kind}-{name}") for kind in ("plain", "streamed"))
    assert len(plain_turns) == len(streamed_turns) == 2
    for a, b in zip(plain_turns, streamed_turns):
        assert (a.token_ids, a.logprobs, a.policy_version, a.finish_reason) == \
               (b.token_ids, b.logprobs, b.policy_version, b.finish_reason)


def test_each_chunk_carries_the_logprobs_of_its_tokens(server):
    """As OpenAI's: a chunk's logprobs are those of the tokens its content came from, sent with it,
    not all at the end; cut at a stop string, they are the unstreamed reply's, joined."""
    url, _ = server
    client = client_of(url)
    unrecorded = {"X-Treerl-Record": "false"}
    ask = dict(model="treerl", messages=CHAT, max_tokens=40, seed=5, logprobs=True, top_logprobs=2,
               extra_headers=unrecorded, extra_body={"top_k": 8})
    warm(client, CHAT)
    plain = client.chat.completions.create(**ask)
    text = plain.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    for stops in ([], [stop]):
        want = client.chat.completions.create(**ask, stop=stops).choices[0]
        chunks = [c.choices[0] for c in client.chat.completions.create(**ask, stop=stops, stream=True) if c.choices]
        content, tokens = "", []
        with_text = [c for c in chunks if c.delta.content]
        assert len(with_text) >= 5
        for c in with_text:
            entries = c.logprobs.content
            assert entries, "a chunk with content carries its tokens' logprobs"
            content += c.delta.content
            tokens += [t.token for t in entries]
            assert "".join(tokens).startswith(content)  # the tokens sent so far made the content sent so far
            assert len("".join(tokens[:-1])) < len(content)  # and no token beyond the one that completes it
        joined = [t for c in chunks if c.logprobs for t in c.logprobs.content]
        assert [(t.token, t.logprob, [x.logprob for x in t.top_logprobs]) for t in joined] == \
               [(t.token, t.logprob, [x.logprob for x in t.top_logprobs]) for t in want.logprobs.content]
        assert content == want.message.content and chunks[-1].finish_reason == want.finish_reason


def test_a_refused_streamed_request_gets_its_4xx_unstreamed(server):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as info:
        list(client_of(url).chat.completions.create(model="treerl", messages=CHAT, max_tokens=10**6, stream=True))
    assert "max_tokens" in str(info.value)


# -- a client that hangs up ----------------------------------------------------------------------------


def test_a_client_hanging_up_mid_stream_leaves_the_turn_recorded_whole(server):
    """Raw HTTP: read the first content event, close the socket. The server goes on serving, samples
    the turn to its end and records it whole: the same tokens as the same request read to the end."""
    url, recorder = server
    host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps({"model": "treerl", "messages": CHAT, "max_tokens": 64, "seed": 5, "stream": True}).encode()
    disconnects = recorder.metrics["stream/disconnects"]
    warm(client_of(url), CHAT)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Task-Id: hung-up\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b'"content": "' not in received.split(b"\r\n\r\n", 1)[-1].replace(b'"content": ""', b""):
            received += sock.recv(4096)
        headers = received.split(b"\r\n\r\n", 1)[0].decode().lower()
    episode_id = next(line.split(": ", 1)[1] for line in headers.splitlines() if line.startswith("x-episode-id"))
    # The stream noticed; the episode's turn is sampled to its end and recorded.
    deadline = time.monotonic() + 60
    while recorder.metrics["stream/disconnects"] == disconnects or recorder.episodes[episode_id].turn is None:
        assert time.monotonic() < deadline, "the server did not finish the hung-up request"
        time.sleep(0.05)
    client = client_of(url)
    reference = client.chat.completions.create(model="treerl", messages=CHAT, max_tokens=64, seed=5,
                                               extra_headers={"X-Task-Id": "read-to-the-end"})
    assert client.models.list().data  # still serving
    reward(client, episode_id)
    reward(client, reference.model_extra["episode_id"])
    [hung], [read] = sampled_segments(recorder, "hung-up"), sampled_segments(recorder, "read-to-the-end")
    assert len(hung.token_ids) == reference.usage.completion_tokens >= 40
    assert (hung.token_ids, hung.logprobs, hung.finish_reason) == (read.token_ids, read.logprobs, read.finish_reason)
    assert recorder.metrics["stream/errors"] == 0
