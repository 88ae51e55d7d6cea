"""SDPO's teacher prompt at the message level: default templates, an attempt as text, the reprompt.

These live on the agents floor (below both the learners and the models) because two places
must write the very same teacher prompt: SDPO's teacher (:mod:`treerl.learners.teacher_context`)
and the tiny model's *reading* examples (:mod:`treerl.models.train_tiny`), which teach the
model to copy what such a prompt shows. Sharing the text keeps them from drifting apart.

>>> attempt = [{"role": "assistant", "content": "<tool_call>x</tool_call>"},
...            {"role": "tool", "name": "calculator", "content": "7"},
...            {"role": "assistant", "content": "The answer is 7."}]
>>> print(attempt_text(attempt))
<tool_call>x</tool_call>
[calculator result] 7
The answer is 7.
>>> reprompt_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}], "A", None,
...                   reprompt_template="{prompt}|{solution}|{feedback}", solution_template="sol={successful_previous_attempt}")
[{'role': 'system', 'content': 'S'}, {'role': 'user', 'content': 'Q?|sol=A|'}]
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["REPROMPT_TEMPLATE", "SOLUTION_TEMPLATE", "FEEDBACK_TEMPLATE", "attempt_text", "reprompt_messages",
           "message_text"]

# TRL's SDPOTrainer defaults, so that a teacher prompt reads the same in both.
REPROMPT_TEMPLATE = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
SOLUTION_TEMPLATE = "\nCorrect solution:\n\n{successful_previous_attempt}\n\n"
FEEDBACK_TEMPLATE = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n"

_THINKING = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def message_text(content: Any) -> str:
    """A message's text: a string as is, the text parts of a content list joined, None as empty."""
    if isinstance(content, list):  # content parts: keep the text ones
        return " ".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return "" if content is None else str(content)


def attempt_text(messages: Sequence[Mapping[str, Any]], *, remove_thinking: bool = False) -> str:
    """An attempt (the messages after the prompt) as one text: assistant turns verbatim, other turns marked."""
    lines = []
    for message in messages:
        role, text = message.get("role"), message_text(message.get("content"))
        if role == "assistant":
            lines.append(_THINKING.sub("", text).strip() if remove_thinking else text)
        elif role == "tool":
            lines.append(f"[{message.get('name') or 'tool'} result] {text}")
        else:
            lines.append(f"[{role}] {text}")
    return "\n".join(lines)


def reprompt_messages(prompt_messages: Sequence[Mapping[str, Any]], solution: str | None, feedback: str | None, *,
                      reprompt_template: str = REPROMPT_TEMPLATE, solution_template: str = SOLUTION_TEMPLATE,
                      feedback_template: str = FEEDBACK_TEMPLATE) -> list[dict[str, Any]]:
    """The prompt with its last user turn replaced by the reprompt (every other message kept)."""
    solution_part = solution_template.format(successful_previous_attempt=solution) if solution is not None else ""
    feedback_part = feedback_template.format(feedback_raw=feedback) if feedback is not None else ""
    messages = [dict(m) for m in prompt_messages]
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    prompt = "" if last_user is None else message_text(messages[last_user].get("content"))
    reprompt = {"role": "user", "content": reprompt_template.format(prompt=prompt, solution=solution_part,
                                                                    feedback=feedback_part)}
    if last_user is None:
        return [*messages, reprompt]
    messages[last_user] = reprompt
    return messages
