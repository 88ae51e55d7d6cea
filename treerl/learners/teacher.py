"""SDPO's teacher: its weights, its trees, and its packed forward over the student's sampled tokens.

**Weights** (:data:`TEACHER_KINDS`): ``ema``, an exponential moving average of the student
(``teacher <- (1 - rate) teacher + rate student`` after every optimizer step,
:func:`ema_update`; with LoRA only the adapters move, so the teacher is the student's own
frozen base with an average of the adapters, :class:`EMAAdapters`); ``initial``, the frozen
starting weights; ``live``, the student itself (no copy; scored under ``no_grad`` before the
step changes it).

**Trees**: the teacher re-scores the **same sampled tokens** as the student, after its own
prompt (:mod:`treerl.learners.teacher_context`). :func:`teacher_trees` rebuilds each
student group as a teacher tree: the group's teacher prompts as a trie of ``prompt``
segments (:func:`prompt_trie`), and under each prompt's end the episode's segments after
the student's prompt, unchanged (sampled turns with their log-probs, the environment's
tokens in between), so sharing survives: failed siblings with one demonstration share the
teacher prompt up to where their own feedback starts (forwarded once, each completion a
branch), and branched rollouts still share their first turns. The trees pack with
:func:`~treerl.learners.packing.pack_groups` and run with the same tree-attention forward
as the student (:func:`~treerl.learners.forward.packed_hidden_states`).

**Alignment**: an episode's terms come out of packing in path order, in both packings, so
the ``r``-th term of student episode ``e`` and the ``r``-th term of its teacher episode
are the same sampled token (:func:`term_ranks`). :func:`teacher_terms` returns, for every
term of one student micro-batch, the teacher's hidden state and log-prob of that token.

Episodes whose path does not start at the group's prompt (a chat template that was not
append-only re-rooted them) get no teacher: their tokens have no single prompt to replace.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from treerl.kernels.logprobs import token_logprobs
from treerl.learners.core import AdaptersOff
from treerl.learners.divergences import LMHead
from treerl.learners.forward import packed_hidden_states
from treerl.learners.packing import PackedBatch, PackingConfig, pack_groups
from treerl.rollout.trajectory import Group

__all__ = [
    "TEACHER_KINDS",
    "EMAAdapters",
    "TeacherTerms",
    "TeacherTrees",
    "ema_update",
    "make_teacher",
    "teacher_terms",
    "teacher_trees",
    "prompt_trie",
    "term_ranks",
    "rebasable",
]

TEACHER_KINDS = ("ema", "initial", "live")


def make_teacher(kind: str, model: torch.nn.Module, reference: torch.nn.Module | None) -> torch.nn.Module:
    """The teacher's model: a frozen copy of ``model`` (``ema``), ``reference`` (``initial``), or ``model``.

    ``model`` is the trained model as the learner built it (tree attention on, LoRA
    applied); ``reference`` the core's frozen starting weights. With LoRA the ``ema`` teacher
    copies only the adapters (:class:`EMAAdapters`), as ``reference`` then copies nothing.
    """
    if kind == "ema":
        if EMAAdapters.fits(model):
            return EMAAdapters(model)
        return copy.deepcopy(model).eval().requires_grad_(False)
    if kind == "initial":
        if reference is None:
            raise ValueError("teacher='initial' needs the frozen starting weights: build(cfg, reference=True).")
        return reference
    if kind == "live":
        return model
    raise ValueError(f"teacher={kind!r}: use one of {TEACHER_KINDS}.")


class EMAAdapters(AdaptersOff):
    """A LoRA model's EMA teacher without a copy of its base: the student's own decoder, run with
    the teacher's average of the trained (adapter) weights in place of the student's.

    Only the trained parameters differ between the student and its EMA (the frozen base is
    equal in both), so ``weights`` holds those alone: adapter-sized, not model-sized. A
    forward through :meth:`get_decoder` swaps them in for the call
    (``torch.func.functional_call``), in eval mode and without gradients; the student's
    parameters, and any graph built on them, are left as they were. The LM head is the
    student's, which LoRA leaves frozen. The learners run a model only through
    ``get_decoder()`` and ``get_output_embeddings()``, which is all this offers (as
    :class:`~treerl.learners.core.AdaptersOff`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)  # the student, not a submodule: the base is the student's
        in_decoder = {id(p): name for name, p in model.get_decoder().named_parameters()}
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.weights: dict[str, torch.Tensor] = {name: p.detach().clone() for name, p in trained}
        # The teacher's trained weights, by the student's names (what ema_update averages) and the decoder's.
        self._decoder_weights = {in_decoder[id(p)]: self.weights[name] for name, p in trained}

    @staticmethod
    def fits(model: torch.nn.Module) -> bool:
        """Whether ``model`` is a peft model whose trained parameters all lie in its decoder (the LM head frozen)."""
        peft = sys.modules.get("peft")  # a model cannot be a PeftModel unless peft was imported
        if peft is None or not isinstance(model, peft.PeftModel):
            return False
        in_decoder = {id(p) for p in model.get_decoder().parameters()}
        return all(id(p) in in_decoder for p in model.parameters() if p.requires_grad)

    def run_decoder(self, decoder: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One forward of the student's ``decoder`` with the teacher's adapter weights in place of its own."""
        return torch.func.functional_call(decoder, self._decoder_weights, args, kwargs)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Set ``weights`` from ``state`` (a checkpoint's; one of a whole copy of the model holds them too)."""
        missing = sorted(set(self.weights) - set(state))
        if missing:
            raise ValueError(f"EMAAdapters.load: the saved teacher has no {missing[0]!r} ({len(missing)} trained "
                             "weights missing); it was saved for another model or another LoRA setting.")
        with torch.no_grad():
            for name, value in self.weights.items():
                value.copy_(state[name])


@torch.no_grad()
def ema_update(teacher: torch.nn.Module, student: torch.nn.Module, rate: float) -> None:
    """``teacher <- (1 - rate) * teacher + rate * student``, parameter by parameter, in place.

    Only the student's trained parameters move (with LoRA, the adapters); frozen ones are
    equal in both already. Parameters are matched by name; an :class:`EMAAdapters` teacher
    holds only the trained ones.

    >>> t, s = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    >>> _ = t.weight.data.fill_(0.0), s.weight.data.fill_(1.0)
    >>> ema_update(t, s, 0.25); t.weight.tolist()
    [[0.25, 0.25]]
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"teacher_update_rate={rate} must be in [0, 1].")
    teacher_params = teacher.weights if isinstance(teacher, EMAAdapters) else dict(teacher.named_parameters())
    for name, p in student.named_parameters():
        if not p.requires_grad:
            continue
        if name not in teacher_params:
            raise ValueError(f"ema_update: the teacher has no parameter {name!r}; the EMA teacher must be a copy of "
                             "the student (make_teacher('ema', model, ...)).")
        teacher_params[name].lerp_(p.detach().to(teacher_params[name].dtype), rate)


def rebasable(group: Group, episode: int) -> bool:
    """Whether the episode's one path starts at the group's prompt segment (see the module docstring)."""
    e = group.episodes[episode]
    path = group.path_indices(e.leaf)
    return not e.extra_leaves and group.segments[path[0]].kind == "prompt" and len(path) > 1


@dataclass
class TeacherTrees:
    """Teacher trees and, for each of their episodes in order, the student episode it re-scores."""

    groups: list[Group]
    student_episodes: list[int]
    """Global (whole-step) student episode index of each teacher episode."""


def teacher_trees(groups: Sequence[Group], prompts: Sequence[Sequence[int] | None],
                  episodes: set[int] | None = None) -> TeacherTrees:
    """Teacher trees of ``groups`` (see the module docstring).

    Args:
        groups: the step's student groups.
        prompts: (E,) per student episode (groups in order), its teacher prompt ids, or None.
        episodes: only these student episodes (global indices), e.g. one micro-batch's.
    """
    out = TeacherTrees([], [])
    first = 0
    for group in groups:
        tree = Group(task_key=group.task_key, env_id=group.env_id, info=group.info)
        chosen = [i for i in range(len(group.episodes)) if prompts[first + i] is not None
                  and (episodes is None or first + i in episodes) and rebasable(group, i)]
        prompt_end = prompt_trie(tree, [tuple(prompts[first + i]) for i in chosen])  # type: ignore[arg-type]
        copied: dict[tuple[int, int], int] = {}  # (teacher prompt's last segment, student segment) -> teacher segment
        for i in chosen:
            index, episode = first + i, group.episodes[i]
            root = prompt_end[tuple(prompts[index])]  # type: ignore[arg-type]
            parent = root
            for s in group.path_indices(episode.leaf)[1:]:
                if (root, s) not in copied:
                    seg = group.segments[s]
                    copied[(root, s)] = tree.add_segment(
                        seg.kind, seg.token_ids, parent=parent, logprobs=seg.logprobs, candidates=seg.candidates,
                        policy_version=seg.policy_version, finish_reason=seg.finish_reason)
                parent = copied[(root, s)]
            tree.add_episode(leaf=parent, reward=episode.reward)
            out.student_episodes.append(index)
        if tree.episodes:
            out.groups.append(tree)
        first += len(group.episodes)
    return out


def prompt_trie(tree: Group, prompts: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    """Add ``prompts`` to ``tree`` as ``prompt`` segments of a compressed trie; returns each prompt's last segment.

    A prefix that several prompts share is one segment, forwarded once: failed siblings shown
    the same demonstration share it even when each also reads its own feedback after it.

    >>> g = Group(task_key="t", env_id="e")
    >>> ends = prompt_trie(g, [(1, 2, 3, 4), (1, 2, 5), (1, 2, 3, 4), (7,)])
    >>> [(s.token_ids, s.parent) for s in g.segments]
    [([1, 2], None), ([3, 4], 0), ([5], 0), ([7], None)]
    >>> ends == {(1, 2, 3, 4): 1, (1, 2, 5): 2, (7,): 3}
    True
    """
    ends: dict[tuple[int, ...], int] = {}

    def add(members: list[tuple[int, ...]], depth: int, parent: int | None) -> None:
        # Every member shares members[0][:depth] and its next token (so the segment is never empty).
        end = min(len(p) for p in members)
        end = next((k for k in range(depth, end) if any(p[k] != members[0][k] for p in members)), end)
        node = tree.add_segment("prompt", list(members[0][depth:end]), parent=parent)
        branches: dict[int, list[tuple[int, ...]]] = {}
        for p in members:
            if len(p) == end:
                ends[p] = node
            else:
                branches.setdefault(p[end], []).append(p)
        for branch in branches.values():
            add(branch, end, node)

    roots: dict[int, list[tuple[int, ...]]] = {}
    for p in dict.fromkeys(prompts):  # distinct, in order
        if not p:
            raise ValueError("prompt_trie: an empty teacher prompt; teacher prompts hold at least the task.")
        roots.setdefault(p[0], []).append(p)
    for members in roots.values():
        add(members, 0, None)
    return ends


def term_ranks(term_episode: Tensor) -> Tensor:
    """(M,) each term's position among its episode's terms, in order.

    >>> term_ranks(torch.tensor([3, 3, 1, 3, 1])).tolist()
    [0, 1, 0, 2, 1]
    """
    order = torch.argsort(term_episode, stable=True)  # (M,) terms grouped by episode, in order
    sorted_episode = term_episode[order]
    counts = torch.bincount(sorted_episode)
    starts = torch.cumsum(counts, 0) - counts  # first sorted position of each episode
    ranks = torch.empty_like(term_episode)
    ranks[order] = torch.arange(term_episode.numel(), device=term_episode.device) - starts[sorted_episode]
    return ranks


@dataclass
class TeacherTerms:
    """The teacher at every term of one student micro-batch (rows without a teacher are zero)."""

    mask: Tensor
    """(M,) bool: the term's episode has a teacher."""
    hidden: Tensor
    """(M, H) the teacher's final hidden state predicting the term's token."""
    logp: Tensor
    """(M,) float32 the teacher's log-prob of the sampled token, full vocabulary, tempered."""
    num_tokens: int = 0
    """Tokens the teacher forward ran (packed)."""
    num_path_tokens: int = 0
    """Tokens it would have run unpacked."""


@torch.no_grad()
def teacher_terms(model: torch.nn.Module, groups: Sequence[Group], prompts: Sequence[Sequence[int] | None],
                  batch: PackedBatch, packing: PackingConfig, *, temperature: float, device: str | torch.device,
                  impl: str = "auto", fp32_head: bool = False) -> TeacherTerms:
    """The teacher's hidden states and log-probs at every term of the student micro-batch ``batch``.

    Packs the teacher trees of the batch's episodes with ``packing``, runs the teacher's
    decoder on them, and lines each teacher term up with its student term. ``fp32_head``: the
    log-probs from a half-precision head in float32 (:func:`~treerl.kernels.logprobs.token_logprobs`).
    """
    term_episode = batch.term_episode.to(device)
    num_terms = term_episode.numel()
    head = LMHead.of(model)
    width = head.weight.shape[1]
    out = TeacherTerms(mask=torch.zeros(num_terms, dtype=torch.bool, device=device),
                       hidden=torch.zeros(num_terms, width, dtype=head.weight.dtype, device=device),
                       logp=torch.zeros(num_terms, dtype=torch.float32, device=device))
    present = set(term_episode.unique().tolist())
    trees = teacher_trees(groups, prompts, episodes=present)
    if not trees.student_episodes:
        return out
    was_training = model.training
    model.eval()
    try:
        teacher_batches = pack_groups(trees.groups, torch.zeros(len(trees.student_episodes)), packing)
        student_of = torch.tensor(trees.student_episodes, dtype=torch.long, device=device)
        keys, hidden, targets = [], [], []
        for tb in teacher_batches:
            tb = tb.to(device)
            states = packed_hidden_states(model, tb)  # (B, T, H)
            flat = states.reshape(-1, states.shape[-1]).index_select(0, tb.loss_row * tb.length + tb.loss_pos)  # (N, H)
            episode = student_of[tb.term_episode]  # (M_t,) student episode of each teacher term
            keys.append(_key(episode, term_ranks(tb.term_episode), num_terms))
            hidden.append(flat[tb.term_loss])
            targets.append(tb.loss_target[tb.term_loss])
            out.num_tokens += tb.num_tokens
            out.num_path_tokens += tb.num_path_tokens
    finally:
        model.train(was_training)
    teacher_keys, teacher_hidden = torch.cat(keys), torch.cat(hidden)  # (M_t,), (M_t, H)
    student_keys = _key(term_episode, term_ranks(term_episode), num_terms)  # (M,)
    order = torch.argsort(teacher_keys)
    found = torch.searchsorted(teacher_keys[order], student_keys).clamp(max=teacher_keys.numel() - 1)
    match = order[found]
    mask = teacher_keys[match] == student_keys  # (M,)
    has_teacher = torch.isin(term_episode, student_of)
    if not torch.equal(mask, has_teacher) or int(mask.sum()) != teacher_keys.numel():
        raise RuntimeError("teacher_terms: the teacher's terms do not line up with the student's (an episode has a "
                           "different number of sampled tokens in the two packings); this is a treerl bug.")
    target = torch.cat(targets)[match[mask]]
    if not torch.equal(target, batch.term_target.to(device)[mask]):
        raise RuntimeError("teacher_terms: the teacher scored other tokens than the student sampled; a treerl bug.")
    out.mask = mask
    out.hidden[mask] = teacher_hidden[match[mask]]
    out.logp[mask] = token_logprobs(out.hidden[mask], head.weight, target, bias=head.bias, temperature=temperature,
                                    impl=impl, fp32_head=fp32_head).logp.float()
    return out


def _key(episode: Tensor, rank: Tensor, num_terms: int) -> Tensor:
    """One integer per (episode, rank) pair; ``rank < num_terms`` keeps them distinct."""
    return episode * (num_terms + 1) + rank
