"""`nanocore` command line: plugins, config, train, and any command a plugin registers."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

from nanocore import generate_cmd  # light: torch is imported when the command runs
from nanocore.errors import NanocoreError

ERROR_GRACE_S = 10.0  # how long ranks other than 0 wait before exiting on a user error


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def setup_logging(level: str = "info", replica_level: str = "warning") -> None:
    rank = _rank()
    chosen = level if rank == 0 else replica_level
    logging.basicConfig(
        level=getattr(logging, chosen.upper(), logging.INFO),
        format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config-file", required=True, help="YAML training config")
    parser.add_argument(
        "--plugin", action="append", default=[], metavar="FILE_OR_MODULE", help="load a local plugin (repeatable)"
    )


def cmd_train(args: argparse.Namespace) -> int:
    from nanocore.config.load import load_config
    from nanocore.trainer import run_training

    setup_logging()
    loaded = load_config(args.config_file, args.plugin)
    setup_logging(loaded.config.logging.log_level, loaded.config.logging.log_level_replica)
    run_training(loaded)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from nanocore.config import dump_yaml
    from nanocore.config.load import load_config

    loaded = load_config(args.config, args.plugin, world_size=args.world_size)
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
                kind: {e.name: {"plugin": e.plugin, "aliases": [a for a, t in reg.aliases().items() if t == e.name]} for e in reg}
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
    print("registries:")
    for kind, reg in registries.by_kind.items():
        names = []
        for e in reg:
            aliases = [a for a, t in reg.aliases().items() if t == e.name]
            names.append(e.name + (f" ({', '.join(aliases)})" if aliases else "") + f" <{e.plugin}>")
        print(f"  {kind:<16} {', '.join(names) or '(none)'}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from nanocore import convert

    setup_logging()
    if args.to_hf:
        convert.to_hf(args.source, args.dest, args.plugin, args.dtype)
    else:
        convert.from_hf(args.source, args.dest, args.plugin)
    return 0


def build_parser(plugin_commands: dict) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanocore", description="nanocore: plugin-based 3D-parallel LLM pretraining")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="list plugins and every registry's names")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE")
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser("config", help="validate a config and print it with every default filled in")
    p.add_argument("config")
    p.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE")
    p.add_argument("--world-size", type=int, default=None, help="also check dp x tp x pp against this many processes")
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("train", help="train (same as run_train.py)")
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("generate", help="continue a prompt with a checkpoint's model (same as run_generate.py)")
    generate_cmd.add_arguments(p)
    p.set_defaults(func=generate_cmd.run)
    p = sub.add_parser("convert", help="convert a checkpoint to a Hugging Face transformers folder, or back")
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to-hf", action="store_true", help="SOURCE: nanocore checkpoint; DEST: new HF folder")
    direction.add_argument("--from-hf", action="store_true", help="SOURCE: HF folder; DEST: new checkpoints folder")
    p.add_argument("source", help="checkpoints folder (follows latest.txt) or step folder; or an HF model folder")
    p.add_argument("dest", help="output folder (must not exist or be empty)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="--to-hf: cast the weights")
    p.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE")
    p.set_defaults(func=cmd_convert)
    for name, entry in plugin_commands.items():
        p = sub.add_parser(name, help=entry.description or f"provided by plugin {entry.plugin}")
        add = entry.extras.get("add_arguments")
        if add is not None:
            add(p)
        p.set_defaults(func=entry.factory)
    return parser


def _plugin_commands(argv: Sequence[str]) -> dict:
    """Commands registered by plugins; only loaded when the command is not a built-in one."""
    builtin = {"plugins", "config", "train", "generate", "convert", "-h", "--help"}
    if argv and argv[0] in builtin - {"-h", "--help"}:
        return {}
    from nanocore.plugins import load_plugins

    registry = load_plugins().registries.command
    return {e.name: e for e in registry}


def run(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; user errors print one message (on rank 0 only) and return 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(_plugin_commands(argv))
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except NanocoreError as exc:
        if _rank() == 0:
            print(f"nanocore: error: {exc}", file=sys.stderr)
        else:
            # A config error happens on every rank: rank 0 reports it, exits, and torchrun stops this
            # rank during the wait, so the message appears once. An error of this rank alone (a file
            # missing on one node) is still reported once the wait is over.
            time.sleep(ERROR_GRACE_S)
            print(f"nanocore: error (rank {_rank()}): {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main() -> None:
    sys.exit(run())


def train_main(argv: Sequence[str] | None = None) -> None:
    """Entry for run_train.py: `--config-file` and `--plugin` without the `train` subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.exit(run(["train", *argv]))
