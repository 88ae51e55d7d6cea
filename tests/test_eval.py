"""``treerl eval`` and :func:`treerl.rollout.evaluate.evaluate_with`: the options they honour."""

from __future__ import annotations

from _scripted import ScriptedPolicy

from treerl.envs import ToolCall, get_parser
from treerl.models import load_default_model
from treerl.rollout.evaluate import EvalConfig, evaluate_with


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


def test_eval_plays_each_dataset_row_at_most_once(capsys):
    _, tok = load_default_model()
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(3)]
    policy = ScriptedPolicy(tok, lambda task, g, turn: "\\boxed{1}", end_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = EvalConfig(env="treerl/MathVerify-v0", env_kwargs={"dataset": rows})
    report = evaluate_with(cfg, policy, tok, num_episodes=5, seed=0)
    # Five episodes would play rows 0 and 1 twice and row 2 once: a success rate weighted by accident.
    assert [t["id"] for t in report.task_rows()] == ["0", "1", "2"]
    assert report.num_episodes == 3 and report.success_rate == 1 / 3
    assert "the dataset has 3 rows" in capsys.readouterr().err
    assert evaluate_with(cfg, policy, tok, num_episodes=2, seed=0).num_episodes == 2  # fewer: the first rows
