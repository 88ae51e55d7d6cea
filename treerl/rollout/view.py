"""``treerl view``: trajectory trees in a browser, as one self-contained HTML file that works offline.

The page is the template and scripts of ``treerl/rollout/viewer/`` (real HTML, CSS and
JavaScript files shipped with the package) with the data inlined, so the result is one
file with no network requests: its Content-Security-Policy forbids any. What it shows:

- a list of groups (step, task, episodes, reward mean/std, success, packing ratio, sampled
  tokens, tool-call errors) that filters (``reward>0.5``, ``seed-12``) and sorts;
- a group as a tree: the shared prompt once, branches where episodes diverge (sibling
  samples are merged token by token, so a branch starts at the first differing token),
  sampled and environment tokens told apart, tool calls with their outcome next to the
  turn that made them, the reward and advantage at each leaf, the policy version per span;
- per-token colouring on demand: the sampler's log-prob, and the sampler/trainer ratio
  where a learner stored the trainer's log-probs (``treerl learn``'s trajectory samples).

Large files stay usable: the page parses a small index up front (one row per group) and
each group's data (token ids and log-probs as base64 little-endian arrays) only when it is
opened; the list and the branches render lazily.

Token text comes from the tokenizer that produced the ids (``--model``; for a learn output
directory its saved model, for a trajectory file the model its header names, else the
shipped tiny model): each used id's bytes are stored
once, and the page decodes a segment's bytes as UTF-8 in stream mode, so a character split
over several byte-level tokens is shown whole, at the token that completes it.

>>> from treerl.rollout.trajectory import Group
>>> g = Group(task_key="seed-0", env_id="demo")
>>> root = g.add_segment("prompt", [1, 2])
>>> leaf = g.add_segment("sampled", [3], parent=root, logprobs=[-0.5])
>>> _ = g.add_episode(leaf=leaf, reward=1.0)
>>> row = group_row(g)
>>> row["episodes"], row["reward_mean"], row["success"], row["sampled_tokens"]
(1, 1.0, 1.0, 1.0)
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from treerl.config import field_help
from treerl.errors import ConfigError
from treerl.rollout.trajectory import TRAJECTORIES_DIR, Group, read_all_groups, read_groups, read_header, sample_files

__all__ = ["ViewConfig", "SourcedGroup", "load_groups", "group_row", "group_payload", "token_pieces",
           "build_html", "write_view"]

KIND_CODES = {"prompt": 0, "sampled": 1, "env": 2}
ASSETS = ("data.js", "list.js", "tree.js", "app.js")
"""The viewer's scripts, inlined in this order (each adds to one namespace object)."""


@dataclass
class ViewConfig:
    """Options of ``treerl view``."""

    paths: list[str] = field_help(help="Trajectory files (JSON Lines) or `treerl learn` output directories.",
                                  default_factory=list, metadata={"cli": False})
    out: str | None = field_help(None, "The HTML file to write (default: view.html in the run directory, or the "
                                       "trajectory file's name with .html).")
    model: str | None = field_help(None, "Model directory whose tokenizer decodes the tokens (default: a run's "
                                         "saved model, or the model a trajectory file's header names, else the "
                                         "shipped tiny model).")
    title: str | None = field_help(None, "Page title (default: the sources' names).")

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("paths: name a trajectory file or a learn output directory (treerl view r.jsonl).")


@dataclass
class SourcedGroup:
    """A group and where it came from (a learn run's step, or none)."""

    group: Group
    source: str
    step: int | None = None


# -- reading ----------------------------------------------------------------------------------------


def load_groups(paths: Sequence[str | os.PathLike]) -> list[SourcedGroup]:
    """Every group of the given trajectory files and learn output directories, in order."""
    out: list[SourcedGroup] = []
    for p in map(Path, paths):
        if p.is_dir():
            samples = sample_files(p)
            if not samples and not any((p / name).exists() for name in ("config.json", "metrics.jsonl")):
                raise ConfigError(f"{p}: not a `treerl learn` output directory (no config.json, metrics.jsonl or "
                                  f"{TRAJECTORIES_DIR}/); pass a learn --output-dir or a trajectory file (treerl "
                                  "rollout, eval or serve --out FILE).")
            if not samples:
                raise ConfigError(f"{p}: no trajectory samples in {p / TRAJECTORIES_DIR}; `treerl learn` keeps them "
                                  "with --sample-groups N (default 4) every --sample-every steps, or pass a "
                                  "trajectory file written by `treerl rollout --out FILE`.")
            for step, path in samples:
                out.extend(SourcedGroup(g, source=p.name, step=step) for g in read_all_groups(path))
        elif p.is_file():
            before = len(out)
            try:
                out.extend(SourcedGroup(g, source=p.name) for g in read_groups(p))
            except (ValueError, KeyError) as exc:
                if len(out) == before and not _starts_with_header(p):  # no line of it is ours: another kind of file
                    raise ConfigError(f"{p}: not a trajectory file (its first line is neither a treerl header nor a "
                                      "group); pass a file written by treerl rollout, eval or serve --out, or a "
                                      "learn output directory.") from None
                raise ConfigError(f"{p}: not a trajectory file ({exc}).") from None
        else:
            raise ConfigError(f"{p}: no such file or directory; pass a trajectory file (treerl rollout --out) or a "
                              "learn output directory.")
    return out


def _starts_with_header(path: Path) -> bool:
    try:
        return read_header(path) is not None
    except (ValueError, OSError):  # a header line that is not JSON is still a trajectory file's
        return True


def default_tokenizer_dir(paths: Sequence[str | os.PathLike]) -> str | None:
    """The tokenizer a view of ``paths`` decodes with when none is named: a run's own model, or the
    model a trajectory file's header names (``None``: the shipped tiny model)."""
    for p in map(Path, paths):
        if (p / "model" / "tokenizer_config.json").is_file():
            return str(p / "model")
        config = p / "config.json"
        if p.is_dir() and config.is_file():
            model = json.loads(config.read_text()).get("model")
            if model:
                return model
        if p.is_file():
            # treerl rollout and treerl eval record --model in the header; its ids are that tokenizer's.
            model = ((read_header(p) or {}).get("run") or {}).get("model")
            if model:
                return model
    return None


def load_tokenizer(path: str | None) -> Any:
    """A tokenizer from a local model directory, a shipped model's name or a cached Hub id, offline
    (``None``: the shipped tiny model's)."""
    from transformers import AutoTokenizer

    from treerl.models import model_directory

    try:
        target = model_directory(path)
    except ConfigError:
        raise ConfigError(f"model {path!r} is not a directory here (nor a Hub id in the Hugging Face cache); pass "
                          "the model directory whose tokenizer wrote the trajectories with --model, or --model tiny "
                          "for the shipped tiny model.") from None
    try:
        return AutoTokenizer.from_pretrained(target, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {path}: no tokenizer could be loaded from it ({exc}).") from None


# -- tokens to text -------------------------------------------------------------------------------


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable stand-in character of each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_pieces(tokenizer: Any, ids: Iterable[int]) -> dict[int, str | list[int]]:
    """Each id's bytes: a string where they are valid UTF-8 alone, else the list of byte values.

    Byte-level BPE tokens map back through GPT-2's byte alphabet, SentencePiece byte
    fallbacks (``<0x0A>``) to their byte, ``▁`` to a space, added tokens to their text.
    """
    added = {int(i): t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)
    alphabet = _byte_level_alphabet()
    pieces: dict[int, str | list[int]] = {}
    for i in sorted(set(int(t) for t in ids)):
        token = added.get(i)
        if token is not None:
            raw = token.encode("utf-8")
        else:
            token = tokenizer.convert_ids_to_tokens(i)
            if token is None:
                raw = f"<unknown id {i}>".encode()
            elif byte_level and all(c in alphabet for c in token):
                raw = bytes(alphabet[c] for c in token)
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                raw = bytes([int(token[3:5], 16)])
            else:
                raw = token.replace("\u2581", " ").encode("utf-8")
        try:
            pieces[i] = raw.decode("utf-8")
        except UnicodeDecodeError:
            pieces[i] = list(raw)
    return pieces


# -- the index and the payloads -----------------------------------------------------------------------


def group_row(group: Group, step: int | None = None, source: str = "", success_threshold: float = 1.0) -> dict:
    """The list's row of one group: what it shows, filters and sorts by."""
    rewards = group.rewards
    n = max(len(rewards), 1)
    mean = sum(rewards) / n
    finals = [e.rewards[-1] if e.rewards else e.reward for e in group.episodes]
    calls = [r for e in group.episodes for r in e.tool_calls]
    return {
        "step": step,
        "source": source,
        "task": group.task_key,
        # An EnvGroup's member (the run's env_id names them all): what a filter on the name should find.
        "env": group.info["env"] if isinstance(group.info.get("env"), str) else group.env_id,
        "answer": _short(group.info.get("answer")),
        "episodes": len(group.episodes),
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "success": sum(f >= success_threshold for f in finals) / n,
        "packing": group.packing_ratio,
        "sampled_tokens": sum(e.num_sampled_tokens for e in group.episodes) / n,
        "tool_errors": sum(1 for r in calls if r.get("error")),
        "tool_calls": len(calls),
    }


def _short(value: Any, limit: int = 80) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _b64(values: Sequence[float] | Sequence[int], dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode("ascii")


def group_payload(group: Group, id_dtype: str = "<u4") -> dict[str, Any]:
    """One group's data for the page: segments with base64 arrays, episodes, tool calls."""
    segments = []
    for s in group.segments:
        segments.append([
            KIND_CODES[s.kind], s.parent, _b64(s.token_ids, id_dtype),
            _b64(s.logprobs, "<f4") if s.logprobs is not None else None,
            _b64(s.trainer_logprobs, "<f4") if s.trainer_logprobs is not None else None,
            s.policy_version, s.finish_reason,
        ])
    episodes = []
    for e in group.episodes:
        calls = [[r.get("segment"), r.get("name"), r.get("arguments"), r.get("error"), r.get("message")]
                 for r in e.tool_calls]
        episodes.append({"l": e.leaf, "x": e.extra_leaves, "r": e.reward, "rs": e.rewards, "a": e.advantage,
                         "t": e.termination, "n": e.metrics.get("turns"), "c": calls})
    info = {k: v for k, v in group.info.items() if k not in ("sampling",)}
    return {"s": segments, "e": episodes, "i": info}


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element: no "</script>" or "<!--" can appear."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                      default=str).replace("<", "\\u003c")


def build_html(groups: Sequence[SourcedGroup], tokenizer: Any, *, title: str = "treerl view") -> str:
    """The whole page: template, styles, scripts and data in one string."""
    ids = {t for sg in groups for s in sg.group.segments for t in s.token_ids}
    id_dtype = "<u2" if max(ids, default=0) < 2**16 else "<u4"
    rows = [group_row(sg.group, sg.step, sg.source) for sg in groups]
    columns = {key: [r[key] for r in rows] for key in (rows[0] if rows else group_row(Group("", "")))}
    index = {
        "title": title,
        "idBytes": 2 if id_dtype == "<u2" else 4,
        "vocab": {str(k): v for k, v in token_pieces(tokenizer, ids).items()},
        "columns": columns,
        "hasSteps": any(sg.step is not None for sg in groups),
        "hasTrainer": any(s.trainer_logprobs is not None for sg in groups for s in sg.group.segments),
        "hasAdvantage": any(e.advantage is not None for sg in groups for e in sg.group.episodes),
    }
    payloads = "\n".join(_script_json(group_payload(sg.group, id_dtype)) for sg in groups)
    assets = resources.files("treerl.rollout") / "viewer"
    parts = {
        "title": html.escape(title),
        "css": (assets / "viewer.css").read_text(encoding="utf-8"),
        "index": _script_json(index),
        "groups": payloads,
        "js": "\n".join((assets / name).read_text(encoding="utf-8") for name in ASSETS),
    }
    template = (assets / "index.html").read_text(encoding="utf-8")
    # One pass over the template's markers, so inserted text is never scanned for markers again.
    return re.sub(r"<!--treerl:(\w+)-->", lambda m: parts[m.group(1)], template)


def default_out(paths: Sequence[str | os.PathLike]) -> Path:
    first = Path(paths[0])
    return first / "view.html" if first.is_dir() else first.with_suffix(".html")


def write_view(cfg: ViewConfig) -> tuple[Path, int]:
    """Build the page for ``cfg.paths`` into ``cfg.out``; returns the file and its number of groups."""
    groups = load_groups(cfg.paths)
    tokenizer = load_tokenizer(cfg.model or default_tokenizer_dir(cfg.paths))
    title = cfg.title or "treerl view: " + ", ".join(Path(p).name or str(p) for p in cfg.paths)
    out = Path(cfg.out) if cfg.out else default_out(cfg.paths)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_html(groups, tokenizer, title=title), encoding="utf-8")
    return out, len(groups)
