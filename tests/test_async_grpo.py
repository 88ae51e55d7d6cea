"""AsyncGRPO: the buffer's tickets and staleness, the equality with synchronous GRPO, and a run end to end."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from treerl.learners.async_buffer import GroupBuffer
from treerl.learners.async_grpo import AsyncGRPOConfig, train_async
from treerl.learners.grpo import GRPOConfig, train
from treerl.rollout.trajectory import read_groups

SMALL = dict(steps=2, tasks_per_step=2, group_size=4, max_new_tokens=48, eval_episodes=0, progress=False,
             num_threads=1)


def _load():
    from treerl.models import load_default_model

    return load_default_model()


# -- the buffer -----------------------------------------------------------------------------------


def _buffer(**kw) -> GroupBuffer:
    args = dict(tasks_per_step=2, max_staleness=1, capacity=4, next_task=0, version=0)
    return GroupBuffer(**{**args, **kw})


def test_tickets_target_the_step_that_will_train_them_and_fill_the_capacity():
    buf = _buffer(capacity=5, next_task=10, version=3)
    buf.add_generator(0)
    buf.add_generator(1)
    issued = buf.issue()
    tickets = sorted((t for ts in issued.values() for t in ts), key=lambda t: t.task)
    assert [t.task for t in tickets] == [10, 11, 12, 13, 14]
    assert [t.target for t in tickets] == [3, 3, 4, 4, 5]  # tasks_per_step groups per version
    assert sorted(len(ts) for ts in issued.values()) == [2, 3]  # spread over the generators
    assert buf.issue() == {}  # full: backpressure until something is taken


def test_stale_groups_are_dropped_whole_and_their_slot_is_reissued():
    buf = _buffer(max_staleness=1)
    buf.add_generator(0)
    buf.issue()
    buf.arrive(0, task=0, oldest=0, newest=2, payload="old")  # its oldest span is 2 behind version 2
    buf.arrive(0, task=1, oldest=1, newest=2, payload="ok")
    taken = buf.take(2, trainer_version=2, timeout=0)
    assert [a.payload for a in taken] == ["ok"] and buf.dropped == 1
    assert buf.staleness == {1: 1}
    # Two slots freed (the dropped group's and the taken one's): fresh tasks, trained as soon as possible.
    assert [(t.task, t.target) for t in buf.issue()[0]] == [(4, 2), (5, 2)]


def test_a_lost_generator_loses_its_tickets_and_its_late_groups_are_ignored():
    buf = _buffer(capacity=4)
    buf.add_generator(0)
    buf.add_generator(1)
    held = {g: [t.task for t in ts] for g, ts in buf.issue().items()}
    assert buf.lose(0) == len(held[0]) == 2
    assert not buf.arrive(0, task=held[0][0], oldest=0, newest=0, payload="late")  # never trained
    assert buf.ignored == 1 and buf.lost == 2
    fresh = [t.task for t in buf.issue()[1]]
    assert fresh == [4, 5], "lost tickets are replaced by new tasks, never replayed"


def test_ignored_groups_are_a_step_metric_and_documented():
    # The summary's ignored_groups was the only count of them: a step's metrics carry the running total too.
    from pathlib import Path
    from types import SimpleNamespace

    from treerl.learners.async_grpo import _async_metrics, _Clock
    from treerl.rollout.summary import RolloutStats

    buf = _buffer(capacity=4)
    buf.add_generator(0)
    held = [t.task for t in buf.issue()[0]]
    buf.lose(0)
    buf.arrive(0, task=held[0], oldest=0, newest=0, payload="late")
    pool = SimpleNamespace(stats=dict, restarts=1, heartbeat_timeouts=0)
    metrics = _async_metrics([], 0, buf, pool, _Clock(), RolloutStats(), max_staleness=1)
    assert metrics["async/ignored_groups"] == 1.0 and metrics["async/lost_groups"] == 4.0
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "`async/ignored_groups`" in readme


def test_take_waits_for_groups_and_takes_the_stalest_first():
    buf = _buffer(max_staleness=2)
    buf.add_generator(0)
    buf.issue()
    threading.Timer(0.2, buf.arrive, args=(0,), kwargs=dict(task=3, oldest=2, newest=2, payload="late")).start()
    assert [a.payload for a in buf.take(1, trainer_version=2, timeout=10)] == ["late"]  # waited for it
    buf.arrive(0, task=1, oldest=1, newest=1, payload="fresh")
    buf.arrive(0, task=0, oldest=0, newest=1, payload="stale")
    buf.arrive(0, task=2, oldest=1, newest=1, payload="fresh too")
    assert [a.payload for a in buf.take(2, trainer_version=2, timeout=0)] == ["stale", "fresh"]
    assert buf.occupancy == 1


@pytest.mark.parametrize("wait_for_due", [True, False])
def test_a_step_waits_for_a_due_group_still_being_played_unless_told_to_drop(wait_for_due):
    buf = _buffer(tasks_per_step=1, max_staleness=1, capacity=3, wait_for_due=wait_for_due)
    buf.add_generator(0)
    assert [t.task for t in buf.issue()[0]] == [0, 1, 2]
    buf.start(0, task=0, version=0)  # a long episode: due at version 1, too stale at 2
    buf.start(0, task=1, version=1)
    buf.arrive(0, task=1, oldest=1, newest=1, payload="fresh")
    taken = buf.take(1, trainer_version=1, timeout=0)
    if wait_for_due:
        assert taken == [], "the fresh group would push the due one past the bound: wait for it"
        buf.arrive(0, task=0, oldest=0, newest=1, payload="due")
        assert [a.payload for a in buf.take(1, trainer_version=1, timeout=0)] == ["due"]
        assert [a.payload for a in buf.take(1, trainer_version=2, timeout=0)] == ["fresh"]
        assert buf.dropped == 0
    else:
        assert [a.payload for a in taken] == ["fresh"]
        buf.arrive(0, task=0, oldest=0, newest=1, payload="due")
        assert buf.take(1, trainer_version=2, timeout=0) == [] and buf.dropped == 1


def test_diagnostics_fire_when_the_trainer_starves_or_staleness_keeps_hitting_the_bound(tmp_path):
    from treerl.learners.async_grpo import ASYNC_CHECKS, _Clock, count_streaks
    from treerl.learners.diagnostics import Diagnostics

    diag, clock = Diagnostics(tmp_path / "diagnostics.jsonl", checks=ASYNC_CHECKS), _Clock()
    idle = {"async/at_bound_frac": 0.0, "async/generator_idle_frac": 0.0, "async/dropped_groups_step": 0.0}
    fired = []
    for step, trainer_idle in enumerate([0.9, 0.9, 0.2, 0.9, 0.9, 0.9]):  # a busy step breaks the streak
        metrics = {**idle, "async/trainer_idle_frac": trainer_idle}
        count_streaks(clock, metrics)
        fired.append(sorted(diag.check(step, metrics)))
    assert fired == [[]] * 5 + [["diag/trainer_starved"]]
    clock = _Clock()
    for step in range(3):  # most spans at the bound while the generators wait for tickets
        metrics = {**idle, "async/at_bound_frac": 0.8, "async/generator_idle_frac": 0.5}
        count_streaks(clock, metrics)
        fired = diag.check(step, metrics)
    assert "diag/staleness_at_bound" in fired and "async/starved_streak" in metrics
    assert diag.check(0, {**idle, "async/dropped_groups_step": 2.0}) == {"diag/groups_dropped": 1.0}
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "diagnostics.jsonl").read_text().splitlines()]
    assert kinds == ["trainer_starved", "staleness_at_bound", "groups_dropped"]


def test_config_errors_name_the_field_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="max_staleness=-1 must be >= 0"):
        AsyncGRPOConfig(output_dir=str(tmp_path), max_staleness=-1)
    with pytest.raises(ValueError, match="--is-level token"):
        AsyncGRPOConfig(output_dir=str(tmp_path), is_level="sequence")
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), is_level="sequence", objective="clipped")
    assert cfg.capacity == (2 + 1) * 8  # every step a generator may run ahead
    with pytest.raises(ValueError, match=r"or unset for \(max_staleness \+ 1\) x tasks_per_step = 24"):
        AsyncGRPOConfig(output_dir=str(tmp_path), buffer_size=0)
    with pytest.raises(ValueError, match="objective='ppo'"):
        AsyncGRPOConfig(output_dir=str(tmp_path), objective="ppo")
    with pytest.raises(ValueError, match="cannot be pickled"):
        train_async(AsyncGRPOConfig(output_dir=str(tmp_path)), env_factory=lambda: None)


# -- end to end -----------------------------------------------------------------------------------


# Two learners' runs side by side, one with generator processes: 15 s a transport (the default run keeps
# test_async_learner_end_to_end).
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["file", "broadcast"])
def test_max_staleness_0_with_one_generator_is_synchronous_grpo(tmp_path, transport):
    """The same groups, the same weights, so the same update as `train`: checked to 1e-5 after 3 steps
    (with the weights reaching the generator as a file, or by gloo broadcast: slow, a second run)."""
    common = {**SMALL, "steps": 3}
    sync_model, tok = _load()
    train(GRPOConfig(output_dir=str(tmp_path / "sync"), **common), model=sync_model, tokenizer=tok)
    async_model, tok = _load()
    train_async(AsyncGRPOConfig(output_dir=str(tmp_path / "async"), max_staleness=0, num_generators=1,
                                weight_transport=transport, **common), model=async_model, tokenizer=tok)
    start, _ = _load()
    moved = max((v - start.state_dict()[k]).abs().max().item() for k, v in sync_model.state_dict().items())
    assert moved > 1e-4, "training must move the weights for the comparison to mean anything"
    for key, value in sync_model.state_dict().items():
        torch.testing.assert_close(async_model.state_dict()[key], value, atol=1e-5, rtol=0, msg=key)
    def read(d):
        return [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]

    for s, a in zip(read("sync"), read("async")):
        assert a["reward/mean"] == s["reward/mean"]
        assert a["async/staleness_0_frac"] == 1.0 and a["async/dropped_groups"] == 0


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
def test_async_learner_end_to_end(tmp_path):
    """Two steps ahead at most: the run trains, logs staleness and buffer figures, evaluates and saves; the
    sampler's head reaches score centering; samples for `treerl view` are kept."""
    model, tok = _load()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # A ratio bound of 1.2 (the default is 2): score centering is non-zero only where a weight is truncated, so
    # a stale span must move some ratio past the bound, which one update does at 1.2 and not always at 2.
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), **{**SMALL, "steps": 4, "eval_episodes": 4}, max_staleness=2,
                          save_groups=True, sample_every=2, sample_groups=1, skip_zero_advantage=False,
                          is_ratio_high=1.2)
    result = train_async(cfg, model=model, tokenizer=tok)
    assert result.policy_version == 4
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        assert m["async/staleness_max"] <= 2 and m["async/dropped_groups"] == 0
        fracs = [v for k, v in m.items() if k.startswith("async/staleness_") and k.endswith("_frac")]
        assert math.isclose(sum(fracs), 1.0)
        for key in ("async/buffer_occupancy", "async/generator_idle_frac", "async/weight_publish_s",
                    "async/episodes_per_s", "perf/tokens_per_s", "loss/policy"):
            assert math.isfinite(m[key]), key
    assert any(m["async/staleness_max"] >= 1 for m in lines[1:]), "generators must run ahead of the trainer"
    assert all("async/trainer_idle_frac" in m for m in lines[1:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_end"]["episodes"] == 4 and summary["async"]["lost_groups"] == 0
    assert sum(summary["async"]["group_staleness"].values()) == 4 * 2 and summary["async"]["counted_from_step"] == 0
    # The generators' decode loop records the sampler's head at every sampled token, and the trainer centers with it.
    sampled = [s for g in read_groups(tmp_path / "groups.jsonl") for s in g.segments if s.kind == "sampled"]
    assert sampled and all(s.top_logprobs is not None and len(s.top_logprobs) == len(s.token_ids) for s in sampled)
    assert all(len(head) == cfg.centering_top_k for s in sampled for head in s.top_logprobs)
    assert all(m["centering/sampler_tail_mass"] > 0 and m["centering/coef_abs_sum"] >= 0 for m in lines)
    assert any(m["centering/coef_abs_sum"] > 0 for m in lines[1:]), "stale spans give a non-zero centering"
    _check_view_samples(tmp_path, steps=[1, 2, 4])
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(result.model_dir)
    for k, v in saved.state_dict().items():
        assert torch.allclose(v, model.state_dict()[k]), k


def _check_view_samples(run_dir, steps):
    """Trajectory samples as GRPO keeps them (advantages, trainer log-probs, versions), and `treerl view` reads them."""
    from treerl.cli import main
    from treerl.rollout.trajectory import sample_files

    assert [step for step, _ in sample_files(run_dir)] == steps
    for _, path in sample_files(run_dir):
        (group,) = read_groups(path)
        assert all(e.advantage is not None for e in group.episodes)
        for s in group.segments:
            if s.kind == "sampled":
                assert s.policy_version is not None and len(s.trainer_logprobs) == len(s.logprobs)
    assert main(["view", str(run_dir)]) == 0
    assert (run_dir / "view.html").stat().st_size > 0


@pytest.mark.slow  # three runs of generator processes: about 30 s
def test_a_resumed_run_continues_the_totals_of_its_checkpoint(tmp_path):
    """summary.json's totals and the running async/* ones count the whole run after --resume, as if it had never
    stopped; a checkpoint written without them still resumes, its totals labelled with the step they start at."""
    model, tok = _load()
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), **{**SMALL, "steps": 2}, max_staleness=0, save_every=1)
    train_async(cfg, model=model, tokenizer=tok)
    state_path = tmp_path / "checkpoints" / "step-2" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    assert sum(state["extra"]["async"]["group_staleness"].values()) == 2 * 2
    # What the first part counted besides staleness (a run of this size loses nothing, so it is set by hand).
    state["extra"]["async"].update(lost_groups=3, generator_restarts=1)
    state_path.write_text(json.dumps(state))
    train_async(AsyncGRPOConfig(**{**vars(cfg), "steps": 3, "resume": True}), model=_load()[0], tokenizer=tok)
    totals = json.loads((tmp_path / "summary.json").read_text())["async"]
    assert totals["counted_from_step"] == 0 and totals["group_staleness"] == {"0": 3 * 2}
    assert totals["lost_groups"] == 3 and totals["generator_restarts"] == 1
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["async/lost_groups"] == 3 and last["async/lost_groups_step"] == 0
    # A checkpoint of before the totals were kept: the totals count from the step it resumed at.
    state = json.loads((tmp_path / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    del state["extra"]
    (tmp_path / "checkpoints" / "step-3" / "trainer_state.json").write_text(json.dumps(state))
    train_async(AsyncGRPOConfig(**{**vars(cfg), "steps": 4, "resume": True}), model=_load()[0], tokenizer=tok)
    totals = json.loads((tmp_path / "summary.json").read_text())["async"]
    assert totals["counted_from_step"] == 3 and totals["group_staleness"] == {"0": 2} and totals["lost_groups"] == 0


def test_a_generator_samples_with_vllm_where_installed(tmp_path, monkeypatch):
    """The vLLM engine in a generator (here the fake engine of test_vllm_policy: no GPU needed)."""
    import asyncio

    from _vllm_fake_engine import install_fake_vllm
    from test_vllm_policy import FakeLLM

    from treerl.learners.async_buffer import Ticket
    from treerl.learners.async_generator import GeneratorCore, GeneratorSpec

    install_fake_vllm(monkeypatch, FakeLLM)
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), **SMALL, generator_policy="vllm")
    spec = GeneratorSpec(cfg=cfg, max_staleness=0, sampling=cfg.sampling_overrides(), policy="vllm")
    core = GeneratorCore(spec, generator_id=0)
    assert core.policy.llm.kwargs["max_logprobs"] == cfg.centering_top_k  # room for the sampler's head

    async def play():
        await core.load_weights(3, {"w": torch.ones(1)})
        return await core.play(Ticket(task=0, target=3))

    oldest, newest, payload = asyncio.run(play())
    core.close()
    assert (oldest, newest) == (3, 3) and core.policy.llm.loaded, "the weights reached the engine's workers"
    assert '"top_logprobs"' in payload and '"generator":0' in payload


def test_weights_that_land_mid_episode_serve_its_next_turns_and_each_span_keeps_its_version(tmp_path):
    import asyncio

    from treerl.envs.builtin.calculator import CalculatorEnv
    from treerl.envs.builtin.calculator_tasks import calculator
    from treerl.envs.tools import tool
    from treerl.learners.async_buffer import Ticket
    from treerl.learners.async_generator import GeneratorCore, GeneratorSpec
    from treerl.rollout.trajectory import Group

    called, proceed = asyncio.Event(), asyncio.Event()

    class PausingCalculator(CalculatorEnv):
        """The calculator waits for the test: new weights arrive while episodes are between turns."""

        def __init__(self, **kwargs):
            @tool(name="calculator", timeout=60.0)
            async def calc(expression: str) -> str:
                """Evaluate an arithmetic expression.

                Args:
                    expression: Arithmetic using numbers, + - * / and parentheses, e.g. "(3 + 4) * 2".
                """
                called.set()
                await proceed.wait()
                return calculator(expression)

            super().__init__(tools=[calc], **kwargs)

    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), **SMALL, max_staleness=0)
    core = GeneratorCore(GeneratorSpec(cfg=cfg, max_staleness=0, env_factory=PausingCalculator), generator_id=0)
    weights = {k: v.clone() for k, v in core.policy.model.state_dict().items()}

    async def play():
        await core.load_weights(0, weights)
        episode = asyncio.create_task(core.play(Ticket(task=0, target=0)))
        await asyncio.wait_for(called.wait(), timeout=60)  # a first turn was sampled with version 0
        await core.load_weights(1, weights)
        proceed.set()
        return await episode

    oldest, newest, payload = asyncio.run(play())
    core.close()
    assert (oldest, newest) == (0, 1)
    group = Group.from_json(payload)
    for episode in group.episodes:
        versions = [s.policy_version for s in episode.path() if s.kind == "sampled"]
        assert versions == sorted(versions) and versions[0] == 0, "the episode went on with the new weights"
    assert any(len(set(s.policy_version for s in e.path() if s.kind == "sampled")) == 2 for e in group.episodes)


def test_a_generator_waits_for_the_trainers_first_weights_whatever_the_staleness_bound(tmp_path):
    """With max_staleness 2 a ticket for step 0 is within the bound of any version, but the generator's own
    model carries none (-1): it starts once version 0 arrived, and its spans say 0, not -1."""
    import asyncio

    from treerl.learners.async_buffer import Ticket
    from treerl.learners.async_generator import GeneratorCore, GeneratorSpec
    from treerl.rollout.trajectory import Group

    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), **SMALL, max_staleness=2)
    core = GeneratorCore(GeneratorSpec(cfg=cfg, max_staleness=2), generator_id=0)
    weights = {k: v.clone() for k, v in core.policy.model.state_dict().items()}

    async def play():
        episode = asyncio.create_task(core.play(Ticket(task=0, target=0)))
        await asyncio.sleep(0.3)
        waited = not episode.done() and not core.drain_starts()
        await core.load_weights(0, weights)
        return waited, await episode

    waited, (oldest, newest, payload) = asyncio.run(play())
    core.close()
    assert waited and (oldest, newest) == (0, 0)
    assert {s.policy_version for s in Group.from_json(payload).segments if s.kind == "sampled"} == {0}


def test_generators_on_one_machine_split_the_sandbox_bound(tmp_path, monkeypatch):
    # The sandbox's bound is per process: each generator at the default (every CPU) would let the
    # generators together start one run per CPU each, and correct programs would time out.
    from treerl.envs.sandbox import max_concurrent_runs, set_max_concurrent_runs
    from treerl.learners.async_generator import GeneratorCore, GeneratorSpec
    from treerl.envs.sandbox import usable_cpus
    from treerl.learners.async_grpo import _sandbox_runs

    monkeypatch.delenv("TREERL_SANDBOX_MAX_CONCURRENT", raising=False)
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), **SMALL, num_generators=2)
    assert _sandbox_runs(cfg) == max(1, usable_cpus() // 2)
    monkeypatch.setenv("TREERL_SANDBOX_MAX_CONCURRENT", "3")
    assert _sandbox_runs(cfg) is None  # the user's choice stands
    try:
        GeneratorCore(GeneratorSpec(cfg=cfg, max_staleness=0, sandbox_runs=1), generator_id=0)
        assert max_concurrent_runs() == 1
    finally:
        set_max_concurrent_runs(None)


def test_a_spawned_generator_imports_the_users_modules_so_their_environments_exist_there(tmp_path, monkeypatch):
    # Generators are spawned: an environment a module given with --import registers (a treerl one, or a
    # SkyRL-Gym one for skyrl/<id>) existed in the trainer only, and each generator died of a KeyError.
    import functools
    import multiprocessing

    from treerl.envs.registry import factory_env_id, make
    from treerl.learners.async_generator import GeneratorSpec
    from treerl.user_modules import import_user_modules

    monkeypatch.setattr("treerl.user_modules._IMPORTED", [])
    module = tmp_path / "my_envs.py"
    module.write_text("import treerl\n"
                      "treerl.register('mine/Spawned-v0', 'treerl.envs.builtin.math_verify:MathVerifyEnv')\n")
    monkeypatch.chdir(tmp_path)
    import_user_modules(["my_envs.py"])  # as treerl learn --import my_envs.py runs it
    spec = GeneratorSpec(cfg=None, max_staleness=0)
    assert spec.imports == (str(module.resolve()),)
    build = functools.partial(make, "mine/Spawned-v0")
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # one process: as generator_main, then build
        assert pool.apply(factory_env_id, (build,)) is None  # not registered in a fresh process ...
        pool.apply(import_user_modules, (spec.imports,))
        assert pool.apply(factory_env_id, (build,)) == "mine/Spawned-v0"  # ... until it imports them


def test_a_ray_generator_imports_the_users_modules_once(tmp_path, monkeypatch):
    # A Ray actor's process (or machine) has not run the trainer's --import modules either; and a file run
    # twice in one process would register its environments twice.
    from treerl.learners import async_ray
    from treerl.learners.async_generator import GeneratorSpec
    from treerl.user_modules import import_user_modules

    monkeypatch.setattr("treerl.user_modules._IMPORTED", [])
    runs = tmp_path / "runs.txt"
    module = tmp_path / "ray_envs.py"
    module.write_text(f"open({str(runs)!r}, 'a').write('run\\n')\n")
    monkeypatch.setattr(async_ray, "GeneratorCore", lambda spec, generator_id: None)  # no model: imports only
    async_ray.GeneratorActor(GeneratorSpec(cfg=None, max_staleness=0, imports=(str(module),)), 0)
    assert runs.read_text() == "run\n"
    import_user_modules([str(module)])
    assert runs.read_text() == "run\n"  # once per process
