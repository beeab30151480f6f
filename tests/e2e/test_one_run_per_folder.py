"""One run per folder, for real (nanocore/run_lock.py): launches that overlap in time into the same
folders are refused before they write anything, and the run that holds them finishes intact.

What a user saw before the lock: the same config started twice at once into one empty folder, both
runs exited 0 writing one checkpoints folder and one metrics.jsonl together; two seeds started
together raced at the first save, one dying on the other's temporary folder. The start-up check
(tests/e2e/test_run_folders.py) cannot see a run that starts in the same second.

The runs here hold on at step 1 (or 3) until the test lets them go, so that they overlap for sure.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from nanocore.checkpoint.verify import verify_checkpoint
from tests.helpers import launch
from tests.helpers.launch import RUN_TRAIN, launch_env, torchrun_command
from tests.helpers.training import tiny_config

# A local plugin: rank 0 holds on at the end of step ACT_HOLD_AT (after that step's checkpoint) until
# the file ACT_GO exists, and says it got there by writing ACT_MARK.
HOLDER = """
import os, time
from pathlib import Path
from nanocore import hookimpl

@hookimpl
def on_step_end(step, metrics, trainer):
    if step == int(os.environ.get("ACT_HOLD_AT", "0")) and int(os.environ.get("RANK", "0")) == 0:
        Path(os.environ["ACT_MARK"]).write_text(str(os.getpid()))
        deadline = time.monotonic() + 300
        while not Path(os.environ["ACT_GO"]).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
"""
STEPS = 4
REFUSED = ("is in use by another run", "already holds")  # the lock, or the start-up check if it saw first


def write_run(tmp: Path, seed: int = 7, dp: int = 1, resume: str | None = None) -> Path:
    (tmp / "holder.py").write_text(HOLDER)
    raw = tiny_config(
        tmp,
        general={"seed": seed, "run": f"seed{seed}"},
        parallelism={"dp": dp},
        tokens={"train_steps": STEPS, "batch_accumulation_per_replica": 2},
        checkpoints={"checkpoint_interval": 2, "save_final_state": True, "resume_checkpoint_path": resume},
        logging={"log_dir": str(tmp / "logs"), "loggers": ["jsonl"]},
        plugins=[str(tmp / "holder.py")],
        optimizer={"learning_rate_scheduler": {"lr_warmup_steps": 0, "lr_decay_style": "constant"}},
    )
    path = tmp / f"run{seed}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def start(config: Path, tmp: Path, nproc: int = 0, hold_at: int = 1) -> subprocess.Popen:
    """`python run_train.py` (nproc 0) or `torchrun --nproc_per_node=nproc run_train.py`, not waited for."""
    args = ["--config-file", str(config)]
    command = torchrun_command(nproc, RUN_TRAIN, args) if nproc else [sys.executable, str(RUN_TRAIN), *args]
    env = launch_env(ACT_HOLD_AT=str(hold_at), ACT_GO=str(tmp / "go"), ACT_MARK=str(tmp / "held"))
    return subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def first_to_end(procs: list[subprocess.Popen], timeout: float = 180) -> subprocess.Popen:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                return p
        time.sleep(0.05)
    for p in procs:
        p.kill()
    raise AssertionError("neither launch ended: both ran on (each holds on at step 1 until the other has ended)")


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    launch.wait_for(
        path, proc, timeout=180, ended="the run ended early", late="the run did not reach the step it holds on at"
    )


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_intact(tmp: Path) -> None:
    """One run's checkpoints and logs: every step logged once, the last checkpoint complete."""
    steps = [json.loads(line)["step"] for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), steps
    root = tmp / "checkpoints"
    assert (root / "latest.txt").read_text().strip() == str(STEPS)
    assert sorted(p.name for p in root.iterdir()) == [".nanocore-lock", "2", "4", "latest.txt"]
    for step in (2, 4):
        verify_checkpoint(root / str(step))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [0, 2], ids=["one_process", "torchrun_dp2"])
def test_two_launches_at_once_into_one_folder_one_is_refused(tmp_path, nproc):
    """Two fresh runs (two seeds; the same config twice is the same case) into the same folders: one
    launch is refused, by the lock or by the start-up check if the other's logs were already there,
    and the other's checkpoints and logs are its own and complete."""
    configs = [write_run(tmp_path, seed, dp=max(nproc, 1)) for seed in (7, 8)]
    procs = [start(config, tmp_path, nproc) for config in configs]
    refused = first_to_end(procs)
    refused_output = refused.communicate()[0]
    (tmp_path / "go").write_text("")
    winner = next(p for p in procs if p is not refused)
    output = winner.communicate(timeout=300)[0]
    assert refused.returncode != 0 and "nanocore: error:" in refused_output, refused_output[-3000:]
    assert any(reason in refused_output for reason in REFUSED), refused_output[-3000:]
    assert winner.returncode == 0, output[-3000:]
    assert_intact(tmp_path)


@pytest.mark.slow
def test_a_resubmitted_job_is_refused_while_the_first_runs_and_resumes_after_a_kill_9(tmp_path):
    config = write_run(tmp_path, resume="latest")
    first = start(config, tmp_path, hold_at=3)  # holds on after step 3, its checkpoint of step 2 saved
    wait_for(tmp_path / "held", first)
    before = snapshot(tmp_path)
    # the same command again, as a scheduler's retry would: it continues `latest`, so the start-up
    # check lets it through; the lock refuses it, naming the first run
    second = subprocess.run(
        [sys.executable, str(RUN_TRAIN), "--config-file", str(config)], cwd=tmp_path, env=launch_env(),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    output = second.stdout + second.stderr
    assert second.returncode != 0, output[-3000:]
    checkpoints = str(tmp_path / "checkpoints")
    assert (
        f"checkpoints.checkpoints_path {checkpoints!r} is in use by another run: run 'seed7' (pid {first.pid}" in output
    )
    assert snapshot(tmp_path) == before, "the refused run wrote nothing"

    first.send_signal(signal.SIGKILL)  # no clean exit: the kernel drops the lock with the process
    first.communicate(timeout=60)
    assert (tmp_path / "checkpoints" / "latest.txt").read_text().strip() == "2"
    (tmp_path / "held").unlink()
    resumed = subprocess.run(
        [sys.executable, str(RUN_TRAIN), "--config-file", str(config)], cwd=tmp_path, env=launch_env(),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / '2'} at step 2" in resumed.stdout + resumed.stderr
    assert (tmp_path / "checkpoints" / "latest.txt").read_text().strip() == str(STEPS)
    verify_checkpoint(tmp_path / "checkpoints" / str(STEPS))
