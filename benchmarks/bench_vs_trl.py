"""treerl's GRPO learner side by side with TRL's ``GRPOTrainer``, in one run, on CPU.

    pip install -e ".[bench]"                   # trl, datasets
    python benchmarks/bench_vs_trl.py           # writes the "## treerl vs TRL GRPOTrainer" section of BENCHMARKS.md

Both sides train the shipped tiny model (Qwen3, 1.7M parameters) from the same weights on the
same single-turn arithmetic problems (drawn deterministically with the Calculator task
generator; no tool is offered, one completion per episode), rendered with the same messages,
system prompt and chat template (two prompt variants, see ``PROMPTS``), rewarded by the same
function (``math_verify_reward`` on the completion text), with the same group size, tasks per
step, completion length, temperature, learning rate (constant, AdamW, no weight decay,
gradient clipping 1.0), loss (DAPO token-level normalization, clip range 0.2 / 0.28, no KL so
no reference model), seed and number of steps. Every step takes the
next ``tasks`` problems in dataset order on both sides (TRL with ``shuffle_dataset=False``).

Per-step wall time: TRL from a ``TrainerCallback`` (``on_step_begin`` -> ``on_step_end``:
generation, reward, loss, backward, optimizer step); treerl from ``perf/step_s`` in its
``metrics.jsonl`` (rollout, reward, advantages, packing, loss, backward, optimizer step, weight
sync to the sampler). A probe in the shared reward function also times both sides the same way
(wall and process CPU time from one call to the next). The first ``--warmup`` steps of each run
are left out of the medians. Reward: the mean math-verify reward of the last ``--last`` steps.
With ``--repeats`` > 1 the two sides alternate and the figures pool the runs. Both sides use
``--threads`` torch threads (default 1: on a busy 2-core machine two threads stall unevenly).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_section  # noqa: E402

import treerl  # noqa: E402
from treerl.envs.builtin.calculator_tasks import calculator, sample_task  # noqa: E402
from treerl.envs.builtin.math_verify import MathVerifyEnv  # noqa: E402
from treerl.envs.core import Task  # noqa: E402
from treerl.envs.verifiers import math_verify_reward  # noqa: E402
from treerl.models import load_default_model  # noqa: E402

SECTION = "## treerl vs TRL GRPOTrainer"
ENV_ID = "bench/Arith-v0"
# MathVerify-v0's own prompt, on both sides. No tool is offered to the model.
SYSTEM_PROMPT = MathVerifyEnv.system_prompt
PROMPTS = ("after-tool", "direct")
"""How a problem is put to the model. The tiny model was trained on Calculator episodes (question,
calculator call, result, ``\\boxed{}`` answer). ``direct``: the question alone; the model then
mostly writes a calculator call anyway (no tool runs) and math-verify reads the last number it
wrote, so the reward starts near 0.05. ``after-tool``: the episode up to its answer turn (the
question, the gold calculator call and its result), so the one completion is the final answer;
the tiny model copies the result into ``\\boxed{}`` right about 1 time in 5, room for RL to act."""


def arithmetic_rows(num: int, seed: int, prompt: str) -> list[dict]:
    """``num`` problems from the Calculator task generator: the messages after the system prompt, and the answer."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num):
        task = sample_task(rng)
        messages = [{"role": "user", "content": task.question}]
        if prompt == "after-tool":
            arguments = {"expression": task.expression}
            call = {"type": "function", "function": {"name": "calculator", "arguments": arguments}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "calculator", "content": calculator(task.expression)}]
        rows.append({"messages": messages, "answer": task.answer})
    return rows


class ArithmeticEnv(MathVerifyEnv):
    """``treerl/MathVerify-v0`` whose rows hold the conversation before the answer turn, as messages."""

    @staticmethod
    def _row(row, prompt_key, answer_key, index) -> Task:
        return Task(prompt=copy.deepcopy(list(row["messages"])), answer=str(row["answer"]), id=str(index))


class MathReward:
    """The reward function of both sides (TRL's signature), which also clocks the steps.

    Each learner calls it once per step, so the intervals between calls are whole steps,
    measured by the same probe on both sides: wall time and process CPU time (all threads).
    """

    __name__ = "math_reward"  # the metric name: reward_fn/math_reward_mean, rewards/math_reward/mean

    def __init__(self):
        self.calls: list[tuple[float, float]] = []

    def __call__(self, completions, answer, **kwargs) -> list[float]:
        self.calls.append((time.perf_counter(), time.process_time()))
        out = []
        for completion, gold in zip(completions, answer, strict=True):
            text = next(m["content"] for m in completion if m["role"] == "assistant")
            out.append(math_verify_reward(text, gold))
        return out

    def intervals(self) -> tuple[list[float], list[float]]:
        """(wall, cpu) seconds between consecutive calls: the steps after the first."""
        pairs = list(zip(self.calls, self.calls[1:]))
        return [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]


# -- treerl ---------------------------------------------------------------------------------------


def run_treerl(args, rows, out_dir: Path) -> dict:
    from treerl.learners.grpo import GRPOConfig, train

    # The environment's own reward would be 0 for a completion that tries to call a tool (there
    # is none), so it gets weight 0 and the shared reward function carries the signal.
    treerl.register(ENV_ID, ArithmeticEnv, override=True, dataset=rows, system_prompt=SYSTEM_PROMPT)
    cfg = GRPOConfig(
        env=ENV_ID, output_dir=str(out_dir), steps=args.steps, tasks_per_step=args.tasks, group_size=args.group_size,
        learning_rate=args.learning_rate, max_new_tokens=args.completion_length, temperature=args.temperature,
        loss="dapo", epsilon_low=0.2, epsilon_high=0.28, beta=0.0, max_grad_norm=1.0, weight_decay=0.0,
        warmup_steps=0, eval_episodes=0, seed=args.seed, device="cpu", num_threads=args.threads, progress=False,
    )
    model, tokenizer = load_default_model()
    reward = MathReward()
    start = time.perf_counter()
    train(cfg, model=model, tokenizer=tokenizer, reward_funcs=[reward], reward_weights=[0.0, 1.0])
    total = time.perf_counter() - start
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    probe_wall, probe_cpu = reward.intervals()
    return {
        "step_s": [m["perf/step_s"] for m in lines],
        "probe_wall": probe_wall,
        "probe_cpu": probe_cpu,
        "reward": [m["reward_fn/math_reward_mean"] for m in lines],
        "total_s": total,
    }


# -- TRL ------------------------------------------------------------------------------------------


def trl_grpo_config(out_dir: Path, *, steps: int, tasks: int, group_size: int, completion_length: int,
                    temperature: float, learning_rate: float, seed: int, **extra):
    """TRL's ``GRPOConfig`` matching ``treerl learn``: one generation of ``tasks`` x ``group_size`` completions
    and one optimizer step per step, constant AdamW without weight decay, DAPO, no KL, tasks in dataset order."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=tasks * group_size,
        gradient_accumulation_steps=1, steps_per_generation=1,  # one generation of tasks x G completions per step
        num_generations=group_size, max_completion_length=completion_length,
        temperature=temperature, top_k=0, top_p=1.0,
        learning_rate=learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", max_grad_norm=1.0, gradient_checkpointing=False,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, num_iterations=1, scale_rewards="group",
        shuffle_dataset=False, seed=seed, data_seed=seed,
        use_vllm=False, use_cpu=True, bf16=False, fp16=False, report_to="none", logging_steps=1,
        save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **extra,
    )


def run_trl(args, rows, out_dir: Path) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.step_s: list[float] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self._t0)

    dataset = Dataset.from_list([
        {"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, *r["messages"]], "answer": r["answer"]}
        for r in rows
    ])
    config = trl_grpo_config(out_dir, steps=args.steps, tasks=args.tasks, group_size=args.group_size,
                             completion_length=args.completion_length, temperature=args.temperature,
                             learning_rate=args.learning_rate, seed=args.seed)
    model, tokenizer = load_default_model()
    timer, reward = StepTimer(), MathReward()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward], args=config,
                          train_dataset=dataset, callbacks=[timer])
    trainer.train()
    total = time.perf_counter() - start
    probe_wall, probe_cpu = reward.intervals()
    return {
        "step_s": timer.step_s,
        "probe_wall": probe_wall,
        "probe_cpu": probe_cpu,
        "reward": [h["reward"] for h in trainer.state.log_history if "reward" in h],
        "total_s": total,
    }


# -- the comparison -------------------------------------------------------------------------------


def compare(args, prompt: str, tmp: Path) -> dict:
    """Both sides on one prompt variant, alternating; pooled figures."""
    rows = arithmetic_rows(args.steps * args.tasks, args.seed, prompt)
    runs: dict[str, list[dict]] = {"treerl": [], "trl": []}
    for r in range(args.repeats):
        for name, fn in (("treerl", run_treerl), ("trl", run_trl)):
            result = fn(args, rows, tmp / f"{prompt}-{name}-{r}")
            runs[name].append(result)
            print(f"{prompt} run {r} {name}: steps {', '.join(f'{s:.2f}' for s in result['step_s'])} s; "
                  f"reward {', '.join(f'{x:.3f}' for x in result['reward'])}; whole run {result['total_s']:.1f} s",
                  flush=True)

    def pooled(name: str) -> dict:
        def cat(key: str, sl: slice) -> list[float]:
            return [x for run in runs[name] for x in run[key][sl]]

        probe = slice(max(args.warmup - 1, 0), None)  # interval i ends at step i + 2
        return {
            "step_s": statistics.median(cat("step_s", slice(args.warmup, None))),
            "probe_wall_s": statistics.median(cat("probe_wall", probe)),
            "probe_cpu_s": statistics.median(cat("probe_cpu", probe)),
            "reward_first": statistics.fmean(cat("reward", slice(None, args.last))),
            "reward_last": statistics.fmean(cat("reward", slice(-args.last, None))),
            "total_s": statistics.median(r["total_s"] for r in runs[name]),
            "rewards": [run["reward"] for run in runs[name]],
        }

    ours, base = pooled("treerl"), pooled("trl")
    print(f"{prompt}: per step treerl {ours['step_s']:.2f} s, TRL {base['step_s']:.2f} s "
          f"({base['step_s'] / ours['step_s']:.2f}x); CPU per step treerl {ours['probe_cpu_s']:.2f} s, "
          f"TRL {base['probe_cpu_s']:.2f} s; reward (last {args.last} steps) treerl {ours['reward_last']:.3f}, "
          f"TRL {base['reward_last']:.3f}", flush=True)
    return {"treerl": ours, "trl": base}


def table(args, results: dict[str, dict]) -> str:
    span = f"steps {args.warmup + 1}-{args.steps}"
    figures = (  # label, key, format, show the ratio, target
        (f"median wall time per step ({span})", "step_s", ".2f", True, ">= 2x"),
        (f"median wall time between reward calls ({span})", "probe_wall_s", ".2f", True, ""),
        (f"median process CPU time between reward calls ({span})", "probe_cpu_s", ".2f", True, ""),
        (f"whole run (setup and {args.steps} steps)", "total_s", ".1f", True, ""),
        (f"mean reward, first {args.last} steps", "reward_first", ".3f", False, ""),
        (f"mean reward, last {args.last} steps", "reward_last", ".3f", False, "treerl >= TRL"),
    )
    lines = ["| prompt | figure | treerl | TRL GRPOTrainer | TRL / treerl | target |", "|---|---|---:|---:|---:|---|"]
    for prompt, res in results.items():
        for label, key, fmt, show_ratio, target in figures:
            ours, base = res["treerl"][key], res["trl"][key]
            ratio = f"{base / ours:.2f}x" if show_ratio else ""
            if ratio and target:
                ratio = f"**{ratio}**"
            unit = " s" if key.endswith("_s") else ""
            lines.append(f"| {prompt} | {label} | {ours:{fmt}}{unit} | {base:{fmt}}{unit} | {ratio} | {target} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tasks", type=int, default=4, help="Problems per step.")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads, the same for both sides (1: on a busy shared machine, multi-threaded "
                             "kernels stall unevenly).")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help=f"Comma-separated, from {PROMPTS}.")
    parser.add_argument("--warmup", type=int, default=2, help="First steps of each run left out of the timings.")
    parser.add_argument("--last", type=int, default=5, help="Reward: mean over this many last steps.")
    parser.add_argument("--repeats", type=int, default=2, help="Runs of each side per prompt, alternating.")
    parser.add_argument("--no-write", action="store_true", help="Print without updating BENCHMARKS.md.")
    args = parser.parse_args()
    prompts = [p for p in args.prompts.split(",") if p]
    if unknown := [p for p in prompts if p not in PROMPTS]:
        parser.error(f"--prompts: {unknown} not in {PROMPTS}")
    if args.warmup >= args.steps or args.last > args.steps:
        parser.error("--warmup must be < --steps and --last <= --steps")
    try:
        import trl
    except ImportError:
        raise SystemExit('bench_vs_trl needs TRL: pip install -e ".[bench]"') from None

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        results = {prompt: compare(args, prompt, Path(tmp)) for prompt in prompts}

    batch = args.tasks * args.group_size
    command = "python benchmarks/bench_vs_trl.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    per_step = "\n".join(
        f"- {prompt}, {name}: " + "; ".join(", ".join(f"{x:.3f}" for x in run) for run in res[name]["rewards"])
        for prompt, res in results.items() for name in ("treerl", "trl")
    )
    verdicts = "; ".join(
        f"{prompt}: {res['trl']['step_s'] / res['treerl']['step_s']:.2f}x per step "
        f"({'meets' if res['trl']['step_s'] >= 2 * res['treerl']['step_s'] else 'misses'} the 2x target), "
        f"last-{args.last}-step reward {res['treerl']['reward_last']:.3f} vs {res['trl']['reward_last']:.3f} "
        f"({'not below' if res['treerl']['reward_last'] >= res['trl']['reward_last'] else 'below'} TRL)"
        for prompt, res in results.items()
    )
    body = f"""Command: `{command}` (run {datetime.date.today()}, torch {torch.__version__}, TRL {trl.__version__}, {args.threads} torch thread(s) on both sides, {platform.machine()}, no GPU).

The shipped tiny model (Qwen3, 1.7M parameters) trained from the same weights by both learners on the same {args.steps * args.tasks} single-turn arithmetic problems (Calculator task generator, seed {args.seed}), taken in the same order: {args.tasks} problems x {args.group_size} generations = {batch} completions per step, at most {args.completion_length} completion tokens, temperature {args.temperature:g}, full vocabulary, {args.steps} steps, learning rate {args.learning_rate:g} constant (AdamW, no weight decay, gradient clipping 1.0), DAPO loss (clip 0.2 / 0.28, token-level normalization over the step), no KL and no reference model, group-scaled advantages, one optimizer step per generation, seed {args.seed}. Reward: `math_verify_reward` on the completion text, the very same Python function on both sides. No tool is offered; system prompt "{SYSTEM_PROMPT}" on both sides. TRL: `GRPOTrainer` with transformers generation (`use_vllm=False`, `use_cpu=True`, float32), `per_device_train_batch_size={batch}` (TRL counts completions), `steps_per_generation=1`, `shuffle_dataset=False`, `gradient_checkpointing=False` (TRL's default is True, which costs recomputation and buys nothing at this size). treerl: `treerl.learners.grpo.train` on `treerl/MathVerify-v0` rows (environment reward weight 0, the shared reward function weight 1). {args.repeats} run(s) per side and prompt, alternating.

Prompts: `direct` is the question alone; the tiny model was trained to call a calculator, so it mostly writes a calculator call anyway (no tool runs) and math-verify reads the last number it wrote: little reward and little to learn from. `after-tool` is the Calculator episode up to its answer turn (the question, the gold calculator call and the calculator's result), so the one completion is the final answer; the tiny model puts the right number in `\\boxed{{}}` about 1 time in 5 at the start.

{table(args, results)}

Against the issue's target (treerl at least 2x faster per step at equal or better reward): {verdicts}.

Reward per step (both sides are seeded, so their repeats replay the same rewards: repeats add timing samples, and the reward comparison is one seed):
{per_step}

Step time, treerl: `perf/step_s` from `metrics.jsonl` (rollout through the engine, reward, advantages, tree packing, loss, backward, optimizer step, weights to the sampler); TRL: a `TrainerCallback`, `on_step_begin` -> `on_step_end` (generation, reward, loss, backward, optimizer step). The probe rows time both sides the same way, from one call of the shared reward function to the next (one whole step, logging included); CPU time is the process's, all threads (math-verify's worker process, used only for answers that are not plain numbers, is not counted). Whole run: constructing the trainer through the end of training (treerl's `train()` also saves a checkpoint and the model). Where the step time goes differs: both sides generate the same number of tokens, but treerl forwards each group's shared prompt once (tree packing) and leaves groups whose advantages are all 0 (every completion got the same reward) out of the forward and backward pass, which gives the same update since each such term's gradient is exactly 0 (`--skip-zero-advantage`, tested in `tests/test_learn.py`); TRL computes the loss on them. With the direct prompt most groups score 0 throughout, so that skip is most of the difference there.
This machine is shared with other jobs: absolute times are noise, read the ratios. With 2 torch threads on this 2-core machine under load, step times of both sides varied by more than 10x between runs (multi-threaded kernels wait for a descheduled thread), so the figures use 1 thread on both sides. {batch} completions per step is a small sample: rewards of single steps differ by chance between the sides (they sample different tokens), and {args.steps} steps show no clear trend on either side, so the reward rows say that neither learner is worse after {args.steps} steps, not which one learns faster."""
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
