"""Peak FLOP/s lookup and MFU (nanocore.mfu)."""

from __future__ import annotations

import logging
import multiprocessing
import time

import pytest
import torch
import yaml

from nanocore import mfu as mfu_module
from nanocore.hardware import hardware_to_yaml, load_hardware
from nanocore.mfu import cpu_matmul_probe, gpu_peak_flops, mfu, mfu_peak, peak_flops_per_device
from tests.helpers.training import run_training, tiny_config


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("NVIDIA H200", torch.bfloat16, 989.4e12),
        ("NVIDIA H200 NVL", torch.bfloat16, 835e12),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
        ("NVIDIA H100 PCIe", torch.float16, 756.5e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
        ("NVIDIA A10G", torch.bfloat16, 70e12),
        ("NVIDIA L4", torch.bfloat16, 121e12),
        ("NVIDIA L40S", torch.bfloat16, 362e12),
        ("NVIDIA L40", torch.bfloat16, 181e12),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2e12),
        ("NVIDIA GeForce RTX 3090", torch.float16, 71e12),
        ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
        ("Tesla T4", torch.float16, 65e12),
    ],
)
def test_known_gpu_peaks(name, dtype, expected):
    assert gpu_peak_flops(name, dtype) == pytest.approx(expected)


def test_float32_peak_depends_on_tf32_and_unknowns_are_none():
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=True) == pytest.approx(156e12)
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=False) == pytest.approx(19.5e12)
    assert gpu_peak_flops("Tesla T4", torch.float32, tf32=True) == pytest.approx(8.1e12)  # no TF32 cores
    assert gpu_peak_flops("Tesla T4", torch.bfloat16) is None  # no bfloat16 tensor cores
    assert gpu_peak_flops("Some Future GPU", torch.bfloat16) is None


def test_peak_for_a_cuda_device_uses_its_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops_per_device(torch.device("cuda", 0), torch.bfloat16) == pytest.approx(989.4e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery Accelerator")
    assert peak_flops_per_device(torch.device("cuda", 0), torch.bfloat16) is None


def test_cpu_probe_is_positive_fast_and_cached(monkeypatch):
    monkeypatch.delenv(mfu_module.ENV_PROBE, raising=False)
    mfu_module._probe.cache_clear()
    start = time.perf_counter()
    first = cpu_matmul_probe()
    assert time.perf_counter() - start < 2.0  # < 0.5 s on an idle core; slack for shared CI machines
    assert first is not None and first > 1e8  # any CPU does more than 0.1 GFLOP/s
    assert cpu_matmul_probe() == first  # measured once per process
    assert peak_flops_per_device(torch.device("cpu"), torch.float32) == first


def test_cpu_probe_counts_the_threads_training_uses(monkeypatch):
    monkeypatch.delenv(mfu_module.ENV_PROBE, raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_matmul_probe()
        torch.set_num_threads(3)
        assert cpu_matmul_probe() == pytest.approx(3 * one)  # one thread's rate, measured once, x threads
        assert torch.get_num_threads() == 3  # the probe gives the threads back
    finally:
        torch.set_num_threads(threads)


def _spin(stop):
    while not stop.is_set():
        pass


def test_cpu_probe_is_not_fooled_by_a_busy_machine(monkeypatch):
    """The probe counts CPU time: other jobs on every core slow its wall clock, not its result. (A
    wall-clock probe taken beside another job gave the tiny example mfu 229%.)"""
    monkeypatch.delenv(mfu_module.ENV_PROBE, raising=False)
    mfu_module._probe.cache_clear()
    quiet = cpu_matmul_probe()
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    hogs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(2 * (multiprocessing.cpu_count() or 1))]
    for h in hogs:
        h.start()
    try:
        time.sleep(1.0)  # the hogs are running on every core
        mfu_module._probe.cache_clear()
        start = time.perf_counter()
        busy = cpu_matmul_probe()
        wall = time.perf_counter() - start
    finally:
        stop.set()
        for h in hogs:
            h.join(10)
        mfu_module._probe.cache_clear()
    assert busy is not None and quiet is not None
    # twice as many spinning processes as cores leave the probe about a third of the wall clock; its
    # figure stays within the noise of a quiet one
    assert busy > 0.6 * quiet, (busy, quiet, wall)


def test_cpu_probe_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(mfu_module.ENV_PROBE, "0")
    assert cpu_matmul_probe() is None
    assert peak_flops_per_device(torch.device("cpu"), torch.bfloat16) is None


def test_mfu_is_achieved_over_peak():
    # 6 GFLOP per token at 1000 tokens/s on a 10 TFLOP/s device: 60%.
    assert mfu(6e9, 1000.0, 1e13) == pytest.approx(0.6)
    assert mfu(6e9, 1000.0, None) is None
    assert mfu(None, 1000.0, 1e13) is None


def test_the_hardware_description_in_force_is_the_peak_and_says_so():
    peak = mfu_peak(torch.device("cpu"), torch.bfloat16, load_hardware("h100-sxm"))
    assert peak is not None and peak.flops == pytest.approx(989.4e12)
    assert peak.source == "h100-sxm bfloat16 (hardware description)"
    assert mfu_peak(torch.device("cpu"), torch.float32, load_hardware("h100-sxm")).flops == pytest.approx(66.9e12)


def test_a_run_reports_mfu_against_general_hardware_and_names_it_in_the_summary(tmp_path, caplog):
    raw = tiny_config(tmp_path, general={"hardware": "a100-80gb"})
    raw["tokens"]["train_steps"] = 2
    with caplog.at_level(logging.INFO, logger="nanocore"):
        result = run_training(raw)
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("start of run"))
    assert "mfu against 19.5 TFLOP/s per device: a100-80gb float32 (hardware description)" in summary
    row = result["metrics"][-1]
    assert 0 < row["mfu"] < 1e-3  # a tiny model on a CPU against an A100's float32 peak


def test_mfu_is_never_above_one_a_peak_beaten_by_the_step_is_not_reported(tmp_path, caplog):
    slow = load_hardware("a100-80gb")
    path = tmp_path / "slow.yaml"
    data = yaml.safe_load(hardware_to_yaml(slow))
    data["name"] = "too-slow"
    data["peak_flops"] = {"float32": 1.0e3}  # 1 kFLOP/s: any step beats it
    path.write_text(yaml.safe_dump(data))
    raw = tiny_config(tmp_path, general={"hardware": str(path)})
    raw["tokens"]["train_steps"] = 2
    with caplog.at_level(logging.WARNING, logger="nanocore"):
        result = run_training(raw)
    assert all("mfu" not in row for row in result["metrics"])
    warnings = [r.getMessage() for r in caplog.records if "above the peak it is measured against" in r.getMessage()]
    assert len(warnings) == 1 and "too-slow float32 (hardware description)" in warnings[0]
