"""A generation backend on a vLLM OpenAI server started separately (``vllm serve``): server mode.

The learner samples through the server's ``POST /v1/completions`` with token-id prompts and
pushes its weights to the server after every step. What is recorded per sampled token is
what the transformers backend records: the id, its processed log-prob (after temperature,
top-k, min-p, top-p), the candidate set, and the weights version.

Written against vLLM 0.33.0 (the PyPI wheel, build commit 4ba787ec9). Files read:

- ``vllm/entrypoints/openai/completion/protocol.py``: ``CompletionRequest`` takes a prompt of
  token ids, ``logprobs``, ``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ``stop_token_ids``,
  ``return_token_ids``, ``return_tokens_as_token_ids`` and ``return_weight_versions``;
  a choice carries ``token_ids``, ``logprobs`` and ``weight_versions`` spans.
- ``vllm/entrypoints/openai/completion/serving.py`` (``_create_completion_logprobs``): per
  token, ``token_logprobs`` is the sampled token's log-prob and ``top_logprobs`` the first
  ``logprobs + 1`` entries (the sampled token and the top ``logprobs``), keyed
  ``"token_id:N"`` with ``return_tokens_as_token_ids``; ``-inf`` is sent as ``-9999.0``.
- ``vllm/config/model.py`` and ``vllm/v1/sample/sampler.py``: with ``--logprobs-mode
  processed_logprobs`` the log-probs are those of the distribution the token was drawn from,
  after the repetition penalty (over the prompt and the output), temperature, min-p and
  top-k/top-p (the default, ``raw_logprobs``, is the model's log-softmax before any of them);
  ``--max-logprobs`` (default 20) caps ``logprobs``.
- ``vllm/entrypoints/launchers/api_server/routers.py``: the dev and RL routes exist only when
  the server runs with ``VLLM_SERVER_DEV_MODE=1``.
- ``vllm/entrypoints/serve/dev/rpc/api_router.py`` (``POST /collective_rpc``: a worker method
  by name, string arguments only), ``vllm/entrypoints/serve/dev/cache/api_router.py``
  (``POST /reset_prefix_cache``), ``vllm/v1/worker/gpu_worker.py`` and
  ``vllm/model_executor/model_loader/reload/inplace.py`` (the worker's
  ``reload_weights(weights_path=...)`` loads a safetensors directory in place).
- ``vllm/entrypoints/rl/online/api_router.py``: ``/pause``, ``/resume``,
  ``/update_weight_version``, ``/weight_info``, ``/get_world_size`` and the weight-transfer
  routes; ``vllm/distributed/weight_transfer/{base,clients,factory,nccl_engine}.py``: the
  trainer side of the NCCL transfer (``WeightTransferTrainerFactory.trainer_init`` with
  ``NCCLTrainerInitInfo``, ``ModuleSource`` and ``HTTPVLLMWeightSyncClient``).

**Candidate sets.** With ``top_k=k`` each request asks for ``logprobs=k``. The server's
processed log-probs are ``-inf`` (sent as ``-9999.0``) outside the support, and the support
lies inside the top k, so the finite entries of ``top_logprobs`` are exactly the candidate
set, and their values are already renormalized over it (the log-softmax of the filtered
logits). Both are exact, as the server computed them; :func:`check_processed` verifies that
they sum to one, which raw log-probs over a top-k set do not. Without ``top_k`` the candidate
set is the whole vocabulary (recorded as None) and the sampled token's processed log-prob is
exact. The one approximation is the ``-9999.0`` floor: a finite processed log-prob below it
(probability under e^-9999) would be read as cut, which no float32 softmax produces.

**Weights.** ``disk`` (default): the trainer writes a safetensors directory the server can
read (same machine or a shared filesystem), then ``/pause``, ``/collective_rpc``
``reload_weights``, ``/reset_prefix_cache``, ``/update_weight_version``, ``/resume``.
``nccl``: vLLM's own weight transfer, GPU to GPU (the trainer on another GPU; vllm installed
beside the trainer). Either way the server labels later tokens with the new version, and
:func:`completion_to_generation` records the label the server returns.

Tested on CPU against ``tests/_vllm_fake_server.py``, which follows this HTTP interface and
samples with the shipped tiny model; the real server only where CUDA and vllm exist.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from treerl.agents.policy import AsyncBatcher, Generation, GenerationRequest, SamplingParams
from treerl.errors import ConfigError

__all__ = ["VLLMServerPolicy", "VLLMServerError", "completion_request", "completion_to_generation",
           "check_processed", "WEIGHT_SYNCS", "CUT_LOGPROB"]

WEIGHT_SYNCS = ("disk", "nccl")
CUT_LOGPROB = -9999.0
"""What the server sends for a ``-inf`` log-prob (JSON has no infinity)."""

SERVE_HINT = ("VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs "
              "--max-logprobs K (K >= your --top-k)")


class VLLMServerError(ConfigError):
    """The vLLM server cannot be used as it is; the message names the fix."""


def completion_request(request: GenerationRequest, model: str, stop_token_ids: frozenset[int]) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for one request.

    >>> body = completion_request(GenerationRequest([1, 2], SamplingParams(top_k=4, max_new_tokens=8), seed=3),
    ...                           "m", frozenset({7}))
    >>> body["prompt"], body["top_k"], body["logprobs"], body["max_tokens"], body["seed"], body["stop_token_ids"]
    ([1, 2], 4, 4, 8, 3, [7])
    """
    params = request.params
    return {
        "model": model,
        "prompt": list(request.prompt_ids),
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k if params.top_k is not None else -1,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "seed": request.seed,
        "n": 1,
        "stop_token_ids": sorted(stop_token_ids | set(params.stop_token_ids)),
        # top_k processed log-probs per step reveal the whole candidate set (see the module docstring).
        "logprobs": params.top_k if params.top_k is not None else params.top_logprobs,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "return_weight_versions": True,
        "skip_special_tokens": False,
    }


def _token_id(key: str) -> int:
    if not key.startswith("token_id:"):
        raise VLLMServerError(f"the server sent token {key!r} where 'token_id:N' was asked for "
                              "(return_tokens_as_token_ids); is it a vLLM OpenAI server?")
    return int(key.removeprefix("token_id:"))


def check_processed(step: Mapping[int, float], lse_tol: float = 1e-3) -> None:
    """Raise unless the finite log-probs of a top-k step sum to one (processed log-probs).

    >>> check_processed({5: math.log(0.75), 6: math.log(0.25), 9: CUT_LOGPROB})
    >>> check_processed({5: math.log(0.5), 6: math.log(0.2)})
    Traceback (most recent call last):
    ...
    treerl.agents.vllm_server_policy.VLLMServerError: the server's log-probs over the top-k set sum to 0.7, not 1: ...
    """
    total = sum(math.exp(lp) for lp in step.values() if lp > CUT_LOGPROB)
    if total <= 0 or abs(math.log(total)) > lse_tol:
        raise VLLMServerError(
            f"the server's log-probs over the top-k set sum to {total:.4g}, not 1: they are not the processed "
            "log-probs of the distribution tokens were drawn from. Start the server with --logprobs-mode "
            f"processed_logprobs ({SERVE_HINT}).")


def completion_to_generation(choice: Mapping[str, Any], params: SamplingParams, *, num_prompt_tokens: int,
                             num_cached_tokens: int | None, version: int) -> Generation:
    """A :class:`Generation` from one choice of a ``/v1/completions`` response.

    ``version`` is used only when the server labels no weights version (before the first push,
    whose label is ``"default"``, or a server without ``return_weight_versions``).

    >>> lp = {"tokens": ["token_id:5"], "token_logprobs": [-0.5],
    ...       "top_logprobs": [{"token_id:5": -0.5, "token_id:6": math.log(1 - math.exp(-0.5)), "token_id:9": -9999.0}]}
    >>> choice = {"token_ids": [5], "logprobs": lp, "finish_reason": "length",
    ...           "weight_versions": [{"version": "3", "start": 0, "end": 1}]}
    >>> g = completion_to_generation(choice, SamplingParams(top_k=3), num_prompt_tokens=4, num_cached_tokens=None,
    ...                              version=2)
    >>> g.token_ids, g.logprobs, g.candidates, g.policy_version, g.num_prompt_tokens_processed
    ([5], [-0.5], [[5, 6]], 3, 4)
    """
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens")
    if tokens is None or logprobs.get("token_logprobs") is None:
        raise VLLMServerError("the server returned no per-token log-probs although every request asks for them; "
                              "is it a vLLM OpenAI server?")
    token_ids = [_token_id(t) for t in tokens]
    if choice.get("token_ids") is not None and [int(t) for t in choice["token_ids"]] != token_ids:
        raise VLLMServerError(f"the server's token_ids {choice['token_ids']} disagree with its log-prob tokens "
                              f"{token_ids}.")
    sampled_logprobs = [float(x) for x in logprobs["token_logprobs"]]
    steps = [{_token_id(k): float(v) for k, v in (step or {}).items()} for step in logprobs.get("top_logprobs") or []]
    candidates = top_ids = top_logprobs = None
    if params.top_k is not None:
        if len(steps) != len(token_ids):
            raise VLLMServerError("the server returned no top log-probs per token; is it a vLLM OpenAI server?")
        ranked = [sorted(((t, lp) for t, lp in step.items() if lp > CUT_LOGPROB), key=lambda x: (-x[1], x[0]))
                  for step in steps]
        for step in steps:
            check_processed(step)
        candidates = [[t for t, _ in pairs] for pairs in ranked]
        if params.top_logprobs > 0:
            top_logprobs = [[lp for _, lp in pairs] for pairs in ranked]
    elif params.top_logprobs > 0:  # the whole vocabulary: its head (the server adds the sampled token beyond it)
        ranked = [sorted(step.items(), key=lambda x: (-x[1], x[0]))[:params.top_logprobs] for step in steps]
        top_ids = [[t for t, _ in pairs] for pairs in ranked]
        top_logprobs = [[lp for _, lp in pairs] for pairs in ranked]
    finish_reason = choice.get("finish_reason")
    if finish_reason not in ("stop", "length"):
        raise VLLMServerError(f"the server finished a request with {finish_reason!r} (aborted, or paused by "
                              "another client?).")
    spans = choice.get("weight_versions") or []
    labels = {span["version"] for span in spans}
    if len(labels) > 1:
        raise VLLMServerError(f"one generation was sampled by several weights versions {sorted(labels)}: the server "
                              "took new weights mid-request; pause it around weight updates (/pause?mode=wait).")
    label = labels.pop() if labels else None
    if label == "default" and version != 0:
        raise VLLMServerError(f"the server samples with the weights it loaded at start (label 'default'), but treerl "
                              f"pushed version {version} to it: it was restarted mid-run. Continue the run with "
                              "--resume (which pushes the checkpoint's weights first).")
    if label not in (None, "default"):
        if not label.lstrip("-").isdigit():
            raise VLLMServerError(f"the server labels its weights {label!r}, not a treerl version number: another "
                                  "client updates this server; give treerl a server of its own.")
        version = int(label)
    return Generation(
        token_ids=token_ids,
        logprobs=sampled_logprobs,
        candidates=candidates,
        finish_reason=finish_reason,
        policy_version=version,
        num_prompt_tokens_processed=num_prompt_tokens - (num_cached_tokens or 0),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )


class VLLMServerPolicy:
    """A :class:`~treerl.agents.policy.Policy` on a vLLM OpenAI server at ``url``.

    Args:
        url: the server, e.g. ``http://127.0.0.1:8000``.
        model: the name the server serves the model under (``vllm serve MODEL`` serves ``MODEL``).
        stop_token_ids: end-of-turn ids added to every request (the server also stops on its eos).
        weight_sync: ``disk`` or ``nccl`` (see the module docstring).
        weights_dir: where ``disk`` writes the weights; the server must read the same path.
        trainer_model: the trainer's module, for ``nccl`` (its parameters are broadcast).
        timeout_s: one HTTP request's limit.
        wait_s: how long to wait for the server to come up (TRL's ``vllm_server_timeout``; 0: fail at once).
        max_concurrency: requests in flight at once.
        version: the weights version before the first push.

    Construction checks the server: it answers, serves ``model``, returns processed log-probs,
    and (for weight pushes) runs with ``VLLM_SERVER_DEV_MODE=1``; each failure names the fix.
    """

    def __init__(self, url: str, model: str, *, stop_token_ids: frozenset[int] = frozenset(),
                 weight_sync: str = "disk", weights_dir: str | os.PathLike | None = None,
                 trainer_model: torch.nn.Module | None = None, timeout_s: float = 600.0,
                 max_concurrency: int = 64, version: int = 0, wait_s: float = 0.0):
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync={weight_sync!r}: use disk or nccl.")
        if weight_sync == "disk" and weights_dir is None:
            raise ValueError("weight_sync='disk' needs weights_dir: a directory the server can read.")
        self.url = url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.stop_token_ids = frozenset(stop_token_ids)
        self.weight_sync = weight_sync
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.trainer_model = trainer_model
        self.timeout_s = timeout_s
        self.version = version
        self.max_concurrency = max_concurrency
        self._pool: ThreadPoolExecutor | None = None
        self._batcher = AsyncBatcher(lambda requests: self.generate(requests), max_batch_size=max_concurrency)
        self._nccl = None
        self._wait_until_up(wait_s)
        self._check_server()

    # -- HTTP --------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            if exc.code == 404 and not path.startswith("/v1/"):
                raise VLLMServerError(
                    f"{method} {self.url}{path}: HTTP 404: the server has no {path.split('?')[0]} route, which "
                    f"exists only in development mode: start it as {SERVE_HINT}.") from None
            if "greater than max allowed" in detail:
                raise VLLMServerError(f"{method} {self.url}{path}: {detail.strip()}: a top-k request asks for top_k "
                                      "log-probs per token (the candidate set), otherwise for the head that score "
                                      "centering reads; restart the server with --max-logprobs at least that many "
                                      "(--top-k), or lower --top-k.") from None
            if "does not exist" in detail and "model" in detail.lower():
                raise VLLMServerError(f"{method} {self.url}{path}: {detail.strip()}; the server serves another "
                                      "model name: pass it as --vllm-server-model.") from None
            raise VLLMServerError(f"{method} {self.url}{path}: HTTP {exc.code}: {detail.strip()}") from None
        except TimeoutError:
            raise VLLMServerError(f"{method} {self.url}{path}: the server did not answer within {self.timeout_s:g} s; "
                                  "raise --vllm-server-timeout-s, or check the server's log.") from None
        except (urllib.error.URLError, OSError) as exc:
            raise VLLMServerError(
                f"{method} {self.url}{path}: no vLLM server answers there ({getattr(exc, 'reason', exc)}): start "
                f"one with {SERVE_HINT}, or fix --vllm-server-url.") from None
        return json.loads(raw) if raw else None

    def _wait_until_up(self, wait_s: float) -> None:
        """Return once the server answers (any HTTP reply, an error too), or after ``wait_s`` seconds, polling
        every 2 s as TRL does; then :meth:`_check_server` says what is wrong, if anything."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=self.timeout_s):
                    return
            except urllib.error.HTTPError:
                return  # it answers: _check_server names the problem
            except (urllib.error.URLError, OSError):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                time.sleep(min(2.0, left))

    def _check_server(self) -> None:
        served = [m.get("id") for m in (self._request("GET", "/v1/models") or {}).get("data", [])]
        if self.model not in served:
            raise VLLMServerError(
                f"the vLLM server at {self.url} serves {served}, not {self.model!r}: start `vllm serve "
                f"{self.model}` (the checkpoint the trainer starts from), or pass --vllm-server-model NAME when "
                "it serves the same weights under another name.")
        # Processed log-probs with top_k=1: the sampled token has log-prob 0 and the runner-up -inf (raw ones
        # give the runner-up a finite log-prob, even when the model is sure of the first).
        probe = completion_request(GenerationRequest([0], SamplingParams(top_k=1, max_new_tokens=1), seed=0),
                                   self.model, frozenset())
        probe["logprobs"] = 2
        choice = self._request("POST", "/v1/completions", probe)["choices"][0]
        step = (choice.get("logprobs") or {}).get("top_logprobs") or [None]
        values = sorted((step[0] or {}).values(), reverse=True)
        if len(values) < 2 or abs(values[0]) > 1e-6 or any(v > CUT_LOGPROB for v in values[1:]):
            raise VLLMServerError(
                f"the vLLM server at {self.url} returns raw log-probs (top_k=1 gave {values}, processed ones give "
                f"[0.0, {CUT_LOGPROB}]): the learner needs those of the distribution tokens were drawn from. "
                f"Restart it with --logprobs-mode processed_logprobs ({SERVE_HINT}).")
        # Weight pushes use the development-mode routes; fail now rather than after the first step.
        # "default" while the server holds the weights it loaded itself, else an earlier push's label.
        self.server_weight_version = str(self._request("GET", "/weight_info")["weight_version"])

    # -- Policy ------------------------------------------------------------------------------

    def _one(self, request: GenerationRequest) -> Generation:
        body = completion_request(request, self.model, self.stop_token_ids)
        response = self._request("POST", "/v1/completions", body)
        details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
        return completion_to_generation(response["choices"][0], request.params,
                                        num_prompt_tokens=len(request.prompt_ids),
                                        num_cached_tokens=details.get("cached_tokens"), version=self.version)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Sample every request (one HTTP request each, concurrently); results are in request order."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="treerl-vllm-http")
        return list(self._pool.map(self._one, requests))

    async def agenerate(self, request: GenerationRequest) -> Generation:
        """Sample one request; concurrent awaiters are sent together."""
        return await self._batcher.submit(request)

    def set_weights(self, weights: Mapping[str, Tensor] | str | os.PathLike, version: int) -> None:
        """Push new weights to the server and label its later tokens ``version``."""
        version = int(version)
        self._request("POST", "/pause?mode=wait")  # requests in flight finish on the old weights
        try:
            if self.weight_sync == "nccl":
                self._send_nccl()
            else:
                self._reload_from_disk(weights, version)
            if not (self._request("POST", "/reset_prefix_cache") or {}).get("success", True):
                raise VLLMServerError("the server could not drop its prefix cache (blocks still held by running "
                                      "requests): its cached prefixes hold keys and values of the old weights.")
            self._request("POST", "/update_weight_version", {"new_version": str(version)})
        finally:
            self._request("POST", "/resume")
        self.version = version

    def _reload_from_disk(self, weights: Mapping[str, Tensor] | str | os.PathLike, version: int) -> None:
        from safetensors.torch import save_file

        if isinstance(weights, Mapping):
            # A new directory per version: the server never reads a half-written file.
            target = self.weights_dir / f"v{version}"
            partial = self.weights_dir / f".v{version}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()},
                      str(partial / "model.safetensors"))
            shutil.rmtree(target, ignore_errors=True)
            partial.rename(target)
        else:
            target = Path(weights)
        self._request("POST", "/collective_rpc",
                      {"method": "reload_weights", "kwargs": {"weights_path": str(target.resolve())}})
        for old in self.weights_dir.glob("v*") if isinstance(weights, Mapping) else ():
            if old != target:
                shutil.rmtree(old, ignore_errors=True)

    def _send_nccl(self) -> None:
        if self._nccl is None:
            self._nccl = self._init_nccl()
        self._nccl.send_weights()  # start_weight_update, update_weights with the broadcast, finish_weight_update

    def _init_nccl(self):
        if self.trainer_model is None:
            raise ValueError("weight_sync='nccl' needs trainer_model: the module whose parameters are broadcast.")
        from treerl.agents.vllm_policy import import_vllm

        import_vllm()
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        from vllm.utils.network_utils import get_ip, get_open_port

        world_size = self._request("GET", "/get_world_size")["world_size"] + 1  # the workers and this trainer
        init = NCCLTrainerInitInfo(master_address=get_ip(), master_port=get_open_port(), world_size=world_size,
                                   rank=0)
        return WeightTransferTrainerFactory.trainer_init(
            init, client=HTTPVLLMWeightSyncClient(self.url, timeout=self.timeout_s),
            source=ModuleSource(self.trainer_model))

    def end_session(self, session: str) -> None:
        """Nothing to free: the server's prefix cache evicts a finished session's blocks by itself."""

    def close(self) -> None:
        """Stop the threads that send requests (a later call starts them anew)."""
        self._batcher.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._nccl is not None:
            self._nccl.shutdown()
            self._nccl = None
