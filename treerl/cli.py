"""The ``treerl`` command: one console script, one subcommand per job.

    treerl envs [--json] [--import MODULE_OR_FILE]
        list registered environments, their tools and JSON Schemas
    treerl eval --env ID [--model PATH] [--num-episodes N] ...
        play a model in an environment; print success rate, rewards and tool-call outcomes
    treerl rollout --env ID --num-tasks N --group-size G --out FILE [...]
        record prefix-tree trajectories as JSON Lines (resumable)
    treerl learn --env ID --output-dir DIR [--steps N] [--loss dapo] [--config FILE] ...
        train with GRPO on trajectory trees; prints the held-out success rate at start and end
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def import_user_modules(specs: Sequence[str]) -> None:
    """Import modules (``pkg.mod``) or run Python files (``path/to/file.py``) that register environments."""
    import importlib
    import runpy
    from pathlib import Path

    for spec in specs:
        if spec.endswith(".py"):
            if not Path(spec).is_file():
                raise SystemExit(f"treerl: --import {spec}: no such file. Pass a Python file or an importable module name.")
            runpy.run_path(spec, run_name="treerl_user_module")
        else:
            try:
                importlib.import_module(spec)
            except ImportError as exc:
                raise SystemExit(f"treerl: --import {spec}: {exc}. Is the module installed or on PYTHONPATH?") from None


def _env_entries() -> list[dict[str, Any]]:
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
    return entries


def cmd_envs(args: argparse.Namespace) -> int:
    import_user_modules(args.imports)
    entries = _env_entries()
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


def load_model(path: str | None, device: str = "cpu"):
    """Load a transformers causal LM and its tokenizer (default: the shipped tiny model), offline."""
    from treerl.models import DEFAULT_MODEL_PATH, load_default_model

    if path is None:
        return load_default_model(device=device)
    from pathlib import Path

    if not Path(path).is_dir():
        raise SystemExit(
            f"treerl: --model {path}: not a directory. Pass a local transformers model directory "
            "(config.json, weights, tokenizer), or omit --model to use the shipped tiny model "
            f"({DEFAULT_MODEL_PATH})."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"treerl: --model {path}: could not load a causal LM and tokenizer from it ({exc}).") from None
    return model.eval(), tokenizer


def config_for_command(cls: type, args: argparse.Namespace):
    """The command's config from flags and ``--config``, after ``--import``; the environment must exist."""
    from treerl.config import config_from_args
    from treerl.envs.registry import spec as env_spec

    import_user_modules(args.imports)
    cfg = config_from_args(cls, args)
    try:
        env_spec(cfg.env)
    except KeyError as exc:
        raise SystemExit(f"treerl: {exc.args[0]}") from None
    return cfg


def cmd_eval(args: argparse.Namespace) -> int:
    from treerl.agents.transformers_policy import TransformersPolicy
    from treerl.rollout.evaluate import EvalConfig, evaluate

    cfg = config_for_command(EvalConfig, args)
    model, tokenizer = load_model(cfg.model, cfg.device)
    policy = TransformersPolicy(model, tokenizer, device=cfg.device)
    report = evaluate(
        cfg.env, policy, tokenizer, num_episodes=cfg.num_episodes, seed=cfg.seed, params=cfg.sampling(),
        max_concurrency=cfg.max_concurrency, success_threshold=cfg.success_threshold,
    )
    if cfg.json:
        json.dump(report.summary(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(report.table())
    return 0


def _add_imports(p: argparse.ArgumentParser) -> None:
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE_OR_FILE",
                   help="Import a module or run a .py file that registers environments (repeatable).")


def build_parser() -> argparse.ArgumentParser:
    from treerl.config import add_dataclass_arguments
    from treerl.learners.grpo import GRPOConfig, cmd_learn
    from treerl.rollout.cli import RolloutConfig, cmd_rollout
    from treerl.rollout.evaluate import EvalConfig

    parser = argparse.ArgumentParser(prog="treerl", description="Agentic RL with tool-use environments and prefix-tree trajectories.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p_envs = sub.add_parser("envs", help="List registered environments with their tools and JSON Schemas.")
    p_envs.add_argument("--json", action="store_true", help="Print machine-readable JSON instead of text.")
    _add_imports(p_envs)
    p_envs.set_defaults(func=cmd_envs)

    commands = [
        ("eval", "Evaluate a model (default: the shipped tiny model) in an environment.", EvalConfig, cmd_eval),
        ("rollout", "Play a model in an environment; store prefix-tree trajectories (JSON Lines).", RolloutConfig,
         cmd_rollout),
        ("learn", "Train a model with GRPO (and its loss variants) on an environment.", GRPOConfig, cmd_learn),
    ]
    for name, help_text, cls, func in commands:
        p = sub.add_parser(name, help=help_text)
        add_dataclass_arguments(p, cls)  # flags generated from the config dataclass
        _add_imports(p)
        p.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
