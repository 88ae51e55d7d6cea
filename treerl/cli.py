"""The ``treerl`` command: one console script, one subcommand per job, the top floor of the package.

    treerl envs [--json] [--import MODULE_OR_FILE]
        list registered environments, their tools and JSON Schemas
    treerl eval --env ID [--env-kwargs JSON] [--model PATH] [--num-episodes N] ...
        play a model in an environment; print success rate, rewards and tool-call outcomes
    treerl rollout --env ID --num-tasks N --group-size G --out FILE [...]
        record prefix-tree trajectories as JSON Lines (resumable)
    treerl learn [--learner grpo] --env ID --output-dir DIR [--steps N] [--loss dapo] [--config FILE] ...
        train on trajectory trees; prints the held-out success rate at start and end
        (--from-rollouts FILE / --from-server URL: on groups recorded elsewhere)
    treerl view FILE.jsonl|RUN_DIR [...] [-o view.html] [--model DIR]
        trajectory trees in a browser: one self-contained HTML file that works offline
    treerl plot RUN_DIR [RUN_DIR ...] [-o DIR]
        a run's plots (reward, tool calls, entropy, clip/IS, packing, step time); several overlaid
    treerl compare RUN_DIR RUN_DIR [...] [--last N] [--json]
        final metrics of learn runs side by side
    treerl serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--out FILE] [--group-size G] ...
        an OpenAI-compatible endpoint whose traffic is recorded as trajectory trees

Every subcommand's flags are generated from its config dataclass (plus ``--config
file.yaml``), and ``--import`` runs the user's modules first (environments, losses and
learners register themselves there). ``learn``'s flags are those of the learner that
``--learner`` (or the ``learner`` key of ``--config``) names. Nothing below this module imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from treerl.config import add_dataclass_arguments, config_from_args, unknown_option_hints
from treerl.errors import ConfigError
from treerl.user_modules import import_user_modules

__all__ = ["main", "build_parser"]


def config_for_command(cls: type, args: argparse.Namespace, *, extra_keys: Sequence[str] = (),
                       hints: dict[str, str] | None = None):
    """The command's config from flags and ``--config``; the environment must exist."""
    from treerl.envs.registry import spec as env_spec

    cfg = config_from_args(cls, args, extra_keys=extra_keys, hints=hints)
    try:
        env_spec(cfg.env)
    except KeyError as exc:
        raise ConfigError(exc.args[0]) from None
    if cfg.env_kwargs:
        _check_env_builds(cfg.env, cfg.env_kwargs, _given_by(args, "env_kwargs"))
    if getattr(cfg, "eval_env_kwargs", None):  # the held-out environment: the same with these on top
        _check_env_builds(cfg.env, cfg.held_out_env_kwargs(), _given_by(args, "eval_env_kwargs"))
    return cfg


def _given_by(args: argparse.Namespace, name: str) -> str:
    """Where the option ``name`` came from, as the user wrote it: its flag, or its key in the ``--config`` file."""
    config_path = getattr(args, "__config__", None)
    if name in vars(args) or not config_path:  # flags are in args only when given
        return "--" + name.replace("_", "-")
    return f"{name} in --config {config_path}"


def _check_env_builds(env_id: str, kwargs: dict, flag: str) -> None:
    """Build ``env_id`` with ``kwargs`` once, before any model loads: a keyword it does not take or a
    file it cannot read is the flag's fault, said in one line."""
    from treerl.envs.registry import make
    from treerl.errors import EnvError, MissingExtraError

    try:
        env = make(env_id, **kwargs)
    except MissingExtraError:  # not the flag's fault: the message names the extra to install
        raise
    except (TypeError, ValueError, OSError, LookupError, EnvError) as exc:
        raise ConfigError(f"{flag} {json.dumps(kwargs)}: {env_id} cannot be built with them: "
                          f"{type(exc).__name__}: {exc}") from None
    env.close()


def _preparse(argv: Sequence[str]) -> argparse.Namespace:
    """``--import``, ``--learner`` and ``--config`` before the full parse: user modules register
    environments, losses and learners, and the learner decides which flags ``learn`` has."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--import", dest="imports", action="append", default=[])
    pre.add_argument("--learner", default=None)
    pre.add_argument("--config", dest="config", default=None)
    known, _ = pre.parse_known_args(argv)
    return known


def _learner_name(pre: argparse.Namespace) -> str:
    """``--learner``, else the ``learner`` key of ``--config``, else grpo."""
    if pre.learner:
        return pre.learner
    if pre.config:
        from treerl.config import load_config_file

        return str(load_config_file(pre.config).get("learner", "grpo"))
    return "grpo"


# -- the commands ---------------------------------------------------------------------------------


def cmd_envs(args: argparse.Namespace) -> int:
    import treerl
    from treerl.envs.registry import description_of

    entries = []
    for env_id, spec in sorted(treerl.registry.items()):
        env = spec.make()
        try:
            entries.append({
                "id": env_id,
                "description": description_of(spec),
                "entry_point": spec.entry_point if isinstance(spec.entry_point, str) else repr(spec.entry_point),
                "tools": env.tool_schemas,
            })
        finally:
            env.close()
    if args.json:
        json.dump(entries, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for e in entries:
        print(f"{e['id']}  {e['description']}")
        if not e["tools"]:
            print("    tools: none")
        for schema in e["tools"]:
            fn = schema["function"]
            print(f"    tool {fn['name']}: {fn.get('description', '')}")
            print(f"        parameters: {json.dumps(fn.get('parameters', {}), sort_keys=True)}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from treerl.agents.chat_templates import resolve_chat_template, warn_about_template
    from treerl.agents.transformers_policy import TransformersPolicy
    from treerl.rollout.evaluate import EvalConfig, evaluate_with, write_episodes
    cfg = config_for_command(EvalConfig, args)
    reward_funcs = cfg.reward_functions()
    cfg.check_out()
    model, tokenizer = cfg.load_model()
    warn_about_template(tokenizer, cfg.env_factory(), resolve_chat_template(cfg.chat_template, tokenizer))
    policy = TransformersPolicy(model, tokenizer, device=cfg.device, continuous_batching=cfg.continuous_batching)
    try:
        report = evaluate_with(cfg, policy, tokenizer, num_episodes=cfg.num_episodes, seed=cfg.seed,
                               success_threshold=cfg.success_threshold, rollouts_per_task=cfg.rollouts_per_task,
                               reward_funcs=reward_funcs, reward_weights=cfg.reward_weights, progress=cfg.progress)
    finally:
        policy.close()
    if cfg.out:
        write_episodes(cfg.out, report, cfg.run_header(tokenizer))
        print(f"wrote {report.num_episodes} episodes to {cfg.out} (`treerl view {cfg.out}` shows them)",
              file=sys.stderr)
    if cfg.json:
        summary = report.summary()
        if cfg.per_task:
            summary["tasks"] = report.task_rows()
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(report.table())
        if cfg.per_task:
            print()
            print(report.task_table())
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    from treerl.agents.transformers_policy import TransformersPolicy
    from treerl.rollout.record import RolloutConfig, record
    from treerl.rollout.summary import summary_table

    cfg = config_for_command(RolloutConfig, args)
    model, tokenizer = cfg.load_model()
    policy = TransformersPolicy(model, tokenizer, device=cfg.device, continuous_batching=cfg.continuous_batching)
    try:
        summary = record(cfg, policy, tokenizer)
    except KeyboardInterrupt:
        if cfg.out:
            raise KeyboardInterrupt(f"the tasks finished so far are in {cfg.out}; the same command goes on with the "
                                    "others") from None
        raise
    finally:
        policy.close()
    if summary["groups"] == 0 and summary["skipped_finished_tasks"] == cfg.num_tasks:
        print(f"all {cfg.num_tasks} tasks are already in {cfg.out}: nothing to play (a larger --num-tasks adds more; "
              "`treerl view` or read_groups reads them)")
        return 0
    skipped = summary["skipped_finished_tasks"]
    # A resumed run plays only the missing tasks: say that the figures leave the others out.
    print(summary_table(summary, **({"resumed": f"{skipped} task(s) already in {cfg.out}, not in these figures"}
                                     if skipped else {})))
    return 0


def cmd_learn(args: argparse.Namespace) -> int:
    from treerl.learners import LEARNERS
    from treerl.learners.distributed import is_main_process

    spec = LEARNERS[args.learner]
    cfg = config_for_command(spec.config, args, extra_keys=("learner",))
    try:
        result = spec.train(cfg)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_how_to_resume(Path(cfg.output_dir))) from None
    if not is_main_process():  # under accelerate launch, rank 0 reports
        return 0
    if result.eval_start and result.eval_end:
        start, end = result.eval_start["success_rate"], result.eval_end["success_rate"]
        print(f"held-out success rate: start {start:.1%} -> end {end:.1%} "
              f"({(end - start) * 100:+.1f} points) over {result.eval_end['episodes']} episodes")
    elif result.eval_end:  # --eval-on-start false: the end's alone
        print(f"held-out success rate at the end: {result.eval_end['success_rate']:.1%} over "
              f"{result.eval_end['episodes']} episodes")
    elif cfg.eval_episodes == 0:
        print("held-out evaluation skipped (--eval-episodes 0)")
    print(f"model saved to {result.model_dir}; metrics in {result.output_dir / 'metrics.jsonl'}")
    return 0


def _how_to_resume(output_dir: Path) -> str:
    from treerl.learners.checkpoints import latest_checkpoint

    if (ckpt := latest_checkpoint(output_dir)) is not None:
        return f"`--resume true` continues {output_dir} from its last checkpoint, {ckpt.name}"
    return (f"{output_dir} has no checkpoint yet: `--resume true` starts over there (`--save-every N` checkpoints "
            "every N steps)")


def cmd_view(args: argparse.Namespace) -> int:
    from treerl.rollout.view import ViewConfig, write_view

    out, num_groups = write_view(config_from_args(ViewConfig, args))
    print(f"wrote {out} ({num_groups} groups, {out.stat().st_size / 2**20:.1f} MiB): open it in a browser; it needs "
          "no server or network")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from treerl.learners.plots import PlotConfig, write_plots

    cfg = config_from_args(PlotConfig, args)
    for path in write_plots(cfg.paths, cfg.out):
        print(path)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from treerl.learners.compare import CompareConfig, compare_runs, compare_table

    cfg = config_from_args(CompareConfig, args)
    if cfg.json:
        json.dump(compare_runs(cfg.paths, cfg.last), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(compare_table(cfg.paths, cfg.last))
    return 0


def _path_commands() -> list[tuple[str, str, type, Callable[[argparse.Namespace], int], str]]:
    """(name, help, config, function, what the positional paths are) of the commands that read files."""
    from treerl.learners.compare import CompareConfig
    from treerl.learners.plots import PlotConfig
    from treerl.rollout.view import ViewConfig

    return [
        ("view", "Trajectory trees in a browser: one self-contained HTML file, offline.", ViewConfig, cmd_view,
         "trajectory files (treerl rollout --out) or learn output directories"),
        ("plot", "Draw a learn run's plots (several runs overlaid); needs treerl[plot].", PlotConfig, cmd_plot,
         "learn output directories"),
        ("compare", "Final metrics of learn runs side by side.", CompareConfig, cmd_compare,
         "learn output directories"),
    ]


def cmd_serve(args: argparse.Namespace) -> int:
    from treerl.serve.app import serve
    from treerl.serve.config import ServeConfig

    cfg = config_from_args(ServeConfig, args)
    try:
        serve(cfg)
    except ImportError as exc:  # the serve extra is missing: say which to install
        raise ConfigError(str(exc)) from None
    return 0


def _commands(learner: str) -> list[tuple[str, str, type, Callable[[argparse.Namespace], int]]]:
    """(name, help, config dataclass, function) of each subcommand whose flags come from a config;
    ``learn``'s config is the chosen learner's."""
    from treerl.learners import LEARNERS
    from treerl.rollout.evaluate import EvalConfig
    from treerl.rollout.record import RolloutConfig
    from treerl.serve.config import ServeConfig

    if learner not in LEARNERS:
        raise ConfigError(f"--learner {learner}: no such learner; choose one of {sorted(LEARNERS)}, or register "
                          "yours with treerl.learners.register_learner in a module given with --import.")
    return [
        ("eval", "Evaluate a model (default: the shipped tiny model) in an environment.", EvalConfig, cmd_eval),
        ("rollout", "Play a model in an environment; store prefix-tree trajectories (JSON Lines).", RolloutConfig,
         cmd_rollout),
        ("learn", f"Train a model on an environment ({learner}: {LEARNERS[learner].help})", LEARNERS[learner].config,
         cmd_learn),
        ("serve", "Serve a model behind an OpenAI-compatible API and record its traffic as trajectory trees.",
         ServeConfig, cmd_serve),
    ]


def _add_imports(p: argparse.ArgumentParser) -> None:
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE_OR_FILE",
                   help="Import a module or run a .py file first: environments, losses and reward functions it "
                        "registers become available (repeatable).")


class _Parser(argparse.ArgumentParser):
    """argparse, with "did you mean" for a misspelled flag, and ``hints`` (flag -> what to use instead)
    for flags that belong elsewhere."""

    hints: dict[str, str] = {}

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            import difflib

            owners: dict[str, list[str]] = {}  # flag -> the commands that have it
            for name, p in self._parsers():
                for a in p._actions:
                    for flag in a.option_strings:
                        if flag.startswith("--"):
                            owners.setdefault(flag, []).append(name)
            for arg in message.split(":", 1)[1].split():
                flag = arg.split("=")[0]
                if not arg.startswith("--"):
                    continue
                if flag in owners:  # right flag, another command's
                    message += f"; {flag} is a flag of {', '.join(f'treerl {c}' for c in owners[flag])}"
                elif flag in self.hints:  # another learner's flag, or another toolkit's
                    message += f"; {flag}: {self.hints[flag]}"
                elif close := difflib.get_close_matches(flag, list(owners), 1):
                    message += f"; {arg}: did you mean {close[0]}?"
        super().error(message)

    def _parsers(self) -> list[tuple[str, argparse.ArgumentParser]]:
        out: list[tuple[str, argparse.ArgumentParser]] = [("", self)]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                out.extend(action.choices.items())
        return out


def build_parser(learner: str = "grpo") -> argparse.ArgumentParser:
    parser = _Parser(prog="treerl", description="Agentic RL with tool-use environments and "
                                                                "prefix-tree trajectories.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p_envs = sub.add_parser("envs", help="List registered environments with their tools and JSON Schemas.")
    p_envs.add_argument("--json", action="store_true", help="Print machine-readable JSON instead of text.")
    _add_imports(p_envs)
    p_envs.set_defaults(func=cmd_envs)

    for name, help_text, cls, func in _commands(learner):
        p = sub.add_parser(name, help=help_text)
        add_dataclass_arguments(p, cls)  # flags generated from the config dataclass
        _add_imports(p)
        if name == "learn":
            from treerl.learners import LEARNERS

            p.add_argument("--learner", default=learner, choices=sorted(LEARNERS),
                           help="Which learner trains (its own flags are listed with --learner NAME --help).")
            hints = unknown_option_hints(cls)
            parser.hints = {"--" + name.replace("_", "-"): hint for name, hint in hints.items()}
        p.set_defaults(func=func)

    for name, help_text, cls, func, paths_help in _path_commands():
        p = sub.add_parser(name, help=help_text)
        # Optional here so that a --config file's `paths` can name them; the config says when none are given.
        p.add_argument("paths", nargs="*", default=argparse.SUPPRESS, metavar="PATH",
                       help=paths_help.capitalize() + " (or `paths` in --config).")
        add_dataclass_arguments(p, cls)
        if any(f.name == "out" for f in dataclasses.fields(cls)):
            p.add_argument("-o", dest="out", default=argparse.SUPPRESS, help="Same as --out.")
        p.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        pre = _preparse(argv)
        import_user_modules(pre.imports)  # once, before the flags that what they register may add
        args = build_parser(_learner_name(pre)).parse_args(argv)
        return int(args.func(args) or 0)
    except ConfigError as exc:  # a setting that cannot work: say which and how to fix it, no traceback
        print(f"treerl: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `treerl compare ... | head` closed the pipe: nothing more to print
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that flushing stdout at exit does not raise again
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C: how to go on, not the traceback of wherever it landed
        print(f"treerl: interrupted{f'; {exc}' if str(exc) else ''}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
