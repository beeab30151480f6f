"""A run holds its folders (nanocore/run_lock.py): a second holder is refused with a message naming the
first; the kernel releases a flock however its holder ends; the lock-file fallback says when a lock
looks stale; a bad `checkpoints.folder_lock` is refused with its YAML path."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.errors import ConfigError, NanocoreError
from nanocore.plugins import load_plugins
from nanocore.run_lock import LOCK_FILE_NAME, LOCK_NAME, lock_run_folders
from tests.helpers.training import tiny_config


def folders(tmp_path):
    return {"checkpoints.checkpoints_path": tmp_path / "ckpt", "logging.log_dir": tmp_path / "logs"}


def test_a_second_holder_is_refused_with_the_first_ones_name_until_it_releases(tmp_path):
    first = lock_run_folders(folders(tmp_path), "auto", run_name="first-run")
    assert first.kinds == {str(tmp_path / "ckpt"): "flock", str(tmp_path / "logs"): "flock"}
    record = json.loads((tmp_path / "ckpt" / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(NanocoreError) as caught:
        lock_run_folders(folders(tmp_path), "auto", run_name="second-run")
    message = str(caught.value)
    assert f"checkpoints.checkpoints_path {str(tmp_path / 'ckpt')!r} is in use by another run" in message
    assert f"run 'first-run' (pid {os.getpid()} on host {socket.gethostname()}, started " in message
    assert "Nothing was changed" in message
    # the log dir alone held is refused as well
    first.release()
    logs_only = lock_run_folders({"logging.log_dir": tmp_path / "logs"}, "flock")
    with pytest.raises(NanocoreError, match="logging.log_dir .* is in use by another run"):
        lock_run_folders(folders(tmp_path), "flock")
    assert not (tmp_path / "ckpt").exists(), "a refused run leaves nothing behind"
    logs_only.release()
    lock_run_folders(folders(tmp_path), "flock").release()


def test_a_folder_inside_the_other_is_locked_once(tmp_path):
    same = {"checkpoints.checkpoints_path": tmp_path / "run", "logging.log_dir": tmp_path / "run"}
    locks = lock_run_folders(same, "auto")
    assert list(locks.kinds) == [str(tmp_path / "run")]
    locks.release()


def test_the_kernel_releases_a_flock_when_its_holder_is_killed(tmp_path):
    (tmp_path / "ckpt").mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom pathlib import Path\nfrom nanocore.run_lock import lock_run_folders\n"
         f"lock_run_folders({{'checkpoints.checkpoints_path': Path({str(tmp_path / 'ckpt')!r})}}, 'flock')\n"
         "print('held', flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(NanocoreError, match=f"pid {holder.pid} on host"):
            lock_run_folders(folders(tmp_path), "flock")
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        holder.kill()
    lock_run_folders(folders(tmp_path), "flock").release()  # nothing left to clean


def test_the_lock_file_fallback_refuses_names_a_stale_holder_and_is_removed_on_release(tmp_path):
    locks = lock_run_folders(folders(tmp_path), "file", run_name="a")
    path = tmp_path / "ckpt" / LOCK_FILE_NAME
    assert json.loads(path.read_text())["pid"] == os.getpid()
    with pytest.raises(NanocoreError) as caught:
        lock_run_folders(folders(tmp_path), "file")
    assert "is in use by another run: run 'a'" in str(caught.value)
    assert "looks stale" not in str(caught.value)  # its pid is alive: this process
    locks.release()
    assert not path.exists() and not (tmp_path / "logs" / LOCK_FILE_NAME).exists()
    assert not (tmp_path / "ckpt").exists(), "folders the run created and left empty are removed"
    (tmp_path / "ckpt").mkdir()

    # a holder killed with -9 leaves its file: the next run is told it looks stale and what to delete
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"host": socket.gethostname(), "pid": dead.pid, "started": "2026-12-01 10:00:00 UTC", "run": "gone"}
    path.write_text(json.dumps(record))
    with pytest.raises(NanocoreError) as caught:
        lock_run_folders(folders(tmp_path), "file")
    message = str(caught.value)
    assert f"The lock looks stale: pid {dead.pid} is not running on this host" in message
    assert f"delete {str(path)!r} and start again" in message
    assert not (tmp_path / "logs" / LOCK_FILE_NAME).exists(), "the lock taken before the refusal is released"
    # another host's holder cannot be checked from here: the message says what to do if it is gone
    path.write_text(json.dumps({**record, "host": "node-17"}))
    with pytest.raises(NanocoreError, match="on host node-17.*If that run is gone .*delete"):
        lock_run_folders(folders(tmp_path), "file")


def test_auto_falls_back_to_a_lock_file_where_flock_is_refused_and_flock_says_so(tmp_path, monkeypatch):
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    locks = lock_run_folders(folders(tmp_path), "auto")
    assert set(locks.kinds.values()) == {"file"}
    locks.release()
    with pytest.raises(
        NanocoreError, match="checkpoints.folder_lock: flock is not supported where .*folder_lock: file"
    ):
        lock_run_folders(folders(tmp_path), "flock")


def test_folders_a_run_created_and_left_empty_are_removed_and_others_kept(tmp_path):
    (tmp_path / "logs").mkdir()  # the user's: kept, with the lock file naming the last holder
    locks = lock_run_folders(folders(tmp_path), "flock")
    (tmp_path / "logs" / "metrics.jsonl").write_text("")
    locks.release()
    assert not (tmp_path / "ckpt").exists()  # created by the run, nothing written into it
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [LOCK_NAME, "metrics.jsonl"]
    held = lock_run_folders(folders(tmp_path), "flock")
    (tmp_path / "ckpt" / "2").mkdir()
    held.release()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [LOCK_NAME, "2"]


def test_none_takes_no_lock(tmp_path):
    assert lock_run_folders(folders(tmp_path), "none").kinds == {}
    assert not (tmp_path / "ckpt").exists()


def test_an_unknown_folder_lock_is_refused_with_its_yaml_path(tmp_path):
    registries = load_plugins().registries
    config = structure_config(tiny_config(tmp_path, checkpoints={"folder_lock": "nfs"}), registries)
    with pytest.raises(ConfigError, match="checkpoints.folder_lock: must be one of auto, flock, file, none; got 'nfs'"):
        check_config(config, registries, world_size=1)


def test_a_refused_holder_releases_what_it_took(tmp_path):
    held = lock_run_folders({"logging.log_dir": tmp_path / "logs"}, "flock")
    with pytest.raises(NanocoreError):
        lock_run_folders(folders(tmp_path), "flock")  # took ckpt, then refused on logs
    held.release()
    again = lock_run_folders({"checkpoints.checkpoints_path": tmp_path / "ckpt"}, "flock")
    again.release()
