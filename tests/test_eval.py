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
