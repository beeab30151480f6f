"""`checkpoints.async_save: true`: training goes on while a checkpoint is written, `latest.txt` moves
only once a save is complete, every way out waits for the write, and a process killed during a
background write leaves the previous checkpoint loadable."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import nanocore.checkpoint.background as background
from nanocore import hookimpl
from nanocore.checkpoint.verify import verify_checkpoint
from tests.helpers.launch import launch_env
from tests.helpers.paths import REPO
from tests.helpers.training import run_training, tiny_config

ASYNC = {"async_save": True, "checkpoint_interval": 2}


def saved_files(root: Path) -> dict[str, bytes]:
    """Every weight and optimizer file of every step folder, by its path under `root`. (Not the RNG
    files: the first trainer of a process starts from another torch RNG state than later ones.)"""
    out = {}
    for sub in ("model", "optimizer"):
        for path in sorted(root.glob(f"*/{sub}/*")):
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_async_saves_write_what_synchronous_saves_write(dp, tmp_path):
    """The same steps saved, byte for byte (the ranks agree on each save's completion), and each
    folder is complete and checksummed."""
    tokens = {"train_steps": 6, "batch_accumulation_per_replica": 4 // dp}
    runs = {}
    for mode in ("sync", "async"):
        checkpoints = {"checkpoint_interval": 2, "async_save": mode == "async"}
        raw = tiny_config(tmp_path / mode, parallelism={"dp": dp}, tokens=tokens, checkpoints=checkpoints)
        runs[mode] = run_training(raw, dp)
    assert runs["async"]["losses"] == runs["sync"]["losses"]
    sync_root, async_root = tmp_path / "sync" / "checkpoints", tmp_path / "async" / "checkpoints"
    assert sorted(p.name for p in async_root.iterdir()) == [".nanocore-lock", "2", "4", "6", "latest.txt"]
    assert (async_root / "latest.txt").read_text().strip() == "6"
    files = saved_files(async_root)
    assert (
        files.keys() == saved_files(sync_root).keys() and len(files) == 3 * 2
    )  # model + optimizer per step (at ZeRO-0 rank 0 holds every piece)
    assert files == saved_files(sync_root)
    for step in (2, 4, 6):
        verify_checkpoint(async_root / str(step))


class HeldWrites:
    """Holds every background write until released, and records what a user sees meanwhile."""

    def __init__(self, root: Path):
        self.root = root
        self.release = threading.Event()
        self.seen: dict[int, tuple[str | None, list[str]]] = {}

    def write_shards(self, real):
        def held(path, shards):
            assert self.release.wait(60), "the test never released the write"
            real(path, shards)

        return held

    @hookimpl
    def on_step_end(self, step, metrics, trainer):
        latest = self.root / "latest.txt"
        folders = sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.exists() else []
        self.seen[step] = (latest.read_text().strip() if latest.exists() else None, folders)
        if step == 3:
            self.release.set()


def test_training_goes_on_while_the_write_is_held_and_latest_waits_for_it(tmp_path, monkeypatch):
    raw = tiny_config(tmp_path, tokens={"train_steps": 6}, checkpoints=ASYNC)
    root = tmp_path / "checkpoints"
    held = HeldWrites(root)
    monkeypatch.setattr(background, "write_shards", held.write_shards(background.write_shards))
    run = run_training(raw, extra_plugins=(held,))
    assert len(run["losses"]) == 6
    # step 2's save started and is held: steps 2 and 3 ran on, with no complete checkpoint and no latest.txt
    for step in (2, 3):
        latest, folders = held.seen[step]
        assert latest is None and "2" not in folders, (step, held.seen[step])
    # released after step 3: step 4's save first waits for it and seals it (one save in flight)
    assert held.seen[4][0] == "2" and "2" in held.seen[4][1], held.seen[4]
    assert held.seen[5][0] in ("2", "4")
    # normal exit waits for the last write: every save complete, latest names the last
    assert (root / "latest.txt").read_text().strip() == "6"
    for step in (2, 4, 6):
        verify_checkpoint(root / str(step))


def test_the_step_that_saves_only_copies(tmp_path, monkeypatch):
    """The save's files are written by a thread other than the training one."""
    threads = []
    real = background.write_shards

    def record(path, shards):
        threads.append(threading.current_thread().name)
        real(path, shards)

    monkeypatch.setattr(background, "write_shards", record)
    run_training(tiny_config(tmp_path, tokens={"train_steps": 2}, checkpoints=ASYNC))
    assert threads and all(name.startswith("nanocore-checkpoint-") for name in threads), threads


# A local plugin: from the save of step SLOW_FROM on, the background write marks a file, then sleeps.
SLOW_WRITES = """
import os, time
from pathlib import Path
import nanocore.checkpoint.background as background

_real = background.write_shards

def _slow(path, shards):
    step = int(path.parent.parent.name.removeprefix(".tmp-"))
    if step >= int(os.environ["SLOW_FROM"]):
        mark = Path(os.environ["SLOW_MARK"])
        mark.with_suffix(".tmp").write_text(str(step))
        os.replace(mark.with_suffix(".tmp"), mark)  # whole or absent: the test may kill us right after
        time.sleep(float(os.environ["SLOW_SECONDS"]))
    _real(path, shards)

background.write_shards = _slow
"""


def start_run(tmp: Path, mark: Path, seconds: float, steps: int = 500) -> subprocess.Popen:
    (tmp / "slow.py").write_text(SLOW_WRITES)
    raw = tiny_config(
        tmp,
        tokens={"train_steps": steps, "batch_accumulation_per_replica": 2},
        checkpoints=ASYNC,
        plugins=[str(tmp / "slow.py")],
    )
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    env = launch_env(SLOW_FROM="4", SLOW_MARK=str(mark), SLOW_SECONDS=str(seconds))
    return subprocess.Popen(
        [sys.executable, str(REPO / "run_train.py"), "--config-file", str(config)],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(mark: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not mark.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before the mark:\n{proc.stdout.read()[-3000:]}")
        assert time.monotonic() < deadline, "the run never reached the mark"
        time.sleep(0.05)


def signal_while_writing(tmp: Path, sig: signal.Signals, seconds: float, timeout: float) -> tuple[Path, int, str]:
    """Start a run whose background write of step 4 takes `seconds`, send `sig` during that write,
    and return (the write's mark, the exit code, the output)."""
    mark = tmp / "writing"
    proc = start_run(tmp, mark, seconds=seconds)
    try:
        wait_for(mark, proc)
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return mark, proc.returncode, output


@pytest.mark.slow
def test_kill_9_during_a_background_write_leaves_the_last_complete_checkpoint(tmp_path):
    mark, _, _ = signal_while_writing(tmp_path, signal.SIGKILL, seconds=600, timeout=60)
    root = tmp_path / "checkpoints"
    assert int(mark.read_text()) == 4
    assert (root / "latest.txt").read_text().strip() == "2"
    assert not (root / "4").exists(), "a checkpoint whose write was killed must never look complete"
    verify_checkpoint(root / "2")
    # and the run resumes from it
    raw = yaml.safe_load((tmp_path / "run.yaml").read_text())
    raw["plugins"], raw["tokens"]["train_steps"] = [], 3
    raw["checkpoints"]["resume_checkpoint_path"] = "latest"
    resumed = run_training(raw)
    assert len(resumed["losses"]) == 1


@pytest.mark.slow
def test_sigterm_during_a_background_write_waits_for_it_and_saves(tmp_path):
    _, returncode, output = signal_while_writing(tmp_path, signal.SIGTERM, seconds=3, timeout=120)
    assert returncode == 128 + signal.SIGTERM, output[-3000:]
    root = tmp_path / "checkpoints"
    stopped = int((root / "latest.txt").read_text())
    assert stopped >= 4
    assert f"checkpoint saved to {root / str(stopped)}" in output
    for folder in (root / "4", root / str(stopped)):
        verify_checkpoint(folder)  # the write in flight was finished and sealed, then the stop's own save
