"""The HTTP side of ``treerl serve``: an OpenAI-compatible API whose traffic the :class:`Recorder` records.

Endpoints (all JSON; errors in OpenAI's shape, the field named in ``param``):

==========================================  ==========================================================
``POST /v1/chat/completions``               messages, tools, tool_choice, parallel_tool_calls,
                                            temperature, top_p, top_k, min_p, repetition_penalty
                                            (vLLM's extra field), max_tokens, stop,
                                            seed, n, stream, logprobs, top_logprobs;
                                            episode by ``X-Episode-Id`` / ``metadata.episode_id`` /
                                            ``user``, group by ``X-Task-Id`` / ``metadata.task_id``;
                                            ``X-Treerl-Record: false`` serves without recording
``GET /v1/models``, ``/v1/models/{id}``      the served model (404 ``model_not_found`` for another id)
``GET /health``                             liveness and the policy version
``POST /v1/episodes/{id}/reward``           ``{"reward": 1.0}`` or ``{"rewards": [...]}`` finishes it;
                                            optional ``metrics``, ``termination``, ``feedback``
``POST /v1/rewards``                        ``{"rewards": [{"episode_id": ..., "reward": ...}, ...]}``
``POST /v1/tasks/{task_id}/finish``         closes the task's group now
``GET /v1/groups?start=&count=&wait=``      finished groups by position (what ``--from-server`` reads)
``GET /v1/stats``                           counters: episodes, tool calls by outcome, groups
``POST /v1/control/weights?version=N``      new weights (a safetensors body, or ``{"path": ...}``)
``POST /v1/control/pause`` / ``resume``     hold new requests (e.g. around a weights update)
==========================================  ==========================================================

Security: with a token (``TREERL_SERVE_TOKEN``) every endpoint needs ``Authorization: Bearer
<token>``; without one the server binds only to loopback and refuses the control endpoints.
Bodies larger than ``max_request_bytes`` (weights: ``max_weights_bytes``) get 413.

FastAPI and uvicorn come with the ``serve`` extra (``pip install 'treerl[serve]'``) and are
imported only when the server starts.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at definition.
import asyncio
import contextlib
import hmac
import json
import math
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from treerl.agents.chat import ChatRenderer
from treerl.agents.policy import Policy, StreamedToken
from treerl.errors import MissingExtraError
from treerl.rollout.view import token_pieces
from treerl.serve.config import ServeConfig
from treerl.serve import streaming
from treerl.serve.openai_format import (RequestError, call_markers, completion_body, completion_head, error_body,
                                        parse_request)
from treerl.serve.recorder import Choice, Recorder

__all__ = ["create_app", "serve", "open_recorder", "require_serve_extra"]


def require_serve_extra() -> None:
    """Import FastAPI and uvicorn, or say which extra to install."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(f"treerl serve needs FastAPI and uvicorn ({exc.name} is missing): "
                          "pip install 'treerl[serve]'") from None


async def _read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (413) as soon as it passes ``limit`` bytes, whatever Content-Length said."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(None, f"the request body exceeds {limit} bytes.", status=413)
    return bytes(body)


def _decode_json(data: bytes) -> Any:
    try:
        return json.loads(data or b"{}")
    except ValueError as exc:
        raise RequestError(None, f"the body is not valid JSON ({exc}).") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise RequestError(None, "the body's JSON is nested too deeply.") from None


async def _read_json(request: Any, limit: int) -> Any:
    return _decode_json(await _read_body(request, limit))


def _header_or(request: Any, header: str, metadata: dict[str, Any], key: str, fallback: str | None = None
               ) -> str | None:
    value = request.headers.get(header) or metadata.get(key) or fallback
    return None if value is None else str(value)


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """The raw bytes of a token (OpenAI's ``bytes``), which ``text.encode()`` is not when the token
    holds part of a multi-byte character (its decoded text is then U+FFFD): those come from the
    vocabulary, as the viewer reads them (:func:`treerl.rollout.view.token_pieces`).

    >>> from treerl.models import load_default_model
    >>> tok = load_default_model()[1]
    >>> ids = tok.encode("é")
    >>> b"".join(token_bytes(tok, i, tok.decode([i])) for i in ids).decode()
    'é'
    """
    if "\ufffd" not in text:
        return text.encode()
    piece = token_pieces(tokenizer, [token_id])[token_id]
    return bytes(piece) if isinstance(piece, list) else piece.encode()


def logprob_entries(tokenizer: Any, num_top: int) -> Callable[[StreamedToken], dict[str, Any]]:
    """A token's entry of OpenAI's ``logprobs.content``: its log-prob and, with ``num_top``, the most
    likely tokens of the distribution it was drawn from (its candidates when top-k bounds it)."""
    pieces: dict[int, tuple[str, list[int]]] = {}

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        if token_id not in pieces:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
            pieces[token_id] = (text, list(token_bytes(tokenizer, token_id, text)))
        text, raw = pieces[token_id]
        return {"token": text, "logprob": logprob, "bytes": raw}

    def token_entry(token: StreamedToken) -> dict[str, Any]:
        top = []
        if num_top and token.top_ids is not None and token.top_logprobs is not None:
            top = [entry(i, x) for i, x in zip(token.top_ids[:num_top], token.top_logprobs[:num_top])]
        return {**entry(token.token_id, token.logprob), "top_logprobs": top}

    return token_entry


def token_logprobs(generation: Any, tokenizer: Any, num_top: int) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` of a generation (see :func:`logprob_entries`)."""
    entry = logprob_entries(tokenizer, num_top)
    top_ids = generation.top_ids if generation.top_ids is not None else generation.candidates
    has_top = generation.top_logprobs is not None and top_ids is not None
    return [entry(StreamedToken(token_id, lp, top_ids[t] if has_top else None,
                                generation.top_logprobs[t] if has_top else None))
            for t, (token_id, lp) in enumerate(zip(generation.token_ids, generation.logprobs))]


def _choice_json(choice: Choice, index: int, tokenizer: Any, logprobs: bool, num_top: int) -> dict[str, Any]:
    out = {"index": index, "message": choice.message, "finish_reason": choice.finish_reason, "logprobs": None,
           "episode_id": choice.episode_id, "_completion_tokens": len(choice.generation.token_ids)}
    if logprobs:
        out["logprobs"] = {"content": token_logprobs(choice.generation, tokenizer, num_top)}
    return out


def create_app(recorder: Recorder, cfg: ServeConfig) -> Any:
    """The FastAPI application serving ``recorder`` (see the module docstring)."""
    require_serve_extra()
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        async def expire_idle() -> None:
            while True:  # idle episodes end as timeouts, so their groups can complete
                await asyncio.sleep(min(5.0, cfg.episode_timeout_s / 4))
                recorder.expire()

        sweeper = asyncio.create_task(expire_idle())
        try:
            yield
        finally:
            sweeper.cancel()
            recorder.close()

    app = FastAPI(title="treerl serve", lifespan=lifespan)
    policy, tokenizer = recorder.policy, recorder.tokenizer

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        path = request.url.path
        control = path.startswith("/v1/control/")
        if control and not cfg.token:
            return JSONResponse(error_body("control endpoints need a bearer token: start the server with "
                                           "TREERL_SERVE_TOKEN set (or --token).", kind="permission_error"), 403)
        if cfg.token:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {cfg.token}".encode()):
                return JSONResponse(error_body("missing or wrong bearer token (Authorization: Bearer <token>).",
                                               kind="authentication_error"), 401,
                                    headers={"WWW-Authenticate": "Bearer"})
        limit = cfg.max_weights_bytes if path == "/v1/control/weights" else cfg.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return JSONResponse(error_body(f"the request body exceeds {limit} bytes.", code="request_too_large"), 413)
        return await call_next(request)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> Any:
        message = str(exc).split(": ", 1)[1] if exc.param else str(exc)
        recorder.metrics[f"http/{exc.status}"] += 1
        return JSONResponse(error_body(f"{exc.param}: {message}" if exc.param else message, param=exc.param,
                                       code=exc.code), exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Any:  # unknown routes, wrong methods
        route = f"{request.method} {request.url.path}"
        message = f"invalid URL ({route})." if exc.status_code == 404 else f"{route}: {exc.detail}"
        return JSONResponse(error_body(message), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request: Request, exc: RequestValidationError) -> Any:  # e.g. ?start=abc
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first["loc"][1:]) or None
        recorder.metrics["http/400"] += 1
        return JSONResponse(error_body(f"{param}: {first['msg']}" if param else first["msg"], param=param), 400)

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok", "policy_version": policy.version, "paused": not recorder.running.is_set()}

    served_model = {"id": cfg.served_model_name, "object": "model", "created": 0, "owned_by": "treerl"}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [served_model]}

    @app.get("/v1/models/{model:path}")  # ids may hold slashes ("org/name")
    async def model_info(model: str) -> Any:
        if model != cfg.served_model_name:
            raise RequestError("model", f"the model {model!r} does not exist; this server serves "
                                        f"{cfg.served_model_name!r}.", status=404, code="model_not_found")
        return served_model

    streams: set[asyncio.Task] = set()  # streamed completions run on when their client goes away
    plain_renderer = ChatRenderer(tokenizer)  # a stream's text: the tokenizer's decoding, whatever the tools

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        chat_request = parse_request(await _read_json(request, cfg.max_request_bytes))
        meta = chat_request.metadata
        episode_id = _header_or(request, "x-episode-id", meta, "episode_id", chat_request.user)
        task_id = _header_or(request, "x-task-id", meta, "task_id")
        record = (_header_or(request, "x-treerl-record", meta, "record") or "true").lower() not in ("0", "false", "no")
        model = chat_request.model or cfg.served_model_name

        def body_of(choices: list[Choice], head: dict[str, Any] | None = None) -> dict[str, Any]:
            body = completion_body([_choice_json(c, i, tokenizer, chat_request.logprobs, chat_request.top_logprobs)
                                    for i, c in enumerate(choices)],
                                   model=model, prompt_tokens=choices[0].prompt_tokens, policy_version=policy.version,
                                   episode_id=choices[0].episode_id if len(choices) == 1 and record else None,
                                   head=head)
            if not record:
                for c in body["choices"]:
                    c.pop("episode_id")
            return body

        queue: asyncio.Queue | None = asyncio.Queue() if chat_request.stream else None
        complete = recorder.complete(chat_request, episode_id=episode_id, task_id=task_id, record=record,
                                     stream=queue)
        if not chat_request.stream:
            choices = await complete
            headers = {"x-episode-id": choices[0].episode_id} if record and len(choices) == 1 else {}
            return JSONResponse(body_of(choices), headers=headers)

        task = asyncio.create_task(complete)
        streams.add(task)
        task.add_done_callback(streams.discard)
        task.add_done_callback(lambda t: queue.put_nowait(streaming.END))
        start = await streaming.started(queue, task)  # a refused request raises here: its 4xx, unstreamed
        recorder.metrics["requests/streamed"] += 1
        ids = start.episode_ids
        headers = {"x-episode-id": ids[0]} if ids is not None and len(ids) == 1 else {}
        head = {**completion_head(), "model": model, "system_fingerprint": f"treerl-v{policy.version}"}
        markers = call_markers(recorder.parser, chat_request)
        texts = [streaming.ChoiceText(plain_renderer, forced, stops=chat_request.stop, markers=markers)
                 for forced in start.forced]
        extras = [{"episode_id": i} for i in ids] if ids is not None else [{} for _ in start.forced]
        return StreamingResponse(
            streaming.events(queue, task, texts, head, extras, lambda choices: body_of(choices, head),
                             chat_request.include_usage, recorder.metrics,
                             logprob_entries(tokenizer, chat_request.top_logprobs) if chat_request.logprobs else None),
            media_type="text/event-stream", headers=headers)

    async def _one_reward(episode_id: str, item: Any) -> None:
        if not isinstance(item, dict):
            raise RequestError("reward", "the body must be an object with reward or rewards.")
        reward, rewards = item.get("reward"), item.get("rewards")
        if rewards is not None and (not isinstance(rewards, list) or not rewards
                                    or not all(_is_number(r) for r in rewards)):
            raise RequestError("rewards", "must be a non-empty list of numbers (one per turn).")
        if rewards is None and not _is_number(reward):
            raise RequestError("reward", f"must be a number, got {reward!r}.")
        metrics = item.get("metrics") or {}
        if not isinstance(metrics, dict):
            raise RequestError("metrics", "must be an object.")
        termination = item.get("termination") or "completed"
        if not isinstance(termination, str):
            raise RequestError("termination", "must be a string.")
        feedback = item.get("feedback")
        if feedback is not None and not isinstance(feedback, str):
            raise RequestError("feedback", "must be a string (what went wrong, in words).")
        await recorder.reward(episode_id, reward, rewards, metrics, termination, feedback)

    @app.post("/v1/episodes/{episode_id}/reward")
    async def reward(episode_id: str, request: Request) -> Any:
        await _one_reward(episode_id, await _read_json(request, cfg.max_request_bytes))
        return {"episode_id": episode_id, "finished": True}

    @app.post("/v1/rewards")
    async def rewards(request: Request) -> Any:
        body = await _read_json(request, cfg.max_request_bytes)
        items = body.get("rewards") if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise RequestError("rewards", "must be a list of {episode_id, reward} objects.")
        results = []
        for i, item in enumerate(items):
            episode_id = item.get("episode_id") if isinstance(item, dict) else None
            if not isinstance(episode_id, str):
                results.append({"index": i, "error": f"rewards[{i}].episode_id is required (a string)."})
                continue
            try:
                await _one_reward(episode_id, item)
                results.append({"index": i, "episode_id": episode_id, "finished": True})
            except RequestError as exc:
                results.append({"index": i, "episode_id": episode_id, "error": str(exc)})
        return {"results": results}

    @app.post("/v1/tasks/{task_id}/finish")
    async def finish_task(task_id: str) -> Any:
        return {"task_id": task_id, "episodes": recorder.finish_task(task_id)}

    @app.get("/v1/groups")
    async def groups(start: int = 0, count: int = 1, wait: float = 0.0) -> Any:
        if start < 0 or not 1 <= count <= 1024 or not 0 <= wait <= 600:
            raise RequestError("start", "start >= 0, 1 <= count <= 1024 and 0 <= wait <= 600 are required.")
        found = await recorder.groups(start, count, wait)
        return {"start": start, "total": len(recorder.finished), "groups": [json.loads(g.to_json()) for g in found]}

    @app.get("/v1/stats")
    async def stats() -> Any:
        return {"metrics": dict(recorder.metrics), "open_episodes": len(recorder.episodes),
                "open_tasks": len(recorder.tasks), "finished_groups": len(recorder.finished),
                "policy_version": policy.version, "paused": not recorder.running.is_set()}

    @app.post("/v1/control/weights")
    async def weights(request: Request, version: int | None = None) -> Any:
        data = await _read_body(request, cfg.max_weights_bytes)
        if request.headers.get("content-type", "").startswith("application/json"):
            body = _decode_json(data)
            if not isinstance(body, dict) or not isinstance(body.get("path"), str):
                raise RequestError("path", "a JSON body names a checkpoint: {\"path\": ..., \"version\": N}.")
            source, version = body["path"], body.get("version", version)
        else:
            from safetensors.torch import load

            try:
                source = load(data)
            except Exception as exc:  # a body that is not safetensors: the client's fault
                raise RequestError("body", f"not a safetensors file ({exc}).") from None
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise RequestError("version", "the new weights need their version: an integer >= 0.")
        start = time.perf_counter()
        try:
            await asyncio.to_thread(policy.set_weights, source, version)
        except (ValueError, FileNotFoundError) as exc:
            raise RequestError("weights", str(exc)) from None
        recorder.metrics["weights/updates"] += 1
        return {"policy_version": policy.version, "seconds": time.perf_counter() - start}

    @app.post("/v1/control/pause")
    async def pause() -> Any:
        recorder.running.clear()
        return {"paused": True}

    @app.post("/v1/control/resume")
    async def resume() -> Any:
        recorder.running.set()
        return {"paused": False}

    return app


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def open_recorder(policy: Policy, tokenizer: Any, cfg: ServeConfig) -> Recorder:
    """The server's :class:`Recorder`, with ``cfg.chat_template`` (and its variables) made the tokenizer's own
    first: the recorder's tool-call parser and every renderer read the template from the tokenizer."""
    cfg.apply_chat_template(tokenizer)
    return Recorder(policy, tokenizer, cfg)


def serve(cfg: ServeConfig, policy: Policy | None = None, tokenizer: Any = None) -> None:
    """Load the model (unless a policy is given), bind, print the URL and serve until interrupted."""
    require_serve_extra()
    import uvicorn

    if cfg.num_threads:
        import torch

        torch.set_num_threads(cfg.num_threads)
    if policy is None:
        from treerl.agents.transformers_policy import TransformersPolicy
        from treerl.models import load_model

        model, tokenizer = load_model(cfg.model, cfg.device)
        policy = TransformersPolicy(model, tokenizer, device=cfg.device, max_batch_size=cfg.max_batch_size,
                                    batch_wait_s=cfg.batch_wait_s)
    recorder = open_recorder(policy, tokenizer, cfg)
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"treerl serve: http://{shown}:{port}/v1 (model {cfg.model or 'the shipped tiny model'}, "
          f"{len(recorder.finished)} finished groups in {cfg.out or 'memory'})", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(recorder, cfg), log_level=cfg.log_level, timeout_keep_alive=30))
    try:
        server.run(sockets=[sock])
    finally:
        policy.close()
