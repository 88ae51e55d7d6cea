"""Build and train treerl's shipped tiny model: tokenizer, chat template, Qwen3 weights.

    python -m treerl.models.train_tiny --out treerl/models/tiny --seed 0

Everything is generated here, from a seed, on a CPU, in a few minutes:

1. Supervised Calculator episodes (system prompt with the tool schema, question, one
   ``<tool_call>``, the ``tool`` result, ``The answer is \\boxed{N}.``). A fixed share of them
   are *deliberately imperfect* in three independent, token-level ways: the wrong operator
   for the word cue, the distractor number in place of an operand, and a question number
   copied into the final answer instead of the tool result. A model that fits this data puts
   real probability on each mistake at one token, so it starts at roughly 30% success at
   temperature 1.0 and RL has an obvious, learnable signal to fix.
2. A byte-level BPE (``tokenizers``) trained on the rendered episodes, with single-token
   ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ``<tool_call>``, ``</tool_call>``,
   ``<tool_response>``, ``</tool_response>``, and an append-only Hermes/Qwen chat template.
3. A Qwen3 model of about two million parameters trained on assistant tokens only.
4. The base success rate, measured like the environment does it: sample at temperature 1.0
   until ``<|im_end|>``, run the tool call, append the tool message, sample the answer,
   check the ``\\boxed{}`` value with math-verify.

With ``--p-reading P`` a share P of the supervised conversations are *reading* examples
(:func:`make_reading_episode`): the last user turn is SDPO's teacher prompt (the default
reprompt, solution and feedback templates of :mod:`treerl.agents.reprompt`) showing a
successful attempt at the same task and, for a share, the environment's feedback on a failed
one; the assistant turns copy what is shown. A pretrained LLM copies a demonstration in its
context; a model trained on Calculator episodes alone never saw one and does not, so SDPO's
teacher (the model reading that prompt) would have nothing to teach. The other examples keep
their deliberate imperfections, so the success without a demonstration stays near where it was
(tiny-reader: 25.0% over 256 held-out tasks in this script's evaluation, tiny: 18.0%).
``treerl/models/tiny-reader`` is the shipped ``tiny`` continued this way (16 minutes on the
loaded 2-core machine):

    python -m treerl.models.train_tiny --out treerl/models/tiny-reader --seed 0 --init-from treerl/models/tiny \\
        --p-reading 0.6 --steps 300 --lr 1e-3

With ``--task code`` the conversations are ``treerl/CodeSandbox-v0`` word problems instead
(``tasks="word-problems"``: write ``solve()``; the hidden test compares with the reference
expression): the reply is a fenced ``solve()`` returning the expression :func:`make_episode`
would have passed to the calculator, mistakes included, and the reading examples copy a
sibling's code or write the expression a failed test names (:func:`make_code_reading_episode`).
``treerl/models/tiny-coder`` is ``tiny-reader`` continued this way (15 minutes on 2 cores; base
success 25.8% over 256 held-out tasks):

    python -m treerl.models.train_tiny --task code --out treerl/models/tiny-coder --seed 0 \\
        --init-from treerl/models/tiny-reader --p-reading 0.6 --p-reading-feedback-only 0.4 \\
        --p-wrong-operator 0.7 --p-distractor 0.8 --steps 900 --lr 1e-3
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from treerl.agents.reprompt import attempt_text, reprompt_messages
from treerl.envs.builtin.calculator_tasks import SYSTEM_PROMPT, CalculatorTask, calculator, sample_task
from treerl.models.tiny_eval import run_code_episodes, run_episodes

__all__ = [
    "TrainTinyConfig",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TOOL_TOKENS",
    "WRONG_OPERATOR",
    "calculator_schema",
    "make_episode",
    "make_reading_episode",
    "make_code_episode",
    "make_code_reading_episode",
    "code_feedback",
    "code_prompt",
    "code_reply",
    "code_schema",
    "sampled_attempt",
    "tokenizer_free_render",
    "train_tokenizer",
    "save_tokenizer",
    "build_model",
    "encode_conversations",
    "shared_prefix_length",
    "train_model",
    "run_episodes",
    "main",
]


TASKS = ("calculator", "code")
"""What the tiny model is trained to do (``--task``)."""


@dataclass
class TrainTinyConfig:
    """How to build the shipped tiny model. Defaults are what ships."""

    out: str = "treerl/models/tiny"
    """Directory to write the model, tokenizer and generation config to."""
    seed: int = 0
    """Seeds python, numpy and torch; the same seed gives the same data order and weights."""
    threads: int = 2
    """torch CPU threads; fixed so that float reductions (and so the weights) are reproducible."""

    vocab_size: int = 1024
    """Byte-level BPE vocabulary size, special tokens included."""
    tokenizer_episodes: int = 4000
    """Rendered episodes the tokenizer is trained on."""

    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024

    steps: int = 900
    """Optimizer steps (each on ``batch_size`` freshly generated episodes)."""
    batch_size: int = 16
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warmup, cosine decay to a tenth)."""
    warmup_steps: int = 30
    weight_decay: float = 0.0

    p_wrong_operator: float = 0.35
    """Share of training episodes whose expression uses the confusable operator (see WRONG_OPERATOR)."""
    p_distractor: float = 0.4
    """Share of episodes *with a distractor number* whose expression uses it in place of an operand."""
    p_wrong_answer: float = 0.3
    """Share of episodes whose final ``\\boxed{}`` copies a question number instead of the tool result."""

    p_reading: float = 0.0
    """Share of training conversations that are reading examples (SDPO's teacher prompt, then a copy of what it
    shows); 0 builds the shipped ``tiny``, 0.5 ``tiny-reader``."""
    p_reading_feedback: float = 0.5
    """Share of reading examples whose prompt also shows the environment's feedback on a failed attempt."""
    p_reading_feedback_only: float = 0.2
    """Share of reading examples that show feedback alone (no demonstration): the answer is copied from the
    feedback, the tool call keeps the student's odds (nothing in the prompt says which call is right)."""
    p_reading_variant: float = 0.25
    """Share of demonstrations written in another correct form (the operands of ``a + b`` or ``a * b`` swapped),
    so that the copy must read the demonstration rather than recall the usual form."""

    task: str = "calculator"
    """``calculator`` (Calculator episodes with a tool call; ``tiny``, ``tiny-reader``) or ``code``
    (CodeSandbox word-problem tasks answered with a ``solve()`` function; ``tiny-coder``)."""

    init_from: str = ""
    """Continue from the model and tokenizer in this directory (e.g. ``treerl/models/tiny``) instead of a fresh
    tokenizer and model: the architecture flags are then ignored, and the token ids stay those of that model."""

    eval_episodes: int = 256
    """Held-out tasks for the base success rate at temperature 1.0."""
    eval_batch_size: int = 64
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("p_wrong_operator", "p_distractor", "p_wrong_answer"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value} is not a probability in [0, 1); set it to e.g. 0.3")
        for name in ("p_reading", "p_reading_feedback", "p_reading_feedback_only", "p_reading_variant"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} is not a probability in [0, 1]; set it to e.g. 0.5")
        positive = ("threads", "vocab_size", "tokenizer_episodes", "hidden_size", "intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "steps",
                    "batch_size", "eval_batch_size", "max_new_tokens", "max_position_embeddings")  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r} is not one of {TASKS}")
        if self.eval_episodes < 0 or self.warmup_steps < 0:
            raise ValueError("eval_episodes and warmup_steps must be >= 0 (0 skips the evaluation / warmup)")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}; "
                "pick a head count that divides it"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide num_attention_heads="
                f"{self.num_attention_heads} (grouped-query attention)"
            )
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size={self.vocab_size} is below the 256 bytes plus special tokens; use >= 512")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive, e.g. 3e-3")


# --- tokens and template ------------------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Control tokens: pad (and end of document), turn start, turn end (the chat eos)."""
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Single tokens but not "special": decoding keeps them, so parsers can see them (as in Qwen)."""

# Hermes / Qwen2.5 style, append-only: a conversation renders as the rendering of any prefix
# of it followed by more text, and the generation prompt is exactly how an assistant turn
# starts. Tools go compactly into the system turn, one JSON object per line.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = none %}{%- set rest = messages %}{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif system is not none %}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{{- message.content | tojson }}{%- endif %}"
    "{{- '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'system' %}"
    "{{- raise_exception('A system message is only allowed first.') }}"
    "{%- else %}"
    "{{- raise_exception('Unknown role ' + message.role + '; use system, user, assistant or tool.') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer pattern: digits one by one (so copying a number is copying digits),
# newlines apart from the letters that follow them (so turn boundaries never merge).
_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def calculator_schema() -> dict[str, Any]:
    """The OpenAI-style schema of :func:`calculator`, exactly as the environment offers it.

    Taken from treerl's ``@tool`` when available so that training data and environment agree
    token for token; the literal below is the same schema written out.
    """
    try:
        from treerl.envs.tools import tool
    except ImportError:
        pass
    else:
        return tool(calculator).schema
    return {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": 'Arithmetic using numbers, + - * / and parentheses, e.g. "(3 + 4) * 2".',
                    }
                },
                "required": ["expression"],
                "additionalProperties": False,
            },
        },
    }


# --- episodes -----------------------------------------------------------------------------

WRONG_OPERATOR = {"+": "-", "-": "+", "*": "+", "/": "-"}
"""The operator a confused model writes instead of the right one for the cue."""

_NUMBER = re.compile(r"\d+")
_OPERATOR = re.compile(r" ([-+*/]) ")


def make_episode(
    task: CalculatorTask, rng: np.random.Generator, config: TrainTinyConfig
) -> tuple[list[dict[str, Any]], bool]:
    """One supervised Calculator conversation for ``task``, imperfect with the config's odds.

    Returns the messages (OpenAI/transformers format) and whether the final answer is right.
    The three mistakes are independent choices at single tokens: an operator, an operand, a
    number in ``\\boxed{}``. Everything else (the call format, copying the tool result) is
    always done right, so the model learns the format perfectly and the mistakes as odds.

    >>> task = CalculatorTask("Ana has 12 apples and buys 7 more. How many?", "12 + 7", "19")
    >>> messages, correct = make_episode(task, np.random.default_rng(0), TrainTinyConfig(p_wrong_operator=0.0,
    ...     p_distractor=0.0, p_wrong_answer=0.0))
    >>> messages[2]["tool_calls"][0]["function"]["arguments"], messages[3]["content"], messages[4]["content"], correct
    ({'expression': '12 + 7'}, '19', 'The answer is \\\\boxed{19}.', True)
    """
    expression = task.expression
    # Draw all three coins every time so the random stream does not depend on the outcomes.
    wrong_op, use_distractor, wrong_answer = rng.random(3) < (
        config.p_wrong_operator,
        config.p_distractor,
        config.p_wrong_answer,
    )
    op_pick, operand_pick, answer_pick = rng.integers(1 << 30, size=3)

    if wrong_op:
        ops = list(_OPERATOR.finditer(expression))
        m = ops[op_pick % len(ops)]
        expression = expression[: m.start(1)] + WRONG_OPERATOR[m.group(1)] + expression[m.end(1) :]
    question_numbers = _NUMBER.findall(task.question)
    operands = list(_NUMBER.finditer(expression))
    distractors = [n for n in question_numbers if n not in {m.group() for m in operands}]
    if use_distractor and distractors:
        m = operands[operand_pick % len(operands)]
        expression = expression[: m.start()] + distractors[0] + expression[m.end() :]

    result = calculator(expression)
    boxed = question_numbers[answer_pick % len(question_numbers)] if wrong_answer else result
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.question},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
            ],
        },
        {"role": "tool", "content": result},
        {"role": "assistant", "content": f"The answer is \\boxed{{{boxed}}}."},
    ]
    return messages, boxed == task.answer


_PERFECT = {"p_wrong_operator": 0.0, "p_distractor": 0.0, "p_wrong_answer": 0.0}
_SWAPPABLE = re.compile(r"^(\d+) ([+*]) (\d+)$")


def sampled_attempt(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The attempt (messages after the prompt) as a rollout records it: each assistant turn's content is the text
    the model samples (its tool calls rendered by :data:`CHAT_TEMPLATE`), each tool message names its tool.

    >>> call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
    >>> sampled_attempt([{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "5"}])
    [{'role': 'assistant', 'content': '<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\\n</tool_call>'}, {'role': 'tool', 'content': '5', 'name': 'calculator'}]
    """
    out = []
    for message in messages:
        if message["role"] == "assistant":
            rendered = tokenizer_free_render([message], [])
            start, end = "<|im_start|>assistant\n", "<|im_end|>\n"
            assert rendered.startswith(start) and rendered.endswith(end), rendered
            out.append({"role": "assistant", "content": rendered[len(start) : -len(end)]})
        elif message["role"] == "tool":
            out.append({**message, "name": "calculator"})
        else:
            out.append(dict(message))
    return out


def make_reading_episode(task: CalculatorTask, rng: np.random.Generator, config: TrainTinyConfig,
                         answer_feedback: Any) -> tuple[list[dict[str, Any]], str]:  # fmt: skip
    """A reading example for ``task``: SDPO's teacher prompt, then the episode that copies what it shows.

    The prompt is the student's (system turn, question) with the question replaced by
    :func:`~treerl.agents.reprompt.reprompt_messages` around a correct attempt at the same task
    (as :func:`~treerl.agents.reprompt.attempt_text` writes a sibling's rollout) and/or the
    environment's feedback on a failed attempt (``answer_feedback(task, completion)``, the
    environment's own words). With a demonstration the assistant turns are the demonstration
    itself; with feedback alone they keep the student's odds on the call and box the answer
    the feedback names. Returns the messages and the kind (``demo``, ``demo+feedback``,
    ``feedback``).
    """
    feedback_only, with_feedback, variant = rng.random(3) < (
        config.p_reading_feedback_only, config.p_reading_feedback, config.p_reading_variant)
    swap = _SWAPPABLE.match(task.expression)
    shown = task
    if variant and swap:
        shown = dataclasses.replace(task, expression=f"{swap.group(3)} {swap.group(2)} {swap.group(1)}")
    demo, _ = make_episode(shown, rng, dataclasses.replace(config, **_PERFECT))
    feedback = None
    if feedback_only or with_feedback:
        # A failed attempt of the student's kind: more mistakes than usual so few draws are needed.
        failing = dataclasses.replace(config, p_wrong_operator=0.5, p_wrong_answer=0.5)
        for _ in range(1000):
            failed, correct = make_episode(task, rng, failing)
            if not correct:
                break
        feedback = answer_feedback(task, failed[-1]["content"])
    if feedback_only:
        target, _ = make_episode(task, rng, config)
        target[-1] = {"role": "assistant", "content": f"The answer is \\boxed{{{task.answer}}}."}
        solution, kind = None, "feedback"
    else:
        target = demo
        solution, kind = attempt_text(sampled_attempt(demo[2:])), "demo+feedback" if feedback else "demo"
    return [*reprompt_messages(demo[:2], solution, feedback), *target[2:]], kind


def calculator_feedback():
    """``(task, completion) -> feedback``: the Calculator environment's gold check on a wrong final answer."""
    from treerl.envs.builtin.calculator import CalculatorEnv
    from treerl.envs.core import Task

    env = CalculatorEnv()
    return lambda task, completion: env.answer_feedback(Task(prompt=task.question, answer=task.answer), completion, 0.0)


# --- code episodes (``--task code``: CodeSandbox word problems, ``tiny-coder``) ---------------


def code_reply(expression: str) -> str:
    """The final answer to a word-problem code task: a ``solve()`` returning ``expression`` in a fenced block."""
    return f"```python\ndef solve():\n    return {expression}\n```"


def code_prompt(task: CalculatorTask) -> list[dict[str, Any]]:
    """The student's prompt for ``task`` as ``treerl/CodeSandbox-v0`` with ``tasks="word-problems"`` poses it."""
    from treerl.envs.builtin.code_sandbox import WORD_PROBLEM_PROMPT, CodeSandboxEnv

    return [{"role": "system", "content": CodeSandboxEnv.system_prompt},
            {"role": "user", "content": WORD_PROBLEM_PROMPT.format(question=task.question)}]


def code_schema() -> dict[str, Any]:
    """The ``run_python`` tool's schema exactly as CodeSandbox offers it."""
    from treerl.envs.builtin.code_sandbox import make_run_python_tool
    from treerl.envs.sandbox import SandboxLimits

    return make_run_python_tool(SandboxLimits()).schema


def make_code_episode(task: CalculatorTask, rng: np.random.Generator,
                      config: TrainTinyConfig) -> tuple[list[dict[str, Any]], bool]:  # fmt: skip
    """One supervised code conversation: the prompt, then ``solve()`` returning an imperfect expression.

    The expression is the one :func:`make_episode` would pass to the calculator (the same operator
    and operand mistakes at the config's odds); it is right when it evaluates to the answer, which
    is what the hidden test ``assert solve() == <reference expression>`` checks.

    >>> task = CalculatorTask("Ana has 12 apples and buys 7 more. How many?", "12 + 7", "19")
    >>> messages, correct = make_code_episode(task, np.random.default_rng(0), TrainTinyConfig(**_PERFECT))
    >>> print(messages[-1]["content"]); correct
    ```python
    def solve():
        return 12 + 7
    ```
    True
    """
    calculator_messages, _ = make_episode(task, rng, config)
    expression = calculator_messages[2]["tool_calls"][0]["function"]["arguments"]["expression"]
    return [*code_prompt(task), {"role": "assistant", "content": code_reply(expression)}], calculator(expression) == task.answer


def code_feedback(task: CalculatorTask) -> str:
    """CodeSandbox's feedback on a wrong ``solve()`` for ``task``: the hidden test, which names the reference."""
    from treerl.envs.builtin.code_sandbox import unit_test_feedback
    from treerl.envs.verifiers import UnitTestReport

    return unit_test_feedback([f"assert solve() == {task.expression}"], UnitTestReport([False], ["AssertionError"]))


def make_code_reading_episode(task: CalculatorTask, rng: np.random.Generator,
                              config: TrainTinyConfig) -> tuple[list[dict[str, Any]], str]:  # fmt: skip
    """A reading example for a code task: SDPO's teacher prompt, then the reply that uses what it shows.

    As :func:`make_reading_episode`: a demonstration (a correct sibling's reply, for a share with its
    operands swapped), and/or the environment's feedback on a failed attempt. The failed test names
    the reference expression, so with feedback alone the reply writes that expression; with a
    demonstration it copies the demonstration. Returns the messages and the kind.
    """
    feedback_only, with_feedback, variant = rng.random(3) < (
        config.p_reading_feedback_only, config.p_reading_feedback, config.p_reading_variant)
    swap = _SWAPPABLE.match(task.expression)
    shown = f"{swap.group(3)} {swap.group(2)} {swap.group(1)}" if variant and swap else task.expression
    feedback = code_feedback(task) if feedback_only or with_feedback else None
    prompt = code_prompt(task)
    if feedback_only:
        return [*reprompt_messages(prompt, None, feedback), {"role": "assistant", "content": code_reply(task.expression)}], "feedback"
    reply = code_reply(shown)
    kind = "demo+feedback" if feedback else "demo"
    return [*reprompt_messages(prompt, reply, feedback), {"role": "assistant", "content": reply}], kind


def _episodes(rng: np.random.Generator, n: int, config: TrainTinyConfig) -> tuple[list[list[dict]], float]:
    """``n`` conversations (a share ``p_reading`` of them reading examples) and the share of student ones that
    are right."""
    conversations, num_correct, num_student = [], 0, 0
    code = config.task == "code"
    answer_feedback = calculator_feedback() if config.p_reading and not code else None
    for _ in range(n):
        task = sample_task(rng)
        if config.p_reading and rng.random() < config.p_reading:
            if code:
                conversations.append(make_code_reading_episode(task, rng, config)[0])
            else:
                conversations.append(make_reading_episode(task, rng, config, answer_feedback)[0])
            continue
        messages, correct = (make_code_episode if code else make_episode)(task, rng, config)
        conversations.append(messages)
        num_correct += correct
        num_student += 1
    return conversations, num_correct / max(num_student, 1)


# --- tokenizer ----------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE trained on ``texts``, wrapped as a transformers fast tokenizer.

    Special and tool tokens are cut out of the training text (they are added whole
    afterwards), so the BPE spends its vocabulary on words, digits and JSON glue.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    cut = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TOKENS))
    tokenizer.train_from_iterator((piece for text in texts for piece in cut.split(text)), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
        padding_side="left",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def save_tokenizer(tokenizer, out: Path) -> None:
    """``save_pretrained``, naming the class every transformers release can load.

    transformers 5 writes its own backend class name, which 4.x cannot resolve;
    ``PreTrainedTokenizerFast`` loads the same ``tokenizer.json`` in both.
    """
    tokenizer.save_pretrained(out)
    config_path = Path(out) / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


def tokenizer_free_render(messages: list[dict], tools: list[dict]) -> str:
    """Render ``messages`` with :data:`CHAT_TEMPLATE` before any tokenizer exists."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=CHAT_TEMPLATE)
    return rendered[0]


# --- model --------------------------------------------------------------------------------


def build_model(tokenizer, config: TrainTinyConfig):
    """A freshly initialized Qwen3 causal LM sized by ``config`` (tied embeddings, GQA)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(model_config)


def encode_conversations(
    tokenizer, conversations: Sequence[list[dict]], tools: list[dict]
) -> list[tuple[list[int], list[bool]]]:
    """Token ids of each rendered conversation and, per token, whether it is trained on.

    Trained tokens are exactly what the policy samples: an assistant turn's text after
    ``<|im_start|>assistant\\n`` up to and including ``<|im_end|>``. The template's pieces are
    pre-token boundaries, so offsets map each token to one side of a span edge.
    """
    texts = [tokenizer.apply_chat_template(c, tools=tools, tokenize=False) for c in conversations]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    start_tag, end_tag = "<|im_start|>assistant\n", "<|im_end|>"
    out = []
    for text, ids, offsets in zip(texts, encoded["input_ids"], encoded["offset_mapping"]):
        spans, pos = [], 0
        while (start := text.find(start_tag, pos)) != -1:
            end = text.index(end_tag, start) + len(end_tag)
            spans.append((start + len(start_tag), end))
            pos = end
        mask = [any(lo <= a and b <= hi for lo, hi in spans) and b > a for a, b in offsets]
        out.append((ids, mask))
    return out


def shared_prefix_length(examples: Sequence[tuple[list[int], list[bool]]]) -> int:
    """How many leading tokens all examples share (the system turn with the tool schema)."""
    first = examples[0][0]
    length = min(len(ids) for ids, _ in examples)
    for pos in range(length):
        if any(ids[pos] != first[pos] for ids, _ in examples):
            return pos
    return length


def _batch(examples: Sequence[tuple[list[int], list[bool]]], pad_id: int, prefix_len: int) -> dict[str, torch.Tensor]:
    """The shared prefix once, plus the right-padded suffixes with their labels."""
    if any(any(mask[:prefix_len]) for _, mask in examples):
        raise AssertionError("a trained token lies in the shared prefix; the prefix split would drop its loss")
    length = max(len(ids) for ids, _ in examples) - prefix_len
    input_ids = torch.full((len(examples), length), pad_id)  # (B, S)
    labels = torch.full((len(examples), length), -100)  # (B, S)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)  # (B, S)
    for row, (ids, mask) in enumerate(examples):
        ids_t, mask_t = torch.tensor(ids[prefix_len:]), torch.tensor(mask[prefix_len:])
        input_ids[row, : len(ids_t)] = ids_t
        attention_mask[row, : len(ids_t)] = 1
        labels[row, : len(ids_t)] = torch.where(mask_t, ids_t, -100)
    prefix_ids = torch.tensor([examples[0][0][:prefix_len]])  # (1, P)
    return {"prefix_ids": prefix_ids, "input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token loss on labelled tokens; the shared prefix is run once, not per row.

    Every episode starts with the same ~110-token system turn, more than half of its length.
    Running it once with a cache that is then repeated over the batch gives the same logits
    and gradients (the repeat sums them back) at about half the cost.
    """
    prefix_ids, input_ids = batch["prefix_ids"], batch["input_ids"]  # (1, P), (B, S)
    (num_rows, suffix_len), prefix_len = input_ids.shape, prefix_ids.shape[1]
    prefix_out = model(input_ids=prefix_ids, use_cache=True)
    # transformers 5 renamed past_key_values to cache; 4.x silently ignores unknown kwargs.
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = getattr(prefix_out, cache_name)
    cache.batch_repeat_interleave(num_rows)
    attention_mask = torch.cat([torch.ones(num_rows, prefix_len, dtype=torch.long), batch["attention_mask"]], 1)
    position_ids = torch.arange(prefix_len, prefix_len + suffix_len).expand(num_rows, -1)  # (B, S)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **{cache_name: cache}
    ).logits  # (B, S, V)
    # The suffix's first token is predicted from the prefix's last position; it is never a
    # trained token (it starts the user's question), so shifting inside the suffix suffices.
    labels = batch["labels"][:, 1:]  # (B, S-1)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)


def train_model(model, batches: Sequence[dict[str, torch.Tensor]], config: TrainTinyConfig, log_every: int = 25) -> None:
    """AdamW on assistant tokens; linear warmup then cosine decay to a tenth of ``lr``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)

    def lr_factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, len(batches) - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    start = time.perf_counter()
    for step, batch in enumerate(batches):
        loss = _loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == len(batches) - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}  "
                  f"{time.perf_counter() - start:6.1f}s", flush=True)  # fmt: skip
    model.eval()


# --- entry point --------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> TrainTinyConfig:
    parser = argparse.ArgumentParser(prog="python -m treerl.models.train_tiny", description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(TrainTinyConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(f.default), default=f.default)
    return TrainTinyConfig(**vars(parser.parse_args(argv)))


def main(argv: Sequence[str] | None = None) -> float:
    """Build, train, save and evaluate the tiny model; returns the base success rate."""
    from transformers import GenerationConfig

    config = _parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(config.threads)
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    # Separate streams so that changing one stage's size leaves the others' data unchanged.
    tok_rng, train_rng, eval_rng = (np.random.default_rng([config.seed, i]) for i in range(3))
    tools = [code_schema() if config.task == "code" else calculator_schema()]

    if config.init_from:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.init_from, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(config.init_from, local_files_only=True, dtype="float32")
    else:
        # The tokenizer sees student episodes only, so reading examples leave it (and every token id) unchanged.
        tok_conversations, _ = _episodes(tok_rng, config.tokenizer_episodes, dataclasses.replace(config, p_reading=0))
        tokenizer = train_tokenizer([tokenizer_free_render(c, tools) for c in tok_conversations], config.vocab_size)
        model = build_model(tokenizer, config)
    conversations, share_correct = _episodes(train_rng, config.steps * config.batch_size, config)
    examples = encode_conversations(tokenizer, conversations, tools)
    lengths = [len(ids) for ids, _ in examples]
    print(f"data: {len(examples)} episodes ({config.p_reading:.0%} reading), {share_correct:.1%} of student ones "
          "fully correct, "
          f"tokens per episode mean {np.mean(lengths):.0f} max {max(lengths)}; "
          f"vocab {len(tokenizer)}; {time.perf_counter() - t0:.1f}s", flush=True)  # fmt: skip
    prefix_len = shared_prefix_length(examples)
    batches = [
        _batch(examples[i : i + config.batch_size], tokenizer.pad_token_id, prefix_len)
        for i in range(0, len(examples), config.batch_size)
    ]

    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    train_model(model, batches, config)
    print(f"trained in {time.perf_counter() - t0:.1f}s", flush=True)

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0, top_p=1.0
    )
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    print(f"saved to {out}", flush=True)

    rate = float("nan")
    if config.eval_episodes:
        tasks = [sample_task(eval_rng) for _ in range(config.eval_episodes)]
        if config.task == "code":
            results = run_code_episodes(model, tokenizer, [code_prompt(t) for t in tasks], tasks, tools,
                                        batch_size=config.eval_batch_size)  # fmt: skip
        else:
            results = run_episodes(model, tokenizer, tasks, tools, batch_size=config.eval_batch_size,
                                   max_new_tokens=config.max_new_tokens)  # fmt: skip
        rate = sum(ok for _, ok in results) / len(results)
        print(f"base success rate at temperature 1.0 on {len(results)} held-out tasks: {rate:.1%} "
              f"(a perfect fit of the data would give about {share_correct:.1%})", flush=True)  # fmt: skip
    print(f"total elapsed {time.perf_counter() - t0:.1f}s", flush=True)
    return rate


if __name__ == "__main__":
    main(sys.argv[1:])
