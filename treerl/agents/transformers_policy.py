"""A generation backend on a transformers causal LM: batched KV-cache decoding on CPU or GPU.

What it does beyond ``model.generate``:

- **Shared prefill.** Requests with the same ``prompt_ids`` (a GRPO group) run the prompt
  through the model once; its keys and values are then copied to every sample's row.
- **Shared prefixes.** Fresh prompts of one call that share a long prefix (one system prompt
  with tool schemas, different questions) run that prefix once; each prompt then prefills
  only its remainder on top of the prefix's keys and values. Recent prefixes are kept (a lone
  prompt's too, cut to what a later prompt shares with it; the least recently used dropped
  first, all dropped by ``set_weights``), so later calls, e.g. a server's next client, reuse them.
- **Shared-prefix attention.** When every row of a decode batch starts with the same prefix
  (a group's prompt), it is stored once and each decode step reads it once for the whole batch
  (:mod:`treerl.agents.cascade`); rows that join without it turn the batch back to per-row copies.
- **Sessions.** A multi-turn episode keeps its cache between turns: the next request only
  prefills the tokens after the longest prefix the session has already seen.
- **Exact sampler records.** Every token comes with its processed log-prob and candidate
  set (see :mod:`treerl.agents.sampling`), and a per-request seed makes it reproducible
  whatever else shares the batch.

Rows of different lengths share one left-padded :class:`~transformers.DynamicCache`; each
row gets its own ``position_ids``, so padding never shifts a position and a row's keys and
values are bit-for-bit what it would have alone (up to the padded attention's float order).

>>> import torch
>>> from transformers import Qwen3Config, Qwen3ForCausalLM
>>> from treerl.agents.policy import GenerationRequest, SamplingParams
>>> config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, eos_token_id=2)
>>> policy = TransformersPolicy(Qwen3ForCausalLM(config), None)
>>> params = SamplingParams(top_k=8, max_new_tokens=4)
>>> [g] = policy.generate([GenerationRequest([5, 6, 7], params, seed=0)])
>>> len(g.token_ids) == len(g.logprobs) == len(g.candidates), g.policy_version
(True, 0)
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from treerl.agents.cascade import CASCADE_KWARG, CascadeState, cascade_attention, cascade_unsupported
from treerl.agents.decode import KV, ContinuousDecoder, DecodeBatch, Row, Unit
from treerl.agents.policy import AsyncBatcher, Generation, GenerationRequest
from treerl.agents.sampling import candidate_lists, head_lists, process_logits, sample_processed

__all__ = ["TransformersPolicy", "END_OF_TURN_TOKENS", "HARMONY_TURN_END_TOKENS", "end_of_turn_ids", "load_state_dict",
           "cast_lm_head_to_fp32"]

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
"""Chat-template end-of-turn tokens that stop a turn when the tokenizer's vocabulary has them."""

HARMONY_TURN_END_TOKENS = ("<|return|>", "<|call|>")
"""gpt-oss's (harmony's) end-of-turn tokens: a final answer, a tool call. In harmony ``<|end|>``
ends one message of a turn (the analysis before the answer or the call), not the turn: a
vocabulary with these tokens stops on them instead of :data:`END_OF_TURN_TOKENS`."""


def end_of_turn_ids(model, tokenizer=None) -> frozenset[int]:
    """Every id that ends a turn: the generation config's eos (int or list), the tokenizer's
    eos, and the template's end-of-turn tokens (:data:`END_OF_TURN_TOKENS`) it knows; a
    harmony vocabulary's are :data:`HARMONY_TURN_END_TOKENS` instead.

    >>> from types import SimpleNamespace
    >>> model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 9]))
    >>> tokenizer = SimpleNamespace(eos_token_id=9, get_vocab=lambda: {"<|im_end|>": 4, "a": 5})
    >>> sorted(end_of_turn_ids(model, tokenizer))
    [4, 7, 9]
    >>> harmony = SimpleNamespace(eos_token_id=None, get_vocab=lambda: {"<|end|>": 1, "<|return|>": 2, "<|call|>": 3})
    >>> sorted(end_of_turn_ids(SimpleNamespace(generation_config=None, config=None), harmony))
    [2, 3]
    """
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None:
        if isinstance(getattr(tokenizer, "eos_token_id", None), int):
            ids.add(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        harmony = any(token in vocab for token in HARMONY_TURN_END_TOKENS)
        tokens = HARMONY_TURN_END_TOKENS if harmony else END_OF_TURN_TOKENS
        ids.update(vocab[token] for token in tokens if token in vocab)
    return frozenset(int(i) for i in ids)


_PLAIN_HEAD_MODELS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
"""Classes whose logits are exactly their bias-free linear head on their decoder's last hidden
state (no soft-capping, scaling or multiplier in between). Named, not probed: a probe forward
would run the user's hooks, and no config flag lists every transform models apply."""


def _weight_stationary_head(model, device: torch.device) -> tuple[tuple[torch.nn.Module, torch.nn.Module] | None, str]:
    """``((decoder, lm_head), reason)`` when the policy may compute the last position's logits
    itself as ``(W @ h.T).T``, else ``(None, reason)``.

    On CPU, for the few rows of a decode step, MKL runs the (V, H) x (H, B) product about 1.5x
    faster than ``F.linear``'s (B, H) x (H, V)^T, and the vocabulary projection is most of a small
    model's decode step. Only the classes of :data:`_PLAIN_HEAD_MODELS` (exactly, not subclasses)
    with a bias-free linear head qualify; others keep their own head.
    """
    name = type(model).__name__
    if device.type != "cpu":
        return None, f"on {device.type} the model's own head runs (the product was measured faster on CPU only)"
    # The class itself, from transformers (remote code may reuse a name for other logits).
    if name not in _PLAIN_HEAD_MODELS or not type(model).__module__.startswith("transformers.models."):
        return None, f"{name} is not one of {sorted(_PLAIN_HEAD_MODELS)}, whose logits are their plain head's"
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if decoder is None or decoder is model or type(head) is not torch.nn.Linear or head.bias is not None:
        return None, f"{name} has no separate decoder and bias-free linear head"
    if head.weight.dtype != torch.float32:  # measured in float32 only
        return None, f"the head's weights are {head.weight.dtype}"
    return (decoder, head), "weight-stationary product on cpu"


def cast_lm_head_to_fp32(model: torch.nn.Module) -> None:
    """TRL's ``cast_lm_head_to_fp32`` on a sampling model, in place: its LM head holds float32 weights
    and computes the logits in float32 from the decoder's hidden states, upcast (outside autocast). A
    head tied to the input embeddings is that one float32 table, whose outputs go back to the
    embeddings' dtype, as TRL does. A float32 head is left as it is."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"cast_lm_head_to_fp32: {type(model).__name__}'s LM head is {type(head).__name__}, not a "
                         "torch.nn.Linear whose logits could be computed in float32; leave the option off.")
    if head.weight.dtype == torch.float32:
        return
    embeddings = model.get_input_embeddings()
    if embeddings is not None and embeddings.weight is head.weight:
        dtype = head.weight.dtype
        embeddings.register_forward_hook(lambda module, args, output: output.to(dtype))
    head.float()

    def float32_logits(hidden: Tensor) -> Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return torch.nn.functional.linear(hidden.float(), head.weight, head.bias)

    head.forward = float32_logits  # an instance's forward: _hooked() then keeps the model's own head call


def _hooked(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs more than its class's forward (hooks, or a forward wrapped on
    the instance), which the decoder-and-head shortcut would skip."""
    return bool(module._forward_hooks or module._forward_pre_hooks) or "forward" in vars(module)


def load_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """Read a state dict from a safetensors file or a transformers checkpoint directory."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    if path.is_dir():
        shards = sorted(path.glob("*.safetensors"))
        if shards:
            from safetensors.torch import load_file

            return {k: v for shard in shards for k, v in load_file(str(shard), device="cpu").items()}
        bins = sorted(path.glob("pytorch_model*.bin"))
        if bins:
            return {k: v for b in bins for k, v in torch.load(b, map_location="cpu", weights_only=True).items()}
    raise FileNotFoundError(
        f"set_weights: {str(path)!r} is neither a .safetensors file nor a checkpoint directory with "
        "*.safetensors or pytorch_model*.bin files; save one with model.save_pretrained(dir) or pass a state dict."
    )


@dataclass
class _Session:
    token_ids: list[int]
    """The tokens whose keys and values ``kv`` holds, in order."""
    kv: KV
    """(1, kv_heads, len(token_ids), head_dim) per layer."""


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit`` and at most ``len(b) - 1``
    (the last prompt token must run through the model: its logits give the first sample).

    >>> _common([1, 2, 3, 4], [1, 2, 3, 9, 9], 10), _common([1, 2, 3], [1, 2, 3], 10), _common([1, 2], [1, 2, 5], 1)
    (3, 2, 1)
    """
    n = min(len(a), len(b) - 1, limit)
    return next((j for j in range(n) if a[j] != b[j]), max(n, 0))


class TransformersPolicy:
    """A :class:`~treerl.agents.policy.Policy` on a transformers causal LM.

    Args:
        model: a causal LM whose forward takes ``position_ids``, a 2D ``attention_mask``, a
            ``DynamicCache`` and ``logits_to_keep`` (every decoder-only model in transformers).
        tokenizer: used only to find end-of-turn ids; may be None.
        device: where the model runs; the model is moved there.
        max_batch_size: most rows decoded together; larger calls run in several batches.
        version: the weights version stamped on generations.
        max_sessions: sessions whose caches are kept; the least recently used is dropped
            first (its next turn then prefills its whole context, which is correct, only slower).
        batch_wait_s: from idle, how long ``agenerate`` waits for more requests before the first
            prefill, so a group that arrives together is prefilled once.
        continuous_batching: ``agenerate`` requests join a running batch between decode steps
            and return as soon as they stop (higher throughput when turns have mixed lengths).
            Off, concurrent requests decode as static batches that finish together, so batch
            composition, and with it the float order of every result, does not depend on
            timing: runs repeat bit for bit (what the learners default to).
        min_shared_prefix: fresh prompts that share at least this many leading tokens prefill
            them once (0 turns prefix sharing off). Results match the unshared path up to float
            order (the prefix and the remainder run as two forwards instead of one).
        max_prefixes: shared prefixes whose caches are kept across calls (0 keeps none).
        cascade_attention: when every row of a decode batch shares a prefix (a group's prompt)
            whose per-row copies would hold at least ``min_cascade_kv`` key elements per layer,
            keep its keys and values once and let each decode step read them once for all rows
            (:mod:`treerl.agents.cascade`). Results match the per-row path up to float order.
            Models it cannot serve (``cascade_reason`` says why) decode per row.
        min_cascade_kv: rows x prefix tokens x kv heads x head dim from which the shared prefix
            is kept once. The split attention runs about 15 small operations where SDPA runs
            one; measured on CPU it wins from about 2^19 (8 rows of a 512-token prompt with 2 kv
            heads of 64) and loses below (8 rows of 256 tokens: 218 vs 167 us per layer).
        fp32_head: compute the logits with a float32 LM head from the decoder's hidden states
            (:func:`cast_lm_head_to_fp32`, TRL's ``cast_lm_head_to_fp32``); nothing changes for a
            float32 model.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        device: str | torch.device = "cpu",
        max_batch_size: int = 64,
        version: int = 0,
        max_sessions: int = 1024,
        batch_wait_s: float = 0.001,
        continuous_batching: bool = True,
        min_shared_prefix: int = 16,
        max_prefixes: int = 8,
        cascade_attention: bool = True,
        min_cascade_kv: int = 2**19,
        fp32_head: bool = False,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1, e.g. max_batch_size=64.")
        if max_sessions < 0:
            raise ValueError(f"max_sessions={max_sessions} must be >= 0 (0 keeps no session caches).")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        if fp32_head:
            cast_lm_head_to_fp32(self.model)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_sessions = max_sessions
        self.batch_wait_s = batch_wait_s
        self.version = version
        self.stop_token_ids = end_of_turn_ids(model, tokenizer)
        # transformers 5 renamed the forward's `past_key_values` to `cache`.
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        if min_shared_prefix < 0 or max_prefixes < 0:
            raise ValueError(f"min_shared_prefix={min_shared_prefix} and max_prefixes={max_prefixes} must be >= 0 "
                             "(0 turns prefix sharing, or keeping prefixes across calls, off).")
        self.min_shared_prefix = min_shared_prefix
        self.max_prefixes = max_prefixes
        if min_cascade_kv < 1:
            raise ValueError(f"min_cascade_kv={min_cascade_kv} must be >= 1, e.g. 2**19; turn the shared-prefix "
                             "attention off with cascade_attention=False.")
        self.min_cascade_kv = min_cascade_kv
        self.cascade_reason = cascade_unsupported(self.model) if cascade_attention else "cascade_attention=False"
        """Why decode steps never read a shared prefix once for all rows (None: they do when rows share one)."""
        self._head, self.head_reason = _weight_stationary_head(self.model, self.device)
        """Whether the policy computes the logits as ``W @ h^T`` itself, or why the model's own head runs."""
        if self._head is not None:
            decoder_params = inspect.signature(self._head[0].forward).parameters
            self._decoder_cache_kwarg = "cache" if "cache" in decoder_params else "past_key_values"
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._prefixes: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        # One lock for the model: generate, set_weights and end_session never interleave.
        self._lock = threading.RLock()
        self.continuous_batching = continuous_batching
        if continuous_batching:  # requests join a running batch between steps
            self._decoder = ContinuousDecoder(self, wait_s=batch_wait_s)
        else:  # `self.generate` is looked up per batch, so a wrapped or patched generate is honoured
            self._batcher = AsyncBatcher(lambda requests: self.generate(requests), max_batch_size=max_batch_size,
                                         wait_s=batch_wait_s)

    # ------------------------------------------------------------------ public API

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Sample every request; results are in request order."""
        sessions = [r.session for r in requests if r.session is not None]
        if len(sessions) != len(set(sessions)):
            raise ValueError(
                "generate got two requests of the same session in one call; a session is one episode "
                "with one next turn. Give each episode its own session id."
            )
        with self._lock, torch.inference_mode():
            results: list[Generation | None] = [None] * len(requests)
            for units in self._batches(self._plan_units(requests)):
                batch = DecodeBatch(self)
                batch.admit(units, [[Row(i, requests[i], self._stop_ids(requests[i]), self.version) for i in unit.rows]
                                    for unit in units])
                while len(batch):
                    for row in batch.step():
                        results[row.index] = row.generation()
        return results  # type: ignore[return-value]

    async def agenerate(self, request: GenerationRequest) -> Generation:
        """Sample one request. Requests decode together in a worker thread, so the event loop keeps
        running tools meanwhile; with continuous batching one that arrives while others decode
        joins them at the next step (:class:`~treerl.agents.decode.ContinuousDecoder`)."""
        if self.continuous_batching:
            return await self._decoder.submit(request)
        return await self._batcher.submit(request)

    def set_weights(self, weights: Mapping[str, Tensor] | str | os.PathLike, version: int) -> None:
        """Load a state dict (or a checkpoint path, see :func:`load_state_dict`), set ``version``
        and drop every session cache (it was computed with the old weights)."""
        state_dict = weights if isinstance(weights, Mapping) else load_state_dict(weights)
        if not self.continuous_batching:  # the lock waits for a static batch to finish
            self._load_weights(state_dict, version)
            return
        # Rows in flight finish with the weights they started with: every generation has one version.
        self._decoder.pause()
        try:
            self._load_weights(state_dict, version)
        finally:
            self._decoder.resume()

    def _load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        with self._lock, torch.no_grad():
            own = self.model.state_dict()
            unexpected = [k for k in state_dict if k not in own]
            if unexpected:
                raise ValueError(
                    f"set_weights: {len(unexpected)} keys are not in the model, e.g. {unexpected[:3]}; pass the "
                    "state dict of the same architecture (for a PEFT model, merge the adapter first)."
                )
            # A missing key is fine only when it is tied to a loaded one (e.g. lm_head and embeddings).
            loaded = {own[k].data_ptr() for k in state_dict}
            missing = [k for k in own if k not in state_dict and own[k].data_ptr() not in loaded]
            if missing:
                raise ValueError(
                    f"set_weights: {len(missing)} model weights are missing from the new weights, e.g. "
                    f"{missing[:3]}; pass a full state dict (model.state_dict())."
                )
            self.model.load_state_dict(state_dict, strict=False)
            self._sessions.clear()
            self._prefixes.clear()
            self.version = int(version)

    def end_session(self, session: str) -> None:
        """Forget a session's cache (a no-op for an unknown session)."""
        with self._lock:
            self._sessions.pop(session, None)

    # ------------------------------------------------------------------ planning

    def _plan_units(self, requests: Sequence[GenerationRequest]) -> list[Unit]:
        """Group requests into prefills: one per continued session, one per distinct fresh prompt."""
        units: list[Unit] = []
        by_prompt: dict[tuple[int, ...], Unit] = {}
        for i, request in enumerate(requests):
            past = self._session_past(request)
            if past is not None:
                units.append(Unit(list(request.prompt_ids), past[0], past[1], [i]))
                continue
            key = tuple(request.prompt_ids)
            if key not in by_prompt:
                by_prompt[key] = Unit(list(request.prompt_ids), None, 0)
                units.append(by_prompt[key])
            by_prompt[key].rows.append(i)
        if self.min_shared_prefix > 0:
            self._share_prefixes([u for u in units if u.past is None])
        return units

    def _share_prefixes(self, fresh: list[Unit]) -> None:
        """Give fresh units that share a prefix of at least ``min_shared_prefix`` tokens the
        prefix's keys and values, computed once (or taken from the kept prefixes).

        Prompts are sorted so that those sharing a prefix are neighbours; a run of neighbours
        whose common prefixes stay long enough shares the longest prefix common to all of them.
        A lone prompt that matches nothing kept is kept after its prefill, so the next prompt
        with the same system prompt (the next client of a server) finds it.
        """
        fresh = sorted(fresh, key=lambda u: u.prompt_ids)
        runs: list[tuple[list[Unit], int]] = []
        for unit in fresh:
            if runs:
                run, length = runs[-1]
                shared = _common(run[-1].prompt_ids, unit.prompt_ids, length)
                if shared >= self.min_shared_prefix:
                    runs[-1] = (run + [unit], shared)
                    continue
            runs.append(([unit], len(unit.prompt_ids) - 1))
        for run, length in runs:
            kept = self._kept_prefix(run[0].prompt_ids, length)
            if kept is not None:
                prefix, kv, cost = kept[0], kept[1], 0
            elif len(run) > 1:
                prefix = tuple(run[0].prompt_ids[:length])
                kv, _, cost = self._prefill(Unit(list(prefix), None, 0))
                self._keep_prefix(prefix, kv)
            else:
                run[0].keep = self.max_prefixes > 0
                continue
            for j, unit in enumerate(run):
                unit.past, unit.num_past = kv, len(prefix)
                unit.shared_processed = cost if j == 0 else 0

    def _kept_prefix(self, prompt: list[int], limit: int) -> tuple[tuple[int, ...], KV] | None:
        """The longest common prefix (at most ``limit`` tokens, at least ``min_shared_prefix``) of
        ``prompt`` and a kept prefix, with its keys and values. A kept prefix that matches only
        in part is cut to the part that matched: what remains is what prompts share."""
        best, best_len = None, self.min_shared_prefix - 1
        for prefix in self._prefixes:
            n = _common(prefix, prompt, limit)
            if n > best_len:
                best, best_len = prefix, n
        if best is None:
            return None
        kv = self._prefixes.pop(best)
        if best_len < len(best):
            best, kv = best[:best_len], [(k[:, :, :best_len], v[:, :, :best_len]) for k, v in kv]
            kv = self._prefixes.pop(best, kv)  # the cut prefix may be kept already
        self._keep_prefix(best, kv)
        return best, kv

    def _keep_prefix(self, prefix: tuple[int, ...], kv: KV) -> None:
        if self.max_prefixes == 0:
            return
        self._prefixes[prefix] = kv
        self._prefixes.move_to_end(prefix)
        while len(self._prefixes) > self.max_prefixes:
            self._prefixes.popitem(last=False)

    def _session_past(self, request: GenerationRequest) -> tuple[KV, int] | None:
        """The session's cached keys and values for the longest prefix it shares with the request."""
        state = self._sessions.get(request.session) if request.session is not None else None
        if state is None:
            return None
        self._sessions.move_to_end(request.session)
        seen, prompt = state.token_ids, request.prompt_ids
        if prompt[: len(seen)] == seen:
            num_past = len(seen)
        else:  # the context was edited (e.g. a template that is not append-only): reuse what still matches
            num_past = next((j for j, (a, b) in enumerate(zip(seen, prompt)) if a != b), min(len(seen), len(prompt)))
        # The last prompt token must run through the model: its logits give the first sample.
        num_past = min(num_past, len(prompt) - 1)
        if num_past == 0:
            return None
        return [(k[:, :, :num_past], v[:, :, :num_past]) for k, v in state.kv], num_past

    def _batches(self, units: list[Unit]) -> list[list[Unit]]:
        """Pack units into batches of at most max_batch_size rows, splitting a unit that is too big."""
        batches: list[list[Unit]] = [[]]
        room = self.max_batch_size
        for unit in units:
            rows = unit.rows
            while rows:
                if room == 0:
                    batches.append([])
                    room = self.max_batch_size
                take, rows = rows[:room], rows[room:]
                # Only the first part counts the shared prefix: the others reuse its keys and values.
                shared = unit.shared_processed if take[0] == unit.rows[0] else 0
                batches[-1].append(Unit(unit.prompt_ids, unit.past, unit.num_past, take, shared, unit.keep))
                room -= len(take)
        return [b for b in batches if b]

    # ------------------------------------------------------------------ model calls

    def _forward(self, input_ids: Tensor, position_ids: Tensor, cache, attention_mask: Tensor | None,
                 cascade: CascadeState | None = None) -> Tensor:
        """Last-position logits (B, V) in float32; with ``cascade``, a decode step whose rows share
        the state's prefix (``cache`` holds only what follows it)."""
        kwargs = {CASCADE_KWARG: cascade} if cascade is not None else {}
        with cascade_attention(self.model) if cascade is not None else contextlib.nullcontext():
            if self._head is not None and not _hooked(self.model) and not _hooked(self._head[1]):
                decoder, head = self._head
                hidden = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                 use_cache=True, **{self._decoder_cache_kwarg: cache}, **kwargs).last_hidden_state
                return torch.mm(head.weight, hidden[:, -1, :].t()).t().float()  # (B, V), see _weight_stationary_head
            kwargs[self._cache_kwarg] = cache
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=True,
                logits_to_keep=1,
                **kwargs,
            )
        return out.logits[:, -1, :].float()

    def _prefill(self, unit: Unit) -> tuple[KV, Tensor, int]:
        """Run the unit's new tokens; returns its keys and values (one row), logits (1, V) and
        the number of tokens run."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer_idx, (k, v) in enumerate(unit.past or []):
            cache.update(k, v, layer_idx)
        new_ids = unit.prompt_ids[unit.num_past:]
        input_ids = torch.tensor([new_ids], dtype=torch.long, device=self.device)  # (1, T)
        position_ids = torch.arange(unit.num_past, len(unit.prompt_ids), device=self.device).unsqueeze(0)  # (1, T)
        logits = self._forward(input_ids, position_ids, cache, None)
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        if unit.keep:  # a lone fresh prompt: later prompts may share its beginning
            n = len(unit.prompt_ids) - 1
            self._keep_prefix(tuple(unit.prompt_ids[:n]), [(k[:, :, :n], v[:, :, :n]) for k, v in kv])
        return kv, logits, len(new_ids)

    def _stop_ids(self, request: GenerationRequest) -> frozenset[int]:
        return self.stop_token_ids | frozenset(request.params.stop_token_ids)

    @staticmethod
    def _sample_step(logits: Tensor, partitions, uniforms: Tensor, seen: Tensor | None = None):
        """Sample every batch row; returns (token_ids (B,), logprobs (B,), candidates or None, heads).
        ``seen`` (B, V): the ids of each row's context, for the repetition penalty (None: no row has one).

        ``heads[b]`` is ``(ids or None, logprobs)`` of the sampler's head (see :func:`head_lists`)
        for a row whose params ask for ``top_logprobs``, else None.
        """
        token_ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        logprobs = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        candidates: list[list[int] | None] | None = None
        heads: list[tuple[list[int] | None, list[float]] | None] = [None] * logits.shape[0]
        for params, index, index_list in partitions:
            whole = len(partitions) == 1  # one partition: every row, no gather
            row_seen = seen if whole or seen is None else seen[index]
            processed = process_logits(logits if whole else logits[index], params, row_seen)
            sampled, sampled_logp = sample_processed(processed, uniforms if whole else uniforms[index])
            if whole:
                token_ids, logprobs = sampled, sampled_logp
            else:
                token_ids[index], logprobs[index] = sampled, sampled_logp
            lists = candidate_lists(processed)
            if lists is not None:
                candidates = candidates or [None] * logits.shape[0]
                for b, c in zip(index_list, lists):
                    candidates[b] = c
            if params.top_logprobs > 0:
                head_ids, head_logprobs = head_lists(processed, params.top_logprobs)
                for j, b in enumerate(index_list):
                    heads[b] = (None if head_ids is None else head_ids[j], head_logprobs[j])
        return token_ids, logprobs, candidates, heads

    def _save_session(self, row: Row, kv: Callable[[], KV]) -> None:
        """Keep a stopped row's keys and values (``kv()``: a copy, (1, Hkv, T, D) per layer) as its session's state."""
        session = row.request.session
        if session is None or self.max_sessions == 0:
            return
        self._sessions[session] = _Session(list(row.request.prompt_ids) + row.token_ids[:-1], kv())
        self._sessions.move_to_end(session)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def close(self) -> None:
        """Stop the worker thread used by ``agenerate`` (a later call starts it again)."""
        (self._decoder if self.continuous_batching else self._batcher).close()
