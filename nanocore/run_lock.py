"""One run per folder: a run holds its checkpoints folder and its log dir for as long as it lives.

The never-overwrite check (`nanocore.run_folders`) looks at what a folder holds when a run starts; it
cannot see a run that starts in the same second (a job submitted twice, two experiments sharing a
path). So, before that check, the launch's rank 0 locks each folder (`checkpoints.folder_lock`):

- `flock` (what `auto` uses): an exclusive `flock` on `.nanocore-lock` inside the folder. The kernel
  drops it when the process ends, however it ends (kill -9 included), so a dead run leaves nothing to
  clean. The file stays behind, naming the last holder; it is not part of any checkpoint or log.
- `file`: where the file system's locks are unreliable (some network file systems lock per client
  only, or refuse `flock`; `auto` falls back to this when `flock` is refused): `.nanocore-lock.run`,
  created only if absent, naming host, pid and start time, removed when the run ends. A run killed
  with -9 leaves it: the next run is refused with a message saying whether the holder looks stale (its
  pid is gone from this host) and which file to delete.
- `none`: no lock (the start-up check alone).

Only global rank 0 of a launch locks (before any process group exists): the other ranks of the same
launch, on any node, never contend with it, and if rank 0 is refused the launcher stops them before
they write anything. A second run into a held folder is refused before it writes anything, with a
message naming the run that holds it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

import attrs

from nanocore.errors import NanocoreError

LOCK_NAME = ".nanocore-lock"
LOCK_FILE_NAME = ".nanocore-lock.run"
LOCK_NAMES = (LOCK_NAME, LOCK_FILE_NAME)  # never a checkpoint's or a log's
LOCK_KINDS = ("auto", "flock", "file", "none")
# errors by which a file system says it has no (working) flock
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def holder_record(run_name: str = "") -> dict[str, object]:
    """Who holds a folder: written into its lock file, shown to a run that is refused."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "run": run_name,
        "command": " ".join(sys.argv)[:300],
    }


def _describe(record: dict[str, object] | None) -> str:
    if not record:
        return "another run (its lock file names no holder yet)"
    what = f"pid {record.get('pid')} on host {record.get('host')}, started {record.get('started')}"
    if record.get("run"):
        what = f"run {record['run']!r} ({what})"
    if record.get("command"):
        what += f", command: {record['command']}"
    return what


def _read_record(path: Path) -> dict[str, object] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


@attrs.define
class _Held:
    folder: Path
    kind: str  # flock | file
    fd: int | None = None  # flock: the open descriptor that holds the lock
    record: dict[str, object] = attrs.Factory(dict)
    created: bool = False  # the folder did not exist before this run locked it


class FolderLocks:
    """The locks a run holds on its folders; `release()` on every way out (idempotent)."""

    def __init__(self) -> None:
        self.held: list[_Held] = []

    def release(self) -> None:
        """Unlock every folder; a folder this run created and left holding nothing but its lock is
        removed (a run that failed on bad input, or wrote nothing there, leaves nothing behind)."""
        while self.held:
            h = self.held.pop()
            empty = h.created and h.folder.is_dir() and set(os.listdir(h.folder)) <= set(LOCK_NAMES)
            if h.kind == "flock" and h.fd is not None:
                if empty:  # unlinked while still held: a run trying it meanwhile is refused, as it would be
                    (h.folder / LOCK_NAME).unlink(missing_ok=True)
                os.close(h.fd)  # the kernel drops the lock with the last descriptor
            elif h.kind == "file":
                path = h.folder / LOCK_FILE_NAME
                if _read_record(path) == h.record:  # still ours: remove it
                    path.unlink(missing_ok=True)
            if empty:
                try:
                    h.folder.rmdir()
                except OSError:  # something arrived meanwhile: keep it
                    pass

    @property
    def kinds(self) -> dict[str, str]:
        """folder -> how it is held (for the start-of-run summary)."""
        return {str(h.folder): h.kind for h in self.held}


def _refused(key: str, folder: Path, holder: str, extra: str = "") -> NanocoreError:
    return NanocoreError(
        f"{key} {str(folder)!r} is in use by another run: {holder}. Nothing was changed.{extra} "
        "Wait for that run to end, or give this run another checkpoints_path and log_dir."
    )


def _lock_flock(key: str, folder: Path, record: dict[str, object]) -> _Held | None:
    """The folder held with flock, or None when this file system refuses flock."""
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _refused(key, folder, _describe(_read_record(path))) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno in _NO_FLOCK:
            return None
        raise
    return _Held(folder, "flock", fd, record)  # the record is written once every folder is held


def _lock_file(key: str, folder: Path, record: dict[str, object]) -> _Held:
    path = folder / LOCK_FILE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        held_by = _read_record(path)
        extra = ""
        if held_by and held_by.get("host") == socket.gethostname():
            pid = held_by.get("pid")
            if isinstance(pid, int) and not _pid_alive(pid):
                extra = (
                    f" The lock looks stale: pid {pid} is not running on this host (a run killed without "
                    f"ending cleanly leaves its lock file). If no run uses the folder, delete {str(path)!r} "
                    "and start again."
                )
        if not extra:
            extra = f" If that run is gone (killed without ending cleanly), delete {str(path)!r} and start again."
        raise _refused(key, folder, _describe(held_by), extra) from None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record))
    return _Held(folder, "file", None, record)


def lock_run_folders(folders: dict[str, Path], kind: str, run_name: str = "") -> FolderLocks:
    """Lock each folder (`{yaml key: folder}`, created if absent) for this process, or raise a
    `NanocoreError` naming the run that holds one (every lock taken so far is released first)."""
    locks = FolderLocks()
    if kind == "none":
        return locks
    record = holder_record(run_name)
    seen: set[Path] = set()
    try:
        for key, folder in folders.items():
            resolved = folder.resolve()
            if resolved in seen:  # the log dir may be the checkpoints folder
                continue
            seen.add(resolved)
            created = not folder.exists()
            folder.mkdir(parents=True, exist_ok=True)  # a refused run finds it there: nothing changes
            held = _lock_flock(key, folder, record) if kind in ("auto", "flock") else None
            if held is None:
                if kind == "flock":
                    raise NanocoreError(
                        f"checkpoints.folder_lock: flock is not supported where {key} {str(folder)!r} lies; "
                        "set checkpoints.folder_lock: file (a lock file naming host and pid) or none"
                    )
                held = _lock_file(key, folder, record)
            held.created = created
            locks.held.append(held)
        for h in locks.held:
            if h.fd is not None:
                os.ftruncate(h.fd, 0)
                os.pwrite(h.fd, json.dumps(record).encode(), 0)
    except BaseException:
        locks.release()
        raise
    return locks
