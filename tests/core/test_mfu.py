"""Peak FLOP/s lookup and MFU (nanocore.mfu)."""

from __future__ import annotations

import time

import pytest
import torch

from nanocore import mfu as mfu_module
from nanocore.mfu import cpu_matmul_probe, gpu_peak_flops, mfu, peak_flops_per_device


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


def test_cpu_probe_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(mfu_module.ENV_PROBE, "0")
    assert cpu_matmul_probe() is None
    assert peak_flops_per_device(torch.device("cpu"), torch.bfloat16) is None


def test_mfu_is_achieved_over_peak():
    # 6 GFLOP per token at 1000 tokens/s on a 10 TFLOP/s device: 60%.
    assert mfu(6e9, 1000.0, 1e13) == pytest.approx(0.6)
    assert mfu(6e9, 1000.0, None) is None
    assert mfu(None, 1000.0, 1e13) is None
