"""Measuring the tiny model's success rate the way the Calculator environment does, without the engine.

:mod:`treerl.models.train_tiny` reports the base success rate of the model it trained with
:func:`run_episodes` (the models floor sits below the rollout engine, so it plays the
episodes itself: sample, run the tool, sample the answer, grade it with math-verify).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import torch

from treerl.envs.builtin.calculator_tasks import SYSTEM_PROMPT, CalculatorTask, calculator, evaluate_expression

__all__ = ["run_episodes", "run_code_episodes"]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SOLVE = re.compile(r"```python\ndef solve\(\):\n    return ([^\n]*)\n```$")


def _tool_message(text: str) -> str | None:
    """The tool message for an assistant turn's calls, or None when the turn has no call."""
    calls = _TOOL_CALL.findall(text)
    if not calls:
        return None
    try:
        call = json.loads(calls[0])
        if call.get("name") != "calculator":
            return f"Error: unknown tool {call.get('name')!r}"
        return calculator(call["arguments"]["expression"])
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return f"Error: {error}"


def _is_correct(final_text: str, answer: str) -> bool:
    from math_verify import parse, verify

    return bool(verify(parse(f"${answer}$"), parse(final_text)))


@torch.no_grad()
def run_episodes(
    model, tokenizer, tasks: Sequence[CalculatorTask], tools: list[dict], *, temperature: float = 1.0,
    max_turns: int = 4, max_new_tokens: int = 64, batch_size: int = 64,
) -> list[tuple[list[dict], bool]]:  # fmt: skip
    """Play Calculator episodes by sampling (as the environment does) and score them.

    Each turn samples from the full distribution at ``temperature`` until ``<|im_end|>``; a
    turn with a tool call gets the tool's result (or error) and another turn, up to
    ``max_turns``; a turn without one is the final answer, checked with math-verify.
    """
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    results: list[tuple[list[dict], bool]] = []
    for first in range(0, len(tasks), batch_size):
        chunk = tasks[first : first + batch_size]
        conversations = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": t.question}] for t in chunk]
        correct = [False] * len(chunk)
        active = list(range(len(chunk)))
        for _turn in range(max_turns):
            if not active:
                break
            prompts = [tokenizer.apply_chat_template(conversations[i], tools=tools, tokenize=False,
                                                     add_generation_prompt=True) for i in active]  # fmt: skip
            batch = tokenizer(prompts, add_special_tokens=False, return_tensors="pt", padding=True, padding_side="left")
            output = model.generate(
                **batch, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            still_active = []
            for row, i in enumerate(active):
                new = output[row, batch["input_ids"].shape[1] :].tolist()
                text = tokenizer.decode([t for t in new if t not in eos_ids], skip_special_tokens=False)
                # The sampled text, calls included, becomes the turn's content verbatim, so
                # the next prompt is this prompt plus what was sampled plus template glue.
                conversations[i].append({"role": "assistant", "content": text})
                tool_content = _tool_message(text)
                if tool_content is None:
                    correct[i] = _is_correct(text, chunk[i].answer)
                    continue
                conversations[i].append({"role": "tool", "content": tool_content})
                still_active.append(i)
            active = still_active
        results.extend(zip(conversations, correct))
    return results


def _solves(reply: str, answer: str) -> bool:
    """Whether ``reply`` is a ``solve()`` returning an expression worth ``answer``.

    The same verdict as CodeSandbox's hidden test for the replies the tiny coder writes (one
    ``return`` of an arithmetic expression), computed here without the sandbox.
    """
    match = _SOLVE.search(reply.strip())
    if match is None:
        return False
    try:
        return evaluate_expression(match.group(1)) == evaluate_expression(answer)
    except ValueError:
        return False


@torch.no_grad()
def run_code_episodes(
    model, tokenizer, prompts: Sequence[list[dict]], tasks: Sequence[CalculatorTask], tools: list[dict], *,
    temperature: float = 1.0, max_new_tokens: int = 64, batch_size: int = 64,
) -> list[tuple[list[dict], bool]]:  # fmt: skip
    """Sample one reply per word-problem code task (``prompts[i]`` poses ``tasks[i]``) and grade it."""
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    results: list[tuple[list[dict], bool]] = []
    for first in range(0, len(tasks), batch_size):
        chunk = list(range(first, min(first + batch_size, len(tasks))))
        texts = [tokenizer.apply_chat_template(prompts[i], tools=tools, tokenize=False, add_generation_prompt=True)
                 for i in chunk]
        batch = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True, padding_side="left")
        output = model.generate(
            **batch, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
            eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        for row, i in enumerate(chunk):
            new = output[row, batch["input_ids"].shape[1] :].tolist()
            reply = tokenizer.decode([t for t in new if t not in eos_ids], skip_special_tokens=False)
            results.append(([*prompts[i], {"role": "assistant", "content": reply}], _solves(reply, tasks[i].answer)))
    return results
