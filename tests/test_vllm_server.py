"""``treerl learn --use-vllm --vllm-mode server``: sampling through a vLLM OpenAI server started separately,
weights pushed to it after every step. On CPU against ``_vllm_fake_server.FakeVLLMServer`` (real HTTP on
loopback, vLLM 0.33's routes and JSON, the shipped tiny model sampling); the real server only where CUDA
and vllm exist."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from _helpers import assert_drawn_from, processed_forward
from _vllm_fake_server import FakeVLLMServer

from treerl.agents.policy import GenerationRequest, SamplingParams
from treerl.agents.transformers_policy import TransformersPolicy
from treerl.agents.vllm_server_policy import VLLMServerError, VLLMServerPolicy, completion_to_generation
from treerl.learners.grpo import GRPOConfig, train
from treerl.models import default_model_path, load_default_model

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def choice(steps: list[dict[int, float]], tokens: list[int], versions=None, finish="length") -> dict:
    return {"token_ids": tokens, "finish_reason": finish, "weight_versions": versions,
            "logprobs": {"tokens": [f"token_id:{t}" for t in tokens],
                         "token_logprobs": [step[t] for step, t in zip(steps, tokens)],
                         "top_logprobs": [{f"token_id:{t}": lp for t, lp in step.items()} for step in steps]}}


def test_candidate_sets_are_the_finite_top_k_entries_already_renormalized():
    # top_k=4 then top-p kept 3 (one -inf, sent as -9999.0); the sampled token comes first, as vLLM sends it.
    p = [0.5, 0.3, 0.2]
    steps = [{11: math.log(p[1]), 10: math.log(p[0]), 12: math.log(p[2]), 40: -9999.0},
             {7: 0.0, 3: -9999.0, 4: -9999.0, 5: -9999.0}]
    params = SamplingParams(top_k=4, top_p=0.85, top_logprobs=4)
    g = completion_to_generation(choice(steps, [11, 7], [{"version": "5", "start": 0, "end": 2}]), params,
                                 num_prompt_tokens=9, num_cached_tokens=6, version=4)
    assert g.token_ids == [11, 7] and g.logprobs == [math.log(0.3), 0.0]
    assert g.candidates == [[10, 11, 12], [7]]  # most likely first, the cut ids dropped
    assert g.top_logprobs == [[math.log(0.5), math.log(0.3), math.log(0.2)], [0.0]]
    assert g.policy_version == 5 and g.num_prompt_tokens_processed == 3
    # The whole vocabulary: no candidate set, the head when asked for.
    full = completion_to_generation(choice([{9: -0.1, 2: -2.5, 3: -3.0}], [9], None), SamplingParams(top_logprobs=2),
                                    num_prompt_tokens=1, num_cached_tokens=None, version=4)
    assert full.candidates is None and full.top_ids == [[9, 2]] and full.policy_version == 4


def test_replies_that_cannot_be_recorded_exactly_are_refused():
    raw = [{5: math.log(0.4), 6: math.log(0.3)}]  # log-probs of a top-k set that do not sum to one
    with pytest.raises(VLLMServerError, match="--logprobs-mode processed_logprobs"):
        completion_to_generation(choice(raw, [5]), SamplingParams(top_k=2), num_prompt_tokens=1,
                                 num_cached_tokens=None, version=0)
    ok = [{5: 0.0}]
    mixed = [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 2}]
    with pytest.raises(VLLMServerError, match="several weights versions"):
        completion_to_generation(choice(ok, [5], mixed), SamplingParams(), num_prompt_tokens=1,
                                 num_cached_tokens=None, version=0)
    with pytest.raises(VLLMServerError, match="another client"):
        completion_to_generation(choice(ok, [5], [{"version": "ckpt-a", "start": 0, "end": 1}]), SamplingParams(),
                                 num_prompt_tokens=1, num_cached_tokens=None, version=0)
    with pytest.raises(VLLMServerError, match="restarted mid-run.*--resume"):
        completion_to_generation(choice(ok, [5], [{"version": "default", "start": 0, "end": 1}]), SamplingParams(),
                                 num_prompt_tokens=1, num_cached_tokens=None, version=3)
    with pytest.raises(VLLMServerError, match="abort"):
        completion_to_generation(choice(ok, [5], finish="abort"), SamplingParams(), num_prompt_tokens=1,
                                 num_cached_tokens=None, version=0)
    bad = choice(ok, [5])
    bad["token_ids"] = [6]
    with pytest.raises(VLLMServerError, match="disagree"):
        completion_to_generation(bad, SamplingParams(), num_prompt_tokens=1, num_cached_tokens=None, version=0)


def test_tokens_logprobs_and_candidates_cross_http_exactly(tmp_path):
    model, tokenizer = load_default_model()
    reference = TransformersPolicy(model, tokenizer)
    prompt = tokenizer("Compute 12 + 30.")["input_ids"]
    requests = [GenerationRequest(prompt, SamplingParams(temperature=0.8, top_k=12, top_p=0.9, max_new_tokens=8),
                                  seed=s) for s in range(2)]
    requests.append(GenerationRequest(prompt, SamplingParams(max_new_tokens=6), seed=7))  # the whole vocabulary
    with FakeVLLMServer() as server:
        policy = VLLMServerPolicy(server.url, server.served_name, weights_dir=tmp_path)
        got = policy.generate(requests)
        policy.close()
    want = [reference.generate([r])[0] for r in requests]  # the server samples each request alone
    for g, w in zip(got, want):
        assert (g.token_ids, g.logprobs, g.candidates, g.finish_reason) == \
            (w.token_ids, w.logprobs, w.candidates, w.finish_reason)
    # And against an independent forward: the processed distribution each token was drawn from.
    for request, g in zip(requests, got):
        processed = processed_forward(model, prompt, g.token_ids, request.params)
        if request.params.top_k is None:
            assert g.candidates is None
            assert g.logprobs == pytest.approx(processed.logprobs.gather(
                1, torch.tensor(g.token_ids)[:, None])[:, 0].tolist(), abs=1e-5)
            continue
        assert_drawn_from(g, processed, abs_tol=1e-5, ordered=True)


def test_learn_pushes_weights_after_each_step_and_records_the_new_version(tmp_path):
    from treerl.cli import main
    from treerl.rollout.trajectory import read_groups

    out = tmp_path / "run"
    # A reward that tells the two generations of a group apart, so every step changes the weights.
    (tmp_path / "rewards.py").write_text("def by_length(completions, **kwargs):\n"
                                         "    return [float(len(str(c)) % 7) for c in completions]\n")
    with FakeVLLMServer() as server:
        code = main(["learn", "--use-vllm", "--vllm-mode", "server", "--vllm-server-url", server.url,
                     "--output-dir", str(out), "--steps", "2", "--tasks-per-step", "1", "--group-size", "2",
                     "--max-new-tokens", "8", "--eval-episodes", "0", "--progress", "false", "--sample-every",
                     "1", "--top-k", "8", "--skip-zero-advantage", "false", "--learning-rate", "1e-3",
                     "--reward-funcs", f"{tmp_path / 'rewards.py'}:by_length",
                     "--malformed-ends-episode", "false"])  # an 8-token cut call must not zero the reward
        assert code == 0
        routes = [route for route, _ in server.control]
        final = {k: v.clone() for k, v in server.model.state_dict().items()}
        bodies = list(server.completions)
    # Two pushes, each paused, reloaded from disk, cache dropped, labelled, resumed.
    push = ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]
    assert routes == ["/weight_info", *push, *push]
    labels = [body for route, body in server.control if route == "/update_weight_version"]
    assert labels == [{"new_version": "1"}, {"new_version": "2"}]
    reloads = [body for route, body in server.control if route == "/collective_rpc"]
    assert [r["method"] for r in reloads] == ["reload_weights"] * 2
    assert [os.path.basename(r["kwargs"]["weights_path"]) for r in reloads] == ["v1", "v2"]
    # The server now holds the trainer's last weights.
    from safetensors.torch import load_file

    for key, value in load_file(str(out / "model" / "model.safetensors")).items():
        assert torch.equal(final[key], value), key
    assert not torch.equal(final["model.norm.weight"], load_default_model()[0].state_dict()["model.norm.weight"])
    # Every request asked for what exact recording needs.
    assert all(b["logprobs"] == 8 and b["top_k"] == 8 and b["return_tokens_as_token_ids"] for b in bodies[1:])
    # Step 1 sampled the starting weights (version 0), step 2 those labelled "1" by the server.
    versions = {}
    for step in (1, 2):
        groups = list(read_groups(out / "trajectories" / f"step-{step:06d}.jsonl"))
        sampled = [s for g in groups for s in g.segments if s.kind == "sampled"]
        assert sampled and all(len(s.candidates) == len(s.token_ids) for s in sampled)
        versions[step] = {s.policy_version for s in sampled}
    assert versions == {1: {0}, 2: {1}}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy/version"] for m in metrics] == [1, 2]


def test_nccl_sync_drives_vllms_trainer_engine_between_pause_and_resume(tmp_path, monkeypatch):
    # vLLM's trainer-side classes (vllm/distributed/weight_transfer, 0.33) stand in as recorders: the
    # NCCL data plane needs two GPUs; what is tested is the order of the control plane around it.
    from types import ModuleType, SimpleNamespace

    calls = []

    class Engine:
        def send_weights(self):
            calls.append("send_weights")

        def shutdown(self):
            calls.append("shutdown")

    def trainer_init(init, *, client, source):
        calls.append(("trainer_init", init, client.url, source.module))
        return Engine()

    modules = {
        "vllm": {}, "vllm.distributed": {}, "vllm.distributed.weight_transfer": {}, "vllm.utils": {},
        "vllm.distributed.weight_transfer.base": {"ModuleSource": lambda module: SimpleNamespace(module=module)},
        "vllm.distributed.weight_transfer.clients": {
            "HTTPVLLMWeightSyncClient": lambda url, timeout: SimpleNamespace(url=url)},
        "vllm.distributed.weight_transfer.factory": {
            "WeightTransferTrainerFactory": SimpleNamespace(trainer_init=trainer_init)},
        "vllm.distributed.weight_transfer.nccl_engine": {"NCCLTrainerInitInfo": lambda **kw: kw},
        "vllm.utils.network_utils": {"get_ip": lambda: "10.0.0.7", "get_open_port": lambda: 29500},
    }
    for name, attrs in modules.items():
        module = ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    model = torch.nn.Linear(2, 2)
    with FakeVLLMServer() as server:
        policy = VLLMServerPolicy(server.url, server.served_name, weight_sync="nccl", trainer_model=model)
        policy.set_weights({}, version=1)
        policy.set_weights({}, version=2)
        g = policy.generate([GenerationRequest([1, 2], SamplingParams(max_new_tokens=2), seed=0)])[0]
        policy.close()
        routes = [route for route, _ in server.control]
    init = {"master_address": "10.0.0.7", "master_port": 29500, "world_size": 2, "rank": 0}  # 1 worker + trainer
    assert calls == [("trainer_init", init, server.url, model), "send_weights", "send_weights", "shutdown"]
    push = ["/reset_prefix_cache", "/update_weight_version", "/resume"]
    assert routes == ["/weight_info", "/pause", "/get_world_size", *push, "/pause", *push]
    assert g.policy_version == 2


def test_a_server_left_with_an_earlier_runs_weights_gets_this_runs_first(tmp_path):
    from treerl.learners.vllm_server import server_vllm_policy

    model, tokenizer = load_default_model()
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # this run starts from other weights than the server's checkpoint
    with FakeVLLMServer() as server:
        server.weight_version = "60"  # an earlier run pushed 60 versions
        cfg = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", vllm_server_url=server.url)
        policy = server_vllm_policy(cfg, model, tokenizer)
        g = policy.generate([GenerationRequest([1, 2], SamplingParams(max_new_tokens=2), seed=0)])[0]
        policy.close()
        assert server.weight_version == "0" and g.policy_version == 0
        assert torch.equal(server.model.model.norm.weight, model.model.norm.weight)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_problems_are_named_with_the_fix(tmp_path):
    name = str(default_model_path())
    with pytest.raises(VLLMServerError, match=r"no vLLM server answers there.*vllm serve.*--vllm-server-url"):
        VLLMServerPolicy(f"http://127.0.0.1:{free_port()}", name, weights_dir=tmp_path, timeout_s=5)
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with pytest.raises(VLLMServerError, match="did not answer within 1 s.*--vllm-server-timeout-s"):
            VLLMServerPolicy(f"http://127.0.0.1:{silent.getsockname()[1]}", name, weights_dir=tmp_path, timeout_s=1)
    with FakeVLLMServer(served_name="Qwen/Qwen3-0.6B") as server:
        with pytest.raises(VLLMServerError, match=r"serves \['Qwen/Qwen3-0.6B'\].*--vllm-server-model"):
            VLLMServerPolicy(server.url, name, weights_dir=tmp_path)
    with FakeVLLMServer(logprobs_mode="raw_logprobs") as server:
        with pytest.raises(VLLMServerError, match="returns raw log-probs.*--logprobs-mode processed_logprobs"):
            VLLMServerPolicy(server.url, name, weights_dir=tmp_path)
    with FakeVLLMServer(dev_mode=False) as server:
        with pytest.raises(VLLMServerError, match="VLLM_SERVER_DEV_MODE=1"):
            VLLMServerPolicy(server.url, name, weights_dir=tmp_path)
    with FakeVLLMServer(max_logprobs=4) as server:
        policy = VLLMServerPolicy(server.url, name, weights_dir=tmp_path)
        with pytest.raises(VLLMServerError, match="--max-logprobs"):
            policy.generate([GenerationRequest([1, 2], SamplingParams(top_k=8, max_new_tokens=2))])
        policy.close()


def test_cli_names_server_problems_in_one_line(tmp_path, capsys):
    from treerl.cli import main

    code = main(["learn", "--use-vllm", "--vllm-mode", "server", "--vllm-server-url",
                 f"http://127.0.0.1:{free_port()}", "--vllm-server-timeout-s", "5", "--output-dir", str(tmp_path)])
    assert code == 2 and "no vLLM server answers there" in capsys.readouterr().err


def test_server_mode_options_are_validated():
    with pytest.raises(ValueError, match="vllm_mode='remote'"):
        GRPOConfig(output_dir="x", use_vllm=True, vllm_mode="remote")
    with pytest.raises(ValueError, match="add --use-vllm"):
        GRPOConfig(output_dir="x", vllm_mode="server")
    with pytest.raises(ValueError, match="http"):
        GRPOConfig(output_dir="x", use_vllm=True, vllm_mode="server", vllm_server_url="localhost:8000")
    with pytest.raises(ValueError, match="--vllm-weight-sync disk"):
        GRPOConfig(output_dir="x", use_vllm=True, vllm_mode="server", vllm_weight_sync="nccl", lora_r=8)
    with pytest.raises(ValueError, match="vllm_weight_sync='ipc'"):
        GRPOConfig(output_dir="x", use_vllm=True, vllm_mode="server", vllm_weight_sync="ipc")


NO_GPU_OR_VLLM = ("a real vLLM server needs a CUDA GPU" if not torch.cuda.is_available() else
                  "vllm is not installed (pip install 'treerl[vllm]')" if not HAS_VLLM else None)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    """``vllm serve`` on the shipped model, as the README starts it (the server and the trainer share one GPU)."""
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    port = free_port()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(default_model_path()), "--port", str(port),
             "--logprobs-mode", "processed_logprobs", "--max-logprobs", "64", "--gpu-memory-utilization", "0.2",
             "--enforce-eager", "--max-model-len", "1024", "--dtype", "float32"],
            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                    break
                except OSError:
                    assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
                    time.sleep(2)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait(timeout=60)


@pytest.mark.skipif(NO_GPU_OR_VLLM is not None, reason=str(NO_GPU_OR_VLLM))
def test_real_server_logprobs_and_candidates_match_a_transformers_forward(real_server, tmp_path):
    model, tokenizer = load_default_model()
    policy = VLLMServerPolicy(real_server, str(default_model_path()), weights_dir=tmp_path)
    prompt = tokenizer("Compute 12 + 30.")["input_ids"]
    params = SamplingParams(top_k=20, top_p=0.9, max_new_tokens=16)
    g = policy.generate([GenerationRequest(prompt, params, seed=0)])[0]
    policy.close()
    assert_drawn_from(g, processed_forward(model, prompt, g.token_ids, params), abs_tol=1e-3, ordered=False)


@pytest.mark.skipif(NO_GPU_OR_VLLM is not None, reason=str(NO_GPU_OR_VLLM))
def test_real_vllm_server_trains_the_shipped_model(real_server, tmp_path):
    # The shipped model's context is 1024 tokens: an episode's last turn must fit in the server's max_model_len.
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), use_vllm=True, vllm_mode="server", device="cuda",
                     vllm_server_url=real_server, steps=2, tasks_per_step=2, group_size=4, max_new_tokens=32,
                     max_episode_tokens=900, eval_episodes=0, progress=False, top_k=20, sample_every=1)
    train(cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy/version"] for m in lines] == [1, 2]
    for m in lines:  # sampler and trainer compute nearly the same distribution
        if "is/ratio_mean" in m:
            assert abs(m["is/ratio_mean"] - 1.0) < 0.1
    from treerl.rollout.trajectory import read_groups

    sampled = [s for g in read_groups(tmp_path / "run" / "trajectories" / "step-000002.jsonl")
               for s in g.segments if s.kind == "sampled"]
    assert sampled and {s.policy_version for s in sampled} == {1}  # the server's label of the pushed weights
