"""AsyncGRPO on Ray: a local Ray instance with 2 CPUs, two generator actors, three asynchronous steps."""

from __future__ import annotations

import json
import logging

import pytest

from treerl.learners.async_grpo import AsyncGRPOConfig, train_async
from treerl.rollout.trajectory import read_groups

pytestmark = pytest.mark.slow  # starts a local Ray instance; the default suite stays under 10 minutes

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'treerl[ray]'")


def test_three_async_steps_with_two_ray_generator_actors(tmp_path):
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        cfg = AsyncGRPOConfig(output_dir=str(tmp_path), steps=3, tasks_per_step=2, group_size=4, max_new_tokens=48,
                              eval_episodes=0, progress=False, num_threads=1, backend="ray", num_generators=2,
                              max_staleness=1, save_groups=True)
        result = train_async(cfg)
    finally:
        ray.shutdown()
    assert result.policy_version == 3
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(m["async/staleness_max"] <= 1 and m["async/weight_publish_s"] >= 0 for m in lines)
    groups = list(read_groups(tmp_path / "groups.jsonl"))
    assert len(groups) == 6 and len({g.info["task_seed"] for g in groups}) == 6
    assert {g.info["generator"] for g in groups} == {0, 1}, "both actors played"
