"""`nanocore calibrate`: it starts its own processes, measures this machine and writes a hardware
description that `nanocore plan --hardware FILE` reads; bad arguments fail before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from nanocore.commands.calibrate import _fit_all_reduce, _fit_kind
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
    # each kind in its own formula: all-gather (n-1) steps, a message latency + size / bandwidth
    gather = [[s, (world - 1) * (latency + s / world / bandwidth)] for s in sizes]
    assert _fit_kind("all_gather", gather, world) == pytest.approx((bandwidth, latency), rel=1e-9)
    send = [[s, latency + s / bandwidth] for s in sizes]
    assert _fit_kind("send", send, world) == pytest.approx((bandwidth, latency), rel=1e-9)


def test_the_fit_weighs_each_point_by_its_own_size_so_small_messages_set_the_latency():
    """Means of collectives between compute are noisy (a few tenths of a millisecond on a CPU): the
    fit must not let the largest message's noise swamp the latency the small ones measure."""
    world, latency, bandwidth = 2, 1e-3, 1e9
    sizes = [4096.0, 65536.0, 2.0**20, 2.0**24]
    exact = [2 * (world - 1) * (latency + s / world / bandwidth) for s in sizes]
    noisy = [[s, t * f] for s, t, f in zip(sizes, exact, (1.05, 0.95, 1.05, 0.95), strict=True)]
    got_bandwidth, got_latency = _fit_all_reduce(noisy, world)
    assert got_latency == pytest.approx(latency, rel=0.1)
    assert got_bandwidth == pytest.approx(bandwidth, rel=0.1)


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
    # the attention core measured on its own, each pass a share of the matmul peak
    assert hw.attention_efficiency is not None
    for curve in (hw.attention_efficiency.forward, hw.attention_efficiency.backward):
        assert len(curve) == 4 and all(0 < e <= 1 for _, e in curve)
    raw = yaml.safe_load(out.read_text())
    assert len(raw["measured"]["all_reduce_seconds"]) == 2  # each rank's raw figures are kept
    # each kind of collective measured on its own, as a step pays it
    assert set(hw.intra_node.collectives) == {"reduce_scatter", "all_gather", "all_to_all", "send"}
    assert all(k.bandwidth > 0 and k.latency >= 0 for k in hw.intra_node.collectives.values())
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

    from nanocore.commands.calibrate import _in_step

    calls = []
    x = torch.ones(16)

    def reduce() -> None:
        calls.append(1)
        dist.all_reduce(x)

    # rank 1 wants a hundred times the time rank 0 does: each alone would stop after a different
    # number of calls, and the rank that stopped first would wait in the next collective for ever
    seconds = 0.002 if rank == 0 else 0.2
    took = _in_step(reduce, lambda: torch.ones(64).sum(), seconds, lambda: None, torch.device("cpu"))
    dist.barrier()
    return len(calls), took


def test_timing_a_collective_makes_every_rank_call_it_equally_often():
    """Calibrate timed all-reduces by each rank's own clock, so the ranks could disagree on how many
    calls to make and hang (seen once in 7 runs here): the count is agreed first."""
    from tests.helpers.distributed import run_ranks

    (calls0, took0), (calls1, took1) = run_ranks(2, _timed_all_reduce, timeout=60)
    assert calls0 == calls1 >= 93  # three untimed calls, then the agreed count (at least 30) in 3 rounds
    assert took0 > 0 and took1 > 0
