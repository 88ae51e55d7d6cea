"""``treerl eval`` and :func:`treerl.rollout.evaluate.evaluate_with`: the options they honour."""

from __future__ import annotations

import json
import math

import pytest
from _scripted import ScriptedPolicy

from treerl.cli import main
from treerl.envs import ToolCall, get_parser
from treerl.models import load_default_model
from treerl.rollout.evaluate import EvalConfig, evaluate_with
from treerl.rollout.trajectory import read_groups, read_header


class _RecordingPolicy(ScriptedPolicy):
    """A scripted policy that remembers the session of each request, in the order they came."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sessions: list[str] = []

    async def agenerate(self, request):
        self.sessions.append(request.session)
        return await super().agenerate(request)


def test_eval_plays_in_lockstep_when_asked():
    _, tok = load_default_model()
    call = get_parser("hermes").render([ToolCall("calculator", {"expression": "1 + 1"})])
    policy = _RecordingPolicy(tok, lambda task, g, turn: [call, "\\boxed{2}"][turn],
                              end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = EvalConfig(lockstep=True, continuous_batching=False, max_concurrency=1)
    report = evaluate_with(cfg, policy, tok, num_episodes=3, seed=0)
    assert report.num_episodes == 3
    # In lockstep every episode is in play at once (max_concurrency does not apply) and the first wave is
    # every episode's first turn; without it, one episode at a time plays both its turns.
    assert len(set(policy.sessions[:3])) == 3, policy.sessions


def test_eval_plays_each_dataset_row_at_most_once(capsys, monkeypatch):
    import treerl.rollout.evaluate

    monkeypatch.setattr(treerl.rollout.evaluate, "_SAID", set())  # said once a process: not yet in this test
    _, tok = load_default_model()
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(3)]
    policy = ScriptedPolicy(tok, lambda task, g, turn: "\\boxed{1}", end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = EvalConfig(env="treerl/MathVerify-v0", env_kwargs={"dataset": rows})
    report = evaluate_with(cfg, policy, tok, num_episodes=5, seed=0)
    # Five episodes would play rows 0 and 1 twice and row 2 once: a success rate weighted by accident.
    assert [t["id"] for t in report.task_rows()] == ["0", "1", "2"]
    assert report.num_episodes == 3 and report.success_rate == 1 / 3
    assert "asks for 5 tasks (--eval-episodes of learn, --num-episodes of eval) but the dataset has 3 rows" in \
        capsys.readouterr().err
    assert evaluate_with(cfg, policy, tok, num_episodes=5, seed=0).num_episodes == 3
    assert "the dataset has 3 rows" not in capsys.readouterr().err  # said once: learn evaluates every few steps
    assert evaluate_with(cfg, policy, tok, num_episodes=2, seed=0).num_episodes == 2  # fewer: the first rows


def _math_rows(n: int) -> list[dict]:
    return [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(n)]


def test_eval_plays_each_task_as_a_group_and_reports_pass_at_k():
    _, tok = load_default_model()
    rows = _math_rows(3)
    # Task 0: generation 0 of 4 right; task 1: all 4 wrong; task 2: all 4 right.
    right = {"seed-0": {0}, "seed-1": set(), "seed-2": {0, 1, 2, 3}}
    answers = {f"seed-{i}": r["answer"] for i, r in enumerate(rows)}
    policy = ScriptedPolicy(tok, lambda task, g, turn: f"\\boxed{{{answers[task] if g in right[task] else 0}}}",
                            end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = EvalConfig(env="treerl/MathVerify-v0", env_kwargs={"dataset": rows})
    report = evaluate_with(cfg, policy, tok, num_episodes=3, seed=0, rollouts_per_task=4)
    # num_episodes counts tasks (verifiers' -n); each is one group of 4 sharing its prompt segment.
    assert report.figures["groups"] == 3 and report.num_episodes == 12
    assert all(len(g.episodes) == 4 and [s.kind for s in g.segments].count("prompt") == 1 for g in report.groups)
    assert report.success_rate == 5 / 12  # over every episode
    # Unbiased pass@k (1 - C(n-c, k) / C(n, k)) averaged over tasks: c = 1, 0, 4 of n = 4.
    assert report.pass_at_k == {1: (0.25 + 0 + 1) / 3, 2: (0.5 + 0 + 1) / 3, 4: (1 + 0 + 1) / 3}
    assert report.summary()["pass@4"] == 2 / 3 and "pass@1 41.7%" in report.table()
    once = evaluate_with(cfg, policy, tok, num_episodes=3, seed=0)
    assert once.num_episodes == 3 and once.pass_at_k == {} and "pass@" not in once.table()


def test_eval_reports_reward_functions_as_learn_logs_them():
    _, tok = load_default_model()

    def brief(prompts, completions, completion_ids, **kwargs):
        return [1.0 if len(ids) < 8 else 0.0 for ids in completion_ids]

    def abstains(prompts, completions, completion_ids, **kwargs):
        return [None] * len(completions)

    rows = _math_rows(2)
    answers = {"seed-0": "1", "seed-1": "2"}
    policy = ScriptedPolicy(tok, lambda task, g, turn: f"\\boxed{{{answers[task]}}}" if g == 0 else "x " * 20,
                            end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = EvalConfig(env="treerl/MathVerify-v0", env_kwargs={"dataset": rows})
    report = evaluate_with(cfg, policy, tok, num_episodes=2, seed=0, rollouts_per_task=2,
                           reward_funcs=[brief, abstains], reward_weights=[1.0, 0.5, 2.0])
    f = report.figures
    # Episode rewards (env, brief): right-and-brief (1, 1) twice, wrong-and-long (0, 0) twice.
    assert f["reward/env_mean"] == 0.5 and f["reward_fn/brief_mean"] == 0.5
    assert math.isnan(f["reward_fn/abstains_mean"])  # None: not applicable, left out of the sum, as in learn
    assert f["reward/mean"] == (1.5 + 1.5 + 0 + 0) / 4  # the weighted sum learn trains on
    assert report.success_rate == 0.5  # the environment's reward decides success
    assert "env reward mean / std" in report.table() and "reward_fn/brief_mean" in report.table()
    with pytest.raises(ValueError, match="reward_weights"):
        EvalConfig(reward_funcs=["math:floor"], reward_weights=[1.0])


def test_eval_gives_reward_functions_a_trainer_state():
    # A function written for learn with a step schedule reads trainer_state; eval passed None and it
    # crashed with "'NoneType' object has no attribute 'global_step'".
    _, tok = load_default_model()
    seen = []

    def scheduled(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.append((trainer_state.global_step, trainer_state.max_steps))
        return [1.0] * len(completions)

    policy = ScriptedPolicy(tok, lambda task, g, turn: "\\boxed{1}", end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = EvalConfig(env="treerl/MathVerify-v0", env_kwargs={"dataset": _math_rows(1)})
    report = evaluate_with(cfg, policy, tok, num_episodes=1, seed=0, reward_funcs=[scheduled])
    assert seen == [(0, 0)] and report.figures["reward_fn/scheduled_mean"] == 1.0  # TRL's state before training


def test_eval_command_writes_trajectories_with_the_report(tmp_path, capsys):
    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, completion_ids, **kwargs):\n"
        "    return [1.0 if len(ids) < 20 else 0.0 for ids in completion_ids]\n")
    out = tmp_path / "runs" / "eval.jsonl"
    out.parent.mkdir()
    out.write_text('{"question": "a dataset, not an earlier evaluation"}\n')
    # Another kind of file at --out is refused before the model loads, and left as it was.
    assert main(["eval", "--out", str(out)]) == 2
    assert "not a treerl trajectory file" in capsys.readouterr().err and "a dataset" in out.read_text()
    out.unlink()
    assert main(["eval", "--num-episodes", "2", "--num-generations", "2", "--max-new-tokens", "8",
                 "--max-episode-tokens", "256", "--reward-funcs", f"{tmp_path / 'my_rewards.py'}:short",
                 "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["groups"] == 2 and printed["episodes"] == 4
    assert {"pass@1", "pass@2", "reward/env_mean", "reward_fn/short_mean"} <= printed.keys()
    groups = list(read_groups(out))  # what treerl view reads
    assert [len(g.episodes) for g in groups] == [2, 2]
    header = read_header(out)
    assert header["report"] == printed and header["run"]["group_size"] == 2
    EvalConfig(out=str(out)).check_out()  # an earlier evaluation's file may be replaced
    # A path that cannot be written is refused before the model loads, not after the evaluation.
    assert main(["eval", "--out", str(tmp_path)]) == 2
    assert "--out" in capsys.readouterr().err


def test_eval_shows_its_progress(capsys):
    from treerl.cli import main
    from treerl.rollout.evaluate import EvalConfig

    assert main(["eval", "--num-episodes", "2", "--max-new-tokens", "8"]) == 0
    assert "eval: 100%" in capsys.readouterr().err  # a bar of finished tasks, as rollout and learn show
    assert EvalConfig(progress=False).progress is False  # --progress false


def test_a_learners_evaluation_keeps_its_completion_budget(tmp_path):
    """A learner's held-out evaluation (and GRPOTrainer.evaluate) generates as its training does: TRL's
    max_completion_length bounds each episode's completion there too, not only --max-new-tokens."""
    from treerl.learners.grpo import GRPOConfig

    _, tok = load_default_model()
    call = get_parser("hermes").render([ToolCall("calculator", {"expression": "1 + 1"})])
    policy = _RecordingPolicy(tok, lambda task, g, turn: call, end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    seen = []
    generate = policy.generate
    policy.generate = lambda requests: seen.extend(requests) or generate(requests)
    cfg = GRPOConfig(output_dir=str(tmp_path), max_completion_length=60, max_new_tokens=200, max_episode_tokens=2048)
    evaluate_with(cfg, policy, tok, num_episodes=2, seed=0)
    first = {}
    for session, request in zip(policy.sessions, seen):
        prompt = first.setdefault(session, len(request.prompt_ids))
        assert len(request.prompt_ids) - prompt + request.params.max_new_tokens <= 60
    assert any(len(r.prompt_ids) > first[s] for s, r in zip(policy.sessions, seen))  # a later turn was played
