"""`nanocore calibrate`: it starts its own processes, measures this machine and writes a hardware
description that `nanocore plan --hardware FILE` reads; bad arguments fail before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from nanocore.commands.calibrate import _fit_all_reduce
from nanocore.hardware import load_hardware
from tests.helpers.launch import REPO
from tests.helpers.training import tiny_config


def test_the_all_reduce_fit_recovers_latency_and_bandwidth_of_the_ring_formula():
    world, latency, bandwidth = 4, 20e-6, 3e9
    sizes = [4096.0, 2.0**20, 2.0**24]
    points = [[s, 2 * (world - 1) * (latency + s / world / bandwidth)] for s in sizes]
    got_bandwidth, got_latency = _fit_all_reduce(points, world)
    assert got_bandwidth == pytest.approx(bandwidth, rel=1e-9)
    assert got_latency == pytest.approx(latency, rel=1e-9)


@pytest.mark.slow
def test_calibrate_two_processes_writes_a_description_plan_reads(tmp_path):
    out = tmp_path / "here.yaml"
    cmd = [sys.executable, "-m", "nanocore", "calibrate", "--world-size", "2", "--output", str(out)]
    run = subprocess.run([*cmd, "--seconds", "0.002", "--threads", "1", "--name", "ci-box"], **_quiet())
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stderr and "GFLOP/s" in run.stderr
    hw = load_hardware(str(out))
    assert hw.name == "ci-box" and hw.devices_per_node == 2
    assert hw.peak_flops["float32"] > 1e8  # any CPU of this decade does 0.1 GFLOP/s on one thread
    assert hw.intra_node.bandwidth > 0 and hw.intra_node.latency >= 0
    assert 1e-8 < hw.op_overhead < 1e-3  # one small eager op: tens of nanoseconds at least, never a millisecond
    assert 0 <= hw.compute_overlap <= 1
    assert hw.matmul_efficiency and all(0 < e <= 1 for _, e in hw.matmul_efficiency)
    assert max(e for _, e in hw.matmul_efficiency) == pytest.approx(1.0, rel=0.5)
    raw = yaml.safe_load(out.read_text())
    assert len(raw["measured"]["all_reduce_seconds"]) == 2  # each rank's raw figures are kept
    assert not out.with_name(out.name + ".tmp").exists()

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path, parallelism={"dp": 2})))
    plan = [sys.executable, "-m", "nanocore", "plan", str(config), "--world-size", "2", "--device", "cpu"]
    got = subprocess.run([*plan, "--hardware", str(out), "--json"], **_quiet())
    assert got.returncode == 0, got.stderr
    data = json.loads(got.stdout)
    assert data["predicted_step_seconds"] > 0 and 0 < data["predicted_mfu"] <= 1


def test_calibrate_refuses_a_missing_folder_and_a_bad_dtype_before_starting(tmp_path):
    cmd = [sys.executable, "-m", "nanocore", "calibrate", "--world-size", "2"]
    missing = subprocess.run([*cmd, "--output", str(tmp_path / "no" / "hw.yaml")], **_quiet())
    assert missing.returncode == 2 and "--output" in missing.stderr and "does not exist" in missing.stderr
    dtype = subprocess.run([*cmd, "--output", str(tmp_path / "hw.yaml"), "--dtypes", "float8"], **_quiet())
    assert dtype.returncode == 2 and "--dtypes" in dtype.stderr
    assert "measuring" not in missing.stderr + dtype.stderr  # no process was started
    assert not (tmp_path / "hw.yaml").exists()


def _quiet() -> dict:
    return {"capture_output": True, "text": True, "cwd": REPO, "timeout": 600}


def _timed_all_reduce(rank, world_size):

    import torch
    import torch.distributed as dist

    from nanocore.commands.calibrate import _time_collective

    calls = []
    x = torch.ones(16)

    def reduce() -> None:
        calls.append(1)
        dist.all_reduce(x)

    # rank 1 wants ten times the time rank 0 does: each alone would stop after a different number of
    # calls, and the rank that stopped first would wait in the next collective for ever
    seconds = 0.002 if rank == 0 else 0.02
    took = _time_collective(reduce, seconds, lambda: None, torch.device("cpu"))
    dist.barrier()
    return len(calls), took


def test_timing_a_collective_makes_every_rank_call_it_equally_often():
    """Calibrate timed all-reduces by each rank's own clock, so the ranks could disagree on how many
    calls to make and hang (seen once in 7 runs here): the count is agreed first."""
    from tests.helpers.distributed import run_ranks

    (calls0, took0), (calls1, took1) = run_ranks(2, _timed_all_reduce, timeout=60)
    assert calls0 == calls1 >= 5  # two untimed calls, then the agreed count (at least 3)
    assert took0 > 0 and took1 > 0
