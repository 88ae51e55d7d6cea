"""Teacher contexts: the prompt SDPO's teacher reads in place of the student's (reprompting).

The teacher is the policy itself, conditioned on what the student did not have: a
**demonstration** (a successful sibling's attempt at the same task) and/or the
environment's **feedback** on this attempt (:meth:`treerl.envs.Env.feedback`, recorded by the
engine as ``episode.metrics["feedback"]``). For each episode of a group:

- **demonstration**: the first sibling whose reward reaches ``success_threshold``, never
  the episode itself, so a successful episode is taught by a *different* successful
  sibling and the only success of a group teaches everyone but itself. Every failed
  sibling gets the same demonstration, so their teacher prompts are identical and the
  teacher forward shares it (:mod:`treerl.learners.teacher`).
- **feedback**: the episode's own, when ``use_feedback`` (and, with
  ``feedback_only_without_solution``, only when it has no demonstration).
- **messages**: the prompt's messages with the system ones (and any earlier turns) kept
  and the last user turn replaced by ``reprompt_template.format(prompt=..., solution=...,
  feedback=...)``, where ``solution`` is ``solution_template`` around the demonstration
  and ``feedback`` is ``feedback_template`` around the feedback (empty when absent).
- **tokens**: rendered with the policy's chat template and the environment's tools, as the
  student's prompt was. Longer than ``max_prompt_tokens``, the demonstration and the
  feedback are shortened (never the task); if even the bare reprompt does not fit, the
  episode gets no teacher.

An episode with neither a demonstration nor feedback gets no teacher and no distillation
term. A multi-turn demonstration is its transcript after the prompt: the assistant's
turns verbatim and the tool results and user turns marked as such.

>>> choose_demonstrations([0.0, 1.0, 0.0, 1.0], threshold=1.0)
[1, 3, 1, 1]
>>> choose_demonstrations([1.0, 0.0], threshold=1.0)   # the only success teaches the others only
[None, 0]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treerl.agents import reprompt
from treerl.agents.chat import ChatRenderer
from treerl.rollout.trajectory import Episode, Group

__all__ = [
    "TeacherContext",
    "TeacherContextConfig",
    "TeacherPrompter",
    "choose_demonstrations",
    "context_metrics",
    "demonstration_text",
    "reprompt_messages",
]

_TRUNCATED = " [...]"


@dataclass
class TeacherContextConfig:
    """How teacher prompts are chosen and written (the learner's ``SDPOConfig`` fills it)."""

    success_threshold: float = 1.0
    use_successful: bool = True
    use_feedback: bool = True
    feedback_only_without_solution: bool = False
    remove_thinking: bool = False
    max_prompt_tokens: int = 2048
    reprompt_template: str = reprompt.REPROMPT_TEMPLATE
    solution_template: str = reprompt.SOLUTION_TEMPLATE
    feedback_template: str = reprompt.FEEDBACK_TEMPLATE

    def __post_init__(self) -> None:
        for name, keys in (("reprompt_template", ("prompt", "solution", "feedback")),
                           ("solution_template", ("successful_previous_attempt",)),
                           ("feedback_template", ("feedback_raw",))):
            template = getattr(self, name)
            try:
                template.format(**{k: "" for k in keys})
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"{name}={template!r} cannot be filled ({exc!r}): it may use only the fields "
                                 f"{{{'}, {'.join(keys)}}} (double other braces: {{{{ }}}}).") from None
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_teacher_prompt_tokens={self.max_prompt_tokens} must be >= 1.")


@dataclass
class TeacherContext:
    """What the teacher of one episode reads."""

    demonstration: int | None
    """The sibling (index in the group) whose attempt is shown, if any."""
    feedback: str | None
    """The feedback shown, if any."""
    feedback_available: bool
    """Whether the episode had feedback (shown or not)."""
    prompt_ids: list[int] | None
    """The teacher's prompt tokens; None: no teacher for this episode."""
    truncated: bool = False
    """Whether the demonstration or feedback was shortened to fit ``max_prompt_tokens``."""
    too_long: bool = False
    """Whether even the shortened prompt did not fit (then ``prompt_ids`` is None)."""


def choose_demonstrations(rewards: Sequence[float], threshold: float) -> list[int | None]:
    """Per episode, the first other episode with ``reward >= threshold`` (see the module docstring)."""
    successful = [j for j, r in enumerate(rewards) if r >= threshold]
    return [next((j for j in successful if j != i), None) for i in range(len(rewards))]


def demonstration_text(episode: Episode, num_prompt_messages: int, *, remove_thinking: bool = False) -> str:
    """The episode's attempt after the prompt: assistant turns verbatim, other turns marked."""
    return reprompt.attempt_text(episode.messages[num_prompt_messages:], remove_thinking=remove_thinking)


def reprompt_messages(prompt_messages: Sequence[Mapping[str, Any]], solution: str | None, feedback: str | None,
                      cfg: TeacherContextConfig) -> list[dict[str, Any]]:
    """The prompt with its last user turn replaced by the reprompt (every other message kept).

    >>> msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    >>> cfg = TeacherContextConfig(reprompt_template="{prompt}|{solution}|{feedback}",
    ...                            solution_template="sol={successful_previous_attempt}",
    ...                            feedback_template="fb={feedback_raw}")
    >>> reprompt_messages(msgs, "A", None, cfg)
    [{'role': 'system', 'content': 'S'}, {'role': 'user', 'content': 'Q?|sol=A|'}]
    """
    return reprompt.reprompt_messages(prompt_messages, solution, feedback, reprompt_template=cfg.reprompt_template,
                                      solution_template=cfg.solution_template,
                                      feedback_template=cfg.feedback_template)


class TeacherPrompter:
    """Writes the teacher prompts of groups with one tokenizer, chat template and tool list.

    Args:
        tokenizer: the policy's tokenizer (its chat template renders the teacher's prompt).
        cfg: the selection rules, templates and length bound.
        tools: the environment's tool schemas, rendered into the prompt as for the student.
    """

    def __init__(self, tokenizer: Any, cfg: TeacherContextConfig, *, tools: list[dict] | None = None):
        self.cfg = cfg
        self.renderer = ChatRenderer(tokenizer, tools=tools or None)

    def group_contexts(self, group: Group, rewards: Sequence[float]) -> list[TeacherContext]:
        """One :class:`TeacherContext` per episode of ``group``; ``rewards`` are the episodes' totals."""
        cfg = self.cfg
        num_prompt = int(group.info.get("num_prompt_messages", 2))
        demos = choose_demonstrations(rewards, cfg.success_threshold) if cfg.use_successful else [None] * len(rewards)
        texts: dict[int, str] = {}
        rendered: dict[tuple[int | None, str | None], tuple[list[int] | None, bool]] = {}
        out = []
        for i, episode in enumerate(group.episodes):
            demo = demos[i]
            raw = episode.metrics.get("feedback")
            available = isinstance(raw, str) and bool(raw.strip())
            feedback = raw if available and cfg.use_feedback and not (
                cfg.feedback_only_without_solution and demo is not None) else None
            if demo is None and feedback is None:
                out.append(TeacherContext(None, None, available, None))
                continue
            if demo is not None and demo not in texts:
                texts[demo] = demonstration_text(group.episodes[demo], num_prompt, remove_thinking=cfg.remove_thinking)
            key = (demo, feedback)  # failed siblings share one demonstration: render it once
            if key not in rendered:
                rendered[key] = self._render(episode.messages[:num_prompt], texts.get(demo), feedback)
            ids, truncated = rendered[key]
            out.append(TeacherContext(demo, feedback, available, ids, truncated=truncated and ids is not None,
                                      too_long=ids is None))
        return out

    def self_prompt(self, group: Group, index: int) -> list[int] | None:
        """The teacher prompt that shows episode ``index``'s own attempt (no feedback): the gate's copy probe."""
        num_prompt = int(group.info.get("num_prompt_messages", 2))
        episode = group.episodes[index]
        text = demonstration_text(episode, num_prompt, remove_thinking=self.cfg.remove_thinking)
        return self._render(episode.messages[:num_prompt], text, None)[0]

    def _render(self, prompt_messages: Sequence[Mapping[str, Any]], solution: str | None,
                feedback: str | None) -> tuple[list[int] | None, bool]:
        """The teacher prompt's ids within the length bound, and whether anything was shortened."""
        limit = self.cfg.max_prompt_tokens
        ids = self.renderer.prompt_ids(reprompt_messages(prompt_messages, solution, feedback, self.cfg))
        if len(ids) <= limit:
            return ids, False
        bare = len(self.renderer.prompt_ids(reprompt_messages(prompt_messages, "" if solution is not None else None,
                                                              "" if feedback is not None else None, self.cfg)))
        budget = limit - bare - 2 * len(self.renderer.encode(_TRUNCATED))
        for _ in range(4):  # token boundaries move when text is cut; shrink until it fits
            if budget <= 0:
                return None, True
            parts = [p for p in (solution, feedback) if p is not None]
            shares = _split_budget([len(self.renderer.encode(p)) for p in parts], budget)
            cut = iter(self._cut(p, n) for p, n in zip(parts, shares))
            short_solution = next(cut) if solution is not None else None
            short_feedback = next(cut) if feedback is not None else None
            ids = self.renderer.prompt_ids(reprompt_messages(prompt_messages, short_solution, short_feedback, self.cfg))
            if len(ids) <= limit:
                return ids, True
            budget -= len(ids) - limit
        return None, True

    def _cut(self, text: str, max_tokens: int) -> str:
        ids = self.renderer.encode(text)
        if len(ids) <= max_tokens:
            return text
        return self.renderer.tokenizer.decode(ids[:max_tokens], skip_special_tokens=True) + _TRUNCATED


def _split_budget(lengths: Sequence[int], budget: int) -> list[int]:
    """Share ``budget`` tokens between texts of ``lengths``: equal shares, what one leaves going to the other.

    >>> _split_budget([10, 100], 60), _split_budget([100, 100], 60), _split_budget([80], 60)
    ([10, 50], [30, 30], [60])
    """
    shares = [0] * len(lengths)
    left, order = budget, sorted(range(len(lengths)), key=lambda i: lengths[i])
    for k, i in enumerate(order):
        shares[i] = min(lengths[i], left // (len(order) - k))
        left -= shares[i]
    return shares


def context_metrics(contexts: Sequence[Sequence[TeacherContext]]) -> dict[str, float]:
    """Step metrics of the contexts of all groups: how many episodes SDPO can learn from, and why.

    >>> c = TeacherContext
    >>> m = context_metrics([[c(1, None, False, [1]), c(None, None, False, None)], [c(None, "x", True, [2])]])
    >>> m["sdpo/reprompt_frac"], m["sdpo/no_teacher_group_frac"], m["sdpo/feedback_used_frac"]
    (0.6666666666666666, 0.0, 0.3333333333333333)
    """
    episodes = [c for group in contexts for c in group]
    n, groups = max(len(episodes), 1), max(len(contexts), 1)
    return {
        "sdpo/reprompt_frac": sum(c.prompt_ids is not None for c in episodes) / n,
        "sdpo/demonstration_frac": sum(c.demonstration is not None for c in episodes) / n,
        "sdpo/feedback_available_frac": sum(c.feedback_available for c in episodes) / n,
        "sdpo/feedback_used_frac": sum(c.feedback is not None and c.prompt_ids is not None for c in episodes) / n,
        "sdpo/truncated_frac": sum(c.truncated for c in episodes) / n,
        "sdpo/too_long_frac": sum(c.too_long for c in episodes) / n,
        "sdpo/success_group_frac": sum(any(c.demonstration is not None for c in g) for g in contexts) / groups,
        "sdpo/no_teacher_group_frac": sum(all(c.prompt_ids is None for c in g) for g in contexts) / groups,
    }
