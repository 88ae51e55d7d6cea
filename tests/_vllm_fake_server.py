"""A stand-in for ``vllm serve`` on CPU: the HTTP routes and JSON of vLLM 0.33.0's OpenAI server
that treerl's server mode uses, sampling with a transformers model (the shipped tiny one).

It follows the server where treerl depends on it (see ``treerl/agents/vllm_server_policy.py``
for the vLLM files this mirrors):

- ``GET /v1/models``; ``POST /v1/completions`` with a token-id prompt: ``top_logprobs`` holds the
  sampled token and the top ``logprobs`` entries, keyed ``"token_id:N"``, ``-inf`` sent as
  ``-9999.0``; ``logprobs`` above ``max_logprobs`` and an unknown model are refused with vLLM's
  messages; ``--logprobs-mode`` is ``processed_logprobs`` (the sampler's distribution) or
  ``raw_logprobs`` (the model's log-softmax, vLLM's default); ``weight_versions`` spans.
- Development mode only (``VLLM_SERVER_DEV_MODE=1``; 404 otherwise): ``/pause``, ``/resume``,
  ``/collective_rpc`` (``reload_weights`` with ``weights_path``), ``/reset_prefix_cache``,
  ``/update_weight_version``, ``/weight_info``, ``/get_world_size``.

Sampling is :class:`~treerl.agents.transformers_policy.TransformersPolicy`'s, so a request's
tokens and processed log-probs are what that policy gives for the same seed.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch

from treerl.agents.policy import GenerationRequest, SamplingParams
from treerl.agents.transformers_policy import TransformersPolicy, load_state_dict
from treerl.models import default_model_path, load_default_model

CUT = -9999.0


class FakeVLLMServer:
    """``with FakeVLLMServer() as server: server.url`` -- a server on a free loopback port."""

    def __init__(self, *, served_name: str | None = None, logprobs_mode: str = "processed_logprobs",
                 max_logprobs: int = 20, dev_mode: bool = True):
        self.model, self.tokenizer = load_default_model()
        self.policy = TransformersPolicy(self.model, self.tokenizer)
        self.served_name = served_name or str(default_model_path())
        self.logprobs_mode = logprobs_mode
        self.max_logprobs = max_logprobs
        self.dev_mode = dev_mode
        self.weight_version = "default"
        self.paused = False
        self.completions: list[dict] = []  # request bodies, in arrival order
        self.control: list[tuple[str, Any]] = []  # (route, body) of every development-mode call
        self.reloaded: list[Path] = []  # the weights directories loaded, in order
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> FakeVLLMServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self.policy.close()

    # -- /v1/completions ---------------------------------------------------------------------

    def complete(self, body: dict) -> tuple[int, dict]:
        if body.get("model") not in (None, self.served_name):
            return 404, _error(f"The model `{body.get('model')}` does not exist.", "NotFoundError", 404)
        num_logprobs = body.get("logprobs")
        if num_logprobs is not None and num_logprobs > self.max_logprobs:
            return 400, _error(f"Requested sample logprobs of {num_logprobs}, which is greater than max allowed: "
                               f"{self.max_logprobs}", "BadRequestError", 400)
        if self.paused:
            return 503, _error("generation is paused", "ServiceUnavailableError", 503)
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return 400, _error("this stand-in takes token-id prompts only", "BadRequestError", 400)
        top_k = body.get("top_k")
        top_k = None if top_k in (None, 0, -1) else top_k
        num_logprobs = num_logprobs or 0
        params = SamplingParams(temperature=body.get("temperature", 1.0), top_k=top_k, top_p=body.get("top_p", 1.0),
                                min_p=body.get("min_p", 0.0), repetition_penalty=body.get("repetition_penalty", 1.0),
                                max_new_tokens=body.get("max_tokens", 16),
                                stop_token_ids=tuple(body.get("stop_token_ids") or ()),
                                top_logprobs=max(num_logprobs, 1))
        with self._lock:
            self.completions.append(body)
            version = self.weight_version
            g = self.policy.generate([GenerationRequest(prompt, params, seed=body.get("seed"))])[0]
            if self.logprobs_mode == "raw_logprobs":
                steps = self._raw_steps(prompt, g.token_ids, num_logprobs)
            else:
                steps = self._processed_steps(g, params, num_logprobs)
        n = len(g.token_ids)
        choice = {
            "index": 0, "text": "", "finish_reason": g.finish_reason, "stop_reason": None,
            "logprobs": {"text_offset": list(range(n)), "tokens": [f"token_id:{t}" for t in g.token_ids],
                         "token_logprobs": [max(step[t], CUT) for step, t in zip(steps, g.token_ids)],
                         "top_logprobs": [{f"token_id:{t}": max(lp, CUT) for t, lp in step.items()}
                                          for step in steps]},
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = g.token_ids
        if body.get("return_weight_versions") and n:
            choice["weight_versions"] = [{"version": version, "start": 0, "end": n}]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        return 200, {"id": "cmpl-fake", "object": "text_completion", "model": self.served_name,
                     "choices": [choice], "usage": usage}

    def _processed_steps(self, g, params: SamplingParams, num_logprobs: int) -> list[dict[int, float]]:
        """Per token: the sampled one first, then the top ``num_logprobs`` of the sampler's distribution
        (vLLM's order), ``-inf`` past the candidate set."""
        steps = []
        for t, token in enumerate(g.token_ids):
            if params.top_k is not None:
                ranked = list(zip(g.candidates[t], g.top_logprobs[t]))
            else:
                ranked = list(zip(g.top_ids[t], g.top_logprobs[t]))
            cut = (i for i in range(self.model.config.vocab_size) if i not in dict(ranked))
            while len(ranked) < num_logprobs:  # vLLM's top-k of processed log-probs reaches into the -inf tail
                ranked.append((next(cut), float("-inf")))
            step = {token: g.logprobs[t]}
            step.update((i, lp) for i, lp in ranked[:num_logprobs] if i != token)
            steps.append(step)
        return steps

    def _raw_steps(self, prompt: list[int], token_ids: list[int], num_logprobs: int) -> list[dict[int, float]]:
        """vLLM's default ``raw_logprobs``: the model's log-softmax before temperature and filtering."""
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        steps = []
        for t, token in enumerate(token_ids):
            top = torch.topk(logprobs[t], num_logprobs) if num_logprobs else None
            step = {token: logprobs[t, token].item()}
            if top is not None:
                step.update((int(i), v.item()) for v, i in zip(top.values, top.indices) if int(i) != token)
            steps.append(step)
        return steps

    # -- development-mode routes -------------------------------------------------------------

    def dev(self, method: str, route: str, query: dict, body: Any) -> tuple[int, Any]:
        self.control.append((route, body))
        if (method, route) == ("POST", "/pause"):
            self.paused = True
            return 200, {"status": "paused"}
        if (method, route) == ("POST", "/resume"):
            self.paused = False
            return 200, {"status": "resumed"}
        if (method, route) == ("POST", "/collective_rpc"):
            if body.get("method") != "reload_weights":
                return 500, _error(f"this stand-in's workers have no method {body.get('method')!r}", "Error", 500)
            path = Path(body["kwargs"]["weights_path"])
            with self._lock:  # vLLM's reload_weights reads the directory's *.safetensors in place
                self.policy.set_weights(load_state_dict(path), version=self.policy.version + 1)
                self.reloaded.append(path)
            return 200, {"results": [None]}
        if (method, route) == ("POST", "/reset_prefix_cache"):
            return 200, {"success": True}
        if (method, route) == ("POST", "/update_weight_version"):
            self.weight_version = body["new_version"]
            return 200, {"success": True, "new_version": body["new_version"]}
        if (method, route) == ("GET", "/weight_info"):
            return 200, {"weight_version": self.weight_version}
        if (method, route) == ("GET", "/get_world_size"):
            return 200, {"world_size": 1}
        return 404, {"detail": "Not Found"}


DEV_ROUTES = {"/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
              "/weight_info", "/get_world_size"}


def _error(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _handler(server: FakeVLLMServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            parsed = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else {}
            if (method, parsed.path) == ("GET", "/v1/models"):
                self._send(200, {"object": "list", "data": [{"id": server.served_name, "object": "model"}]})
            elif (method, parsed.path) == ("POST", "/v1/completions"):
                self._send(*server.complete(body))
            elif parsed.path in DEV_ROUTES and server.dev_mode:
                self._send(*server.dev(method, parsed.path, parse_qs(parsed.query), body))
            else:
                self._send(404, {"detail": "Not Found"})

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

    return Handler
