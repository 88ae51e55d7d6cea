"""SDPO's teacher contexts: which sibling demonstrates, when feedback is shown, what the teacher's
prompt keeps and replaces, multi-turn demonstrations, and the length bound."""

from __future__ import annotations

import pytest

from treerl.learners.teacher_context import (
    TeacherContextConfig,
    TeacherPrompter,
    choose_demonstrations,
    context_metrics,
    demonstration_text,
    reprompt_messages,
)
from treerl.models import load_default_model
from treerl.rollout.trajectory import Group

SYSTEM = {"role": "system", "content": "Use the calculator tool, then answer with \\boxed{number}."}
USER = {"role": "user", "content": "Ben buys 5 bags with 2 apples in each. How many apples does Ben buy?"}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5 * 2"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_model()[1]


def _group(attempts: list[tuple[float, list[dict], str | None]]) -> Group:
    """A group whose episodes have these (reward, messages after the prompt, feedback)."""
    g = Group(task_key="seed-0", env_id="treerl/Calculator-v0", info={"num_prompt_messages": 2})
    root = g.add_segment("prompt", [1, 2, 3])
    for reward, after, feedback in attempts:
        leaf = g.add_segment("sampled", [4, 5], parent=root, logprobs=[-1.0, -1.0])
        g.add_episode(leaf=leaf, reward=reward, messages=[SYSTEM, USER, *after],
                      metrics={"feedback": feedback} if feedback else {})
    return g


def _answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_a_sample_is_never_its_own_demonstration():
    assert choose_demonstrations([1.0, 1.0, 0.0], 1.0) == [1, 0, 0]  # each success taught by the other
    assert choose_demonstrations([0.0, 1.0, 0.0], 1.0) == [1, None, 1]  # the only success teaches no one itself
    assert choose_demonstrations([0.2, 0.5], 1.0) == [None, None]
    assert choose_demonstrations([0.6, 0.5], 0.5) == [1, 0]  # the threshold is inclusive


def test_failed_siblings_share_one_demonstration_and_one_prompt(tokenizer):
    g = _group([(0.0, _answer("\\boxed{7}"), None), (1.0, _answer("\\boxed{10}"), None),
                (0.0, _answer("\\boxed{12}"), None), (1.0, _answer("So \\boxed{10}"), None)])
    contexts = TeacherPrompter(tokenizer, TeacherContextConfig(use_feedback=False)).group_contexts(g, g.rewards)
    assert [c.demonstration for c in contexts] == [1, 3, 1, 1]
    assert contexts[0].prompt_ids == contexts[2].prompt_ids  # identical teacher prefix for the failures
    assert contexts[1].prompt_ids != contexts[0].prompt_ids  # a success sees the other success
    text = tokenizer.decode(contexts[1].prompt_ids)
    assert "Correct solution:\n\nSo \\boxed{10}" in text and "Correctly solve the original question." in text


def test_feedback_rules(tokenizer):
    g = _group([(0.0, _answer("\\boxed{7}"), "The final answer \\boxed{7} is wrong."),
                (1.0, _answer("\\boxed{10}"), None),
                (0.0, _answer("\\boxed{3}"), "   ")])  # blank feedback is no feedback
    with_feedback = TeacherPrompter(tokenizer, TeacherContextConfig()).group_contexts(g, g.rewards)
    assert with_feedback[0].feedback == "The final answer \\boxed{7} is wrong." and with_feedback[0].demonstration == 1
    assert "feedback from your unsuccessful earlier attempt:\n\nThe final answer" in tokenizer.decode(
        with_feedback[0].prompt_ids)
    assert not with_feedback[2].feedback_available and with_feedback[2].feedback is None
    assert with_feedback[1].prompt_ids is None  # the only success has no demonstration and no feedback
    only = TeacherPrompter(tokenizer, TeacherContextConfig(feedback_only_without_solution=True))
    assert only.group_contexts(g, g.rewards)[0].feedback is None  # it has a demonstration
    off = TeacherPrompter(tokenizer, TeacherContextConfig(use_feedback=False)).group_contexts(g, g.rewards)
    assert off[0].feedback is None and off[0].feedback_available
    # Feedback alone gives a teacher when no sibling succeeded (e.g. every code attempt failed).
    failed = _group([(0.0, _answer("x"), "Test 1 failed."), (0.0, _answer("y"), None)])
    alone = TeacherPrompter(tokenizer, TeacherContextConfig()).group_contexts(failed, failed.rewards)
    assert alone[0].prompt_ids is not None and alone[0].demonstration is None and alone[1].prompt_ids is None
    metrics = context_metrics([with_feedback, alone])
    assert metrics["sdpo/no_teacher_group_frac"] == 0.0 and metrics["sdpo/reprompt_frac"] == 3 / 5


def test_system_messages_are_kept_and_the_last_user_turn_replaced():
    cfg = TeacherContextConfig()
    prompt = [SYSTEM, {"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}, USER]
    out = reprompt_messages(prompt, "A", "F", cfg)
    assert out[:3] == prompt[:3]
    assert out[3]["role"] == "user" and out[3]["content"] == cfg.reprompt_template.format(
        prompt=USER["content"], solution=cfg.solution_template.format(successful_previous_attempt="A"),
        feedback=cfg.feedback_template.format(feedback_raw="F"))
    parts = [{"type": "text", "text": "look"}, {"type": "image"}]
    assert reprompt_messages([{"role": "user", "content": parts}], None, None, cfg)[0]["content"].startswith("look")


def test_a_multi_turn_demonstration_is_its_transcript():
    g = _group([(1.0, [{"role": "assistant", "content": "<think>hmm</think>" + CALL},
                       {"role": "tool", "name": "calculator", "content": "10"},
                       {"role": "assistant", "content": "The answer is \\boxed{10}."}], None)])
    text = demonstration_text(g.episodes[0], 2)
    assert text == f"<think>hmm</think>{CALL}\n[calculator result] 10\nThe answer is \\boxed{{10}}."
    assert demonstration_text(g.episodes[0], 2, remove_thinking=True).startswith("<tool_call>")


def test_long_demonstrations_and_feedback_are_shortened_never_the_task(tokenizer):
    long_answer = "Let me think. " * 200 + "\\boxed{10}"
    g = _group([(0.0, _answer("\\boxed{7}"), "wrong " * 300), (1.0, _answer(long_answer), None)])
    full = TeacherPrompter(tokenizer, TeacherContextConfig(max_prompt_tokens=8192)).group_contexts(g, g.rewards)[0]
    assert not full.truncated and len(full.prompt_ids) > 1000
    cfg = TeacherContextConfig(max_prompt_tokens=400)
    short = TeacherPrompter(tokenizer, cfg).group_contexts(g, g.rewards)[0]
    assert short.truncated and len(short.prompt_ids) <= 400
    text = tokenizer.decode(short.prompt_ids)
    assert USER["content"] in text and SYSTEM["content"] in text and text.count("[...]") == 2
    assert "Correctly solve the original question." in text  # the template's instruction survives
    tiny = TeacherPrompter(tokenizer, TeacherContextConfig(max_prompt_tokens=50)).group_contexts(g, g.rewards)[0]
    assert tiny.prompt_ids is None and tiny.too_long  # not even the task fits: no teacher


def test_templates_are_checked():
    with pytest.raises(ValueError, match="reprompt_template.*may use only the fields"):
        TeacherContextConfig(reprompt_template="{prompt} {answer}")
    with pytest.raises(ValueError, match="max_teacher_prompt_tokens"):
        TeacherContextConfig(max_prompt_tokens=0)
