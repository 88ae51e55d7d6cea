"""Chat template variants: the model's own, or treerl's variant of its family for training.

Several families' templates rewrite the history as a conversation grows: Qwen3, Qwen3.5,
GLM-4 MoE and Nemotron 3 drop the reasoning of turns before the last user query, DeepSeek-R1
drops every earlier turn's reasoning, gpt-oss drops the analysis of tool-calling turns once a
final answer follows. The rendered conversation then no longer starts with the tokens the
model saw, and :class:`~treerl.agents.chat.ChatRenderer` starts a new branch (faithful, but
the branches share nothing, so a tree packs no better than separate sequences).

A **training variant** renders every turn as the model sampled it: the reasoning is kept
wherever it was written. Played with it, episodes of these families extend their context at
every turn. The trade-off: the model sees its earlier reasoning in later turns, which its
own template would have hidden (longer contexts, and a context the model was not tuned on
after a new user turn); inference servers that use the model's own template will show the
trained model a different history than the one it was trained on. Templates that are
already append-only have no variant: ``training`` keeps them.

A **tool-use variant** serves a family whose template has no tool role (Gemma 3 and Phi-3.5
ignore ``tools`` and refuse or drop ``tool`` messages, so in a tool-use episode the model
never sees the schemas, and the first tool call ends the episode or its result is lost):
it lists the schemas in the first turn with an instruction for a call format a treerl
parser reads (the one :func:`~treerl.envs.parsers.get_parser` picks from that template),
writes structured ``tool_calls`` in that format, and gives each result back as a user turn
inside ``<tool_response>`` tags, append-only, as vLLM's tool-use templates passed with
``--chat-template`` do. Without tools it renders what the model's own template renders
(Gemma's writes an assistant turn untrimmed, as sampled). For these families ``training``
picks it: their own templates are append-only already, and cannot play a tool-use episode.

The variants are this package's ``templates/<family>_training.jinja`` and
``templates/<family>_tools.jinja``, each derived from the model's own template (its header
names the source, the license and the changes; the training idea follows TRL's ``*_training``
templates). :func:`resolve_chat_template` picks one by flag:

>>> resolve_chat_template("model", None) is None
True
>>> sorted(TRAINING_TEMPLATES)[:2]
['deepseek_r1_training', 'glm4_moe_training']
>>> sorted(TOOL_TEMPLATES)
['gemma3_tools', 'phi3_5_tools']
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["TRAINING_TEMPLATES", "TOOL_TEMPLATES", "SHIPPED_TEMPLATES", "KNOWN_TEMPLATES", "load_template",
           "mark_chat_template", "resolve_chat_template", "template_family", "template_gaps", "training_variant",
           "warn_about_template"]

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent / "templates"

SHIPPED_TEMPLATES: dict[str, str] = {p.stem: p.name for p in sorted(_DIR.glob("*.jinja"))}
"""Shipped template names -> files (``treerl/agents/templates``): what ``--chat-template NAME`` takes."""

TRAINING_TEMPLATES: dict[str, str] = {k: v for k, v in SHIPPED_TEMPLATES.items() if k.endswith("_training")}
"""The prefix-preserving training variants, by name."""

TOOL_TEMPLATES: dict[str, str] = {k: v for k, v in SHIPPED_TEMPLATES.items() if k.endswith("_tools")}
"""The tool-use variants of families whose template has no tool role, by name."""

KNOWN_TEMPLATES: dict[str, str] = {
    # sha256 of the template as the model ships it -> its family (tests/templates/real holds each text).
    "563b1ce7d61d50a9b4c7439a912a1116f095b712df5b5e4d3e1116049874eb64": "deepseek_r1",
    "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4": "gemma3",
    "44f815868bf02fa458dd2f741a338046f4bf45f398eb6d067766726b9d96cce3": "glm4_moe",
    "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146": "gpt_oss",
    "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65": "llama3_1",
    "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4": "llama3_2",
    "9951bf3cc3ad2c187223b2083dea106d46c50c3c84fecc4e6fda82832dbb6a9b": "mistral",
    "ab7813c3abdd9cb655905a410728b26c7884eca45ddfab8d9f931553485a7862": "nemotron3_nano",
    "78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90": "phi3_5",
    "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f": "qwen2_5",
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": "qwen3",
    "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715": "qwen3_5",
}
"""The model templates treerl recognizes, by the sha256 of their text."""


def template_family(template: str | None) -> str | None:
    """The family of a model's own chat template (None when treerl does not know it)."""
    if not isinstance(template, str):
        return None
    return KNOWN_TEMPLATES.get(hashlib.sha256(template.encode()).hexdigest())


def load_template(name: str) -> str:
    """The text of a shipped template, e.g. ``load_template("qwen3_training")``."""
    if name not in SHIPPED_TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}: treerl ships {sorted(SHIPPED_TEMPLATES)}; pass one of "
                         "them, 'model', 'training', or the path of a .jinja file.")
    return (_DIR / SHIPPED_TEMPLATES[name]).read_text(encoding="utf-8")


def training_variant(family: str | None) -> str | None:
    """The name of the template ``--chat-template training`` picks for ``family``: its training
    variant, else its tool-use variant, else None (the model's own is kept).

    >>> training_variant("qwen3"), training_variant("gemma3"), training_variant("qwen2_5")
    ('qwen3_training', 'gemma3_tools', None)
    """
    names = [f"{family}_training", f"{family}_tools"] if family is not None else []
    return next((name for name in names if name in SHIPPED_TEMPLATES), None)


_APPLIED = "treerl_chat_template"  # the spec a tokenizer's own template already carries


def mark_chat_template(tokenizer: Any, spec: str | None) -> None:
    """Record that ``tokenizer``'s own template is already the one ``spec`` chooses (after
    ``EpisodeOptions.apply_chat_template``), so that resolving ``spec`` again gives None
    (the tokenizer's own, template variables included) instead of the bare file."""
    setattr(tokenizer, _APPLIED, spec)


def resolve_chat_template(spec: str | None, tokenizer: Any) -> str | None:
    """The template text for ``spec``, or None for the tokenizer's own.

    ``spec``: ``None`` or ``"model"`` (the tokenizer's own), ``"training"`` (the variant of
    the tokenizer's family when there is one, :func:`training_variant`, else its own), a shipped
    name such as ``"qwen3_training"`` or ``"gemma3_tools"``, or the path of a ``.jinja`` file.
    """
    if spec is None or spec == "model" or getattr(tokenizer, _APPLIED, None) == spec:
        return None
    if spec == "training":
        family = template_family(getattr(tokenizer, "chat_template", None))
        name = training_variant(family)
        if name is None:
            logger.info("chat template: no training variant for %s; the model's own template is used",
                        family or "this (unrecognized) template")
            return None
        return load_template(name)
    if spec.endswith(".jinja"):
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"chat template file {spec!r} does not exist; pass an existing .jinja file, 'model', "
                             "'training' or a shipped name.")
        return path.read_text(encoding="utf-8")
    return load_template(spec)


# -- what a template leaves out ------------------------------------------------------------

_PROBE = "treerl-probe-result-8d1f"  # a tool result no template writes by itself
_PROBE_ID = "probe1234"  # 9 alphanumerics: Mistral's templates refuse other ids


def template_gaps(tokenizer: Any, tool_schemas: list[dict[str, Any]], chat_template: str | None = None) -> list[str]:
    """What the chat template (``chat_template``, else the tokenizer's own) keeps from the model
    in a tool-use episode, in words; empty when it renders both the tool schemas and the tool
    results. Checked by rendering a tiny conversation: the prompt with and without ``tools``, and
    a tool call with its result (as a structured call and as plain text; the first form the
    template renders decides). When treerl ships a tool-use variant of the template's family, the
    warnings name it as the fix.
    """
    if not tool_schemas:
        return []
    family = template_family(chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None))
    fix = (f"pass --chat-template {family}_tools (treerl's tool-use variant of this family's template, which renders "
           "the schemas and the results; --chat-template training picks it too)."
           if f"{family}_tools" in TOOL_TEMPLATES else None)

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=True)

    gaps = []
    user = {"role": "user", "content": "hi"}
    if render([user], None) == render([user], tool_schemas):
        gaps.append(f"the chat template ignores `tools`: the schemas of the environment's {len(tool_schemas)} tool(s) "
                    "never reach the prompt, so the model cannot know them; " + (fix or "pass --chat-template with a "
                    "template that renders tools (e.g. the model family's tool-use template)."))
    name = tool_schemas[0].get("function", tool_schemas[0]).get("name", "tool")
    result = {"role": "tool", "name": name, "tool_call_id": _PROBE_ID, "content": _PROBE}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": _PROBE_ID, "type": "function", "function": {"name": name, "arguments": {}}}]}
    errors = []
    for turn in (call, {"role": "assistant", "content": "I call a tool."}):
        try:
            text = render([user, turn, result], tool_schemas)
        except Exception as exc:  # noqa: BLE001 - a template refusing this form: try the next
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if _PROBE not in text:
            gaps.append("the chat template drops `tool` messages: the results of the model's tool calls never reach "
                        "its next turn; " + (fix or "pass --chat-template with a template that renders tool results "
                        "(role `tool`)."))
        return gaps
    gaps.append(f"the chat template cannot render a tool result ({errors[0]}): episodes will end at their first "
                "tool call (termination render_error); " + (fix or "pass --chat-template with a template that "
                "renders tool results (role `tool`)."))
    return gaps


def warn_about_template(tokenizer: Any, env_factory: Callable[[], Any], chat_template: str | None = None) -> list[str]:
    """Warn (log and stderr) about what the chat template keeps from the model in ``env_factory``'s
    episodes (:func:`template_gaps`); returns the warnings. What ``treerl rollout`` and ``treerl learn``
    check before they play."""
    try:
        env = env_factory()
    except Exception as exc:  # noqa: BLE001 - advisory only: the run reports a broken environment where it plays
        logger.debug("template check skipped: the environment did not build (%s)", exc)
        return []
    try:
        tools = getattr(env, "tool_schemas", None) or []
    finally:
        env.close()
    messages = template_gaps(tokenizer, tools, chat_template)
    for message in messages:
        logger.info(message)  # printed below: at warning level Python's last-resort handler printed it twice
        print(f"warning: {message}", file=sys.stderr)
    return messages
