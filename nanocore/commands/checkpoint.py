"""`nanocore checkpoint verify PATH [--all]`: the checks a resume runs, without training.

The checks themselves are the library's (nanocore/checkpoint/verify.py); this prints what was checked.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from nanocore.errors import NanocoreError

if TYPE_CHECKING:
    from nanocore.checkpoint.verify import Report

VERIFY_HELP = "check a checkpoint without training: manifest, checksums, meta.json, config.yaml, coverage"


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a checkpoints folder (follows latest.txt) or one step folder")
    parser.add_argument("--all", action="store_true", help="check every step folder of a checkpoints folder")


def cmd_verify(args: argparse.Namespace) -> int:
    return verify_command(args.path, every=args.all)


def verify_command(path: str | Path, every: bool = False, out: Callable[[str], None] = print) -> int:
    """Check one checkpoint (a step folder, or a checkpoints folder's latest) or, `every`, all of a
    checkpoints folder's step folders; print what was checked. Raises CheckpointError if one is damaged."""
    # torch, numpy and safetensors: imported when the command runs, not when `nanocore --help` does
    from nanocore.checkpoint.folder import LATEST, CheckpointError, resolve_checkpoint, step_folders
    from nanocore.checkpoint.verify import verify_checkpoint

    path = Path(path)
    if not every:
        report = verify_checkpoint(resolve_checkpoint(path))
        _print(report, out)
        return 0
    folders = step_folders(path)
    if not folders:
        raise NanocoreError(f"{path} holds no step folders (with --all, PATH is a checkpoints folder)")
    damaged = []
    for folder in folders:
        try:
            _print(verify_checkpoint(folder), out)
        except CheckpointError as exc:
            out(f"DAMAGED: {exc}")
            damaged.append(folder.name)
    latest = path / LATEST
    out(f"{LATEST}: {latest.read_text().strip() if latest.is_file() else 'none'}")
    if damaged:
        raise CheckpointError(
            f"{len(damaged)} of {len(folders)} checkpoints in {path} are damaged: {', '.join(damaged)}"
        )
    return 0


def _print(report: Report, out: Callable[[str], None]) -> None:
    out(f"ok {report.folder}")
    for line in report.checked:
        out(f"  {line}")
