"""Several processes through accelerate: the update equals the single-process update on the same data.

The two-process run is a real ``accelerate launch`` (torchrun-style processes talking over
gloo on the CPU) of this file's ``__main__``: each rank calls :func:`train` on its half of
every step's tasks and saves its own weights, so the test checks both that the ranks agree
and that they took the single-process steps.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from treerl.learners.distributed import Ranks
from treerl.learners import sdpo
from treerl.learners.grpo import GRPOConfig, train

pytestmark = pytest.mark.slow  # starts two accelerate processes; the default suite stays under 10 minutes

# Two steps, so that step 2's rollouts run on the weights each rank computed in step 1.
# Several processes never skip zero-advantage groups; the single-process reference must not either,
# so that its logged metrics cover the same terms.
CONFIG = dict(steps=2, tasks_per_step=4, group_size=4, max_new_tokens=32, eval_episodes=0, progress=False,
              num_threads=1, learning_rate=2e-4, skip_zero_advantage=False)


def _load():
    from treerl.models import load_default_model

    return load_default_model()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


# SDPO: three tasks (two on rank 0, one on rank 1) of which, with this seed, one group succeeds at step 1
# and the others are taught by feedback alone, so the gate judges those by the whole step's copy probes.
SDPO_CONFIG = dict(CONFIG, tasks_per_step=3, group_size=3, max_new_tokens=24)


def _rank_main(out: Path, learner: str) -> None:
    """One rank of the accelerate run: train, then save this rank's weights."""
    model, tok = _load()
    if learner == "sdpo":
        sdpo.train(sdpo.SDPOConfig(output_dir=str(out / "run"), **SDPO_CONFIG), model=model, tokenizer=tok)
    else:
        train(GRPOConfig(output_dir=str(out / "run"), **CONFIG), model=model, tokenizer=tok)
    save_file(_state(model), str(out / f"rank{int(os.environ['RANK'])}.safetensors"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_task_plays_the_same_whichever_rank_plays_it():
    """Rank 1 of 2 plays tasks 1 and 3 without tasks 0 and 2 beside them: same tokens, same log-probs."""
    import treerl
    from treerl.agents.transformers_policy import TransformersPolicy
    from treerl.rollout.engine import RolloutEngine

    torch.set_num_threads(1)
    cfg = GRPOConfig(output_dir="unused", **CONFIG)
    model, tok = _load()
    engine = RolloutEngine(TransformersPolicy(model, tok), tok, params=cfg.sampling(), seed=cfg.seed,
                           max_concurrency=cfg.max_concurrency, max_episode_tokens=cfg.max_episode_tokens)

    def play(tasks: range):
        groups, _ = asyncio.run(engine.run(lambda: treerl.make(cfg.env), cfg.env, tasks, cfg.group_size))
        return {g.info["task_seed"]: g for g in groups}

    alone = play(Ranks(rank=1, world_size=2).shard(range(4)))
    together = play(range(4))
    assert sorted(alone) == [1, 3]
    for seed, group in alone.items():
        for a, b in zip(group.episodes, together[seed].episodes, strict=True):
            assert a.token_ids == b.token_ids and a.reward == b.reward
            assert torch.allclose(torch.tensor(a.sampler_logprobs), torch.tensor(b.sampler_logprobs), atol=1e-5)
    assert sum(len(e.token_ids) for g in alone.values() for e in g.episodes) > 0


def _launch_two(tmp_path: Path, learner: str) -> list[dict[str, torch.Tensor]]:
    """Each rank's weights after a two-process accelerate run of ``_rank_main``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port()), __file__, str(tmp_path), learner]
    r = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return [load_file(str(tmp_path / f"rank{i}.safetensors")) for i in range(2)]


def _metrics(run: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_accelerate_processes_take_the_single_process_steps(tmp_path):
    torch.set_num_threads(1)
    model, tok = _load()
    before = _state(model)
    train(GRPOConfig(output_dir=str(tmp_path / "single"), **CONFIG), model=model, tokenizer=tok)
    single = _state(model)

    ranks = _launch_two(tmp_path, "grpo")
    for k in single:
        assert torch.equal(ranks[0][k], ranks[1][k]), f"the ranks disagree on {k}"
    # The update itself (not just the weights) matches. The sums run in another order (two
    # packings, then an all-reduce), and AdamW's first steps divide each gradient element by
    # its own size, which magnifies that float noise where an element's gradient is ~0: a few
    # of the 1.7M elements differ by a few percent of the learning rate (2.9e-5 of the
    # update's norm in all).
    update = torch.cat([(single[k] - before[k]).flatten() for k in single])
    error = torch.cat([(ranks[0][k] - single[k]).flatten() for k in single])
    assert update.norm() > 0.1
    assert error.norm() <= 1e-4 * update.norm(), (error.norm(), update.norm())
    assert error.abs().max() <= 0.1 * CONFIG["learning_rate"], error.abs().max()

    # Only rank 0 wrote; its metrics are those of the whole step.
    run = tmp_path / "run"
    assert (run / "model" / "model.safetensors").exists() and (run / "checkpoints" / "step-2").exists()
    many, one = _metrics(run), _metrics(tmp_path / "single")
    assert [m["step"] for m in many] == [1, 2]
    # The gradient norm (before clipping) is the global gradient's: loss normalizers summed
    # over ranks, gradients summed over ranks.
    for a, b in zip(one, many, strict=True):
        for key in ("reward/mean", "reward/std", "reward/success_rate", "loss/policy", "grad/norm",
                    "is/ratio_mean", "is/ratio_max", "entropy/mean", "clip/region_frac", "tools/invalid_rate"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_two_accelerate_processes_take_the_single_process_sdpo_steps(tmp_path):
    """SDPO's gate and its metrics see every rank's groups: the same teachers, the same update."""
    torch.set_num_threads(1)
    model, tok = _load()
    before = _state(model)
    sdpo.train(sdpo.SDPOConfig(output_dir=str(tmp_path / "single"), **SDPO_CONFIG), model=model, tokenizer=tok)
    single = _state(model)

    ranks = _launch_two(tmp_path, "sdpo")
    update = torch.cat([(single[k] - before[k]).flatten() for k in single])
    error = torch.cat([(ranks[0][k] - single[k]).flatten() for k in single])
    assert error.norm() <= 1e-4 * update.norm(), (error.norm(), update.norm())
    one, many = _metrics(tmp_path / "single"), _metrics(tmp_path / "run")
    assert one[0]["sdpo/demonstration_frac"] > 0 and one[0]["sdpo/feedback_used_frac"] > 0  # what the test is about
    for a, b in zip(one, many, strict=True):
        for key in [k for k in a if k.startswith(("sdpo/", "loss/"))]:
            assert b.get(key) == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


REWARDS = """
def mentions_answer(completions, answer, level, log_extra, **kwargs):
    log_extra("level", level)
    return [1.0 if a in c[-1]["content"] else 0.0 for c, a in zip(completions, answer)]

def only_hard(completions, level, **kwargs):  # None: not applicable
    return [len(c[-1]["content"]) / 100 if lv == "hard" else None for c, lv in zip(completions, level)]
"""


def test_reward_functions_log_every_ranks_episodes(tmp_path, monkeypatch):
    """Rank 0 plays the easy rows only, where only_hard never applies: its mean and the log_extra
    values are still those of the whole step."""
    from treerl.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i),
             "level": "hard" if i % 2 else "easy"} for i in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["learn", "--env", "treerl/MathVerify-v0", "--env-kwargs", '{"data_path": "train.jsonl"}', "--steps", "1",
            "--tasks-per-step", "4", "--group-size", "2", "--max-new-tokens", "8", "--eval-episodes", "0",
            "--reward-funcs", "my_rewards.py:mentions_answer,my_rewards.py:only_hard", "--progress", "false",
            "--num-threads", "1"]
    assert main([*args, "--output-dir", "one"]) == 0
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port()), "-m", "treerl.cli", *args, "--output-dir", "two"]
    r = subprocess.run(launch, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    one, two = _metrics(tmp_path / "one")[0], _metrics(tmp_path / "two")[0]
    for key in ("reward_fn/mentions_answer_mean", "reward_fn/only_hard_mean"):
        assert two[key] == pytest.approx(one[key], rel=1e-6), key
    extras = [json.loads((tmp_path / run / "reward_extras.jsonl").read_text()) for run in ("one", "two")]
    assert extras[0] == extras[1] == {"step": 1, "level": ["easy"] * 2 + ["hard"] * 2 + ["easy"] * 2 + ["hard"] * 2}


def test_fewer_tasks_than_processes_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(Ranks, "from_env", classmethod(lambda cls, device, **kwargs: cls(rank=0, world_size=4)))
    with pytest.raises(ValueError, match="tasks_per_step=2 is fewer than the 4 processes"):
        train(GRPOConfig(output_dir=str(tmp_path), **{**CONFIG, "tasks_per_step": 2}))


if __name__ == "__main__":  # a rank of the accelerate run above
    _rank_main(Path(sys.argv[1]), sys.argv[2])
