"""A policy that plays scripted turns (test helper): each generation of a group says its own lines.

Episodes are told apart by the engine's session name (``task_key/generation``); each request
of a session is the next turn of that generation's script. Tokens are the tokenizer's ids of
the text plus the end-of-turn id, each with log-prob -1 (any fixed value: the learner only reads).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from treerl.agents.policy import Generation, GenerationRequest


class ScriptedPolicy:
    """``script(task_key, generation, turn) -> text`` decides every turn."""

    def __init__(self, tokenizer, script: Callable[[str, int, int], str], end_id: int):
        self.tokenizer, self.script, self.end_id = tokenizer, script, end_id
        self.version = 0
        self.turns: Counter[str] = Counter()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        out = []
        for r in requests:
            session = r.session or "/0"
            task_key, _, name = session.rpartition("/")
            text = self.script(task_key, int(name.split(".")[0]), self.turns[session])
            self.turns[session] += 1
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.end_id]
            ids = ids[: r.params.max_new_tokens]
            out.append(Generation(token_ids=ids, logprobs=[-1.0] * len(ids), candidates=None,
                                  finish_reason="stop" if ids[-1] == self.end_id else "length",
                                  policy_version=self.version, num_prompt_tokens_processed=len(r.prompt_ids)))
        return out

    async def agenerate(self, request: GenerationRequest) -> Generation:
        return self.generate([request])[0]

    def set_weights(self, weights, version: int) -> None:
        self.version = version

    def end_session(self, session: str) -> None:
        pass

    def close(self) -> None:
        pass
