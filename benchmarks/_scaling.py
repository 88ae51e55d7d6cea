"""The pieces of ``bench_scaling.py``: the fixed episodes of one point, the models, and one measured side.

A point is ``(prompt tokens, group size, assistant turns, model)``. Its episodes are built once,
by rendering scripted conversations with the tiny model's own chat template (Hermes/Qwen
``<tools>`` block in the system turn, ``<tool_call>`` markup, ``<tool_response>`` results)
through :class:`treerl.agents.chat.ChatRenderer`, the renderer the rollout engine uses: the
prompt is tokenized once and every tool result enters as the exact bridge tokens the engine
would append. The same token ids then feed both learners:

- treerl: one :class:`~treerl.rollout.trajectory.Group` (the shared prompt once, each
  generation's turns and tool results below it), trained by the GRPO learner's own stages,
  ``pack_groups`` and ``optimize`` (tree packing, tree attention, fused log-probs, loss,
  backward, clipping, AdamW step);
- TRL: the batch its ``GRPOTrainer._generate_and_score_completions`` returns for these
  completions (prompt left-padded, completions right-padded, ``tool_mask`` 0 on tool-result
  tokens as its multi-turn tool loop sets it), trained by its own ``Trainer.train`` loop with
  generation replaced by that fixed batch: ``training_step`` (its ``_compute_loss``, the
  fused LM head it installs, backward), gradient clipping, optimizer and scheduler steps.

Generation is not part of either step.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _common import reset_rss_peak, rss_peak

MODEL_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size")
MODELS: dict[str, tuple[int, ...]] = {
    # name: Qwen3Config sizes in MODEL_FIELDS order; "1.7M" is the shipped tiny model's architecture
    # (vocab 721, tied head).
    "1.7M": (192, 4, 6, 2, 32, 512),
    "6M": (256, 8, 8, 2, 32, 768),
    "14M": (384, 8, 6, 2, 64, 1152),
    "24M": (512, 8, 8, 2, 64, 1536),
    "49M": (640, 10, 10, 2, 64, 2048),
}


@dataclass(frozen=True)
class Point:
    """One measured configuration: every axis's value."""

    prompt: int
    """Target tokens of the rendered prompt (system text + tool schemas + the user's question)."""
    group: int
    """Generations of the one task of the step (GRPO's group)."""
    turns: int
    """Assistant turns per episode; each but the last calls a tool and gets its result."""
    model: str
    """A key of :data:`MODELS`."""


# -- the episodes ---------------------------------------------------------------------------------


def _tool(i: int) -> dict:
    """A made-up tool schema of the size small real ones have (two typed, described parameters)."""
    return {"type": "function", "function": {
        "name": f"lookup_{i}",
        "description": f"Find rows of table {i} as JSON.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "Filter text."},
            "limit": {"type": "integer", "minimum": 1},
        }, "required": ["query"]},
    }}


def render_prompt(tokenizer: Any, target: int) -> tuple[Any, list[dict], list[int]]:
    """(renderer, messages, prompt ids) of a system prompt with tool schemas, ``target`` tokens or just over.

    Tool schemas are added while they fit, then words of system text until the target is reached.
    """
    from treerl.agents.chat import ChatRenderer

    question = {"role": "user", "content": "How many units of the blue kettle are left, and when was the last "
                                           "order for it placed?"}
    system = "You are an inventory assistant. Call the tools to find facts; answer briefly."
    tools: list[dict] = []

    def render(tools: list[dict], system: str) -> tuple[Any, list[dict], list[int]]:
        renderer = ChatRenderer(tokenizer, tools=tools or None)
        messages = [{"role": "system", "content": system}, question]
        return renderer, messages, renderer.prompt_ids(messages)

    while len(render([*tools, _tool(len(tools))], system)[2]) <= target:
        tools.append(_tool(len(tools)))
    words = iter(("Keep answers short, cite the rows you used, and say when a tool failed. " * 400).split())
    renderer, messages, ids = render(tools, system)
    while len(ids) < target:
        system += " " + next(words)
        renderer, messages, ids = render(tools, system)
    return renderer, messages, ids


def build_group(tokenizer: Any, point: Point, seed: int = 0) -> Any:
    """The group of one step at ``point``: scripted episodes rendered token for token, random rewards."""
    from treerl.rollout.trajectory import Group

    rng = random.Random(seed)
    renderer, messages, prompt_ids = render_prompt(tokenizer, point.prompt)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    num_tools = len(renderer.tools or [])
    group = Group(task_key=f"scaling-{point.prompt}-{point.group}-{point.turns}", env_id="bench/scaling")
    root = group.add_segment("prompt", prompt_ids)
    for _ in range(point.group):
        conversation, parent = list(messages), root
        for turn in range(point.turns):
            if turn < point.turns - 1:
                call = {"name": f"lookup_{rng.randrange(max(num_tools, 1))}",
                        "arguments": {"query": f"blue kettle {rng.randrange(10_000)}", "limit": rng.randrange(1, 50)}}
                text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
            else:
                text = (f"There are {rng.randrange(1000)} units left; the last order was on "
                        f"2026-0{rng.randrange(1, 10)}-1{rng.randrange(10)}.")
            ids = [*renderer.encode(text), end_id]
            parent = group.add_segment("sampled", ids, parent=parent, logprobs=[-1.0] * len(ids), policy_version=0)
            if turn < point.turns - 1:
                rows = [{"sku": f"K-{rng.randrange(10**6)}", "units": rng.randrange(500)} for _ in range(2)]
                result = [{"role": "tool", "content": json.dumps(rows)}]
                bridge = renderer.bridge(conversation, ids, renderer.completion_text(ids), result)
                if bridge.branch:  # the shipped template is append-only; a branch would be a bug here
                    raise RuntimeError(f"scripted episode branched: {bridge.detail}")
                conversation = [*conversation, bridge.message, *result]
                parent = group.add_segment("env", bridge.ids, parent=parent)
        group.add_episode(leaf=parent, reward=rng.random())
    return group


def token_counts(group: Any) -> dict[str, int]:
    """Unique tokens (the tree), flat tokens (every path in full) and TRL's padded batch size in tokens."""
    paths = [len(e.token_ids) for e in group.episodes]
    prompt = len(group.segments[0].token_ids)
    return {"unique_tokens": group.num_unique_tokens, "flat_tokens": sum(paths),
            "padded_tokens": len(paths) * (prompt + max(p - prompt for p in paths)),
            "sampled_tokens": sum(e.num_sampled_tokens for e in group.episodes), "prompt_tokens": prompt}


def group_advantages(group: Any) -> torch.Tensor:
    """(G,) GRPO's advantages of the group's rewards (group mean baseline, scaled by the group's std)."""
    from treerl.learners.advantages import AdvantageConfig, compute_advantages

    rewards = torch.tensor(group.rewards, dtype=torch.float32)
    return compute_advantages(rewards, torch.zeros(len(rewards), dtype=torch.long), AdvantageConfig()).adv


def trl_batch(group: Any, adv: torch.Tensor, pad_id: int, device: str) -> dict[str, Any]:
    """What TRL's ``_generate_and_score_completions`` returns for the group's completions (no IS, no KL)."""
    prompt = len(group.segments[0].token_ids)
    episodes = group.episodes
    width = max(len(e.token_ids) - prompt for e in episodes)

    def pad(rows: list[list[int]], value: int) -> torch.Tensor:
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], device=device)

    completions = [e.token_ids[prompt:] for e in episodes]
    completion_mask = pad([[1] * len(c) for c in completions], 0)
    tool_mask = pad([[int(s) for s in e.sampled_mask[prompt:]] for e in episodes], 1)
    return {
        "prompt_ids": torch.tensor([e.token_ids[:prompt] for e in episodes], device=device),
        "prompt_mask": torch.ones(len(episodes), prompt, dtype=torch.long, device=device),
        "completion_ids": pad(completions, pad_id),
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": adv.to(device),
        "num_items_in_batch": (completion_mask * tool_mask).sum(),
    }


# -- the model ------------------------------------------------------------------------------------


def build_model(name: str, device: str, max_positions: int) -> torch.nn.Module:
    """A Qwen3-architecture causal LM of size ``name`` with the tiny tokenizer's vocabulary, seeded weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=721, tie_word_embeddings=True, max_position_embeddings=max_positions,
                         attention_dropout=0.0, pad_token_id=0, eos_token_id=2, bos_token_id=None,
                         **dict(zip(MODEL_FIELDS, MODELS[name], strict=True)))
    model = Qwen3ForCausalLM(config).to(device)
    model.set_attn_implementation("sdpa")
    return model.train()


# -- one side of one point ------------------------------------------------------------------------


class _Meter:
    """Wall time, process CPU time and the memory peak of each step."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.steps: list[dict[str, float]] = []
        self._t = (0.0, 0.0, 0)

    def begin(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            reset_rss_peak()
            base = rss_peak()  # the restarted mark itself: the step's peak can only be at or above it
        self._t = (time.perf_counter(), time.process_time(), base)

    def end(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        wall, cpu, base = self._t
        peak = torch.cuda.max_memory_allocated() if self.cuda else rss_peak()
        self.steps.append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                           "peak_bytes": peak - base, "peak_total_bytes": peak})


def run_treerl(point: Point, *, device: str, impl: str, steps: int, bf16: bool) -> dict:
    """``steps`` GRPO steps of treerl's learner on the point's group; per-step measurements."""
    from treerl.kernels.tree_attention import enable_tree_attention
    from treerl.learners.grpo import GRPOConfig, optimize
    from treerl.learners.packing import pack_groups
    from treerl.learners.precision import resolve_precision
    from treerl.models import load_default_model

    _, tokenizer = load_default_model()
    group = build_group(tokenizer, point)
    counts = token_counts(group)
    model = build_model(point.model, device, max_positions=counts["prompt_tokens"] + 4096)
    choice = enable_tree_attention(model, impl=impl)
    with tempfile.TemporaryDirectory() as tmp:
        # One row holds a whole group (TRL's batch holds it too): no prompt is split over rows.
        cfg = GRPOConfig(output_dir=tmp, learning_rate=1e-4, group_size=point.group, tasks_per_step=1,
                         eval_episodes=0, max_tokens_per_row=2 * counts["flat_tokens"], bf16=bf16 or None)
    precision = resolve_precision(cfg.dtype, cfg.bf16, cfg.fp16, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # constant, as treerl learn's
    adv = group_advantages(group)
    meter = _Meter(device)
    for _ in range(steps):
        meter.begin()
        batches = pack_groups([group], adv, cfg.packing_config())  # packing is part of the timed step
        optimize(model, optimizer, scheduler, batches, cfg, device, {}, precision=precision)
        meter.end()
    return {"side": f"treerl-{choice.impl}", "counts": counts, "steps": meter.steps,
            "num_params": sum(p.numel() for p in model.parameters()), "backend": choice.reason}


def run_trl(point: Point, *, device: str, steps: int, bf16: bool) -> dict:
    """``steps`` steps of TRL's ``GRPOTrainer.train`` with generation replaced by the point's fixed batch."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from treerl.models import load_default_model

    _, tokenizer = load_default_model()
    group = build_group(tokenizer, point)
    counts = token_counts(group)
    model = build_model(point.model, device, max_positions=counts["prompt_tokens"] + 4096)
    adv = group_advantages(group)
    batch = trl_batch(group, adv, tokenizer.pad_token_id, device)
    meter = _Meter(device)

    class StepMeter(TrainerCallback):  # on_step_begin -> on_step_end: training_step, clipping, optimizer step
        def on_step_begin(self, args, state, control, **kwargs):
            meter.begin()

        def on_step_end(self, args, state, control, **kwargs):
            meter.end()

    def reward(completions, **kwargs):  # never called: generation and scoring are replaced
        return [0.0] * len(completions)

    with tempfile.TemporaryDirectory() as tmp:
        # TRL's defaults but for: one generation of G completions per optimizer step (its batch
        # counts completions), the same learning rate as treerl, float32 on CPU / bfloat16
        # autocast on CUDA (treerl's precision on each), and gradient checkpointing off (treerl's
        # default; TRL's default is on, which recomputes the forward to save memory).
        config = GRPOConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=point.group, num_generations=point.group,
            gradient_accumulation_steps=1, steps_per_generation=1, learning_rate=1e-4, beta=0.0,
            max_completion_length=batch["completion_ids"].shape[1], gradient_checkpointing=False,
            use_cpu=not device.startswith("cuda"), bf16=bf16, report_to="none", logging_steps=10**6,
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False,
        )
        dataset = Dataset.from_list([{"prompt": "fixed"}] * steps)
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward], args=config,
                              train_dataset=dataset, callbacks=[StepMeter()])
        # Generation and scoring replaced by the fixed batch (the same tensors every step).
        trainer._prepare_inputs = lambda generation_batch: dict(batch)
        trainer.train()
    return {"side": "trl", "counts": counts, "steps": meter.steps,
            "num_params": sum(p.numel() for p in model.parameters()), "loss_type": config.loss_type}


def summarize(result: dict, warmup: int, key: str) -> dict:
    """Medians over the steps after ``warmup`` (memory: the largest peak of those steps)."""
    timed = result["steps"][warmup:] or result["steps"]
    return {**{k: v for k, v in result.items() if k != "steps"},
            "time_s": statistics.median(s[key] for s in timed),
            "wall_s": statistics.median(s["wall_s"] for s in timed),
            "peak_bytes": max(s["peak_bytes"] for s in timed),
            "times_s": [s[key] for s in timed]}


def point_json(point: Point) -> str:
    return json.dumps(asdict(point))


def point_from_json(text: str) -> Point:
    return Point(**json.loads(text))


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1))
