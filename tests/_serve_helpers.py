"""A ``treerl serve`` on loopback for the tests: the real app under uvicorn, in a thread of the test process."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

from treerl.agents import ChatRenderer, TransformersPolicy
from treerl.serve.app import bind, create_app, open_recorder
from treerl.serve.config import ServeConfig
from treerl.serve.recorder import Recorder


@contextlib.contextmanager
def running_server(model: Any, tokenizer: Any, policy: Any = None, **options: Any) -> Iterator[tuple[str, Recorder]]:
    """Serve ``model`` (or ``policy``, a policy of it) on a free loopback port; yields ``(base_url, recorder)``
    (base_url ends in /v1)."""
    import uvicorn

    cfg = ServeConfig(port=0, **options)
    if policy is None:
        policy = TransformersPolicy(model, tokenizer, max_batch_size=cfg.max_batch_size, batch_wait_s=cfg.batch_wait_s)
    recorder = open_recorder(policy, tokenizer, cfg)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(recorder, cfg), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1", recorder
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        policy.close()


def seen_contexts(group, episode, tokenizer, tools) -> list[tuple[list[int], str]]:
    """For each sampled turn on the episode's main path: (the context ids the model saw, its raw text)."""
    renderer = ChatRenderer(tokenizer, tools=tools)
    out, context = [], []
    for segment in episode.path():
        if segment.kind == "sampled":
            out.append((list(context), renderer.completion_text(segment.token_ids)))
        context += segment.token_ids
    return out


class Exchanges:
    """httpx event hooks keeping every chat-completions request body and its reply, as the client sent and got them."""

    def __init__(self):
        self.pairs: list[tuple[dict, dict]] = []
        self._pending: dict[int, dict] = {}

    def on_request(self, request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self._pending[id(request)] = json.loads(request.content)

    def on_response(self, response) -> None:
        body = self._pending.pop(id(response.request), None)
        if body is not None:
            response.read()
            self.pairs.append((body, json.loads(response.content)))

    def http_client(self):
        import httpx

        return httpx.Client(event_hooks={"request": [self.on_request], "response": [self.on_response]}, timeout=120)


def assert_recorded_exactly(tokenizer, group, pairs) -> None:
    """Every sampled turn of ``group`` (one episode's, in order) saw the rendering of the request that asked for it.

    The expected text is computed from the client's own request bodies: its messages and
    tools through the chat template, with the replies this server gave rendered from their raw
    sampled text wherever the client sent them back unchanged.
    """
    from treerl.envs.parsers import get_parser
    from treerl.serve.openai_format import call_opening, message_key, parse_request, template_messages

    sampled = [i for i, s in enumerate(group.segments) if s.kind == "sampled"]
    assert len(sampled) == len(pairs), (len(sampled), len(pairs))
    raw_texts: dict[str, str] = {}
    for index, (body, reply) in zip(sampled, pairs):
        request = parse_request(body)
        renderer = ChatRenderer(tokenizer, tools=request.tools)
        path = group.path_indices(index)
        context = [t for j in path[:-1] for t in group.segments[j].token_ids]
        # tool_choice required or named: the server forced the call's opening (an unsampled segment) first.
        opening = call_opening(get_parser(tokenizer=tokenizer), request) or ""
        expected = renderer.render(template_messages(request.messages, raw_texts)) + opening
        assert tokenizer.decode(context, skip_special_tokens=False) == expected
        forced = group.segments[path[-2]].token_ids if opening else []
        raw = renderer.completion_text([*forced, *group.segments[index].token_ids])
        message = parse_request({"messages": [reply["choices"][0]["message"]]}).messages[0]
        raw_texts[message_key(message)] = raw
