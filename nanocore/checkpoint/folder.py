"""Checkpoint folders: one per step plus latest.txt, written under a temporary name and renamed
when complete, so a crash mid-save never damages the last good checkpoint.

    checkpoints/
      latest.txt                 "20"
      20/
        meta.json                step, topology, data positions, LR scheduler, consumed tokens (meta.py)
        config.yaml              the config the run was trained with
        model/rank-00003.safetensors       pieces of parameters with their place in the full tensor
        optimizer/rank-00003.safetensors   pieces of optimizer state, same scheme
        rng/rank-00003.pt        every rank's RNG states (loaded with weights_only=True)
        manifest.json            every other file's size and checksum (see manifest.py), written last

Durability: every file, the temporary folder and its sub-folders are fsynced before the rename,
the parent after it; latest.txt is replaced the same way (temporary name, fsync, rename, fsync).
A save that fails on any rank (a full disk, an unwritable folder) fails on every rank with one
message, removes the half-written `.tmp-<step>` and leaves the last good checkpoint and latest.txt
as they were.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from nanocore.checkpoint.manifest import MANIFEST, read_manifest, write_manifest, write_part
from nanocore.errors import NanocoreError

LATEST = "latest.txt"
REMOVING = ".removing-"  # a step folder being replaced or removed: renamed first, so a step folder is whole or absent
log = logging.getLogger("nanocore")


class CheckpointError(NanocoreError):
    """A checkpoint could not be written, or is damaged; the message names the file and the way on."""


def step_folder(root: Path, step: int) -> Path:
    return root / str(step)


def tmp_folder(root: Path, step: int) -> Path:
    return root / f".tmp-{step}"


def step_folders(root: Path) -> list[Path]:
    """The step folders of a checkpoints folder, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def is_complete(folder: Path) -> bool:
    """meta.json is there and every file the manifest lists has its recorded size (cheap: nothing is hashed)."""
    if not (folder / "meta.json").is_file():
        return False
    try:
        manifest = read_manifest(folder)
        if manifest is None:
            return True
        return all(
            (folder / name).is_file() and (folder / name).stat().st_size == entry["size"]
            for name, entry in manifest["files"].items()
        )
    except (OSError, ValueError):
        return False


def previous_checkpoint(root: Path, before: int | None = None) -> Path | None:
    """The newest complete step folder in `root` (older than step `before`, when given)."""
    for folder in reversed(step_folders(root)):
        if (before is None or int(folder.name) < before) and is_complete(folder):
            return folder
    return None


def way_on(folder: Path) -> str:
    """What to do about a damaged step folder: resume from the previous complete one, if there is one."""
    root = folder.parent
    previous = previous_checkpoint(root, int(folder.name)) if folder.name.isdigit() else None
    if previous is None:
        return f"there is no earlier complete checkpoint in {root}: restore the file from a copy, or start a new run"
    return f"resume from the previous complete checkpoint instead: checkpoints.resume_checkpoint_path: {previous}"


def _is_step_folder(path: Path) -> bool:
    return (path / "meta.json").exists() or (path / MANIFEST).exists()


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoints folder (follow latest.txt) or a step folder -> the step folder."""
    path = Path(path)
    if _is_step_folder(path):
        return path
    latest = path / LATEST
    if latest.exists():
        step = latest.read_text().strip()
        folder = path / step
        if not (step.isdigit() and _is_step_folder(folder)):
            previous = previous_checkpoint(path, int(step) if step.isdigit() else None)
            how = (
                f"resume from the previous complete checkpoint instead: checkpoints.resume_checkpoint_path: {previous}"
                if previous is not None
                else f"there is no complete checkpoint in {path}"
            )
            raise CheckpointError(f"{latest} points to step {step!r}, but {folder} is missing or incomplete; {how}")
        return folder
    if not path.exists():
        raise NanocoreError(f"checkpoint path {str(path)!r} does not exist")
    raise NanocoreError(
        f"{str(path)!r} is neither a checkpoint step folder (no meta.json) nor a checkpoints folder (no {LATEST})"
    )


# -- saving ------------------------------------------------------------------------------------
def begin_save(
    root: Path, step: int, is_main: bool, barrier: Callable[[], None], agree: Callable[[bool], bool] | None = None
) -> Path:
    """Create an empty temporary folder for `step` (rank 0), visible to all ranks afterwards.

    `agree(ok) -> bool` is true on every rank iff `ok` on every rank (the engine's `all_ranks_ok`):
    with it, a failure on one rank fails the save on all of them instead of leaving them waiting.
    """
    tmp = tmp_folder(root, step)
    error = None
    if is_main:
        try:
            _remove(tmp)  # a previous crash left it half-written
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = exc
    _fail_unless_all_ok(root, step, is_main, error, _agree(error, agree, barrier))
    return tmp


def finish_save(
    root: Path,
    step: int,
    is_main: bool,
    barrier: Callable[[], None],
    *,
    rank: int = 0,
    failure: BaseException | None = None,
    agree: Callable[[bool], bool] | None = None,
    keep_last_n: int | None = None,
    part_written: bool = False,
) -> Path:
    """After every rank has written into the temporary folder: seal it with a manifest, flush it to
    disk, rename it and point latest.txt to it; then remove step folders beyond the newest `keep_last_n`.

    Every rank calls this, `failure` being what went wrong while it wrote its pieces, if anything.
    `part_written`: this rank's files are already hashed and synced (`write_part`, by a background write).
    """
    tmp, final = tmp_folder(root, step), step_folder(root, step)
    error = failure
    if error is None and not part_written:
        try:
            write_part(tmp, rank)  # hashes and fsyncs this rank's files
        except OSError as exc:
            error = exc
    _fail_unless_all_ok(root, step, is_main, error, _agree(error, agree, barrier))
    if is_main:
        try:
            write_manifest(tmp, step)
            _sync_folders(tmp)
            _replace_folder(tmp, final)
            _write_latest(root, step)
        except OSError as exc:
            error = exc
    _fail_unless_all_ok(root, step, is_main, error, _agree(error, agree, barrier))
    if is_main:
        for leftover in root.glob(f"{REMOVING}*"):  # of a removal a crash interrupted
            shutil.rmtree(leftover, ignore_errors=True)
        if keep_last_n is not None:
            prune(root, step, keep_last_n)
    return final


def prune(root: Path, step: int, keep_last_n: int) -> list[Path]:
    """Remove the step folders up to `step` but the newest `keep_last_n` (rank 0, once `step` is complete).

    Folders of later steps (left by a run that went further, then was resumed from an earlier step)
    are not touched: the run replaces them when it gets there.
    """
    done = [p for p in step_folders(root) if int(p.name) <= step]
    removed = []
    for folder in done[: max(0, len(done) - keep_last_n)]:
        try:
            _remove(folder)
            removed.append(folder)
        except OSError as exc:
            log.warning("could not remove old checkpoint %s (checkpoints.keep_last_n): %s", folder, exc)
    if removed:
        names = ", ".join(p.name for p in removed)
        log.info("removed old checkpoint(s) %s (checkpoints.keep_last_n: %d)", names, keep_last_n)
    return removed


def _agree(error: BaseException | None, agree: Callable[[bool], bool] | None, barrier: Callable[[], None]) -> bool:
    if agree is None:  # one process (a conversion, a test)
        barrier()
        return error is None
    return agree(error is None)


def _fail_unless_all_ok(root: Path, step: int, is_main: bool, error: BaseException | None, all_ok: bool) -> None:
    if all_ok:
        return
    if is_main:
        shutil.rmtree(tmp_folder(root, step), ignore_errors=True)
    reason = _io_reason(error) if error is not None else "another rank could not write its part (its log says why)"
    if reason is None and error is not None:
        raise error  # not an I/O problem: a bug, shown with its traceback
    if not is_main:
        log.error("could not write the checkpoint of step %d: %s", step, reason)
    latest = root / LATEST
    last = f" ({root / latest.read_text().strip()})" if latest.is_file() else ""
    raise CheckpointError(
        f"could not save the checkpoint of step {step} in {root}: {reason}. The half-written "
        f"{tmp_folder(root, step).name} "
        f"was removed; the last good checkpoint{last} and {LATEST} are as they were. Free some space or make the "
        "folder writable (or change checkpoints.checkpoints_path), then resume with "
        "checkpoints.resume_checkpoint_path: latest"
    )


def _io_reason(exc: BaseException) -> str | None:
    """The operating system's words for a failed write, or None when `exc` is not about I/O."""
    if isinstance(exc, OSError):
        return str(exc)  # "[Errno 28] No space left on device: '<path>'"
    found = re.search(r"os error (\d+)", str(exc))  # safetensors reports the OS error inside its own
    if found:
        number = int(found.group(1))
        return f"[Errno {number}] {os.strerror(number)} ({type(exc).__name__}: {exc})"
    return None


def _remove(folder: Path) -> None:
    """Remove a folder, renaming it out of the way first so that it is never seen half-removed."""
    if not folder.exists():
        return
    trash = folder.parent / f"{REMOVING}{folder.name}"
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(folder, trash)
    shutil.rmtree(trash)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # some file systems cannot sync a directory
            raise
    finally:
        os.close(fd)


def _sync_folders(folder: Path) -> None:
    """fsync every folder under `folder`, deepest first, then `folder` (its files were synced when hashed)."""
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        _fsync_dir(sub)
    _fsync_dir(folder)


def _replace_folder(tmp: Path, final: Path) -> None:
    old = final.parent / f"{REMOVING}{final.name}"
    if final.exists():  # the same step saved again (after a resume from an earlier step)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _write_latest(root: Path, step: int) -> None:
    tmp = root / f".{LATEST}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / LATEST)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(root)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


# -- RNG -------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every RNG this process uses, in a form torch.load(weights_only=True) accepts."""
    np_state = cast(tuple, np.random.get_state(legacy=True))  # (kind, keys, pos, has_gauss, cached)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tuples(obj: Any) -> Any:
    return tuple(_tuples(o) for o in obj) if isinstance(obj, (list, tuple)) else obj


def save_rng(folder: Path, rank: int) -> None:
    # serialised in memory, then written plainly: torch.save's own writer reports a full disk as
    # "unexpected pos", a plain write as OSError "No space left on device"
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    (folder / "rng").mkdir(parents=True, exist_ok=True)
    (folder / "rng" / f"rank-{rank:05d}.pt").write_bytes(buffer.getvalue())


def load_rng(folder: Path, rank: int) -> bool:
    """Restore this rank's RNG states if the checkpoint has them (same rank count); False otherwise."""
    path = folder / "rng" / f"rank-{rank:05d}.pt"
    if not path.exists():
        return False
    set_rng_state(torch.load(path, weights_only=True))
    return True
