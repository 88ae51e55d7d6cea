"""Prefix-tree trajectories: the data structure everything else reads.

A **segment** is a run of token ids with one origin: ``prompt`` (the rendered task),
``sampled`` (the policy produced it; per-token sampler log-probs, candidate sets and the
policy version come with it) or ``env`` (tool results, user turns, template glue). Segments
link child to parent; a root-to-leaf path is exactly the token sequence the model saw.

An **episode** is a leaf plus what the environment said (rewards, tool-call records,
termination, metrics). A **group** is all episodes of one task: its generations share the
prompt segment, and branches forked mid-episode share more.

Groups are stored as JSON Lines, one group per line (see :data:`SCHEMA_VERSION` and
:meth:`Group.to_json`), after a header line that says what produced them (see
:func:`make_header`; files written before headers existed are still read).
:func:`read_groups` yields them back (:func:`read_all_groups` reads a whole file into a list,
faster). Writing never fails on what an episode holds: a
value strict JSON cannot spell becomes ``null`` and is listed in the group's
``info["unencodable"]`` (:mod:`treerl.rollout.safe_json`).

>>> g = Group(task_key="seed-0", env_id="demo")
>>> root = g.add_segment("prompt", [1, 2, 3])
>>> a = g.add_segment("sampled", [4, 5], parent=root, logprobs=[-0.1, -0.2], policy_version=0)
>>> b = g.add_segment("sampled", [6], parent=root, logprobs=[-0.3], policy_version=0)
>>> e = g.add_episode(leaf=a, reward=1.0)
>>> _ = g.add_episode(leaf=b, reward=0.0)
>>> e.token_ids, e.sampled_mask
([1, 2, 3, 4, 5], [False, False, False, True, True])
>>> round(g.packing_ratio, 3)   # (5 + 4) tokens on paths / 6 unique tokens
1.5
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from treerl.errors import ConfigError
from treerl.rollout.safe_json import dumps_record

__all__ = [
    "SCHEMA_VERSION",
    "HEADER_KEY",
    "Segment",
    "Episode",
    "Group",
    "make_header",
    "read_header",
    "read_groups",
    "read_all_groups",
    "GroupWriter",
    "repair_trajectory_file",
    "is_foreign_file",
    "to_flat_records",
    "TRAJECTORIES_DIR",
    "sample_path",
    "sample_files",
]

HEADER_KEY = "treerl_trajectories"
"""The key that marks a file's header line (its value is the schema version)."""

SCHEMA_VERSION = 1
"""Version of the JSON Lines schema written by :meth:`Group.to_json`."""

SegmentKind = Literal["prompt", "sampled", "env"]


@dataclass
class Segment:
    """A run of tokens with one origin; ``parent`` indexes the group's segment list."""

    kind: SegmentKind
    token_ids: list[int]
    parent: int | None = None
    logprobs: list[float] | None = None
    """Sampled segments: the sampler's log-prob of each token, after the repetition penalty, temperature,
    top-k, top-p and min-p."""
    candidates: list[list[int]] | None = None
    """Sampled segments: the ids each token was drawn from; None means the full vocabulary."""
    policy_version: int | None = None
    finish_reason: str | None = None
    trainer_logprobs: list[float] | None = None
    """Sampled segments in a learner's trajectory sample: the trainer's log-prob of each token
    when it trained on them (optional; stored only when set)."""
    top_ids: list[list[int]] | None = None
    """Sampled segments, when the sampler recorded its head over the whole vocabulary: per
    token, its most likely ids (see ``top_logprobs``)."""
    top_logprobs: list[list[float]] | None = None
    """Sampled segments, when recorded: per token, the sampler's log-probs of ``candidates``
    (the whole support) or else of ``top_ids``. Score centering reads them."""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "parent": self.parent, "token_ids": self.token_ids}
        if self.kind == "sampled":
            d.update(logprobs=self.logprobs, candidates=self.candidates, policy_version=self.policy_version,
                     finish_reason=self.finish_reason)
            if self.trainer_logprobs is not None:
                d["trainer_logprobs"] = self.trainer_logprobs
            if self.top_logprobs is not None:  # only when recorded: files without them stay as they were
                d.update(top_ids=self.top_ids, top_logprobs=self.top_logprobs)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Segment:
        return cls(kind=d["kind"], token_ids=list(d["token_ids"]), parent=d.get("parent"),
                   logprobs=d.get("logprobs"), candidates=d.get("candidates"),
                   policy_version=d.get("policy_version"), finish_reason=d.get("finish_reason"),
                   trainer_logprobs=d.get("trainer_logprobs"), top_ids=d.get("top_ids"),
                   top_logprobs=d.get("top_logprobs"))


@dataclass
class Episode:
    """One generation of a task: a leaf of the group's tree plus the environment's verdict.

    ``extra_leaves`` holds the ends of earlier contexts of the same episode when a chat
    template was not append-only and the episode continued on a re-rendered branch: those
    tokens were sampled too and are trained on with the same reward.
    """

    leaf: int
    reward: float
    rewards: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    termination: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    extra_leaves: list[int] = field(default_factory=list)
    advantage: float | None = None
    """The advantage a learner gave this episode (trajectory samples of ``treerl learn``; optional)."""
    group: Group | None = field(default=None, repr=False, compare=False)

    # -- views along the root-to-leaf path --------------------------------------------------
    def path(self, leaf: int | None = None) -> list[Segment]:
        assert self.group is not None, "an Episode must belong to a Group"
        return self.group.path(self.leaf if leaf is None else leaf)

    @property
    def token_ids(self) -> list[int]:
        """Every token the model saw and produced, root to leaf."""
        return [t for s in self.path() for t in s.token_ids]

    @property
    def sampled_mask(self) -> list[bool]:
        """True where the policy sampled the token (the loss positions)."""
        return [s.kind == "sampled" for s in self.path() for _ in s.token_ids]

    @property
    def sampler_logprobs(self) -> list[float]:
        """The sampler's log-prob of each token; 0.0 where the token was not sampled."""
        out: list[float] = []
        for s in self.path():
            out.extend(s.logprobs if s.kind == "sampled" and s.logprobs is not None else [0.0] * len(s.token_ids))
        return out

    @property
    def candidates(self) -> list[list[int] | None]:
        """Per token: its candidate set (sampled tokens with a bounded support), else None."""
        out: list[list[int] | None] = []
        for s in self.path():
            if s.kind == "sampled" and s.candidates is not None:
                out.extend(s.candidates)
            else:
                out.extend([None] * len(s.token_ids))
        return out

    @property
    def policy_versions(self) -> list[int | None]:
        return [s.policy_version if s.kind == "sampled" else None for s in self.path() for _ in s.token_ids]

    @property
    def leaves(self) -> list[int]:
        """The leaf of every context of this episode, each once (the main leaf first)."""
        return list(dict.fromkeys([self.leaf, *self.extra_leaves]))

    @property
    def cut_by_token_limit(self) -> bool:
        """Whether a token limit ended the episode: its last turn stopped at ``max_new_tokens`` (finish reason
        ``"length"``) or it reached ``max_episode_tokens`` (termination ``"max_tokens"``): TRL's truncated
        completion, which ``mask_truncated_completions`` leaves out of the loss."""
        last = self.path()[-1]
        return self.termination == "max_tokens" or (last.kind == "sampled" and last.finish_reason == "length")

    @property
    def num_sampled_tokens(self) -> int:
        """Sampled tokens over all of the episode's contexts, each segment counted once."""
        assert self.group is not None, "an Episode must belong to a Group"
        segments = {i for leaf in self.leaves for i in self.group.path_indices(leaf)}
        return sum(len(self.group.segments[i].token_ids) for i in segments if self.group.segments[i].kind == "sampled")

    def to_dict(self) -> dict[str, Any]:
        d = {
            "leaf": self.leaf, "reward": self.reward, "rewards": self.rewards, "messages": self.messages,
            "tool_calls": self.tool_calls, "termination": self.termination, "metrics": self.metrics,
            "extra_leaves": self.extra_leaves,
        }
        if self.advantage is not None:
            d["advantage"] = self.advantage
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Episode:
        return cls(leaf=d["leaf"], reward=d["reward"], rewards=list(d.get("rewards", [])),
                   messages=list(d.get("messages", [])), tool_calls=list(d.get("tool_calls", [])),
                   termination=d.get("termination"), metrics=dict(d.get("metrics", {})),
                   extra_leaves=list(d.get("extra_leaves", [])), advantage=d.get("advantage"))


@dataclass(repr=False)
class Group:
    """All episodes of one task, as one prefix tree."""

    task_key: str
    env_id: str
    segments: list[Segment] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        # Sizes, not contents: Python 3.11's asyncio.run formats the repr of the value its main
        # coroutine returned (signal.getsignal on its SIGINT handler), and a whole group's
        # token ids and candidate sets are megabytes of text, seconds per call of engine.run.
        return (f"Group(task_key={self.task_key!r}, env_id={self.env_id!r}, segments={len(self.segments)}, "
                f"episodes={len(self.episodes)}, tokens={self.num_unique_tokens})")

    def add_segment(self, kind: SegmentKind, token_ids: Sequence[int], *, parent: int | None = None,
                    logprobs: Sequence[float] | None = None, candidates: Sequence[Sequence[int]] | None = None,
                    policy_version: int | None = None, finish_reason: str | None = None,
                    top_ids: Sequence[Sequence[int]] | None = None,
                    top_logprobs: Sequence[Sequence[float]] | None = None) -> int:
        """Append a segment and return its index (parents must already exist)."""
        if parent is not None and not 0 <= parent < len(self.segments):
            raise ValueError(f"parent={parent} does not name an existing segment (have {len(self.segments)}).")
        if kind == "sampled":
            if logprobs is None or len(logprobs) != len(token_ids):
                raise ValueError("A sampled segment needs one sampler log-prob per token.")
            if candidates is not None and len(candidates) != len(token_ids):
                raise ValueError("A sampled segment needs one candidate set per token (or None for the full vocab).")
            if top_logprobs is not None:
                heads = candidates if candidates is not None else top_ids
                if heads is None or len(top_logprobs) != len(token_ids) or any(
                        len(lp) != len(h) for lp, h in zip(top_logprobs, heads)):
                    raise ValueError("top_logprobs needs, per token, one log-prob per candidate (or per top_ids "
                                     "entry when the whole vocabulary is the support).")
        self.segments.append(Segment(
            kind=kind, token_ids=[int(t) for t in token_ids], parent=parent,
            logprobs=[float(x) for x in logprobs] if logprobs is not None else None,
            candidates=[[int(c) for c in cs] for cs in candidates] if candidates is not None else None,
            policy_version=policy_version, finish_reason=finish_reason,
            top_ids=[[int(c) for c in cs] for cs in top_ids] if top_ids is not None else None,
            top_logprobs=[[float(x) for x in lp] for lp in top_logprobs] if top_logprobs is not None else None,
        ))
        return len(self.segments) - 1

    def add_episode(self, leaf: int, reward: float, **kwargs: Any) -> Episode:
        episode = Episode(leaf=leaf, reward=float(reward), group=self, **kwargs)
        self.episodes.append(episode)
        return episode

    def canonicalize(self) -> None:
        """Number the segments in the order the episodes reach them, root to leaf, episode by episode.

        Concurrent episodes add their segments in whatever order their turns finish, so the
        same episodes could come out numbered differently from run to run; the packing of
        the tree (and with it the order of every floating-point sum over it) follows that
        numbering. After this, the same episodes in the same order give the same group.

        >>> g = Group(task_key="k", env_id="demo")
        >>> root = g.add_segment("prompt", [1])
        >>> late = g.add_segment("sampled", [3], parent=root, logprobs=[0.0])
        >>> early = g.add_segment("sampled", [2], parent=root, logprobs=[0.0])
        >>> _ = g.add_episode(leaf=early, reward=0.0)
        >>> _ = g.add_episode(leaf=late, reward=1.0, tool_calls=[{"segment": late}])
        >>> g.canonicalize()
        >>> [s.token_ids for s in g.segments], [e.leaf for e in g.episodes], g.episodes[1].tool_calls
        ([[1], [2], [3]], [1, 2], [{'segment': 2}])
        """
        new_of: dict[int, int] = {}
        for episode in self.episodes:
            for leaf in episode.leaves:
                for s in self.path_indices(leaf):
                    new_of.setdefault(s, len(new_of))
        for s in range(len(self.segments)):  # segments on no episode's path keep their relative order
            new_of.setdefault(s, len(new_of))
        segments: list[Segment] = [self.segments[0]] * len(self.segments)
        for old, new in new_of.items():
            segment = self.segments[old]
            segment.parent = None if segment.parent is None else new_of[segment.parent]
            segments[new] = segment
        self.segments = segments
        for episode in self.episodes:
            episode.leaf = new_of[episode.leaf]
            episode.extra_leaves = [new_of[leaf] for leaf in episode.extra_leaves]
            for call in episode.tool_calls:  # each call record names the sampled segment that made it
                if isinstance(call, dict) and isinstance(call.get("segment"), int):
                    call["segment"] = new_of[call["segment"]]

    def path_indices(self, leaf: int) -> list[int]:
        """Indices of the segments from the root to ``leaf``."""
        out = []
        node: int | None = leaf
        while node is not None:
            out.append(node)
            node = self.segments[node].parent
        return out[::-1]

    def path(self, leaf: int) -> list[Segment]:
        """Segments from the root to ``leaf``."""
        return [self.segments[i] for i in self.path_indices(leaf)]

    @property
    def num_unique_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def packing_ratio(self) -> float:
        """Tokens over all root-to-leaf paths divided by unique tokens in the tree (>= 1)."""
        leaves = [leaf for e in self.episodes for leaf in e.leaves]
        on_paths = sum(len(s.token_ids) for leaf in leaves for s in self.path(leaf))
        unique = self.num_unique_tokens
        return on_paths / unique if unique else 1.0

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes]

    # -- storage ---------------------------------------------------------------------------
    def to_json(self) -> str:
        """One JSON line (no newline). Never fails on episode data: what strict JSON cannot
        spell (``NaN``, huge integers, deep nesting, unknown objects) becomes ``null`` and is
        listed in ``info["unencodable"]``."""
        # The parts are encoded apart, so that what could not be encoded is known before
        # "info", which lists it, is encoded.
        parts, dropped = {}, []
        for key, value in (("task_key", self.task_key), ("env_id", self.env_id),
                           ("segments", [s.to_dict() for s in self.segments]),
                           ("episodes", [e.to_dict() for e in self.episodes])):
            parts[key], lost = dumps_record(value, default=_json_default)
            dropped += [{**d, "path": f"{key}{'' if d['path'].startswith('[') else '.'}{d['path']}"} for d in lost]
        info = {**self.info, "unencodable": dropped[:20]} if dropped else self.info
        parts["info"], lost = dumps_record(info, default=_json_default)
        return (f'{{"schema_version":{SCHEMA_VERSION},"task_key":{parts["task_key"]},"env_id":{parts["env_id"]},'
                f'"info":{parts["info"]},"segments":{parts["segments"]},"episodes":{parts["episodes"]}}}')

    @classmethod
    def from_json(cls, line: str) -> Group:
        d = json.loads(line)
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"Trajectory schema_version {version!r} is not supported (this treerl reads {SCHEMA_VERSION}).")
        group = cls(task_key=d["task_key"], env_id=d["env_id"], info=d.get("info", {}),
                    segments=[Segment.from_dict(s) for s in d["segments"]])
        for e in d["episodes"]:
            episode = Episode.from_dict(e)
            episode.group = group
            group.episodes.append(episode)
        return group


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def make_header(run: Mapping[str, Any]) -> dict[str, Any]:
    """The first line of a trajectory file: what produced the groups under it.

    ``run`` holds what makes episodes comparable (environment and its keyword arguments,
    model, tokenizer, sampling settings, ...): a resumed run must have the same. The
    treerl version and the creation time are recorded too, but not compared.

    >>> make_header({"env_id": "demo"})["run"]
    {'env_id': 'demo'}
    """
    import treerl

    return {HEADER_KEY: SCHEMA_VERSION, "treerl_version": treerl.__version__,
            "created_unix": round(time.time(), 3), "run": dict(run)}


def _is_header(line: str) -> bool:
    return line.lstrip().startswith("{") and f'"{HEADER_KEY}"' in line[:200]


def read_header(path: str | os.PathLike) -> dict[str, Any] | None:
    """The header of a trajectory file, or ``None`` (a file written before headers existed, or empty)."""
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    if not _is_header(first):
        return None
    try:
        header = json.loads(first)
    except ValueError:
        raise ConfigError(f"{path}:1: the header line is not valid JSON; `treerl rollout --repair` cannot fix a "
                          "header: write to another --out.") from None
    return header if isinstance(header, dict) else None


def _read_lines(path: str | os.PathLike) -> Iterator[tuple[int, str, Group | str | None]]:
    """``(line number, line, group)`` per line; the group is the reason when the line is unreadable,
    ``None`` for the header, blank lines and a torn last line (the writer was killed mid-write)."""
    # Line by line: a file of many groups is never held whole. Only the last line can lack its newline.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.decode("utf-8", errors="replace")
            group: Group | str | None = None
            if line.strip() and not (lineno == 1 and _is_header(line)):
                try:
                    group = Group.from_json(raw.decode("utf-8"))
                except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:  # UnicodeDecodeError too
                    torn = not raw.endswith(b"\n") and isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError))
                    group = None if torn else exc.msg if isinstance(exc, json.JSONDecodeError) else (
                        f"{type(exc).__name__}: {exc}")
            yield lineno, line, group


def read_groups(path: str | os.PathLike) -> Iterator[Group]:
    """Yield the groups stored in a JSON Lines file (its header line is skipped).

    A torn last line (the writer was killed mid-write) is skipped; any other bad line raises
    :class:`~treerl.errors.ConfigError` (a ``ValueError``) with its line number.
    """
    for lineno, _, group in _read_lines(path):
        if isinstance(group, str):
            raise ConfigError(f"{path}:{lineno}: not a valid trajectory line ({group[:200]}). Rerun `treerl rollout` "
                              "with --repair to move unreadable lines aside and resume, or repair_trajectory_file().")
        if group is not None:
            yield group


def read_all_groups(path: str | os.PathLike) -> list[Group]:
    """Every group stored in a JSON Lines file, as a list: ``list(read_groups(path))``, faster.

    The groups read are kept, so the cyclic garbage collector's full passes, which the growing
    heap sets off, walk every token list read so far and free nothing (each group is a
    reference cycle, as its episodes refer back to it, so it is these passes that free a
    dropped one). Here collection is paused while the file is read: only this function's
    parsing runs meanwhile, and it leaves no cyclic garbage. On 3,000 groups that takes 0.6-0.75x
    the time of ``list(read_groups(path))`` (BENCHMARKS.md, "Reading trajectory files").
    """
    with _collection_paused():
        return list(read_groups(path))


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Automatic garbage collection off for the block, then as it was (a caller may have turned it off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def is_foreign_file(path: str | os.PathLike) -> bool:
    """True when ``path`` holds lines but neither a header nor one trajectory group: another kind of
    file (a dataset, notes), which no command may append to, repair or replace. Reads up to its first group.
    """
    foreign = False
    for lineno, line, group in _read_lines(path):
        if isinstance(group, Group) or (lineno == 1 and _is_header(line)):
            return False
        foreign = foreign or isinstance(group, str)
    return foreign


def _not_a_trajectory_file(path: str | os.PathLike) -> ConfigError:
    return ConfigError(f"{path} is not a treerl trajectory file (no line of it is a trajectory group); pass "
                       "another --out.")


def repair_trajectory_file(path: str | os.PathLike) -> list[int]:
    """Move unreadable lines of a trajectory file to ``PATH.corrupt``; returns their line numbers.

    Each moved line is appended to the quarantine file as ``{"line": N, "text": ...}``; the
    file is rewritten without them (atomically, through a temporary file), so that a resumed
    run plays their tasks again. A file without one readable group or header is refused:
    it is not a trajectory file.
    """
    path = Path(path)
    kept: list[str] = []
    bad: list[tuple[int, str]] = []
    readable = False
    for lineno, line, group in _read_lines(path):
        if isinstance(group, str):
            bad.append((lineno, line))
        else:
            readable = readable or group is not None or (lineno == 1 and _is_header(line))
            if line.endswith("\n"):  # a torn last line is dropped here, as the writer would
                kept.append(line)
    if not bad:
        return []
    if not readable:
        raise _not_a_trajectory_file(path)
    with open(path.with_name(path.name + ".corrupt"), "a", encoding="utf-8") as quarantine:
        for lineno, line in bad:
            quarantine.write(json.dumps({"file": str(path), "line": lineno, "text": line}) + "\n")
    tmp = path.with_name(path.name + ".repair.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return [lineno for lineno, _ in bad]


class GroupWriter:
    """Appends groups to a JSON Lines file, one flushed line per group.

    Opening an existing file cuts off a torn last line (left by a killed writer), so a
    resumed run appends after the last complete group and never leaves a broken line.

    Args:
        path: The output file; created with its parent directories.
        fsync: Also ``os.fsync`` after each group (survives a machine crash, not only a
            killed process).
        header: What produced the groups (see :func:`make_header`): written as the first
            line of a new file; an existing file's header must have the same ``run``, else
            :class:`~treerl.errors.ConfigError` names what differs. An existing file without
            a header (written before headers existed) must hold groups of the same
            ``run["env_id"]`` only.
    """

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False, header: Mapping[str, Any] | None = None):
        self.path = Path(path)
        self.fsync = fsync
        if header is not None and self.path.exists() and self.path.stat().st_size > 0:
            _check_resumable(self.path, header)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _truncate_torn_tail(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if header is not None and os.fstat(self._fd).st_size == 0:
            self._write_line(json.dumps(dict(header), separators=(",", ":"), default=str))

    def finished_keys(self) -> set[str]:
        return {g.task_key for g in read_groups(self.path)} if self.path.exists() else set()

    def write(self, group: Group) -> None:
        self._write_line(group.to_json())

    def _write_line(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        # One write() call per line on an O_APPEND descriptor: a kill leaves at most a torn tail.
        written = 0
        while written < len(data):
            written += os.write(self._fd, data[written:])
        if self.fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> GroupWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_resumable(path: Path, header: Mapping[str, Any]) -> None:
    """Refuse to append to a file whose groups came from another run setup."""
    run = dict(header.get("run") or {})
    existing = read_header(path)
    if existing is not None:
        before = dict(existing.get("run") or {})
        differ = [k for k in dict.fromkeys([*run, *before]) if run.get(k) != before.get(k)]  # env_id first
        if differ:
            details = "; ".join(f"{k}: file has {before.get(k)!r}, this run {run.get(k)!r}" for k in differ[:4])
            raise ConfigError(f"{path} holds trajectories of another setup ({details}), so resuming into it would mix "
                              "them. Pass another --out, or the file's settings.")
        return
    if is_foreign_file(path):  # not a file written before headers existed: --repair would not make it one
        raise _not_a_trajectory_file(path)
    env_id = run.get("env_id")
    others = sorted({g.env_id for g in read_groups(path)} - {env_id}) if env_id is not None else []
    if others:
        raise ConfigError(f"{path} holds trajectories of {others[0]!r}, not {env_id!r}, so resuming into it would mix "
                          "environments. Pass another --out, or --env " + others[0] + ".")


def _truncate_torn_tail(path: Path) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        # Back from the end to the last newline, a block at a time: the file may hold gigabytes of groups.
        cut = end
        while cut > 0:
            start = max(0, cut - (1 << 16))
            f.seek(start)
            newline = f.read(cut - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
            cut = start
        f.truncate(0)  # the only line is torn


def to_flat_records(groups: Sequence[Group] | Iterator[Group]) -> Iterator[dict[str, Any]]:
    """Per-episode flat records for trainers that do not read trees (TRL-style fields).

    ``prompt_ids`` is the root segment; ``completion_ids`` the rest of the path, with
    ``completion_mask`` marking sampled tokens and ``sampler_logprobs`` their log-probs
    (0.0 elsewhere) (GRPOTrainer's names). For SFTTrainer, the whole sequence: ``input_ids``
    with ``labels`` (-100 where the token was not sampled: prompt, tool results, template glue)
    and ``assistant_masks`` (1 where it was). ``answer`` and ``info`` (the dataset row's other
    columns, when the environment kept them) come from the task.
    """
    for g in groups:
        for i, e in enumerate(g.episodes):
            path = e.path()
            n_prompt = len(path[0].token_ids)
            ids, mask, logps = e.token_ids, e.sampled_mask, e.sampler_logprobs
            yield {
                "task_key": g.task_key,
                "env_id": g.env_id,
                "episode": i,
                "prompt_ids": ids[:n_prompt],
                "completion_ids": ids[n_prompt:],
                "completion_mask": [int(m) for m in mask[n_prompt:]],
                "sampler_logprobs": logps[n_prompt:],
                "input_ids": list(ids),
                "labels": [t if m else -100 for t, m in zip(ids, mask)],
                "assistant_masks": [int(m) for m in mask],
                "answer": g.info.get("answer"),
                "info": g.info.get("row") or {},
                "reward": e.reward,
                "messages": e.messages,
                "termination": e.termination,
            }


# -- trajectory samples of a learn run ------------------------------------------------------------

TRAJECTORIES_DIR = "trajectories"
"""Where ``treerl learn`` keeps its trajectory samples inside its output directory."""


def sample_path(out_dir: str | os.PathLike, step: int) -> Path:
    """The sample file of step ``step`` (1-based, as in ``metrics.jsonl``).

    >>> sample_path("runs/x", 10).as_posix()
    'runs/x/trajectories/step-000010.jsonl'
    """
    return Path(out_dir) / TRAJECTORIES_DIR / f"step-{step:06d}.jsonl"


def sample_files(out_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, file) of every trajectory sample in a learn output directory, by step."""
    folder = Path(out_dir) / TRAJECTORIES_DIR
    found = []
    for path in folder.glob("step-*.jsonl") if folder.is_dir() else ():
        digits = path.stem.removeprefix("step-")
        if digits.isdigit():
            found.append((int(digits), path))
    return sorted(found)
