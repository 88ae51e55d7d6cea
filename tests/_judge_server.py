"""A scripted OpenAI-compatible judge on loopback: real HTTP, chosen verdicts.

``ScriptedJudge(reply)`` serves ``POST /v1/chat/completions``; ``reply(prompt_text, call_index)`` returns the
verdict text, or ``(status, text)`` for an HTTP error, or ``("sleep", seconds, text)`` to answer late. Every
request body is kept in ``requests``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ScriptedJudge:
    def __init__(self, reply: Callable[[str, int], Any]):
        self.reply = reply
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def prompts(self) -> list[str]:
        """The user message of each request, in arrival order."""
        return [body["messages"][-1]["content"] for body in self.requests]

    def __enter__(self) -> ScriptedJudge:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(judge: ScriptedJudge) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            with judge._lock:
                index = len(judge.requests)
                judge.requests.append(body)
            answer = judge.reply(body["messages"][-1]["content"], index)
            status = 200
            if isinstance(answer, tuple) and answer[0] == "sleep":
                time.sleep(answer[1])
                answer = answer[2]
            elif isinstance(answer, tuple):
                status, answer = answer
            if status == 200:
                payload = {"id": f"chatcmpl-{index}", "object": "chat.completion", "created": 0,
                           "model": body.get("model"),
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": answer}}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            else:
                payload = {"error": {"message": answer, "type": "server_error", "code": status}}
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                pass

    return Handler
