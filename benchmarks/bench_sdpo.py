"""SDPO vs GRPO at equal samples, from one shipped model: held-out success at the end of training.

    python benchmarks/bench_sdpo.py                  # Calculator and CodeSandbox, seeds 0 and 1; writes "## SDPO vs GRPO"
    python benchmarks/bench_sdpo.py --envs treerl/Calculator-v0 --seeds 0 --no-write --workdir runs/bench-sdpo

Every run is ``treerl learn [--learner sdpo ...] --env ENV --model MODEL --output-dir DIR --seed S``
with every other option at its default: 60 steps of 8 tasks x 8 generations (3,840 episodes
per run, the same for every learner), learning rate 2e-4, evaluation on
64 held-out episodes (task seeds 10000-10063, temperature 1.0) before and after. The learners:

- ``grpo``: the default learner (``dapo`` loss);
- ``sdpo``: ``--learner sdpo --distillation-weight 1`` (distillation alone; the other defaults:
  top-k 100 with a tail, alpha 0.5, the frozen initial model as teacher, IS clip 2, the copy
  gate, demonstrations and environment feedback);
- ``sdpo+grpo``: ``--learner sdpo`` with its defaults (``--distillation-weight 0.5``: half
  GRPO's loss, half SDPO's).

The runs of one environment and seed follow each other (grpo, sdpo, sdpo+grpo), so a change
in the machine's load hits the learners alike. Each finished run keeps its ``summary.json``
in ``--workdir``; rerunning with the same workdir skips the finished runs.

``--model`` is the model every learner starts from; by default ``tiny-reader`` on Calculator
(the shipped tiny model's recipe with reading examples: it copies a demonstration in SDPO's
teacher prompt, as a pretrained LLM does; ``tiny`` never saw one and cannot be a teacher) and
``tiny-coder`` on CodeSandbox, whose tasks are then generated word problems
(``--env-kwargs '{"tasks": "word-problems"}'``: write ``solve()``; the hidden test compares with
the reference expression, so a failed test shows it). ``tiny-coder`` is ``tiny-reader`` continued
on such tasks, imperfect at them, with reading examples that use a sibling's code or the failed
test.

It also measures whether that model can be its own teacher at all (the **copy
check**): Calculator tasks played with their gold actions, then the student's log-prob of
those tokens against SDPO's teacher's, whose prompt shows an attempt with the very same
text. A model that reads its context puts the teacher above the student.
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
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_section  # noqa: E402

SECTION = "## SDPO vs GRPO at equal samples"
LEARNERS: dict[str, list[str]] = {
    "grpo": [],
    "sdpo": ["--learner", "sdpo", "--distillation-weight", "1"],  # distillation alone, gated
    "sdpo+grpo": ["--learner", "sdpo"],  # the defaults: half GRPO, half distillation, gated
    "sdpo-ungated": ["--learner", "sdpo", "--distillation-weight", "1", "--distillation-gate-margin", "none"],
}
DEFAULT_LEARNERS = ("grpo", "sdpo", "sdpo+grpo")  # the paper's ungated SDPO alone on request
ENVS = ("treerl/Calculator-v0", "treerl/CodeSandbox-v0")


DEFAULT_MODEL = "tiny-reader"
ENV_MODELS = {"treerl/Calculator-v0": "tiny-reader", "treerl/CodeSandbox-v0": "tiny-coder"}
"""The shipped model each environment's runs start from unless ``--model`` says otherwise."""
ENV_KWARGS: dict[str, dict] = {"treerl/CodeSandbox-v0": {"tasks": "word-problems"}}
"""Environment settings per environment (CodeSandbox: generated word-problem tasks, so held-out tasks are new)."""


def run_one(env: str, learner: str, seed: int, workdir: Path, extra: list[str], model: str = DEFAULT_MODEL) -> dict:
    out = workdir / f"{env.split('/')[-1]}-{learner}-{seed}"
    record = out / "bench.json"
    if record.exists():
        kept = json.loads(record.read_text())
        if (kept.get("model"), kept.get("extra")) != (model, extra):
            raise SystemExit(f"{record} was run with --model {kept.get('model')} and extra flags {kept.get('extra')}, "
                             f"this run asks for --model {model} and {extra}: its figures would be reported as this "
                             "run's. Use another --workdir, or remove that directory to rerun it.")
        return kept
    start, load = time.monotonic(), _load()
    env_kwargs = ["--env-kwargs", json.dumps(ENV_KWARGS[env])] if env in ENV_KWARGS else []
    cmd = [sys.executable, "-m", "treerl.cli", "learn", *LEARNERS[learner], "--env", env, *env_kwargs, "--model", model,
           "--output-dir", str(out), "--seed", str(seed), "--progress", "false", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {"env": env, "learner": learner, "seed": seed, "model": model, "wall_s": wall, "load": load, "load_after": _load(),
              "commit": _commit(), "extra": extra, "teacher": config.get("teacher"),
              **{k: config[k] for k in ("steps", "tasks_per_step", "group_size", "eval_episodes", "learning_rate")},
              "start": summary["eval_start"]["success_rate"], "end": summary["eval_end"]["success_rate"],
              "reward_start": summary["eval_start"]["reward/mean"], "reward_end": summary["eval_end"]["reward/mean"],
              "step_s": statistics.median(m["perf/step_s"] for m in metrics),
              "train_reward": [m["reward/mean"] for m in metrics],
              "sdpo": {k: statistics.mean(m[k] for m in metrics if k in m) for k in
                       ("sdpo/reprompt_frac", "sdpo/demonstration_frac", "sdpo/feedback_used_frac",
                        "sdpo/no_teacher_group_frac", "sdpo/divergence", "sdpo/teacher_logp", "sdpo/student_logp",
                        "sdpo/logp_gap_success", "sdpo/logp_gap_failure", "sdpo/gated_frac", "sdpo/copy_gap")
                       if any(k in m for m in metrics)}}
    record.write_text(json.dumps(result))
    print(f"{env} {learner} seed {seed}: {result['start']:.1%} -> {result['end']:.1%} "
          f"({wall / 60:.1f} min)", file=sys.stderr, flush=True)
    return result


def held_out(env: str, model: str, episodes: int) -> float:
    """Success of ``model`` (a shipped name or a directory) on ``episodes`` held-out tasks (seeds from 10000), at
    temperature 1.0, as ``treerl eval`` plays them."""
    env_kwargs = ["--env-kwargs", json.dumps(ENV_KWARGS[env])] if env in ENV_KWARGS else []
    cmd = [sys.executable, "-m", "treerl.cli", "eval", "--env", env, *env_kwargs, "--model", model,
           "--num-episodes", str(episodes), "--seed", "10000", "--json", "true"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return float(json.loads(proc.stdout)["success_rate"])


def reevaluate(runs: list[dict], workdir: Path, episodes: int) -> None:
    """Each run's final model and its starting model on ``episodes`` held-out tasks (kept in its record)."""
    starts: dict[tuple[str, str], float] = {}
    for r in runs:
        if r.get("reeval_episodes") == episodes:
            starts[(r["env"], r["model"])] = r["reeval_start"]
            continue
        key = (r["env"], r["model"])
        if key not in starts:
            starts[key] = held_out(r["env"], r["model"], episodes)
        out = workdir / f"{r['env'].split('/')[-1]}-{r['learner']}-{r['seed']}"
        r.update(reeval_episodes=episodes, reeval_start=starts[key], reeval_end=held_out(r["env"], str(out / "model"), episodes))
        (out / "bench.json").write_text(json.dumps(r))
        print(f"{r['env']} {r['learner']} seed {r['seed']} on {episodes} held-out episodes: "
              f"{r['reeval_start']:.1%} -> {r['reeval_end']:.1%}", file=sys.stderr, flush=True)


def _reeval_table(env_runs: list[dict]) -> list[str]:
    """The re-evaluated runs' table, or nothing."""
    done = [r for r in env_runs if "reeval_end" in r]
    if not done:
        return []
    n = done[0]["reeval_episodes"]
    lines = ["", f"The same final models, each on {n} held-out episodes (task seeds 10000-{10000 + n - 1}, `treerl eval "
             f"--num-episodes {n} --seed 10000`; standard error about {100 * (0.25 / n) ** 0.5:.1f} points at 50%):", "",
             "| learner | success at start | at end, per seed | mean at end | mean gain |", "|---|---:|---:|---:|---:|"]
    for learner in LEARNERS:
        own = [r for r in done if r["learner"] == learner]
        if own:
            ends = statistics.mean(r["reeval_end"] for r in own)
            lines.append(f"| {learner} | {own[0]['reeval_start']:.1%} | "
                         + " / ".join(f"{r['reeval_end']:.1%}" for r in own)
                         + f" | {ends:.1%} | {(ends - own[0]['reeval_start']) * 100:+.1f} pts |")
    return lines


def copy_check(num_tasks: int, model_name: str = DEFAULT_MODEL) -> dict[str, float]:
    """Student vs teacher log-prob of gold Calculator episodes when the teacher is shown the same text."""
    import asyncio
    import copy

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _scripted import ScriptedPolicy  # a policy that plays given texts (the tests' helper)

    import treerl
    from treerl.kernels.tree_attention import enable_tree_attention
    from treerl.learners.forward import packed_logprobs
    from treerl.learners.packing import PackingConfig, pack_groups
    from treerl.learners.sdpo import SDPOConfig, teacher_prompts
    from treerl.learners.teacher import teacher_terms
    from treerl.learners.teacher_context import TeacherPrompter
    from treerl.models import load_model
    from treerl.rollout.engine import RolloutEngine

    model, tok = load_model(model_name)
    env = treerl.make("treerl/Calculator-v0")
    gold = {}
    for seed in range(num_tasks):
        env.reset(seed=seed)
        gold[f"seed-{seed}"] = env.gold_actions(env.task)
    policy = ScriptedPolicy(tok, lambda task, g, turn: gold[task][min(turn, len(gold[task]) - 1)],
                            tok.convert_tokens_to_ids("<|im_end|>"))
    groups, _ = asyncio.run(RolloutEngine(policy, tok, seed=0).run(
        lambda: treerl.make("treerl/Calculator-v0"), "treerl/Calculator-v0", range(num_tasks), 2))
    cfg = SDPOConfig(output_dir="unused", use_feedback=False)  # the default templates, demonstrations only
    rewards = torch.tensor([[e.reward] for g in groups for e in g.episodes])
    prompts = teacher_prompts(groups, rewards, [1.0], TeacherPrompter(tok, cfg.context_config(),
                                                                      tools=env.tool_schemas), {})
    tree = copy.deepcopy(model)
    enable_tree_attention(tree)
    student, teacher = [], []
    with torch.no_grad():
        for batch in pack_groups(groups, torch.zeros(len(prompts)), PackingConfig()):
            out = packed_logprobs(tree, batch, temperature=cfg.temperature)
            t = teacher_terms(tree, groups, prompts, batch, PackingConfig(), temperature=cfg.temperature,
                              device="cpu")
            student.append(out.logp_vocab[t.mask])
            teacher.append(t.logp[t.mask])
    return {"model": model_name, "tasks": num_tasks, "success": float(rewards.mean()), "student_logp": float(torch.cat(student).mean()),
            "teacher_logp": float(torch.cat(teacher).mean())}


def _commit() -> str:
    """The measured code's commit (with "+changes" when the work tree differs): which runs can be reused."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


DEFAULT_STEPS, DEFAULT_EVAL_EPISODES = 60, 64  # the full benchmark: treerl learn's defaults


def _extra(r: dict) -> list[str]:
    """The flags a run had beyond the defaults (older records only kept steps and eval episodes)."""
    if "extra" in r:
        return list(r["extra"])
    out = [] if r.get("steps", DEFAULT_STEPS) == DEFAULT_STEPS else ["--steps", str(r["steps"])]
    if r.get("eval_episodes", DEFAULT_EVAL_EPISODES) != DEFAULT_EVAL_EPISODES:
        out += ["--eval-episodes", str(r["eval_episodes"])]
    return out


def _env_command(env: str, env_runs: list[dict]) -> str:
    seeds = sorted({r["seed"] for r in env_runs})
    learners = [name for name in LEARNERS if any(r["learner"] == name for r in env_runs)]
    model = env_runs[0].get("model", "tiny")
    cmd = f"python benchmarks/bench_sdpo.py --envs {env} --seeds {' '.join(map(str, seeds))}"
    cmd += f" --model {model}" if model != ENV_MODELS.get(env, DEFAULT_MODEL) else ""
    if learners != list(DEFAULT_LEARNERS):
        cmd += f" --learners {' '.join(learners)}"
    if "reeval_episodes" in env_runs[0]:
        cmd += f" --reeval-episodes {env_runs[0]['reeval_episodes']}"
    extra = _extra(env_runs[0])
    return cmd + (f" -- {' '.join(extra)}" if extra else "")


def teacher_words(runs: list[dict]) -> str:
    """The teacher the SDPO runs used, as their configs recorded it."""
    # Records from before the default changed name no teacher: theirs was ema.
    kinds = {r.get("teacher") or "ema" for r in runs if r["learner"] != "grpo"}
    names = {"ema": "EMA teacher 0.05", "initial": "the frozen initial model as teacher",
             "live": "the live student as teacher"}
    return " / ".join(names.get(k, k) for k in sorted(kinds)) or "no SDPO run"


def report(runs: list[dict], envs: list[str], loads: list[str], note: str = "",
           check: dict[str, float] | None = None) -> str:
    commits = sorted({r.get("commit", "not recorded") for r in runs})
    lines = [
        f"Run {datetime.date.today()} (measured code: commit {', '.join(commits)}; torch {torch.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs; "
        + (note or ("load not recorded" if loads[0] == "?" else
                    f"load average before the runs {loads[0]}, after {loads[-1]}")) + ").",
        "",
        "Every run is `treerl learn [--learner sdpo [--distillation-weight 1]] --env ENV --model MODEL --output-dir "
        "DIR --seed S [flags below]` from the shipped model named below, every other option at its default (8 tasks "
        "x 8 generations per step, learning rate 2e-4, the same episodes per run for every learner). `sdpo` is "
        "distillation alone (`--distillation-weight 1`; top-k 100 with a tail, alpha 0.5, "
        f"{teacher_words(runs)}, IS clip 2, the copy gate, demonstrations and environment feedback); `sdpo+grpo` "
        "is `--learner sdpo` at its defaults, half GRPO's loss and half distillation. Held-out success: episodes on "
        "task seeds from 10000 at temperature 1.0, before and after training.",
        f"The full benchmark (`python benchmarks/bench_sdpo.py`) is {DEFAULT_STEPS} steps (3,840 episodes per run), "
        f"seeds 0 and 1, {DEFAULT_EVAL_EPISODES} held-out episodes, on both environments; a run below with fewer "
        "steps, seeds or held-out episodes is a reduced run and says so.",
        "",
    ]
    for env in envs:
        env_runs = [r for r in runs if r["env"] == env]
        if not env_runs:
            continue
        seeds = sorted({r["seed"] for r in env_runs})
        r0 = env_runs[0]
        steps, episodes = r0.get("steps", DEFAULT_STEPS), r0.get("eval_episodes", DEFAULT_EVAL_EPISODES)
        reduced = steps != DEFAULT_STEPS or episodes != DEFAULT_EVAL_EPISODES or any(
            sorted(r["seed"] for r in env_runs if r["learner"] == learner) != [0, 1] for learner in DEFAULT_LEARNERS)
        per_run = steps * r0.get("tasks_per_step", 8) * r0.get("group_size", 8)
        settings = f" with `--env-kwargs '{json.dumps(ENV_KWARGS[env])}'`" if env in ENV_KWARGS else ""
        lines += [f"**{env}**{settings}, from `{r0.get('model', 'tiny')}`: `{_env_command(env, env_runs)}`: {steps} steps = {per_run:,} episodes per run, "
                  f"seeds {', '.join(map(str, seeds))}, {episodes} held-out episodes"
                  + (" (a reduced run, not the full benchmark)." if reduced else "."), "",
                  "| learner | seed | held-out success at start | at end | gain | held-out mean reward at end | "
                  "median step | wall time |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for learner in LEARNERS:
            for r in (r for r in env_runs if r["learner"] == learner):
                lines.append(f"| {learner} | {r['seed']} | {r['start']:.1%} | {r['end']:.1%} | "
                             f"{(r['end'] - r['start']) * 100:+.1f} pts | {r['reward_end']:.3f} | "
                             f"{r['step_s']:.1f} s | {r['wall_s'] / 60:.1f} min |")
        lines += ["", "| learner | seeds | mean success at end | mean gain | step time / GRPO's (median steps) |",
                  "|---|---|---:|---:|---:|"]
        grpo = [r["step_s"] for r in env_runs if r["learner"] == "grpo"]
        for learner in LEARNERS:
            own = [r for r in env_runs if r["learner"] == learner]
            if not own:
                continue
            ratio = f"{statistics.mean(r['step_s'] for r in own) / statistics.mean(grpo):.2f}x" if grpo else "-"
            lines.append(f"| {learner} | {', '.join(str(r['seed']) for r in own)} | "
                         f"{statistics.mean(r['end'] for r in own):.1%} | "
                         f"{statistics.mean((r['end'] - r['start']) * 100 for r in own):+.1f} pts | {ratio} |")
        lines += _reeval_table(env_runs)
        sdpo_runs = [r for r in env_runs if r["sdpo"]]
        if sdpo_runs:
            keys = list(sdpo_runs[0]["sdpo"])
            lines += ["", "SDPO's own metrics, mean over the steps of each run:", "",
                      "| run | " + " | ".join(k.removeprefix("sdpo/") for k in keys) + " |",
                      "|---|" + "---:|" * len(keys)]
            for r in sdpo_runs:
                lines.append(f"| {r['learner']} seed {r['seed']} | "
                             + " | ".join(f"{r['sdpo'].get(k, float('nan')):.3f}" for k in keys) + " |")
        lines.append("")
    if check is not None:
        lines += [f"Copy check: {check['tasks']} Calculator tasks played with their gold actions (success "
                  f"{check['success']:.0%}); mean log-prob of those sampled tokens under `{check.get('model', 'tiny')}` "
                  f"as the student: {check['student_logp']:.3f}; as SDPO's teacher, whose prompt shows an attempt with the "
                  f"very same text: {check['teacher_logp']:.3f}.", ""]
    return "\n".join(lines)


def _finished(workdir: Path, envs: list[str], seeds: list[int], learners: list[str]) -> list[dict]:
    """The records of the finished runs in ``workdir`` (of the given envs, seeds and learners)."""
    records = [workdir / f"{env.split('/')[-1]}-{learner}-{seed}" / "bench.json"
               for env in envs for seed in seeds for learner in learners]
    return [json.loads(r.read_text()) for r in records if r.exists()]


def _loads(runs: list[dict]) -> list[str]:
    """The load averages before the first of ``runs`` and after the last (as they recorded them)."""
    return [r.get("load", "?") for r in runs[:1]] + [r.get("load_after", "?") for r in runs[-1:]] or ["?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", default=list(ENVS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--learners", nargs="+", default=list(DEFAULT_LEARNERS), choices=list(LEARNERS))
    parser.add_argument("--workdir", type=Path, default=None, help="Keep runs here (rerunning skips finished ones).")
    parser.add_argument("--no-write", action="store_true", help="Print without updating BENCHMARKS.md.")
    parser.add_argument("--report-only", action="store_true",
                        help="Report the finished runs in --workdir (of the given envs, seeds, learners); run nothing.")
    parser.add_argument("--model", default=None,
                        help="The model every run starts from: a shipped model's name (tiny, tiny-reader, tiny-coder) or "
                             "a directory; default: tiny-reader on Calculator, tiny-coder on CodeSandbox.")
    parser.add_argument("--reeval-episodes", type=int, default=0,
                        help="Also evaluate every final model (and the start) on this many held-out episodes (0: no).")
    parser.add_argument("--copy-check-tasks", type=int, default=16, help="Tasks of the copy check (0 skips it).")
    parser.add_argument("--preamble", type=Path, default=None,
                        help="A Markdown file whose text opens the section (what the figures show, in words).")
    parser.add_argument("--note", default="", help="Replaces the load figures in the report's first line.")
    parser.add_argument("--also", type=Path, default=None,
                        help="Append a report of the finished runs in this earlier workdir (e.g. another scale).")
    parser.add_argument("--also-note", default="", help="What the --also runs are (a paragraph under their heading).")
    parser.add_argument("--also-heading", default="Earlier runs", help="The heading of the --also runs.")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="More flags for every run, after --, e.g. -- --steps 5")
    args = parser.parse_args()
    extra = [a for a in args.extra if a != "--"]
    loads = [_load()]
    if args.report_only:
        if args.workdir is None:
            parser.error("--report-only reads the runs of --workdir DIR")
        runs = _finished(args.workdir, args.envs, args.seeds, args.learners)
        loads = _loads(runs)
        if args.reeval_episodes:
            reevaluate(runs, args.workdir, args.reeval_episodes)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = args.workdir or Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            runs = [run_one(env, learner, seed, workdir, extra, args.model or ENV_MODELS.get(env, DEFAULT_MODEL))
                    for env in args.envs for seed in args.seeds for learner in args.learners]
            if args.reeval_episodes:
                reevaluate(runs, workdir, args.reeval_episodes)
        loads.append(_load())
    check = copy_check(args.copy_check_tasks, args.model or DEFAULT_MODEL) if args.copy_check_tasks else None
    body = report(runs, args.envs, loads, args.note, check)
    if args.preamble is not None:
        body = args.preamble.read_text().rstrip() + "\n\n" + body
    if args.also is not None:
        earlier = _finished(args.also, args.envs, args.seeds, args.learners)
        body += "\n" + "\n".join([f"### {args.also_heading}", "", *([args.also_note, ""] if args.also_note else []),
                                   report(earlier, args.envs, _loads(earlier))])
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
