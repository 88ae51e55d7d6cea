"""Batched decoding for :class:`~treerl.agents.transformers_policy.TransformersPolicy`: one decode
loop, and continuous batching on top of it.

:class:`DecodeBatch` holds rows that decode together in one left-padded KV cache. Rows join
between decode steps (:meth:`DecodeBatch.admit`: each new context is prefilled once and its
keys and values placed so that every row ends at the same column) and leave when they stop
(:meth:`DecodeBatch.step` returns them). Each row keeps its own ``position_ids`` and its own
stream of uniforms (seeded by its request), so a row samples the same tokens whether it
decodes alone, in a static batch, or joins a running one (up to the padded attention's float
order).

:class:`ContinuousDecoder` runs a :class:`DecodeBatch` in a worker thread for
``agenerate``: requests that arrive while others decode join at the next step instead of
waiting for the whole batch, and each result is handed back as soon as its row stops. A
weight update waits for the rows in flight to finish (new rows are held back meanwhile), so
every generation is sampled by one weights version.

A request with a repetition penalty reads which ids its context holds: from the admission of
the first such row until the batch empties, the batch keeps a (B, V) mask of them (``seen``),
built from each row's ``prompt_ids`` and tokens and updated with every sampled token.

A request with an ``on_token`` callback (streaming) is handed each token as its row samples it
(with its log-prob and head, as the generation records them), in the decode thread; the others
pay one ``is None`` test per token.

Cache layout per layer: keys (B, Hkv, capacity, D) in a buffer; columns ``[start_b, cur)``
of row ``b`` hold its context, columns before ``start_b`` are left padding. When every row's
context starts with the same ``P`` tokens (a group's prompt) and the policy allows it, those
are kept once, ``(1, Hkv, P, D)`` per layer in ``prefix``, the buffer holds only what follows
them, and decode steps attend to both (:mod:`treerl.agents.cascade`). Rows that join without
the whole prefix cut it to what they share, moving the rest into every row's own columns.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
import time
from typing import Any

import torch
from torch import Tensor

from treerl.agents.cascade import CascadeState
from treerl.agents.policy import Generation, GenerationRequest, SamplingParams, StreamedToken
from treerl.agents.sampling import context_mask

__all__ = ["DecodeBatch", "ContinuousDecoder", "Unit", "Row"]

# Per layer: (keys, values), each (rows, kv_heads, seq, head_dim).
KV = list[tuple[Tensor, Tensor]]


@dataclass
class Unit:
    """One prefill: a context run through the model once and shared by ``rows`` (request indices)."""

    prompt_ids: list[int]
    past: KV | None
    """Keys and values of ``prompt_ids[:num_past]`` from a session, or None."""
    num_past: int
    rows: list[int] = field(default_factory=list)
    shared_processed: int = 0
    """Prompt tokens run for this unit before its own prefill (a prefix it shares with other
    units, prefilled once): counted on its first row, so a shared prefix is counted once."""
    keep: bool = False
    """Keep the context's keys and values after the prefill as a prefix later prompts may share."""


@dataclass
class Row:
    """One request being decoded."""

    index: int
    """Position in the caller's request list (or the order of arrival)."""
    request: GenerationRequest
    stop_ids: frozenset[int]
    version: int
    """The weights version the row is sampled with."""
    num_prompt_tokens_processed: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    candidates: list[list[int]] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    uniforms: Tensor | None = None
    """(max_new_tokens,) the row's own stream, seeded by its request."""
    deliver: Callable[[Generation | BaseException], None] | None = None
    """Continuous decoding: hands the result (or an error) back to the awaiting caller."""

    def generation(self) -> Generation:
        return Generation(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            candidates=self.candidates,
            finish_reason="stop" if self.token_ids[-1] in self.stop_ids else "length",
            policy_version=self.version,
            num_prompt_tokens_processed=self.num_prompt_tokens_processed,
            top_ids=self.top_ids,
            top_logprobs=self.top_logprobs,
        )


def uniform_stream(request: GenerationRequest, device: torch.device) -> Tensor:
    """(max_new_tokens,) uniforms from a generator seeded by the request (fresh entropy when unseeded).

    The stream depends on nothing else, so a row's samples do not depend on its batch.
    """
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    n = request.params.max_new_tokens
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float().to(device)


class DecodeBatch:
    """Rows decoding together; see the module docstring for the cache layout."""

    def __init__(self, policy: Any):
        # `policy` is the TransformersPolicy whose model, prefill, sampling and sessions the batch uses.
        self.policy = policy
        self._reset()

    def _reset(self) -> None:
        self.rows: list[Row] = []
        self.start: list[int] = []  # first real column of each row
        self.cur = 0  # columns filled, the same for every row
        self.cache = None
        self.logits: Tensor | None = None  # (B, V) the next token's logits of each row
        self.seen: Tensor | None = None  # (B, V) bool, the ids in each row's context (with a repetition penalty)
        self._partitions = None
        self.prefix_ids: list[int] = []  # tokens every row starts with, kept once (see the module docstring)
        self.prefix: KV | None = None  # their keys and values, (1, Hkv, P, D) per layer

    def __len__(self) -> int:
        return len(self.rows)

    def admit(self, units: list[Unit], rows: list[list[Row]]) -> None:
        """Prefill each unit once and add its rows (``rows[u]`` share unit ``u``'s context)."""
        from transformers import DynamicCache

        prefilled = [self.policy._prefill(unit) for unit in units]
        if not self.rows:
            self._start_prefix(units, rows, prefilled)
        elif self.prefix is not None:
            shared = min(_common_len(self.prefix_ids, unit.prompt_ids) for unit in units)
            if shared < len(self.prefix_ids):
                num_rows = len(self.rows) + sum(map(len, rows))
                self._cut_prefix(shared if self._pays(num_rows, shared, self.prefix[0][0]) else 0)
        num_prefix = len(self.prefix_ids)
        new_rows, new_lens, new_logits = [], [], []
        for unit, unit_rows, (_, logits, num_run) in zip(units, rows, prefilled):
            for j, row in enumerate(unit_rows):
                row.num_prompt_tokens_processed = num_run + unit.shared_processed if j == 0 else 0
                row.uniforms = uniform_stream(row.request, self.policy.device)
                new_rows.append(row)
                new_lens.append(len(unit.prompt_ids) - num_prefix)  # what the row keeps beyond the prefix
            new_logits.append(logits.expand(len(unit_rows), -1))

        # The new layout: old columns from the first one any row still needs, shifted right so
        # that the longest new context fits before `cur`; room after `cur` for every row's steps.
        first = min(self.start, default=0)
        cur = max(self.cur - first, max(new_lens))
        shift = cur - (self.cur - first)
        everyone = self.rows + new_rows
        capacity = cur + max(r.request.params.max_new_tokens - len(r.token_ids) for r in everyone)
        reference = prefilled[0][0]
        growing_layer = _growing_layer_class()
        cache = DynamicCache()
        for layer_idx, (k0, v0) in enumerate(reference):
            keys = k0.new_zeros(len(everyone), k0.shape[1], capacity, k0.shape[3])  # (B, H, capacity, D)
            values = v0.new_zeros(len(everyone), v0.shape[1], capacity, v0.shape[3])
            if self.rows:
                old = self.cache.layers[layer_idx]
                keys[: len(self.rows), :, shift:cur] = old.keys[:, :, first:]
                values[: len(self.rows), :, shift:cur] = old.values[:, :, first:]
            b = len(self.rows)
            for unit, unit_rows, (kv, _, _) in zip(units, rows, prefilled):
                stop, length = b + len(unit_rows), len(unit.prompt_ids) - num_prefix
                keys[b:stop, :, cur - length : cur] = kv[layer_idx][0][:, :, num_prefix:]
                values[b:stop, :, cur - length : cur] = kv[layer_idx][1][:, :, num_prefix:]
                b = stop
            cache.layers.append(growing_layer(keys, values, cur))
        # Once built, the mask covers every row until the batch empties, joiners without a penalty included.
        if self.seen is not None or any(row.request.params.repetition_penalty != 1.0 for row in everyone):
            vocab_size = new_logits[0].shape[-1]
            old = self.seen if self.seen is not None else self._context_mask(self.rows, vocab_size)
            self.seen = torch.cat([old, self._context_mask(new_rows, vocab_size)])
        self.start = [s - first + shift for s in self.start] + [cur - n for n in new_lens]
        self.cache, self.cur, self.rows = cache, cur, everyone
        self.logits = torch.cat([self.logits, *new_logits]) if self.logits is not None else torch.cat(new_logits)
        self._partitions = None

    def _context_mask(self, rows: list[Row], vocab_size: int) -> Tensor:
        """(len(rows), V) bool: the ids of each row's whole context (prompt and sampled tokens)."""
        return context_mask([list(row.request.prompt_ids) + row.token_ids for row in rows], vocab_size,
                            self.policy.device)

    def _start_prefix(self, units: list[Unit], rows: list[list[Row]], prefilled: list) -> None:
        """A fresh batch: keep the prefix every new row shares once, if the policy allows and it pays."""
        self.prefix_ids, self.prefix = [], None
        if self.policy.cascade_reason is not None:
            return
        shared = min(_common_len(units[0].prompt_ids, unit.prompt_ids) for unit in units)
        if self._pays(sum(map(len, rows)), shared, prefilled[0][0][0][0]):
            self.prefix_ids = units[0].prompt_ids[:shared]
            self.prefix = [(k[:, :, :shared], v[:, :, :shared]) for k, v in prefilled[0][0]]

    def _pays(self, num_rows: int, shared: int, keys: Tensor) -> bool:
        """Whether ``num_rows`` rows' copies of ``shared`` tokens are worth keeping once (``keys``: a layer's, (1, Hkv, T, D))."""
        return num_rows >= 2 and num_rows * shared * keys.shape[1] * keys.shape[3] >= self.policy.min_cascade_kv

    def _cut_prefix(self, keep: int) -> None:
        """Keep only the first ``keep`` prefix tokens shared; the rest is copied into every row's
        own columns, right before them (each row's left padding stays where it was)."""
        moved = len(self.prefix_ids) - keep
        growing_layer = _growing_layer_class()
        layers = []
        for layer, (prefix_k, prefix_v) in zip(self.cache.layers, self.prefix):
            buffers = []
            for old, prefix in ((layer._key_buffer, prefix_k), (layer._value_buffer, prefix_v)):
                new = old.new_zeros(old.shape[0], old.shape[1], old.shape[2] + moved, old.shape[3])
                new[:, :, moved : self.cur + moved] = old[:, :, : self.cur]
                for b, start in enumerate(self.start):
                    new[b, :, start : start + moved] = prefix[0, :, keep:]
                buffers.append(new)
            layers.append(growing_layer(buffers[0], buffers[1], self.cur + moved))
        self.cache.layers[:] = layers
        self.cur += moved
        self.prefix_ids = self.prefix_ids[:keep]
        self.prefix = [(k[:, :, :keep], v[:, :, :keep]) for k, v in self.prefix] if keep else None

    def _row_kv(self, b: int) -> KV:
        """Batch row b's whole context: a copy, (1, Hkv, T, D) per layer."""
        start, own = self.start[b], [(layer.keys, layer.values) for layer in self.cache.layers]
        if self.prefix is None:
            return [(k[b : b + 1, :, start:].clone(), v[b : b + 1, :, start:].clone()) for k, v in own]
        return [(torch.cat([pk, k[b : b + 1, :, start:]], dim=2), torch.cat([pv, v[b : b + 1, :, start:]], dim=2))
                for (pk, pv), (k, v) in zip(self.prefix, own)]

    def step(self) -> list[Row]:
        """Sample one token for every row; returns the rows that stopped (their session saved),
        and runs the others' new tokens through the model for the next step."""
        if self._partitions is None:
            self._partitions = _partition([row.request.params for row in self.rows], self.policy.device)
        uniforms = torch.stack([row.uniforms[len(row.token_ids)] for row in self.rows])  # (B,)
        token_ids, logprobs, candidates, heads = self.policy._sample_step(self.logits, self._partitions, uniforms,
                                                                          self.seen)
        if self.seen is not None:  # the new tokens are context from the next step on
            self.seen[torch.arange(len(self.rows), device=self.seen.device), token_ids] = True
        token_list, logprob_list = token_ids.tolist(), logprobs.tolist()
        finished: list[Row] = []
        keep: list[int] = []
        for b, row in enumerate(self.rows):
            token = token_list[b]
            row.token_ids.append(token)
            row.logprobs.append(logprob_list[b])
            if row.request.on_token is not None:  # a streamed request: its token, as soon as it exists
                row.request.on_token(_streamed(token, logprob_list[b], candidates[b] if candidates else None, heads[b]))
            if candidates is not None and candidates[b] is not None:
                if row.candidates is None:
                    row.candidates = []
                row.candidates.append(candidates[b])
            if heads[b] is not None:
                head_ids, head_logprobs = heads[b]
                if row.top_logprobs is None:
                    row.top_logprobs, row.top_ids = [], None if head_ids is None else []
                row.top_logprobs.append(head_logprobs)
                if head_ids is not None:
                    row.top_ids.append(head_ids)
            if token in row.stop_ids or len(row.token_ids) >= row.request.params.max_new_tokens:
                # The cache holds the context and every sampled token but this last one.
                self.policy._save_session(row, functools.partial(self._row_kv, b))
                finished.append(row)
            else:
                keep.append(b)
        self.drop(keep, token_ids)
        return finished

    def drop(self, keep: list[int], token_ids: Tensor | None = None) -> None:
        """Keep only batch rows ``keep``; with ``token_ids`` (B,), run their new tokens through the model."""
        if not keep:
            self._reset()  # empty: the cache goes, the next admission starts afresh
            return
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, device=self.policy.device)
            self.cache.batch_select_indices(index)
            self.rows = [self.rows[b] for b in keep]
            self.start = [self.start[b] for b in keep]
            self.logits = self.logits[index]
            if self.seen is not None:
                self.seen = self.seen[index]
            if token_ids is not None:
                token_ids = token_ids[index]
            self._partitions = None
        if token_ids is None:
            return
        start = torch.tensor(self.start, device=self.policy.device)  # (B,)
        position_ids = (len(self.prefix_ids) + self.cur - start).unsqueeze(1)  # (B, 1) real tokens before the new one
        valid = None
        if any(self.start):  # left padding somewhere: mask it (new column included)
            valid = torch.arange(self.cur + 1, device=start.device) >= start.unsqueeze(1)  # (B, cur + 1)
        if self.prefix is None:
            attention_mask = None if valid is None else valid.long()
            self.logits = self.policy._forward(token_ids.unsqueeze(1), position_ids, self.cache, attention_mask)
        else:
            state = CascadeState(self.prefix, valid)
            self.logits = self.policy._forward(token_ids.unsqueeze(1), position_ids, self.cache, None, cascade=state)
        self.cur += 1


class ContinuousDecoder:
    """Runs a :class:`DecodeBatch` in a worker thread; requests join between steps (see the module docstring)."""

    def __init__(self, policy: Any, *, wait_s: float = 0.001):
        self.policy = policy
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._pending: list[tuple[GenerationRequest, Callable[[Generation | BaseException], None]]] = []
        self._batch = DecodeBatch(policy)
        self._thread: threading.Thread | None = None
        self._paused = 0
        self._stopping = False

    async def submit(self, request: GenerationRequest) -> Generation:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def deliver(result: Generation | BaseException) -> None:
            def settle() -> None:
                if future.done():  # the caller gave up (cancelled): nothing to hand back
                    return
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the caller's event loop is closed
                pass

        with self._cond:
            self._pending.append((request, deliver))
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="treerl-decode", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return await future

    def pause(self) -> None:
        """Hold new rows back and wait until the rows in flight are done (a weight update follows)."""
        with self._cond:
            self._paused += 1
            self._cond.wait_for(lambda: len(self._batch) == 0)

    def resume(self) -> None:
        with self._cond:
            self._paused -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the worker once nothing is in flight or waiting (a later ``submit`` starts it again)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _take_pending(self) -> list[tuple[GenerationRequest, Callable]]:
        """Requests to admit now, up to the room in the batch; a second request of a session in
        flight is refused (a session is one episode, with one next turn at a time)."""
        room = self.policy.max_batch_size - len(self._batch)
        busy = {row.request.session for row in self._batch.rows if row.request.session is not None}
        taken, left = [], []
        for request, deliver in self._pending:
            if request.session is not None and request.session in busy:
                deliver(ValueError(
                    "two requests of the same session are in flight; a session is one episode with one next turn. "
                    "Give each episode its own session id."
                ))
            elif room > 0:
                taken.append((request, deliver))
                room -= 1
                if request.session is not None:
                    busy.add(request.session)
            else:
                left.append((request, deliver))
        self._pending = left
        return taken

    def _run(self) -> None:
        while True:
            with self._cond:
                # Idle (nothing decoding, nothing admissible): wait; closing or a long idle ends the
                # thread (the next submit starts another).
                while not self._batch.rows and (not self._pending or self._paused):
                    if self._stopping:
                        self._thread = None
                        return
                    if not self._cond.wait(timeout=10.0) and not self._pending and not self._batch.rows:
                        self._thread = None
                        return
                from_idle = not self._batch.rows
            if from_idle and self.wait_s > 0:
                time.sleep(self.wait_s)  # let a burst (a GRPO group) arrive, so its prompt is prefilled once
            with self._cond:
                admit = [] if self._paused else self._take_pending()
            try:
                with self.policy._lock, torch.inference_mode():
                    if admit:
                        self._admit(admit)
                    finished = self._batch.step() if self._batch.rows else []
            except BaseException as error:  # noqa: BLE001 - handed to every awaiting caller, not swallowed
                with self._cond:
                    failed = [row.deliver for row in self._batch.rows] + [deliver for _, deliver in admit]
                    self._batch = DecodeBatch(self.policy)
                    self._cond.notify_all()
                for deliver in dict.fromkeys(failed):
                    deliver(error)
                continue
            for row in finished:
                row.deliver(row.generation())
            with self._cond:
                self._cond.notify_all()  # a paused weight update may be waiting for the batch to drain

    def _admit(self, admit: list[tuple[GenerationRequest, Callable]]) -> None:
        requests = [request for request, _ in admit]
        units = self.policy._plan_units(requests)
        version = self.policy.version
        rows = [[Row(i, requests[i], self.policy._stop_ids(requests[i]), version, deliver=admit[i][1])
                 for i in unit.rows] for unit in units]
        self._batch.admit(units, rows)


def _streamed(token: int, logprob: float, candidates: list[int] | None,
              head: tuple[list[int] | None, list[float]] | None) -> StreamedToken:
    """The :class:`StreamedToken` of a row's new token: what its :class:`Generation` records there."""
    if head is None:
        return StreamedToken(token, logprob)
    head_ids, head_logprobs = head
    return StreamedToken(token, logprob, candidates if head_ids is None else head_ids, head_logprobs)


def _common_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of ``a`` and ``b``.

    >>> _common_len([1, 2, 3], [1, 2, 4, 5]), _common_len([1, 2], [1, 2, 3])
    (2, 2)
    """
    n = min(len(a), len(b))
    return next((j for j in range(n) if a[j] != b[j]), n)


@functools.cache
def _growing_layer_class():
    """A transformers ``DynamicLayer`` over a preallocated buffer (built lazily: importing
    transformers is slow, and only generation needs it)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """Keys and values live in (B, H, capacity, D) buffers; ``keys``/``values`` are views of
        the filled part, so appending a step costs one slice write rather than a full copy."""

        def __init__(self, key_buffer: Tensor, value_buffer: Tensor, length: int):
            super().__init__()
            self._key_buffer, self._value_buffer, self._length = key_buffer, value_buffer, length
            self.device, self.dtype, self.is_initialized = key_buffer.device, key_buffer.dtype, True
            self._refresh()

        def _refresh(self) -> None:
            self.keys = self._key_buffer[:, :, : self._length]
            self.values = self._value_buffer[:, :, : self._length]

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
            end = self._length + key_states.shape[-2]
            if end > self._key_buffer.shape[-2]:
                raise RuntimeError(f"GrowingLayer is full ({self._key_buffer.shape[-2]} positions); this is a bug.")
            self._key_buffer[:, :, self._length : end] = key_states
            self._value_buffer[:, :, self._length : end] = value_states
            self._length = end
            self._refresh()
            return self.keys, self.values

        def batch_select_indices(self, indices: Tensor) -> None:
            self._key_buffer, self._value_buffer = self._key_buffer[indices], self._value_buffer[indices]
            self._refresh()

    return GrowingLayer


def _partition(params: list[SamplingParams], device: torch.device) -> list[tuple[SamplingParams, Tensor, list[int]]]:
    """Batch rows grouped by sampling params: [(params, row index tensor, row index list)]."""
    groups: dict[SamplingParams, list[int]] = {}
    for b, p in enumerate(params):
        groups.setdefault(p, []).append(b)
    return [(p, torch.tensor(idx, device=device), idx) for p, idx in groups.items()]
