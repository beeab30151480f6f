"""`nanocore convert --to-hf CHECKPOINT OUT` / `--from-hf HF_DIR OUT`: the command over nanocore/hf_interop.py."""

from __future__ import annotations

import argparse

from nanocore.dtypes import CAST_NAMES
from nanocore.log_setup import setup_logging
from nanocore.plugins import add_plugin_argument

HELP = "convert a checkpoint to a Hugging Face transformers folder, or back"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to-hf", action="store_true", help="SOURCE: nanocore checkpoint; DEST: new HF folder")
    direction.add_argument("--from-hf", action="store_true", help="SOURCE: HF folder; DEST: new checkpoints folder")
    parser.add_argument("source", help="checkpoints folder (follows latest.txt) or step folder; or an HF model folder")
    parser.add_argument("dest", help="output folder (must not exist or be empty)")
    parser.add_argument("--dtype", choices=list(CAST_NAMES), help="--to-hf: cast the weights")
    add_plugin_argument(parser)


def cmd_convert(args: argparse.Namespace) -> int:
    from nanocore import hf_interop  # torch and safetensors: only when the command runs

    setup_logging()
    if args.to_hf:
        hf_interop.to_hf(args.source, args.dest, args.plugin, args.dtype)
    else:
        hf_interop.from_hf(args.source, args.dest, args.plugin)
    return 0
