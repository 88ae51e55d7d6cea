"""CodeSandbox word problems, the code reading examples, and the shipped ``tiny-coder``."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import torch
from _scripted import ScriptedPolicy

import treerl
from treerl.envs.builtin.calculator_tasks import CalculatorTask, sample_task
from treerl.envs.builtin.code_sandbox import extract_code
from treerl.envs.verifiers import unit_test_results
from treerl.learners.sdpo import SDPOConfig
from treerl.learners.teacher_context import TeacherPrompter
from treerl.models import SHIPPED_MODELS, load_model, model_directory
from treerl.models.tiny_eval import _solves
from treerl.models.train_tiny import (
    WRONG_OPERATOR,
    TrainTinyConfig,
    code_feedback,
    code_prompt,
    code_reply,
    code_schema,
    encode_conversations,
    make_code_episode,
    make_code_reading_episode,
)
from treerl.rollout.engine import RolloutEngine

ENV = "treerl/CodeSandbox-v0"
KWARGS = {"tasks": "word-problems"}


def _task(env) -> CalculatorTask:
    """The environment's current word-problem task as the training data writes it."""
    rng_task = env.task
    question = rng_task.prompt.split(": ", 1)[1]
    return CalculatorTask(question=question, expression=rng_task.info["expression"], answer="")


# --- training data ---------------------------------------------------------------------------


def test_code_episodes_are_right_exactly_when_the_sandbox_says_so():
    rng = np.random.default_rng(3)
    config = TrainTinyConfig(task="code", p_wrong_operator=0.5, p_distractor=0.6)
    verdicts = []
    for _ in range(12):
        task = sample_task(rng)
        messages, correct = make_code_episode(task, rng, config)
        assert messages[:2] == code_prompt(task)
        reply = messages[-1]["content"]
        report = unit_test_results(extract_code(reply), [f"assert solve() == {task.expression}"])
        assert report.passed == [correct] and _solves(reply, task.answer) == correct
        verdicts.append(correct)
    assert any(verdicts) and not all(verdicts)


def test_code_reading_prompt_is_sdpos_teacher_prompt_token_for_token():
    # SDPO's own teacher prompt for a failed CodeSandbox episode (a successful sibling's reply as the
    # demonstration, the environment's recorded feedback) against the reading example's prompt.
    tok = load_model("tiny-reader")[1]
    env = treerl.make(ENV, **KWARGS)
    env.reset(seed=3)
    task = _task(env)
    gold, wrong = code_reply(task.expression), code_reply("1 + 1")
    policy = ScriptedPolicy(tok, lambda key, g, turn: gold if g == 0 else wrong, tok.convert_tokens_to_ids("<|im_end|>"))
    [group], _ = asyncio.run(RolloutEngine(policy, tok, seed=0).run(lambda: treerl.make(ENV, **KWARGS), ENV, [3], 2))
    assert [e.reward for e in group.episodes] == [1.0, 0.0]
    recorded = group.episodes[1].metrics["feedback"]
    assert recorded == code_feedback(task)  # the environment's own words
    cfg = SDPOConfig(output_dir="unused")  # the default templates
    [_, failed] = TeacherPrompter(tok, cfg.context_config(), tools=env.tool_schemas).group_contexts(group, [1.0, 0.0])
    assert failed.demonstration == 0 and failed.feedback == recorded
    assert env.tool_schemas == [code_schema()]

    for only, kind in ((0.0, "demo+feedback"), (1.0, "feedback")):
        config = TrainTinyConfig(task="code", p_reading_feedback=1.0, p_reading_feedback_only=only, p_reading_variant=0.0)
        messages, got = make_code_reading_episode(task, np.random.default_rng(0), config)
        assert got == kind and messages[-1]["content"] == gold  # the reply writes the reference
        if kind == "demo+feedback":
            prompt_ids = tok.apply_chat_template(messages[:2], tools=env.tool_schemas, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
            assert list(prompt_ids) == failed.prompt_ids


def test_code_reading_examples_mix_demonstrations_and_feedback():
    config = TrainTinyConfig(task="code", p_reading_feedback_only=0.4)
    rng, kinds = np.random.default_rng(5), {}
    for _ in range(300):
        task = sample_task(rng)
        messages, kind = make_code_reading_episode(task, rng, config)
        kinds[kind] = kinds.get(kind, 0) + 1
        user = messages[1]["content"]
        assert ("Correct solution:" in user) == (kind != "feedback")
        assert (f"`assert solve() == {task.expression}` raised AssertionError" in user) == (kind != "demo")
        if kind != "feedback":  # the reply copies the demonstration, which solves the task
            assert f"Correct solution:\n\n{messages[-1]['content']}\n\n" in user
            assert _solves(messages[-1]["content"], task.answer)
    assert 100 <= kinds["feedback"] <= 150 and kinds["demo"] >= 50 and kinds["demo+feedback"] >= 50


# --- the shipped model -------------------------------------------------------------------------


def _logp(model, tokenizer, conversation: list[dict]) -> torch.Tensor:
    """(T,) log-probs of the conversation's assistant tokens."""
    [(ids, mask)] = encode_conversations(tokenizer, [conversation], [code_schema()])
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids_t).logits[0, :-1].float(), -1)  # (S-1, V)
    return logp.gather(1, ids_t[0, 1:, None])[:, 0][torch.tensor(mask[1:])]  # (T,)


def test_tiny_coder_writes_code_and_reads_the_failed_test():
    model, tok = load_model("tiny-coder")
    assert model_directory("tiny-coder") == str(SHIPPED_MODELS["tiny-coder"])
    rng = np.random.default_rng(21)
    config = TrainTinyConfig(task="code", p_reading_feedback_only=1.0)
    gold_gaps, wrong_gaps = [], []
    for _ in range(8):
        task = sample_task(rng)
        prompt = code_prompt(task)
        reading, _ = make_code_reading_episode(task, rng, config)  # feedback alone: the failed test
        op = re.search(r" ([-+*/]) ", task.expression)
        wrong = code_reply(task.expression[: op.start(1)] + WRONG_OPERATOR[op.group(1)] + task.expression[op.end(1) :])
        for reply, gaps in ((reading[-1]["content"], gold_gaps), (wrong, wrong_gaps)):
            teacher = _logp(model, tok, [*reading[:2], {"role": "assistant", "content": reply}]).sum()
            student = _logp(model, tok, [*prompt, {"role": "assistant", "content": reply}]).sum()
            gaps.append(float(teacher - student))
    # Shown the failed test, the model is surer of the reference than without it and less sure of a
    # wrong expression: the signal SDPO's teacher gives on a failure. (tiny-reader, never trained on
    # code, fails this: the prompt's code makes it surer of the wrong expression too.)
    assert min(gold_gaps) > 0.0 and sum(gold_gaps) / len(gold_gaps) > 1.0, gold_gaps
    assert sum(g < 0 for g in wrong_gaps) >= 6 and sum(wrong_gaps) / len(wrong_gaps) < -2.0, wrong_gaps
