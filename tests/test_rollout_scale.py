"""How rollout bookkeeping grows with episodes, turns and tokens: counts, not timings.

A fake policy answers instantly, so what is left is the engine's own work per turn and per
group; these tests pin the counts that keep it linear (renders per turn, encodings per
write, the size of a group's repr).
"""

from __future__ import annotations

import asyncio

from treerl.rollout import Group


def big_group(num_episodes: int = 16, turns: int = 8, tokens: int = 100, width: int = 20) -> Group:
    group = Group(task_key="seed-0", env_id="demo")
    root = group.add_segment("prompt", list(range(500)))
    for _ in range(num_episodes):
        parent = root
        for _ in range(turns):
            parent = group.add_segment("sampled", [7] * tokens, parent=parent, logprobs=[-0.5] * tokens,
                                       candidates=[list(range(1000, 1000 + width))] * tokens, policy_version=0)
            parent = group.add_segment("env", [3] * 40, parent=parent)
        group.add_episode(leaf=parent, reward=0.0)
    return group


def test_group_repr_names_sizes_not_tokens():
    # asyncio.run (Python 3.11) formats the repr of what engine.run returns; a repr that
    # spelled out every token id and candidate set cost seconds per learner step.
    group = big_group()
    text = repr(group)
    assert len(text) < 200, text[:300]
    assert "episodes=16" in text and f"tokens={group.num_unique_tokens}" in text

    async def returns_groups():
        return [group] * 8, None

    groups, _ = asyncio.run(returns_groups())
    assert groups[0] is group


def test_writing_a_group_encodes_its_tokens_once(monkeypatch, tmp_path):
    # Each part of a line used to be encoded twice: once to see that strict JSON takes it,
    # once more for the text written.
    import json

    from treerl.rollout import GroupWriter, read_groups, safe_json

    group = big_group(num_episodes=2, turns=2)
    encoded: list[int] = []
    real_dumps = json.dumps

    def counting_dumps(obj, **kwargs):
        if isinstance(obj, list) and obj and isinstance(obj[0], dict) and "token_ids" in obj[0]:
            encoded.append(len(obj))
        return real_dumps(obj, **kwargs)

    monkeypatch.setattr(safe_json.json, "dumps", counting_dumps)
    with GroupWriter(tmp_path / "r.jsonl") as writer:
        writer.write(group)
    monkeypatch.undo()
    assert encoded == [len(group.segments)]
    assert [g.to_json() for g in read_groups(tmp_path / "r.jsonl")] == [group.to_json()]


def test_packing_builds_candidate_sets_in_one_piece(monkeypatch):
    # One small tensor per loss position (12,800 here) cost seconds per learner step.
    import torch

    from treerl.learners.packing import PackingConfig, pack_groups

    group = big_group()
    calls = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: calls.append(1) or real_tensor(*a, **k))
    [batch] = pack_groups([group], [0.5] * 16, PackingConfig(max_tokens_per_row=1 << 16))
    monkeypatch.undo()
    assert len(calls) < 50
    assert batch.loss_candidates.shape == (16 * 8 * 100, 20)
    assert (batch.loss_candidates == torch.arange(1000, 1020)).all()


class InstantPolicy:
    """Answers every request at once with the same few tokens and the end-of-turn id."""

    version = 0

    def __init__(self, tokenizer):
        self.ids = [*tokenizer.encode("fine, and you?", add_special_tokens=False), tokenizer.eos_token_id]

    async def agenerate(self, request):
        from treerl.agents.policy import Generation

        return Generation(token_ids=list(self.ids), logprobs=[-0.5] * len(self.ids), candidates=None,
                          finish_reason="stop", policy_version=0, num_prompt_tokens_processed=0)

    def end_session(self, session):
        pass


def talk_env(turns: int):
    from treerl.envs.core import Env

    class Talk(Env):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return [{"role": "user", "content": f"task {seed}"}], {}

        async def astep(self, action):
            self.t += 1
            return [{"role": "user", "content": f"and then {self.t}?"}], 0.0, self.t >= turns, False, {}

    return Talk()


def test_a_turn_renders_the_conversation_once(monkeypatch):
    # The bridge needs the rendering of the conversation before the turn, which is the text
    # the previous turn's bridge rendered: rendering it again made every turn two renderings
    # of the whole conversation (the part of an episode's cost that grows as turns^2).
    from treerl.agents.chat import ChatRenderer
    from treerl.models import default_model_path
    from treerl.rollout.engine import RolloutEngine
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    renders = []
    real_render = ChatRenderer.render
    monkeypatch.setattr(ChatRenderer, "render", lambda self, *a, **k: renders.append(1) or real_render(self, *a, **k))
    num_tasks, group_size, turns = 2, 3, 6
    engine = RolloutEngine(InstantPolicy(tok), tok, max_episode_tokens=1 << 16)
    groups, _ = asyncio.run(engine.run(lambda: talk_env(turns), "talk", range(num_tasks), group_size))
    assert all(e.metrics["turns"] == turns for g in groups for e in g.episodes)
    # One rendering of the prompt per group, then one per bridge (turns - 1 per episode).
    assert len(renders) == num_tasks + num_tasks * group_size * (turns - 1)
    renderer = ChatRenderer(tok)
    for e in groups[0].episodes:  # and the paths are still the rendered conversations
        assert e.token_ids == renderer.prompt_ids(e.messages)[:len(e.token_ids)]


def test_reading_and_resuming_a_file_do_not_hold_it_whole(tmp_path):
    # read_groups read every line into memory before yielding the first group, and opening a
    # writer on an existing file read the whole file to look at its last byte.
    import gc
    import tracemalloc

    from treerl.rollout import GroupWriter, read_groups

    group = Group(task_key="seed-0", env_id="demo")
    group.add_episode(leaf=group.add_segment("prompt", [1, 2, 3]), reward=0.0,
                      messages=[{"role": "user", "content": "long text " * 5000}])
    line = group.to_json() + "\n"  # its text: as big in memory as in the file
    path = tmp_path / "r.jsonl"
    with open(path, "w") as f:
        f.write(line * 200 + line[: len(line) // 2])  # and a torn last line
    size = path.stat().st_size
    assert size > 8_000_000

    tracemalloc.start()
    count = 0
    for _ in read_groups(path):  # a group and its episodes form cycles: freed by the collector
        count += 1
        if count % 25 == 0:
            gc.collect()
    read_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    GroupWriter(path).close()
    open_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert count == 200
    assert path.stat().st_size == len(line) * 200  # the torn line was cut
    assert read_peak < size / 2, (read_peak, size)
    assert open_peak < size / 20, (open_peak, size)
