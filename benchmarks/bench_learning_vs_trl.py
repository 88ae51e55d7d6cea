"""Learning on multi-turn tool use: ``treerl learn`` vs TRL's ``GRPOTrainer(tools=[calculator])``, on CPU.

    pip install -e ".[bench]"                          # trl, datasets
    python benchmarks/bench_learning_vs_trl.py         # full scale: 60 steps x 8 tasks x 8 = 3,840 episodes a side a seed
    python benchmarks/bench_learning_vs_trl.py --steps 10 --eval-episodes 64 --no-write   # reduced scale

Both sides train the shipped tiny model from the same weights on ``treerl/Calculator-v0``'s
training tasks (task seeds 0, 1, 2, ... in that order: step k plays tasks 8k..8k+7, TRL with
``shuffle_dataset=False``), rendered from the same messages, system prompt, tool schema and chat
template, with the same group size, tasks per step, learning rate (constant AdamW, no weight
decay, clipping 1.0), loss (DAPO, clip 0.2 / 0.28, no KL), temperature 1 and number of steps,
so both play the same number of episodes. Each episode is multi-turn: the model calls
``calculator(expression)``, reads the result, answers in ``\\boxed{}`` (treerl: at most
``--max-turns`` assistant turns of ``--max-new-tokens`` tokens; TRL: at most ``--max-turns - 1``
tool-calling iterations within ``--max-completion-length`` tokens). The reward is
``math_verify_reward`` of the final answer on both sides.

Every trained model, and the untrained one, is then scored by the same held-out evaluator:
treerl's evaluation (the rollout engine, lockstep) on ``--eval-episodes`` Calculator tasks from
seed 10,000 on, each played once at temperature 1, with the environment's error messages on
(``malformed_ends_episode=False``) so that malformed calls are counted, not cut short.

What TRL needs to play this environment (its side's adaptations, nothing else differs):

- a response template to parse tool calls out of generated text: the shipped model's chat
  template is Qwen3's format but not byte-equal to one TRL recognizes, so ``add_response_schema``
  refuses it; the benchmark sets TRL's Qwen3 template (``trl.chat_template_utils.qwen3_template``)
  on the tokenizer;
- the tool's JSON Schema as treerl renders it: TRL derives the schema from the Python function
  (``transformers.utils.get_json_schema``), which adds ``"return": {"type": "string"}`` and lacks
  ``"additionalProperties": false``; the trainer's ``tools`` (what prompts are rendered with) are
  set to treerl's schema after construction, while the function itself still runs the calls
  (TRL executes ``_standalone_tools``). The benchmark checks that both sides render the same
  prompt tokens.

Results and the exact command go to the "## Learning on tool use: treerl vs TRL GRPOTrainer"
section of BENCHMARKS.md. ``--results-dir`` keeps each run's figures as JSON so an interrupted
benchmark resumes where it stopped; treerl's files are named by ``--treerl-env-kwargs``, so a rerun
with other treerl options in the same directory trains only treerl's side and reuses TRL's runs and
the untrained evaluation (the report names what it reused). Each file keeps the options its figures
depend on (steps, sizes, turns, learning rate, threads); a file written with other options is refused,
not reported as this run's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_section  # noqa: E402
from bench_vs_trl import trl_grpo_config  # noqa: E402

import treerl  # noqa: E402
from treerl.envs.builtin.calculator_tasks import calculator  # noqa: E402
from treerl.envs.verifiers import math_verify_reward  # noqa: E402
from treerl.models import load_default_model  # noqa: E402

SECTION = "## Learning on tool use: treerl vs TRL GRPOTrainer"
ENV_ID = "treerl/Calculator-v0"
EVAL_SEED = 10_000
SIDES = ("treerl", "trl")


def training_rows(num: int) -> list[dict]:
    """Calculator's training tasks 0..num-1 as TRL rows: the messages ``env.reset(seed=i)`` gives, and the answer."""
    env = treerl.make(ENV_ID)
    rows = []
    for i in range(num):
        messages, info = env.reset(seed=i)
        rows.append({"prompt": messages, "answer": str(info["answer"])})
    return rows


def held_out(model_dir: str | None, args) -> dict:
    """The shared evaluator: success rate, its standard error, and failed tool calls per episode."""
    from treerl.agents.transformers_policy import TransformersPolicy
    from treerl.rollout.evaluate import EvalConfig, evaluate_with

    cfg = EvalConfig(env=ENV_ID, env_kwargs={"malformed_ends_episode": False, "max_turns": args.max_turns},
                     model=model_dir, max_new_tokens=args.max_new_tokens, continuous_batching=False, lockstep=True,
                     num_episodes=args.eval_episodes, seed=EVAL_SEED)
    model, tokenizer = cfg.load_model()
    policy = TransformersPolicy(model, tokenizer, device="cpu", continuous_batching=False)
    start = time.perf_counter()
    try:
        report = evaluate_with(cfg, policy, tokenizer, num_episodes=cfg.num_episodes, seed=cfg.seed)
    finally:
        policy.close()
    f = report.figures
    n, p, calls = f["episodes"], f["success_rate"], f["tool_calls"]
    return {"episodes": n, "success": p, "se": math.sqrt(p * (1 - p) / n),
            "malformed_per_episode": calls.get("malformed", 0) / n,
            "failed_calls_per_episode": sum(v for k, v in calls.items() if k != "ok") / n,
            "tool_calls": calls, "eval_s": time.perf_counter() - start}


# -- treerl ---------------------------------------------------------------------------------------


def run_treerl(args, seed: int, out_dir: Path) -> dict:
    """``treerl learn --env treerl/Calculator-v0`` with the README's settings (evaluation left to :func:`held_out`)."""
    from treerl.learners.grpo import GRPOConfig, train

    cfg = GRPOConfig(env=ENV_ID, env_kwargs={"max_turns": args.max_turns, **json.loads(args.treerl_env_kwargs)},
                     output_dir=str(out_dir), steps=args.steps, tasks_per_step=args.tasks, group_size=args.group_size,
                     learning_rate=args.learning_rate, max_new_tokens=args.max_new_tokens, eval_episodes=0,
                     seed=seed, num_threads=args.threads, progress=False)
    model, tokenizer = load_default_model()
    wall, cpu = time.perf_counter(), time.process_time()
    train(cfg, model=model, tokenizer=tokenizer)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {"train_s": wall, "train_cpu_s": cpu, "model_dir": str(out_dir / "model"),
            "reward": [m["reward/mean"] for m in lines],
            "malformed_per_episode_train": [m.get("tool_calls/malformed", 0.0) / (args.tasks * args.group_size)
                                            for m in lines]}


# -- TRL ------------------------------------------------------------------------------------------


class FinalAnswerReward:
    """TRL's reward: ``math_verify_reward`` of the last assistant message (what Calculator scores)."""

    __name__ = "calculator_reward"

    def __call__(self, completions, answer, **kwargs) -> list[float]:
        out = []
        for completion, gold in zip(completions, answer, strict=True):
            replies = [m for m in completion if m["role"] == "assistant"]
            out.append(math_verify_reward(replies[-1].get("content") or "", gold) if replies else 0.0)
        return out


def run_trl(args, seed: int, out_dir: Path) -> dict:
    from datasets import Dataset
    from trl import GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    env = treerl.make(ENV_ID)
    rows = training_rows(args.steps * args.tasks)
    config = trl_grpo_config(out_dir, steps=args.steps, tasks=args.tasks, group_size=args.group_size,
                             completion_length=args.max_completion_length, temperature=1.0,
                             learning_rate=args.learning_rate, seed=seed,
                             max_tool_calling_iterations=args.max_turns - 1)
    model, tokenizer = load_default_model()
    tokenizer.response_template = qwen3_template  # adaptation 1: how TRL finds tool calls in the text
    torch.set_num_threads(args.threads)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[FinalAnswerReward()], args=config,
                          train_dataset=Dataset.from_list(rows), tools=[calculator])
    trainer.tools = env.tool_schemas  # adaptation 2: prompts show treerl's schema; `calculator` still runs the calls
    check_same_prompt(trainer, tokenizer, env, rows[0]["prompt"])
    trainer.train()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    model_dir = out_dir / "model"
    trainer.model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    history = trainer.state.log_history
    return {"train_s": wall, "train_cpu_s": cpu, "model_dir": str(model_dir),
            "reward": [h["reward"] for h in history if "reward" in h]}


def check_same_prompt(trainer, tokenizer, env, messages: list[dict]) -> None:
    """Both sides must show the model the same prompt tokens (treerl renders with the environment's schemas)."""
    theirs = tokenizer.apply_chat_template(messages, tools=trainer.tools, chat_template=trainer.chat_template,
                                           add_generation_prompt=True, tokenize=False)
    ours = tokenizer.apply_chat_template(messages, tools=env.tool_schemas, add_generation_prompt=True, tokenize=False)
    if theirs != ours:
        raise SystemExit(f"TRL would render another prompt than treerl:\n{theirs}\n---\n{ours}")


# -- the comparison -------------------------------------------------------------------------------


EVAL_SETTINGS = ("eval_episodes", "max_turns", "max_new_tokens")
TRAIN_SETTINGS = {
    "treerl": ("steps", "tasks", "group_size", "learning_rate", "max_turns", "max_new_tokens", "threads"),
    "trl": ("steps", "tasks", "group_size", "learning_rate", "max_turns", "max_completion_length", "threads"),
}
"""The options each stored result depends on (treerl's environment options are in its file names)."""


def settings(args, names) -> dict:
    return {name: getattr(args, name) for name in names}


def cached(path: Path, fn, *fn_args, settings: dict, reused: list[str] | None = None) -> dict:
    """``fn(*fn_args)`` with the 1-minute load average before and after it, or what an earlier run of the
    benchmark stored at ``path`` with the same ``settings`` (its name then goes to ``reused``). A stored run with
    other settings is refused: its figures would be reported as this run's."""
    if path.exists():
        stored = json.loads(path.read_text())
        if stored.get("settings") != settings:
            theirs = stored.get("settings") or {}
            differ = ", ".join(f"{k} {theirs.get(k, 'not recorded')} there, {v} here" for k, v in settings.items()
                               if theirs.get(k) != v)
            raise SystemExit(f"{path} holds a run with other settings ({differ}): pass another --results-dir, or "
                             "delete that file to run it again.")
        print(f"reusing {path}", flush=True)
        if reused is not None:
            reused.append(path.stem)
        return stored
    load = os.getloadavg()[0]
    result = {**fn(*fn_args), "load_before": load, "load_after": os.getloadavg()[0], "settings": settings}
    path.write_text(json.dumps(result, indent=1))
    return result


def side_name(side: str, args) -> str:
    """``side``, and for treerl its environment options: runs with other options are other files."""
    options = json.loads(args.treerl_env_kwargs)
    if side != "treerl" or not options:
        return side
    return side + "".join(f"+{k}={v}" for k, v in sorted(options.items())).replace("/", "_")


def run_all(args, results: Path, work: Path) -> dict:
    reused: list[str] = []
    evaluation = settings(args, EVAL_SETTINGS)
    out = {"untrained": cached(results / "untrained.json", held_out, None, args, settings=evaluation, reused=reused),
           "seeds": {}, "reused": reused}
    print(f"untrained: {out['untrained']}", flush=True)
    for seed in args.seeds:
        per_side = {}
        for side in args.sides:
            train_fn = run_treerl if side == "treerl" else run_trl
            name = side_name(side, args)
            training = settings(args, TRAIN_SETTINGS[side])
            trained = cached(results / f"{name}-seed{seed}-train.json", train_fn, args, seed,
                             work / f"{name}-{seed}", settings=training, reused=reused)
            scored = cached(results / f"{name}-seed{seed}-eval.json", held_out, trained["model_dir"], args,
                            settings={**training, **evaluation}, reused=reused)
            per_side[side] = {**trained, "eval": scored}
            print(f"seed {seed} {side}: trained in {trained['train_s']:.0f} s, held-out {scored}", flush=True)
        out["seeds"][seed] = per_side
    return out


def load(trained: dict) -> str:
    """The machine's load around a training run (others' jobs slow the wall time, not the CPU time)."""
    if "load_before" not in trained:
        return "not recorded"
    return f"{trained['load_before']:.1f} / {trained['load_after']:.1f}"


def report(args, out: dict, command: str) -> str:
    import trl

    base = out["untrained"]
    lines = ["| seed | figure | untrained | treerl | TRL GRPOTrainer | target | met |",
             "|---|---|---:|---:|---:|---|---|"]
    verdicts = []
    for seed, res in out["seeds"].items():
        if set(res) != set(SIDES):
            continue
        ours, theirs = res["treerl"], res["trl"]
        oe, te = ours["eval"], theirs["eval"]
        ok_success = oe["success"] >= te["success"] - te["se"]
        ok_malformed = oe["malformed_per_episode"] <= base["malformed_per_episode"]
        ratio = theirs["train_s"] / ours["train_s"]
        lines += [
            f"| {seed} | held-out success, {base['episodes']} episodes (± 1 s.e.) | {base['success']:.1%} ± "
            f"{base['se']:.1%} | {oe['success']:.1%} ± {oe['se']:.1%} | {te['success']:.1%} ± {te['se']:.1%} | "
            f"treerl >= TRL - 1 s.e. | {'yes' if ok_success else '**no**'} |",
            f"| {seed} | malformed tool calls per held-out episode | {base['malformed_per_episode']:.3f} | "
            f"{oe['malformed_per_episode']:.3f} | {te['malformed_per_episode']:.3f} | treerl <= untrained | "
            f"{'yes' if ok_malformed else '**no**'} |",
            f"| {seed} | failed tool calls (any kind) per held-out episode | {base['failed_calls_per_episode']:.3f} | "
            f"{oe['failed_calls_per_episode']:.3f} | {te['failed_calls_per_episode']:.3f} | | |",
            f"| {seed} | training wall time | | {ours['train_s']:.0f} s | {theirs['train_s']:.0f} s "
            f"(**{ratio:.2f}x**) | TRL / treerl >= 2x | {'yes' if ratio >= 2 else '**no**'} |",
            f"| {seed} | training process CPU time | | {ours['train_cpu_s']:.0f} s | {theirs['train_cpu_s']:.0f} s "
            f"({theirs['train_cpu_s'] / ours['train_cpu_s']:.2f}x) | | |",
            f"| {seed} | load average (1 min) before / after training | | {load(ours)} | {load(theirs)} | | |",
        ]
        verdicts.append(f"seed {seed}: success {'meets' if ok_success else 'misses'}, malformed calls "
                        f"{'meet' if ok_malformed else 'miss'}, wall time {'meets' if ratio >= 2 else 'misses'}")
    curves = "\n".join(
        f"- seed {seed}, {side}: " + ", ".join(f"{x:.2f}" for x in res[side]["reward"])
        for seed, res in out["seeds"].items() for side in SIDES if side in res)
    episodes = args.steps * args.tasks * args.group_size
    scale = "full scale" if args.steps == 60 and args.tasks == 8 and args.group_size == 8 else "**reduced scale**"
    treerl_kwargs = json.loads(args.treerl_env_kwargs)
    return f"""Command: `{command}` ({scale}; run {datetime.date.today()}, torch {torch.__version__}, TRL {trl.__version__}, {args.threads} torch thread(s) on both sides, {platform.machine()}, no GPU).

The shipped tiny model trained from the same weights by `treerl learn --env {ENV_ID}` (the README's settings{f', environment options {treerl_kwargs}' if treerl_kwargs else ''}; a malformed call ends a training episode: {'yes' if treerl_kwargs.get('malformed_ends_episode', True) else 'no, the model reads an error message and goes on'}) and by TRL's `GRPOTrainer(tools=[calculator])` on the same {args.steps * args.tasks} training tasks in the same order: {args.tasks} tasks x {args.group_size} generations per step, {args.steps} steps, {episodes:,} multi-turn episodes a side and seed; learning rate {args.learning_rate:g} constant (AdamW, no weight decay, clipping 1.0), DAPO loss (clip 0.2 / 0.28), no KL, group-scaled advantages, temperature 1, seeds {', '.join(map(str, args.seeds))}. treerl: at most {args.max_turns} assistant turns of {args.max_new_tokens} tokens; TRL: at most {args.max_turns - 1} tool-calling iterations within {args.max_completion_length} completion tokens, `use_vllm=False`, float32, `steps_per_generation=1`, `shuffle_dataset=False`. Reward on both sides: `math_verify_reward` of the final answer.

Held-out evaluator, the same for every model: treerl's evaluation on {args.eval_episodes} Calculator tasks (seeds {EVAL_SEED}..{EVAL_SEED + args.eval_episodes - 1}), each played once at temperature 1, {args.max_turns} turns of {args.max_new_tokens} tokens, with the environment's error messages on (a malformed call is answered and counted, the episode goes on), lockstep generation. Standard error: sqrt(p (1 - p) / n).

{chr(10).join(lines)}

Against the targets: {'; '.join(verdicts) or 'no seed has both sides'}.{f" Reused from an earlier run of the benchmark in the same results directory (same settings on that side): {', '.join(out['reused'])}." if out.get('reused') else ''}

Training wall time: building the trainer through the end of training on both sides (treerl's `train()` also writes checkpoints, trajectory samples and the model; TRL's model is saved outside the timing). TRL's side needed two adaptations to play this environment: the shipped chat template is Qwen3's format but not byte-equal to a template TRL recognizes, so `add_response_schema` refuses it and the benchmark sets `trl.chat_template_utils.qwen3_template` as the tokenizer's response template; and TRL derives the tool's JSON Schema from the Python function (adding `"return": {{"type": "string"}}`, lacking `"additionalProperties": false`), so the trainer's `tools` are set to treerl's schema after construction (the function still runs the calls); the benchmark checks that both sides render the same prompt. Where the environments differ by design: a reply with a malformed call ends TRL's episode (its parser falls back to plain text; reward 0), and so it does in treerl's training environment when `malformed_ends_episode` is on; a reply with neither a call nor `\\boxed{{}}` ends TRL's episode, while treerl's Calculator answers it with a reminder.

Mean reward per training step:
{curves}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tasks", type=int, default=8, help="Tasks per step.")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-4, help="treerl's default for the tiny model.")
    parser.add_argument("--max-turns", type=int, default=4, help="Assistant turns of one episode (Calculator's).")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="treerl: tokens per turn (learn's default).")
    parser.add_argument("--max-completion-length", type=int, default=256,
                        help="TRL: tokens of the whole multi-turn completion (turns and tool results).")
    parser.add_argument("--seeds", default="0,1", help="Comma-separated training seeds.")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"Comma-separated, from {SIDES}.")
    parser.add_argument("--eval-episodes", type=int, default=256)
    parser.add_argument("--treerl-env-kwargs", default="{}", help="More options of treerl's training environment.")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, the same on both sides.")
    parser.add_argument("--results-dir", default=None,
                        help="Keep each run's figures here as JSON and reuse them on a rerun (default: a temporary "
                             "directory).")
    parser.add_argument("--no-write", action="store_true", help="Print without updating BENCHMARKS.md.")
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.sides = [s for s in args.sides.split(",") if s]
    if unknown := [s for s in args.sides if s not in SIDES]:
        parser.error(f"--sides: {unknown} not in {SIDES}")
    if args.max_turns < 2:
        parser.error("--max-turns must be >= 2: a call, then the answer")
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit('bench_learning_vs_trl needs TRL: pip install -e ".[bench]"') from None

    torch.set_num_threads(args.threads)
    shown = [shlex.quote(a) if prev != "--results-dir" else "DIR" for prev, a in zip(["", *sys.argv[1:]], sys.argv[1:])]
    command = "python benchmarks/bench_learning_vs_trl.py" + (" " + " ".join(shown) if shown else "")  # no local paths
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(args.results_dir or Path(tmp) / "results")
        results.mkdir(parents=True, exist_ok=True)
        work = results / "runs" if args.results_dir else Path(tmp)
        out = run_all(args, results, work)
    body = report(args, out, command)
    print(body)
    if not args.no_write and all(set(r) == set(SIDES) for r in out["seeds"].values()):
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
