"""Tree packing vs flat packing: time and peak memory of forward + backward.

    python benchmarks/bench_tree_packing.py          # CPU; add --device cuda on a GPU

A ~10M-parameter Qwen3-architecture model built from a config trains one window of GRPO
groups with the packed forward (``treerl.learners.forward.packed_loss``) in three modes:

- ``tree``: each group's prefix tree once (tree attention, ``segment`` on CPU, ``flex``
  on CUDA);
- ``flat``: each path its own segment, rows packed densely under the same budget and the
  same attention backend: the fair baseline, it differs from ``tree`` only by sharing;
- ``padded``: one path per row with the model's own SDPA attention, the classic batch.

Layouts: G samples sharing a prompt at packing ratios 1.0, 2.3 and 3.4, and a multi-turn
tree with nested forks near 3.5 (two first turns, each forked into three after a tool
result, each forked into two again). Sizes are chosen so every layout packs to about the
same number of tree tokens.

Each layout runs in two fresh subprocesses, one for memory and one for time, each holding
one model that it switches between tree attention and SDPA, so the three modes see the same
weights. Memory is the peak of one step: on CPU the growth of the process RSS high-water
mark (restarted just before the step; glibc's mmap threshold is pinned in that process only,
so freed tensors go back to the OS and each step's peak is its own), on CUDA
``torch.cuda.max_memory_allocated``. Time is the median of ``--runs`` steps after a warm-up,
in a process with the allocator's defaults (a pinned threshold makes every large tensor a
fresh mapping whose pages the kernel faults in and zeroes, which added about 60% to the CPU
time of a step on this model), the modes interleaved round by round (in a rotating order) so
that load from other processes falls on all of them alike. A step is forward,
loss and backward over the whole window, from a freshly packed batch (the attention plan
is rebuilt, as in training). Packing time (Python, on the CPU) is reported apart. The
script prints a markdown table and replaces the section "## Tree packing" in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, mib, reset_rss_peak, rss_peak, write_section  # noqa: E402

SECTION = "## Tree packing"
MODES = ("tree", "flat", "padded")
LAYOUTS = ("ratio-1.0", "ratio-2.3", "ratio-3.4", "nested-3.5")
ROW_BUDGET = 2048


def build_groups(layout: str, vocab: int, seed: int = 0) -> list:
    """The groups of one window for ``layout``."""
    import random

    from treerl.rollout.trajectory import Group

    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def sampled(group, n: int, parent: int) -> int:
        return group.add_segment("sampled", tokens(n), parent=parent, logprobs=[-1.0] * n, policy_version=0)

    def fork(num_groups: int, prompt: int, completion: int, samples: int) -> list:
        groups = []
        for g in range(num_groups):
            group = Group(task_key=f"{layout}-{g}", env_id="bench")
            root = group.add_segment("prompt", tokens(prompt))
            for _ in range(samples):
                group.add_episode(leaf=sampled(group, completion, root), reward=rng.random())
            groups.append(group)
        return groups

    if layout == "ratio-1.0":
        return fork(3, 224, 64, 1)  # 3 x 288 tokens, nothing shared
    if layout == "ratio-2.3":
        return fork(2, 192, 64, 4)  # 4 x 256 path tokens on 448 unique, twice
    if layout == "ratio-3.4":
        return fork(1, 272, 64, 8)  # 8 x 336 path tokens on 784 unique
    if layout == "nested-3.5":
        group = Group(task_key=layout, env_id="bench")
        root = group.add_segment("prompt", tokens(104))
        for _ in range(2):
            turn1 = group.add_segment("env", tokens(16), parent=sampled(group, 24, root))
            for _ in range(3):
                turn2 = group.add_segment("env", tokens(16), parent=sampled(group, 24, turn1))
                for _ in range(2):
                    group.add_episode(leaf=sampled(group, 24, turn2), reward=rng.random())
        return [group]  # 12 x 208 path tokens on 712 unique
    raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")


def build_model(args: argparse.Namespace):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64, max_position_embeddings=1024, attention_dropout=0.0, tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config).to(args.device)
    model.set_attn_implementation("sdpa")
    return model.train()


def step_flops(batches, config) -> float:
    """Multiply-adds x 2 of one forward + backward (3x the forward) that no implementation can skip.

    Forward per packed token: the linear layers of every decoder layer; attention: each query
    against the keys it sees (its depth + 1 along its path, counted from the position ids),
    QK and PV; the LM head: once per loss position. Padding, masked scores and gathers are
    not counted: they are what a backend spends beyond the ideal.
    """
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    linear = (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
              + 3 * hidden * config.intermediate_size)  # q, o; k, v; gate, up, down
    forward = 0.0
    for b in batches:
        real = sum(layout.num_tokens for layout in b.layouts.layouts)
        depth = b.position_ids[:, : b.layouts.length]  # (B, T); padding rows carry 0s
        visible = sum(int(depth[r, : layout.num_tokens].sum()) + layout.num_tokens
                      for r, layout in enumerate(b.layouts.layouts))
        forward += config.num_hidden_layers * (real * linear + visible * heads * head_dim * 2)
        forward += b.loss_pos.numel() * hidden * config.vocab_size
    return 3 * 2 * forward


def run_layout(args: argparse.Namespace) -> dict:
    """In the child process: every mode of one layout on one model; memory, then interleaved timing."""
    import torch

    from treerl.kernels.tree_attention import enable_tree_attention
    from treerl.learners.forward import packed_loss, window_normalizer
    from treerl.learners.losses import LossConfig
    from treerl.learners.packing import PackingConfig, pack_groups, packing_metrics

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    num_params = sum(p.numel() for p in model.parameters())
    choice = enable_tree_attention(model)
    groups = build_groups(args.layout, args.vocab)
    adv = torch.randn(sum(len(g.episodes) for g in groups), generator=torch.Generator().manual_seed(0))
    loss_cfg = LossConfig(policy_loss="grpo")
    modes = args.modes

    def config(mode: str) -> PackingConfig:
        # One row per micro-batch for the packed modes (no padding at all, as varlen packing
        # does); a layout's paths are equally long, so one padded batch wastes nothing either.
        return PackingConfig(max_tokens_per_row=ROW_BUDGET, mode=mode, rows_per_batch=64 if mode == "padded" else 1)

    def pack(mode: str):
        return [b.to(device) for b in pack_groups(groups, adv, config(mode))]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(mode: str, batches) -> None:
        model.set_attn_implementation("sdpa" if mode == "padded" else choice.attn_implementation)
        normalizer = window_normalizer(batches)
        for batch in batches:
            out, _ = packed_loss(model, batch, loss_cfg, normalizer)
            out.loss.backward()
        model.zero_grad(set_to_none=True)
        sync()

    result: dict = {"layout": args.layout, "backend": choice.impl, "num_params": num_params, "modes": {}}
    for mode in modes:
        start = time.perf_counter()
        batches = pack(mode)
        pack_s = time.perf_counter() - start
        result["modes"][mode] = {
            "pack_s": pack_s,
            "flops": step_flops(batches, model.config),
            "tokens": sum(b.num_tokens for b in batches),
            "path_tokens": sum(b.num_path_tokens for b in batches),
            "packing_ratio": packing_metrics(batches)["tree/packing_ratio"],
            "shapes": [list(b.input_ids.shape) for b in batches],
            "times_s": [],
            "cpu_s": [],
        }
        step(mode, pack(mode))  # warm-up: thread pools, allocator, compiled kernels on CUDA
    if args.measure == "memory":
        for mode in modes:
            batches = pack(mode)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            else:
                base = reset_rss_peak()
            step(mode, batches)
            peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else rss_peak()
            result["modes"][mode]["peak_bytes"] = peak - base
        return result
    for r in range(args.runs):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            batches = pack(mode)
            wall, cpu = time.perf_counter(), time.process_time()
            step(mode, batches)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            result["modes"][mode]["times_s"].append(wall)
            result["modes"][mode]["cpu_s"].append(cpu)
    for stats in result["modes"].values():
        stats["median_s"] = statistics.median(stats["times_s"])
        stats["median_cpu_s"] = statistics.median(stats["cpu_s"])
    return result


def render(results: dict, args: argparse.Namespace) -> str:
    any_result = next(iter(results.values()))
    on_cpu = not args.device.startswith("cuda")
    key = "median_cpu_s" if on_cpu else "median_s"
    measure = (
        f"process CPU time with {args.threads} torch thread(s)" if on_cpu else "wall time (CUDA synchronized)"
    )
    lines = [
        f"Qwen3-architecture model built from a config, {any_result['num_params'] / 1e6:.1f}M parameters "
        f"(hidden {args.hidden}, {args.layers} layers, vocab {args.vocab:,}), float32 on {args.device}, GRPO "
        f"loss, forward + backward over one window. tree and flat: rows of at most {ROW_BUDGET} tokens, one row "
        "per micro-batch (no padding), tree attention backend "
        f"`{any_result['backend']}`; padded: one path per row in one micro-batch, SDPA. Time = median {measure} "
        f"of {args.runs} steps after a warm-up, modes interleaved. Peak = growth of "
        + ("the process RSS high-water mark" if on_cpu else "`torch.cuda.max_memory_allocated`")
        + " over one step.",
        "",
        "| layout | packing ratio | tokens tree / flat | tree | flat | padded | speedup vs flat | speedup / ratio "
        "| FLOPs flat / tree | speedup / FLOP ratio | speedup vs padded | peak tree | peak flat | peak padded |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    wall_lines = [
        "| layout | tree | flat | padded | speedup vs flat | speedup vs padded |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for layout in LAYOUTS:
        row = {mode: results.get(layout, {}).get("modes", {}).get(mode) for mode in MODES}
        tree, flat, padded = row["tree"], row["flat"], row["padded"]
        if tree is None or flat is None:
            continue
        ratio = tree["packing_ratio"]

        def t(r, k=key):
            return f"{r[k]:.2f} s" if r else "-"

        def m(r):
            return mib(r["peak_bytes"]) if r else "-"

        def x(r, k=key):
            return f"{r[k] / tree[k]:.2f}x" if r else "-"

        flop_ratio = flat["flops"] / tree["flops"]
        lines.append(
            f"| {layout} | {ratio:.2f} | {tree['tokens']:,} / {flat['tokens']:,} | {t(tree)} | {t(flat)} | "
            f"{t(padded)} | {x(flat)} | {flat[key] / tree[key] / ratio:.2f} | {flop_ratio:.2f} | "
            f"{flat[key] / tree[key] / flop_ratio:.2f} | {x(padded)} | {m(tree)} | {m(flat)} | {m(padded)} |"
        )
        wall_lines.append(
            f"| {layout} | {t(tree, 'median_s')} | {t(flat, 'median_s')} | {t(padded, 'median_s')} | "
            f"{x(flat, 'median_s')} | {x(padded, 'median_s')} |"
        )
    packs = ", ".join(
        f"{layout} {results[layout]['modes']['tree']['pack_s'] * 1e3:.0f} ms"
        for layout in LAYOUTS
        if "tree" in results.get(layout, {}).get("modes", {})
    )
    lines += ["", f"Packing time (tree mode, Python, not included above): {packs}."]
    if on_cpu:
        lines += ["", "Median wall time of the same steps (disturbed by whatever else runs on the machine):", ""]
        lines += wall_lines
    ideal = "; ".join(
        f"{layout}: {r['flat']['flops'] / r['tree']['flops']:.2f}, {r['flat']['flops'] / r['tree']['flops'] / ratio:.2f} of "
        f"its packing ratio {ratio:.2f}"
        for layout in LAYOUTS
        if (r := results.get(layout, {}).get("modes", {})) and "tree" in r and "flat" in r
        and (ratio := r["tree"]["packing_ratio"]) >= 3
    )
    lines += [
        "",
        "Reading the figures: at ratio 1.0 tree and flat pack identical rows (a chain of single-child segments "
        "is one layout segment, and the equally long episodes of a row run as one causal SDPA call on a view of "
        "the row, as `padded` does), so their difference is noise. The packing ratio counts tokens, but the work "
        "is not proportional to tokens: the LM head and the loss run once per loss position in both modes (every "
        "sampled token; only nested forks share the sampled tokens of common turns), and here the head (vocab x "
        "hidden per position) costs about a third of the decoder per token while sampled tokens are two thirds of "
        "the tree's tokens at ratio 3.4; attention grows with the keys each query sees. `FLOPs flat / tree` is "
        "the speedup the arithmetic allows (linear layers per packed token, attention per visible key, the head "
        "per loss position; see `step_flops`), the most any implementation can gain, and `speedup / FLOP ratio` "
        "how much of it the tree path delivers. At ratios above 3 the FLOP-ideal speedup is "
        f"{ideal}: 0.95 of the packing ratio is out of reach by construction for these layouts, whatever the "
        "kernel. What the tree path still spends beyond the ideal: the gathered root-to-segment keys and values "
        "of branched segments and the masked scores of their buckets (roots, equally long consecutive segments "
        "and single-chain rows need no gather; the masks are built once per batch).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch threads in the measuring process (default: 1 on CPU, where the process CPU time is then "
        "the measure least disturbed by other load; torch's default on CUDA)",
    )
    parser.add_argument("--runs", type=int, default=5, help="timed steps per mode after the warm-up")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--layout", help=argparse.SUPPRESS)  # set in the child process
    parser.add_argument("--measure", choices=("time", "memory"), help=argparse.SUPPRESS)  # set in the child
    parser.add_argument("--no-write", action="store_true", help="print the table without updating BENCHMARKS.md")
    args = parser.parse_args()
    if args.threads is None and args.device == "cpu":
        args.threads = 1

    if args.layout:  # child
        print(json.dumps(run_layout(args)))
        return

    results = {}
    wall = time.perf_counter()
    # A fixed mmap threshold stops glibc from keeping freed large blocks resident, so the
    # RSS high-water mark of a step measures that step (see the module docstring).
    memory_env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    for layout in args.layouts:
        cmd = [sys.executable, __file__, "--layout", layout, "--modes", *args.modes] + [
            f"--{k}={getattr(args, k)}" for k in ("device", "hidden", "layers", "vocab", "runs", "threads")
            if getattr(args, k) is not None
        ]
        print(f"running {layout} ...", file=sys.stderr, flush=True)
        # Time and memory in separate processes: with the mmap threshold pinned every large
        # tensor is a fresh mapping whose pages the kernel faults in and zeroes, which inflated
        # the CPU time of a step by about 60% (and more for paths with more temporaries).
        measured = {}
        for measure, env in (("memory", memory_env), ("time", None)):
            done = subprocess.run(cmd + [f"--measure={measure}"], capture_output=True, text=True, env=env)
            if done.returncode:
                sys.stderr.write(done.stderr)
                raise SystemExit(f"{layout} ({measure}) failed")
            measured[measure] = json.loads(done.stdout.strip().splitlines()[-1])
        results[layout] = measured["time"]
        for mode, r in results[layout]["modes"].items():
            r["peak_bytes"] = measured["memory"]["modes"][mode]["peak_bytes"]
            times = ", ".join(f"{x:.2f}" for x in r["times_s"])
            cpu = ", ".join(f"{x:.2f}" for x in r["cpu_s"])
            print(
                f"  {mode}: wall [{times}] s, cpu [{cpu}] s, {mib(r['peak_bytes'])}, rows {r['shapes']}",
                file=sys.stderr, flush=True,
            )
    wall = time.perf_counter() - wall
    table = render(results, args)
    print(table)
    if not args.no_write:
        import torch

        cpu = platform.processor() or platform.machine()
        body = (
            f"Command: `{command_line('bench_tree_packing.py')}` (run {datetime.date.today().isoformat()}, torch {torch.__version__}, "
            f"{os.cpu_count()} CPU cores, {cpu}; {wall / 60:.1f} min wall time for the whole script).\n\n{table}\n"
        )
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
