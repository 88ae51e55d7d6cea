"""Reading examples (SDPO's teacher prompt, then a copy of what it shows) and the shipped ``tiny-reader``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from _scripted import ScriptedPolicy

import treerl
from treerl.agents.reprompt import attempt_text
from treerl.envs.builtin.calculator_tasks import CalculatorTask, calculator, sample_task
from treerl.learners.sdpo import SDPOConfig
from treerl.learners.teacher_context import TeacherPrompter
from treerl.models import SHIPPED_MODELS, load_model, model_directory
from treerl.models.train_tiny import (
    TrainTinyConfig,
    calculator_feedback,
    calculator_schema,
    encode_conversations,
    make_episode,
    make_reading_episode,
    sampled_attempt,
)
from treerl.rollout.engine import RolloutEngine

ENV = "treerl/Calculator-v0"
PERFECT = TrainTinyConfig(p_wrong_operator=0.0, p_distractor=0.0, p_wrong_answer=0.0)


@pytest.fixture(scope="module")
def reader():
    return load_model("tiny-reader")


@pytest.fixture(scope="module")
def tokenizer():
    return load_model(None)[1]


def _played_group(tokenizer, seed: int, wrong: str):
    """A Calculator group of two played by script: generation 0 the gold actions, 1 the gold call then ``wrong``."""
    env = treerl.make(ENV)
    env.reset(seed=seed)
    gold = env.gold_actions(env.task)
    policy = ScriptedPolicy(tokenizer, lambda task, g, turn: gold[turn] if g == 0 or turn == 0 else wrong,
                            tokenizer.convert_tokens_to_ids("<|im_end|>"))
    [group], _ = asyncio.run(RolloutEngine(policy, tokenizer, seed=0).run(lambda: treerl.make(ENV), ENV, [seed], 2))
    task = CalculatorTask(question=env.task.prompt, expression=env.task.info["expression"], answer=str(env.task.answer))
    return group, task


def test_reading_prompt_is_sdpos_teacher_prompt_token_for_token(tokenizer):
    # SDPO's own teacher prompt for a failed episode (a successful sibling's rollout as the
    # demonstration, the environment's recorded feedback) against the reading example's prompt.
    tok = tokenizer
    group, task = _played_group(tok, seed=3, wrong="The answer is \\boxed{1}.")
    assert [e.reward for e in group.episodes] == [1.0, 0.0]
    recorded = group.episodes[1].metrics["feedback"]
    assert recorded == calculator_feedback()(task, "The answer is \\boxed{1}.")  # the environment's own words
    cfg = SDPOConfig(output_dir="unused")  # the default templates
    tools = treerl.make(ENV).tool_schemas
    [_, failed] = TeacherPrompter(tok, cfg.context_config(), tools=tools).group_contexts(group, [1.0, 0.0])
    assert failed.demonstration == 0 and failed.feedback == recorded

    config = TrainTinyConfig(p_reading_feedback=1.0, p_reading_feedback_only=0.0, p_reading_variant=0.0)
    messages, kind = make_reading_episode(task, np.random.default_rng(0), config, lambda t, c: recorded)
    assert kind == "demo+feedback"
    prompt_ids = tok.apply_chat_template(messages[:2], tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    assert list(prompt_ids) == failed.prompt_ids
    # The demonstration is the gold rollout's transcript, as SDPO writes it; the reply copies it.
    assert attempt_text(sampled_attempt(messages[2:])) == attempt_text(group.episodes[0].messages[2:])


def test_reading_examples_show_the_same_task_solved_and_copy_it():
    config = TrainTinyConfig(p_reading=0.5)
    rng, feedback = np.random.default_rng(5), calculator_feedback()
    kinds: dict[str, int] = {}
    for _ in range(300):
        task = sample_task(rng)
        messages, kind = make_reading_episode(task, rng, config, feedback)
        kinds[kind] = kinds.get(kind, 0) + 1
        user = messages[1]["content"]
        assert messages[0]["role"] == "system" and user.startswith(task.question + "\n")
        assert user.endswith("\n\nCorrectly solve the original question.\n")
        assert ("Correct solution:" in user) == (kind != "feedback")
        assert ("feedback from your unsuccessful earlier attempt" in user) == (kind != "demo")
        if kind != "demo":
            assert f"is wrong. The correct answer is {task.answer}." in user
        expression = messages[2]["tool_calls"][0]["function"]["arguments"]["expression"]
        assert messages[-1]["content"] == f"The answer is \\boxed{{{task.answer}}}."
        if kind == "feedback":
            continue  # the call keeps the student's odds; the answer is the one the feedback names
        # The demonstration solves this very task, and the reply is the demonstration itself.
        assert calculator(expression) == task.answer
        assert attempt_text(sampled_attempt(messages[2:])) in user
    assert 90 <= kinds["demo"] <= 150 and 90 <= kinds["demo+feedback"] <= 150 and 35 <= kinds["feedback"] <= 85


def test_student_examples_stay_imperfect_and_the_default_recipe_has_no_reading():
    # p_reading=0 (the shipped tiny): the stream is make_episode's alone, mistakes included.
    rng_a, rng_b = np.random.default_rng(9), np.random.default_rng(9)
    from treerl.models.train_tiny import _episodes

    conversations, share = _episodes(rng_a, 200, TrainTinyConfig())
    expected = [make_episode(sample_task(rng_b), rng_b, TrainTinyConfig())[0] for _ in range(200)]
    assert conversations == expected and 0.2 < share < 0.6
    mixed, share_mixed = _episodes(np.random.default_rng(9), 400, TrainTinyConfig(p_reading=0.5))
    reading = [c for c in mixed if "Correctly solve the original question." in c[1]["content"]]
    assert 150 <= len(reading) <= 250 and 0.2 < share_mixed < 0.6


def _logp(model, tokenizer, conversation: list[dict]) -> torch.Tensor:
    """(T,) log-probs of the conversation's assistant tokens (what the policy samples)."""
    [(ids, mask)] = encode_conversations(tokenizer, [conversation], [calculator_schema()])
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids_t).logits[0, :-1].float(), -1)  # (S-1, V)
    return logp.gather(1, ids_t[0, 1:, None])[:, 0][torch.tensor(mask[1:])]  # (T,)


def test_tiny_reader_loads_by_name_and_copies_what_it_is_shown(reader):
    model, tok = reader
    assert model_directory("tiny-reader") == str(SHIPPED_MODELS["tiny-reader"])
    _, tiny_tok = load_model("tiny")
    assert tok.get_vocab() == tiny_tok.get_vocab() and tok.chat_template == tiny_tok.chat_template
    rng = np.random.default_rng(11)
    same = TrainTinyConfig(p_reading_feedback=0.0, p_reading_feedback_only=0.0, p_reading_variant=0.0)
    swapped = TrainTinyConfig(p_reading_feedback=0.0, p_reading_feedback_only=0.0, p_reading_variant=1.0)
    gaps, swap_gaps = [], []
    while len(swap_gaps) < 3:
        task = sample_task(rng)
        student, _ = make_episode(task, rng, PERFECT)
        # Shown the very attempt it scores, the teacher is on the whole surer of it than the student
        # (the shipped tiny is 0.8 nats per token *less* sure: it cannot read the prompt).
        reading, _ = make_reading_episode(task, rng, same, None)
        assert reading[2:] == student[2:]
        gaps.append(float(_logp(model, tok, reading).mean() - _logp(model, tok, student).mean()))
        # Shown "b + a" where the student writes "a + b", it writes what it is shown: a form the
        # student almost never samples becomes likely, so the copy comes from the prompt.
        reading, _ = make_reading_episode(task, rng, swapped, None)
        if reading[2:] != student[2:]:
            as_student = [*student[:2], *reading[2:]]
            swap_gaps.append(float(_logp(model, tok, reading).sum() - _logp(model, tok, as_student).sum()))
    assert min(swap_gaps) > 2.0, (swap_gaps, gaps)
    assert sum(gaps) / len(gaps) > 0.0 and sum(g > 0 for g in gaps) >= 0.7 * len(gaps), gaps
