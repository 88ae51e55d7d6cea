"""AsyncGRPO under faults: generators killed or hung, and the trainer killed and resumed (SIGKILL each time)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treerl.learners.async_grpo import AsyncGRPOConfig, train_async
from treerl.rollout.trajectory import read_groups

# SIGKILL/SIGSTOP fault runs start real generator processes: minutes in all; the default suite stays under 10 minutes.
pytestmark = pytest.mark.slow

SMALL = dict(tasks_per_step=2, group_size=4, max_new_tokens=48, eval_episodes=0, progress=False, num_threads=1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def test_a_killed_generator_is_replaced_and_its_groups_are_lost_never_duplicated(tmp_path):
    killed: list[int] = []

    def kill_after_first_step(step, metrics, pool):
        if step == 0:
            (pid,) = pool.pids.values()
            os.kill(pid, signal.SIGKILL)  # mid-flight: it holds the tickets of the next steps
            killed.append(pid)

    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), steps=4, max_staleness=1, save_groups=True, **SMALL)
    train_async(cfg, on_step=kill_after_first_step)
    totals = json.loads((tmp_path / "summary.json").read_text())["async"]
    assert totals["generator_restarts"] == 1 and totals["lost_groups"] >= 1
    groups = list(read_groups(tmp_path / "groups.jsonl"))
    seeds = [g.info["task_seed"] for g in groups]
    assert len(seeds) == 4 * 2 and len(set(seeds)) == len(seeds), "a lost group is never trained twice"
    assert all(len(g.episodes) == 4 for g in groups), "groups arrive whole"
    assert {g.info["generator"] for g in groups} == {0, 1}, "the replacement generator played the later steps"
    assert not _alive(killed[0])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["async/lost_groups_step"] for m in lines) == totals["lost_groups"]


def test_a_generator_without_heartbeats_is_reported_and_replaced(tmp_path):
    stopped: list[int] = []

    def hang_after_first_step(step, metrics, pool):
        if step == 0:
            (pid,) = pool.pids.values()
            os.kill(pid, signal.SIGSTOP)  # alive but silent: only the heartbeat timeout can tell
            stopped.append(pid)

    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), steps=3, max_staleness=1, heartbeat_timeout=2.0, **SMALL)
    train_async(cfg, on_step=hang_after_first_step)
    totals = json.loads((tmp_path / "summary.json").read_text())["async"]
    assert totals["heartbeat_timeouts"] == 1 and totals["generator_restarts"] == 1
    reports = [json.loads(line) for line in (tmp_path / "diagnostics.jsonl").read_text().splitlines()]
    (report,) = [r for r in reports if r["kind"] == "heartbeat_timeout"]
    assert f"pid {stopped[0]}" in report["action"] and "replaced" in report["action"]
    _wait_until(lambda: not _alive(stopped[0]), 5, "the hung generator to be killed")  # SIGKILL ends it stopped


def test_a_killed_trainer_resumes_from_its_checkpoint_and_generators_load_that_version(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "treerl.cli", "learn", "--learner", "async_grpo", "--output-dir", str(out),
           "--steps", "8", "--tasks-per-step", "2", "--group-size", "4", "--max-new-tokens", "48",
           "--eval-episodes", "0", "--progress", "false", "--save-every", "1", "--max-staleness", "0",
           "--num-threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_until(lambda: (out / "checkpoints" / "step-2").is_dir() or first.poll() is not None, 50,
                    "the second checkpoint")
        generators = _children(first.pid)
        assert first.poll() is None, first.stderr.read()[-2000:]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
    assert not (out / "summary.json").exists(), "the run must be killed before it finishes"
    assert generators, "the trainer runs its generators as child processes"
    _wait_until(lambda: not any(_alive(pid) for pid in generators), 15, "orphaned generators to exit")

    second = subprocess.run([*cmd, "--resume", "true"], capture_output=True, text=True, env=env, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = int(re.search(r"resumed from .* at step (\d+)", second.stderr).group(1))
    assert resumed >= 2
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 9))
    first_resumed = lines[resumed]  # step resumed + 1
    assert first_resumed["async/span_version_min"] == resumed  # the checkpoint's version, nothing older
    assert first_resumed["async/staleness_0_frac"] == 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policy_version"] == 8
    # The totals continue the checkpoint's: the whole run's, as if it had never stopped.
    assert summary["async"]["counted_from_step"] == 0
    assert summary["async"]["group_staleness"] == {"0": 2 * 8}


def test_generators_that_keep_dying_stop_the_run_with_a_clear_error(tmp_path):
    import functools

    import pytest

    from treerl.envs.registry import make
    from treerl.learners.async_pool import GeneratorFailed

    broken = functools.partial(make, "treerl/NoSuchEnvironment-v0")  # fails in the generator, at its first task
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), steps=1, **SMALL)
    with pytest.raises(GeneratorFailed, match="died 3 times in a row before they delivered a group"):
        train_async(cfg, env_factory=broken)
