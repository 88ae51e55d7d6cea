"""What every command that plays episodes is configured with: the environment, the model, sampling and limits.

``treerl eval``, ``treerl rollout`` and ``treerl learn`` configs derive from
:class:`EpisodeOptions`, so the flags (and YAML keys) that pick the environment and its
keyword arguments, the model, the sampling and the per-episode limits are spelled once, and
the environment factory and the :class:`~treerl.rollout.engine.RolloutEngine` are built in
one place.

>>> opts = EpisodeOptions(env="treerl/MathVerify-v0", env_kwargs={"data_path": "problems.jsonl"})
>>> opts.env_kwargs
{'data_path': 'problems.jsonl'}
>>> EpisodeOptions(env_kwargs=["data_path"])
Traceback (most recent call last):
...
ValueError: env_kwargs=['data_path'] must be a mapping of keyword arguments for the environment, ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from treerl.agents.chat_templates import SHIPPED_TEMPLATES, mark_chat_template, resolve_chat_template
from treerl.agents.policy import Policy, SamplingOptions
from treerl.config import field_help
from treerl.envs.registry import make
from treerl.models import load_model, set_chat_template
from treerl.rollout.engine import RolloutEngine

__all__ = ["EpisodeOptions", "ChatTemplateOptions"]


@dataclass
class ChatTemplateOptions:
    """The chat template a command renders conversations with (a base of :class:`EpisodeOptions` and of
    ``treerl serve``'s config), and :meth:`apply_chat_template`, which makes it the tokenizer's own.

    >>> ChatTemplateOptions(chat_template="chatml")
    Traceback (most recent call last):
    ...
    ValueError: chat_template='chatml' is not a template choice: use 'model', 'training', one of [...
    """

    chat_template: str = field_help(
        "model", "The chat template episodes are rendered with: 'model' (the tokenizer's own), 'training' (treerl's "
                 "prefix-preserving variant of the model's family where its template rewrites history: more shared "
                 "prefix; its tool-use variant where the template has no tool role: Gemma 3, Phi-3.5; see the "
                 "README's 'Model families'), a shipped name such as 'qwen3_training' or 'gemma3_tools', or a "
                 ".jinja file.")
    chat_template_kwargs: dict[str, Any] = field_help(
        help='Template variables fixed for the run, e.g. \'{"enable_thinking": false}\' (a mapping in YAML).',
        default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs={self.chat_template_kwargs!r} must be a mapping, e.g. "
                             "--chat-template-kwargs '{\"enable_thinking\": false}'.")
        if not isinstance(self.chat_template, str) or not (self.chat_template in ("model", "training", *SHIPPED_TEMPLATES)
                                                            or self.chat_template.endswith(".jinja")):
            raise ValueError(f"chat_template={self.chat_template!r} is not a template choice: use 'model', 'training', "
                             f"one of {sorted(SHIPPED_TEMPLATES)} or the path of a .jinja file "
                             "(--chat-template training).")

    def apply_chat_template(self, tokenizer: Any) -> None:
        """Make ``chat_template`` (and the fixed ``chat_template_kwargs``) the tokenizer's own template, so
        that every renderer of the run (rollout, evaluation, ``treerl serve``, a teacher's context, flat
        records for TRL) uses it without being told."""
        template = resolve_chat_template(self.chat_template, tokenizer)
        if template is not None:
            tokenizer.chat_template = template
        set_chat_template(tokenizer, None, self.chat_template_kwargs)
        mark_chat_template(tokenizer, self.chat_template)


@dataclass
class EpisodeOptions(ChatTemplateOptions, SamplingOptions):
    """The environment, model, sampling and per-episode limits (a base of each command's config)."""

    env: str = field_help("treerl/Calculator-v0", "Registered environment id (see `treerl envs`).")
    env_kwargs: dict[str, Any] = field_help(
        help='Keyword arguments for the environment, e.g. \'{"data_path": "problems.jsonl"}\' (a mapping in YAML).',
        default_factory=dict)
    model: str | None = field_help(None, "A local transformers model directory, a Hub id in the Hugging Face cache "
                                         "(e.g. Qwen/Qwen3-0.6B; nothing is downloaded), or a shipped model by name "
                                         "(tiny, tiny-reader, tiny-coder); default: the shipped tiny model.")
    device: str = field_help("cpu", "Torch device of the policy.")
    max_concurrency: int = field_help(32, "Episodes in flight at once.")
    max_episode_tokens: int = field_help(2048, "An episode whose context reaches this many tokens is truncated.")
    max_episode_seconds: float = field_help(300.0, "Wall-clock limit of one episode.")
    continuous_batching: bool = field_help(True, "Requests join the policy's running batch between decode steps "
                                                 "(faster with mixed turn lengths; batch composition then depends "
                                                 "on timing, so float results may differ from run to run).")
    lockstep: bool = field_help(False, "Generation in waves of every episode in play, in a fixed order, so the "
                                       "policy's batches and every float repeat from run to run (needs "
                                       "--continuous-batching false; a turn waits for the slowest tool call; "
                                       "all episodes of a step are in play at once).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.env_kwargs, dict):
            raise ValueError(f"env_kwargs={self.env_kwargs!r} must be a mapping of keyword arguments for the "
                             "environment, e.g. --env-kwargs '{\"data_path\": \"problems.jsonl\"}' (or a YAML "
                             "mapping).")
        for name in ("max_concurrency", "max_new_tokens", "max_episode_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if not self.max_episode_seconds > 0:
            raise ValueError(f"max_episode_seconds={self.max_episode_seconds} must be > 0.")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"device={self.device!r} is not a torch device: use cpu, cuda, cuda:N or mps "
                             "(--device cpu).") from None
        if self.lockstep and self.continuous_batching:
            raise ValueError("lockstep=True needs continuous_batching=False: rows joining a running batch make its "
                             "membership depend on time (--continuous-batching false, or --lockstep false).")
        self.sampling()  # SamplingParams validates the sampling options with its own messages

    def load_model(self, device: Any = None) -> tuple[Any, Any]:
        """The model and tokenizer of ``model`` (a directory, a cached Hub id, or the shipped tiny model)
        with ``chat_template`` and ``chat_template_kwargs`` applied."""
        model, tokenizer = load_model(self.model, self.device if device is None else device)
        self.apply_chat_template(tokenizer)
        return model, tokenizer

    def env_factory(self) -> Callable[[], Any]:
        """A fresh environment per call: ``make(env, **env_kwargs)``."""
        return functools.partial(make, self.env, **self.env_kwargs)

    def engine(self, policy: Policy, tokenizer: Any, *, seed: int, branch_at_turn: int | None = None,
               branch_factor: int = 1, shuffle_seed: int | None = None, max_completion_tokens: int | None = None,
               **sampling_overrides: Any) -> RolloutEngine:
        """A :class:`~treerl.rollout.engine.RolloutEngine` that plays ``policy`` with these options."""
        return RolloutEngine(policy, tokenizer, params=self.sampling(**sampling_overrides),
                             max_concurrency=self.max_concurrency, max_episode_tokens=self.max_episode_tokens,
                             max_episode_seconds=self.max_episode_seconds, branch_at_turn=branch_at_turn,
                             branch_factor=branch_factor, seed=seed, lockstep=self.lockstep,
                             chat_template=resolve_chat_template(self.chat_template, tokenizer),
                             shuffle_seed=shuffle_seed, max_completion_tokens=max_completion_tokens)

