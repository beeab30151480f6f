"""A run owns its checkpoints folder and its log dir: it never writes into another run's.

Decided once, before any process group or tensor exists, identically on every rank:

- a fresh run (no `checkpoints.resume_checkpoint_path`) refuses a checkpoints folder that already
  holds checkpoints, and a log dir that already holds files, unless `checkpoints.overwrite: true`;
- a run that continues its own checkpoints (`resume_checkpoint_path: latest`, the checkpoints folder
  itself, or one of its step folders) resumes and appends to its logs;
- `latest` on an empty checkpoints folder starts fresh: rerunning the same command after a
  preemption continues from the newest checkpoint, whenever the preemption came.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import attrs

from nanocore.checkpoint.folder import LATEST, resolve_checkpoint, step_folders
from nanocore.config.schema import Config
from nanocore.errors import NanocoreError
from nanocore.run_lock import LOCK_NAMES

LATEST_KEYWORD = "latest"


@attrs.frozen
class RunFolders:
    """Where this launch resumes from and how it treats what is already on disk."""

    checkpoints: Path
    log_dir: Path
    resume_from: Path | None  # the step folder to load, None for a fresh start
    continues: bool  # this run's own checkpoints folder: logs are appended, the W&B run continues
    overwrite: bool  # a fresh run replacing an earlier run's checkpoints and logs (asked for explicitly)


def existing_checkpoints(root: Path) -> list[str]:
    """What in `root` belongs to saved checkpoints: step folders and latest.txt (sorted by step)."""
    found = [p.name for p in step_folders(root)]
    if (root / LATEST).exists():
        found.append(LATEST)
    return found


def _within(path: Path, root: Path) -> bool:
    path, root = path.resolve(), root.resolve()
    return path == root or root in path.parents


def _shown(items: list[str], limit: int = 6) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def plan_run_folders(config: Config) -> RunFolders:
    """Resolve the resume path and check that this run may write where it is configured to."""
    ck = config.checkpoints
    root, log_dir = Path(ck.checkpoints_path), Path(config.logging.log_dir)
    path = ck.resume_checkpoint_path
    resume_from: Path | None = None
    if path == LATEST_KEYWORD or (path and Path(path).resolve() == root.resolve()):
        continues = True
        if (root / LATEST).exists():
            resume_from = resolve_checkpoint(root)
    elif path:
        resume_from = resolve_checkpoint(path)
        continues = _within(resume_from, root)
    else:
        continues = False
    overwrite = ck.overwrite and not continues
    if not continues and not overwrite:
        _refuse_if_used(root, log_dir, resumed=resume_from is not None)
    return RunFolders(root, log_dir, resume_from, continues, overwrite)


def _refuse_if_used(root: Path, log_dir: Path, *, resumed: bool) -> None:
    problems = []
    saved = existing_checkpoints(root)
    if saved:
        problems.append(
            f"checkpoints.checkpoints_path {str(root)!r} already holds checkpoints of another run ({_shown(saved)})"
        )
    # the checkpoints folder may sit inside the log dir; it is judged above, by its checkpoints
    logs = (
        sorted(p.name for p in log_dir.iterdir() if p.resolve() != root.resolve() and p.name not in LOCK_NAMES)
        if log_dir.is_dir()
        else []
    )
    if logs:
        problems.append(f"logging.log_dir {str(log_dir)!r} already holds logs of another run ({_shown(logs)})")
    if not problems:
        return
    how = (
        "to continue that run set checkpoints.resume_checkpoint_path: latest; "
        if not resumed
        else "a run resumed from another folder writes into folders of its own; "
    )
    raise NanocoreError(
        "; ".join(problems)
        + ". Nothing was changed. Ways on: "
        + how
        + "to start a new run choose another checkpoints_path and log_dir; "
        "to replace the old run's checkpoints and logs set checkpoints.overwrite: true"
    )


def clear_for_overwrite(folders: RunFolders) -> None:
    """Remove the earlier run's step folders and latest.txt (checkpoints.overwrite: true); rank 0 only."""
    for name in existing_checkpoints(folders.checkpoints):
        target = folders.checkpoints / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
