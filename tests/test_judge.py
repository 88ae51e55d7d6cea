"""The LLM judge reward (``treerl.envs.judge.JudgeReward``) against a scripted OpenAI-compatible server on
loopback: the verdicts it reads, the prompt the judge gets, failures as data (timeout, HTTP 500, no verdict),
retries, concurrency, the cache, and a training step of the shipped tiny model rewarded by the judge alone."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("openai")

from _judge_server import ScriptedJudge  # noqa: E402

from treerl.envs.judge import JudgeReward  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SYSTEM = {"role": "system", "content": "Answer briefly."}


def chat(question: str, reply: str) -> tuple[list[dict], list[dict]]:
    return [SYSTEM, {"role": "user", "content": question}], [{"role": "assistant", "content": reply}]


class Log:
    """The ``log_metric`` and ``log_extra`` callbacks treerl and TRL pass to reward functions."""

    def __init__(self):
        self.metrics, self.extras = {}, {}

    def kwargs(self) -> dict:
        return {"log_metric": self.metrics.__setitem__, "log_extra": self.extras.__setitem__}


def test_yes_no_verdicts_and_the_prompt_holds_question_answer_and_response():
    def reply(prompt, _):
        return {"Paris": "Yes.", "Lyon": "**No**, Lyon is not the capital.", "Nice": "I cannot tell."}[
            next(city for city in ("Paris", "Lyon", "Nice") if f"Response:\n```\n{city}\n```" in prompt)]

    with ScriptedJudge(reply) as server:
        judge = JudgeReward(base_url=server.url, model="judge-model", retry_backoff_s=0.01)
        pairs = [chat("Capital of France?", text) for text in ("<think>Lyon? no.</think>Paris", "Lyon", "Nice")]
        log = Log()
        rewards = judge(prompts=[p for p, _ in pairs], completions=[c for _, c in pairs],
                        answer=["Paris"] * 3, **log.kwargs())
        assert rewards == [1.0, 0.0, 0.0]
        (prompt,) = [p for p in server.prompts() if "Response:\n```\nParis\n```" in p]
        # The question, the gold answer and the final answer (the reasoning before </think> left out).
        assert "Capital of France?" in prompt and "Ground truth answer:\n```\nParis\n```" in prompt
        assert "Lyon?" not in prompt
        assert {body["model"] for body in server.requests} == {"judge-model"}
        assert {body["temperature"] for body in server.requests} == {0.0}
        reasons = log.extras["judge/reason"]
        assert reasons[:2] == [None, None] and "no verdict" in reasons[2] and "I cannot tell" in reasons[2]
        assert log.metrics["judge/failed"] == pytest.approx(1 / 3)

        # No gold answer: the prompt without one; text prompts and completions (TRL's standard format) too.
        assert judge(prompts=["Capital of France?"], completions=["Paris"]) == [1.0]
        assert "Ground truth" not in server.prompts()[-1] and "Capital of France?" in server.prompts()[-1]


def test_score_verdicts_scale_to_the_range_and_out_of_range_is_a_failure():
    with ScriptedJudge(lambda prompt, _: "Score: 8" if "good" in prompt else "Score: 42") as server:
        judge = JudgeReward(base_url=server.url, verdict="score", score_range=(0, 10), failure_reward=-1.0,
                            prompt="Q: {question}\nA: {response}\nGold: {answer}\nScore 0-10.")
        rewards = judge(prompts=["q", "q"], completions=["good", "bad"], answer=["x", "x"])
        assert rewards == [pytest.approx(0.8), -1.0]
        assert "a number in [0, 10]" in judge.last_results[1].reason
        assert "Q: q\nA: good\nGold: x\nScore 0-10." in server.prompts()
    with pytest.raises(ValueError, match="JudgeReward.prompt has the fields"):
        JudgeReward(prompt="Is {reply} right?")


def test_a_timeout_and_a_500_are_reward_zero_with_the_reason_recorded():
    def reply(prompt, _):
        if "slow" in prompt:
            return ("sleep", 3.0, "yes")
        if "broken" in prompt:
            return (500, "the judge crashed")
        return "yes"

    with ScriptedJudge(reply) as server:
        judge = JudgeReward(base_url=server.url, timeout_s=0.5, max_retries=0)
        log = Log()
        start = time.monotonic()
        rewards = judge(prompts=["q"] * 3, completions=["slow", "broken", "fine"], **log.kwargs())
        assert time.monotonic() - start < 2.5
        assert rewards == [0.0, 0.0, 1.0]
        slow, broken, fine = log.extras["judge/reason"]
        assert "Timeout" in slow and "HTTP 500" in broken and fine is None
        assert log.metrics["judge/failed"] == pytest.approx(2 / 3)
        # failure_reward=None: "not applicable", left out of the weighted sum.
        assert JudgeReward(base_url=server.url, timeout_s=0.5, max_retries=0, failure_reward=None)(
            prompts=["q"], completions=["broken"]) == [None]


def test_transport_errors_are_retried_a_bounded_number_of_times_and_client_errors_are_not():
    def reply(prompt, index):
        if "bad request" in prompt:
            return (400, "no such model")
        return (503, "loading") if index < 2 else "yes"

    with ScriptedJudge(reply) as server:
        log = Log()
        judge = JudgeReward(base_url=server.url, max_retries=2, retry_backoff_s=0.01)
        assert judge(prompts=["q"], completions=["a"], **log.kwargs()) == [1.0]
        assert len(server.requests) == 3 and log.metrics["judge/retries"] == 2
    with ScriptedJudge(reply) as server:
        judge = JudgeReward(base_url=server.url, max_retries=1, retry_backoff_s=0.01)
        assert judge(prompts=["q"], completions=["a"]) == [0.0]
        assert len(server.requests) == 2 and "after 1 retries" in judge.last_results[0].reason
        assert judge(prompts=["q"], completions=["bad request"]) == [0.0]
        assert len(server.requests) == 3 and "HTTP 400" in judge.last_results[0].reason


def test_concurrency_is_limited_and_identical_queries_are_cached():
    in_flight, most = [0], [0]
    lock = threading.Lock()

    def reply(prompt, _):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.15)
        with lock:
            in_flight[0] -= 1
        return "yes"

    with ScriptedJudge(reply) as server:
        judge = JudgeReward(base_url=server.url, max_concurrency=2)
        log = Log()
        assert judge(prompts=["q"] * 6, completions=[f"a{i}" for i in range(6)], **log.kwargs()) == [1.0] * 6
        assert most[0] == 2
        assert judge(prompts=["q"] * 2, completions=["a0", "a1"], **log.kwargs()) == [1.0, 1.0]
        assert len(server.requests) == 6 and log.metrics["judge/cache_hits"] == 2


def test_grpo_trainer_step_is_rewarded_by_the_judges_verdicts(tmp_path):
    from treerl import GRPOConfig, GRPOTrainer

    def verdict(prompt):  # a fixed verdict per response
        response = prompt.split("Response:\n```\n")[1].split("\n```")[0]
        return "yes" if len(response) % 2 == 0 else "no"

    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(2)]
    with ScriptedJudge(lambda prompt, _: verdict(prompt)) as server:
        judge = JudgeReward(base_url=server.url)
        trainer = GRPOTrainer(model="tiny", reward_funcs=[judge], train_dataset=rows,
                              args=GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, num_generations=2,
                                              tasks_per_step=2, max_new_tokens=6, progress=False, sample_groups=0))
        trainer.train()
        prompts = server.prompts()
    questions = {p.split("Question:\n```\n")[1].split("\n```")[0] for p in prompts}
    assert {f"What is {i} + {i}?" for i in range(2)} <= questions
    assert all("Ground truth answer:\n```\n0\n```" in p or "Ground truth answer:\n```\n2\n```" in p for p in prompts)
    (extras,) = [json.loads(line) for line in (tmp_path / "out" / "reward_extras.jsonl").read_text().splitlines()]
    assert len(extras["judge/verdict"]) == 4 and extras["judge/reason"] == [None] * 4
    scripted = [1.0 if v == "yes" else 0.0 for v in extras["judge/verdict"]]
    assert scripted == [r.reward for r in judge.last_results]
    (metrics,) = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["reward_fn/judge_mean"] == pytest.approx(sum(scripted) / 4)
    assert metrics["reward/mean"] == pytest.approx(sum(scripted) / 4)  # the judge's alone (env weight 0)
    assert metrics["reward_fn/judge/failed"] == 0.0


def test_learn_takes_the_judge_from_the_command_line(tmp_path, monkeypatch, capsys):
    from treerl.cli import main

    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(2)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with ScriptedJudge(lambda prompt, index: "yes") as server:
        common = ["learn", "--env", "treerl/MathVerify-v0", "--env-kwargs", '{"data_path": "train.jsonl"}',
                  "--steps", "1", "--tasks-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
                  "--eval-episodes", "0", "--progress", "false", "--sample-groups", "0"]
        assert main([*common, "--output-dir", "bad", "--judge", json.dumps({"url": server.url})]) == 2
        assert "JudgeReward takes" in capsys.readouterr().err
        assert main([*common, "--output-dir", "bad", "--judge", json.dumps({"base_url": server.url}),
                     "--reward-weights", "1.0"]) == 2
        assert "give 2: the environment's reward first" in capsys.readouterr().err
        code = main([*common, "--output-dir", "run", "--reward-weights", "0.0", "1.0",
                     "--judge", json.dumps({"base_url": server.url, "model": "m", "name": "judge"})])
        assert code == 0
        assert len(server.requests) >= 1 and {b["model"] for b in server.requests} == {"m"}
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["reward_fn/judge_mean"] == 1.0 and metrics["reward/mean"] == 1.0
