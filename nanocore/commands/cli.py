"""`nanocore` command line: plugins, config, train, the other built-in commands of this package,
and any command a plugin registers."""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from nanocore import __version__
from nanocore.commands import (  # light: torch comes when one runs
    calibrate,
    checkpoint,
    convert,
    generate,
    pipeline_sim,
    plan,
)
from nanocore.errors import NanocoreError
from nanocore.log_setup import rank, setup_logging
from nanocore.plugins import add_plugin_argument
from nanocore.registry import RENAMED_HOOKS

ERROR_GRACE_S = 10.0  # how long ranks other than 0 wait before exiting on a user error


def add_overrides_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY.PATH=VALUE",
        help="override config values (YAML-typed), e.g. tokens.train_steps=10 optimizer.clip_grad=null",
    )


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config-file", required=True, help="YAML training config")
    add_plugin_argument(parser)
    add_overrides_argument(parser)


def cmd_train(args: argparse.Namespace) -> int:
    from nanocore.config.load import load_config
    from nanocore.trainer import run_training

    setup_logging()
    loaded = load_config(args.config_file, args.plugin, overrides=args.overrides)
    setup_logging(loaded.config.logging.log_level, loaded.config.logging.log_level_replica)
    run_training(loaded)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from nanocore.commands.preflight import check_inputs
    from nanocore.config import dump_yaml
    from nanocore.config.load import load_config

    loaded = load_config(args.config, args.plugin, world_size=args.world_size, overrides=args.overrides)
    config_dir = loaded.path.resolve().parent if loaded.path is not None else Path.cwd()
    for line in check_inputs(loaded.config, loaded.plugins.registries, config_dir, data=not args.skip_data):
        print(f"ok: {line}", file=sys.stderr)
    sys.stdout.write(dump_yaml(loaded.config))
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from nanocore.plugins import load_plugins

    plugins = load_plugins(args.plugin)
    registries = plugins.registries
    infos = plugins.list()
    if args.json:
        data = {
            "plugins": [
                {
                    "name": i.name,
                    "source": i.source,
                    "distribution": i.distribution,
                    "version": i.version,
                    "location": i.location,
                    "hooks": i.hooks,
                }
                for i in infos
            ],
            "registries": {
                kind: {
                    e.name: {"plugin": e.plugin, "aliases": [a for a, t in reg.aliases().items() if t == e.name]}
                    for e in reg
                }
                for kind, reg in registries.by_kind.items()
            },
        }
        print(json.dumps(data, indent=2))
        return 0
    print(f"{len(infos)} plugin(s):")
    for i in infos:
        origin = f"{i.distribution} {i.version}" if i.distribution else i.location
        print(f"  {i.name:<14} {origin}  [{i.source}]")
        print(f"  {'':<14} hooks: {', '.join(i.hooks) or '-'}")
        stale = [f"{h} -> {RENAMED_HOOKS[h]}" for h in i.hooks if h in RENAMED_HOOKS]
        if stale:
            print(f"  {'':<14} deprecated hook names, still called until 0.3: {', '.join(stale)}")
    print("registries:")
    for kind, reg in registries.by_kind.items():
        names = []
        for e in reg:
            aliases = [a for a, t in reg.aliases().items() if t == e.name]
            names.append(e.name + (f" ({', '.join(aliases)})" if aliases else "") + f" <{e.plugin}>")
        print(f"  {kind:<16} {', '.join(names) or '(none)'}")
    return 0


def build_parser(plugin_commands: dict) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanocore", description="nanocore: plugin-based LLM pretraining (dp, cp, tp, pp, ep parallel)"
    )
    parser.add_argument("--version", action="version", version=f"nanocore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="list plugins and every registry's names")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_plugin_argument(p)
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser(
        "config",
        help="validate a config and the tokenizer and data it names; print it with every default filled in",
    )
    p.add_argument("config")
    add_plugin_argument(p)
    p.add_argument(
        "--world-size", type=int, default=None, help="also check dp x cp x tp x pp against this many processes"
    )
    p.add_argument(
        "--skip-data", action="store_true", help="do not build the datasets (the tokenizer is still checked)"
    )
    add_overrides_argument(p)
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("plan", help=plan.HELP)
    plan.add_arguments(p)
    add_overrides_argument(p)
    p.set_defaults(func=plan.cmd_plan)
    p = sub.add_parser("train", help=f"{TRAIN_HELP} (same as run_train.py)")
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("generate", help=f"{generate.HELP} (same as run_generate.py)")
    generate.add_arguments(p)
    p.set_defaults(func=generate.run)
    p = sub.add_parser("convert", help=convert.HELP)
    convert.add_arguments(p)
    p.set_defaults(func=convert.cmd_convert)
    p = sub.add_parser("checkpoint", help="inspect saved checkpoints")
    checkpoint_commands = p.add_subparsers(dest="checkpoint_command", required=True)
    p = checkpoint_commands.add_parser("verify", help=checkpoint.VERIFY_HELP)
    checkpoint.add_verify_arguments(p)
    p.set_defaults(func=checkpoint.cmd_verify)
    p = sub.add_parser("calibrate", help=calibrate.HELP)
    calibrate.add_arguments(p)
    p.set_defaults(func=calibrate.cmd_calibrate)
    p = sub.add_parser("pipeline-sim", help=pipeline_sim.HELP)
    pipeline_sim.add_arguments(p)
    p.set_defaults(func=pipeline_sim.cmd_pipeline_sim)
    for name, entry in plugin_commands.items():
        p = sub.add_parser(name, help=entry.description or f"provided by plugin {entry.plugin}")
        add = entry.extras.get("add_arguments")
        if add is not None:
            add(p)
        p.set_defaults(func=entry.factory)
    return parser


def _plugin_commands(argv: Sequence[str]) -> dict:
    """Commands registered by plugins; only loaded when the command is not a built-in one."""
    builtin = {"plugins", "config", "plan", "train", "generate", "convert", "checkpoint", "pipeline-sim"}
    if argv and (argv[0] in builtin or argv[0] in ("--version", "-V")):
        return {}
    from nanocore.plugins import load_plugins

    registry = load_plugins().registries.command
    return {e.name: e for e in registry}


TRAIN_HELP = "train a model from a YAML config (one process, or every rank under torchrun)"


def _standalone_parser(command: str, prog: str) -> argparse.ArgumentParser:
    """The parser of one built-in command under a script's own name (run_train.py, run_generate.py)."""
    add, func, description = {
        "train": (add_train_arguments, cmd_train, TRAIN_HELP),
        "generate": (generate.add_arguments, generate.run, generate.HELP),
    }[command]
    parser = argparse.ArgumentParser(prog=prog, description=f"nanocore: {description}")
    parser.add_argument("--version", action="version", version=f"nanocore {__version__}")
    add(parser)
    parser.set_defaults(func=func)
    return parser


def run(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Run the CLI and return the exit status. With `prog`, `argv[0]` is a command run as script `prog`.

    User errors print one message (on rank 0 only) and return 2; a signal that stopped training
    returns 128 + its number; any other exception prints its traceback and returns 1. Whatever
    happened, the exception (and the frames it holds) is gone and garbage collected before this
    returns, so that process groups are destroyed while the interpreter is fully alive.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if prog is not None:
            args = _standalone_parser(argv[0], prog).parse_args(argv[1:])
        else:
            args = build_parser(_plugin_commands(argv)).parse_args(argv)
        return int(args.func(args) or 0)
    except NanocoreError as exc:
        code = getattr(exc, "exit_code", 2)
        if rank() == 0:
            print(f"nanocore: error: {exc}", file=sys.stderr)
        elif code == 2:
            # A config error happens on every rank: rank 0 reports it, exits, and torchrun stops this
            # rank during the wait, so the message appears once. An error of this rank alone (a file
            # missing on one node) is still reported once the wait is over.
            time.sleep(ERROR_GRACE_S)
            print(f"nanocore: error (rank {rank()}): {exc}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"nanocore: interrupted (rank {rank()})", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        gc.collect()


def main() -> None:
    sys.exit(run())


def train_main(argv: Sequence[str] | None = None) -> None:
    """Entry for run_train.py: the `train` command's arguments, under the script's own name."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.exit(run(["train", *argv], prog="run_train.py"))


def generate_main(argv: Sequence[str] | None = None) -> None:
    """Entry for run_generate.py: the `generate` command's arguments, under the script's own name."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.exit(run(["generate", *argv], prog="run_generate.py"))
