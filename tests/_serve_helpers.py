"""A ``treerl serve`` on loopback for the tests: the real app under uvicorn, in a thread of the test process."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from treerl.agents import ChatRenderer, TransformersPolicy
from treerl.serve.app import bind, create_app
from treerl.serve.config import ServeConfig
from treerl.serve.recorder import Recorder


@contextlib.contextmanager
def running_server(model: Any, tokenizer: Any, **options: Any) -> Iterator[tuple[str, Recorder]]:
    """Serve ``model`` on a free loopback port; yields ``(base_url, recorder)`` (base_url ends in /v1)."""
    import uvicorn

    cfg = ServeConfig(port=0, **options)
    policy = TransformersPolicy(model, tokenizer)
    recorder = Recorder(policy, tokenizer, cfg)
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
