"""Model FLOPs utilisation: achieved training FLOP/s divided by the device's peak.

On NVIDIA GPUs the peak comes from a table of dense (no 2:4 sparsity) tensor-core numbers from the
vendors' datasheets, looked up by `torch.cuda.get_device_name`. On CPU there is no honest datasheet
number, so the "peak" is what a few float32 matmuls achieve in this process (`cpu_matmul_probe`):
CPU MFU says how close the training step gets to plain matmul speed, not to the silicon's limit.
Set NANOCORE_MFU_PROBE=0 to skip the probe (MFU is then unknown on CPU).
"""

from __future__ import annotations

import functools
import os
import time

import torch

ENV_PROBE = "NANOCORE_MFU_PROBE"

T = 1e12
# (name substring, {precision: dense peak FLOP/s}). The first matching substring wins, so more
# specific names (H100 PCIe, H200 NVL) come before the generic ones. "tf32" is float32 matmuls run
# on tensor cores; "fp32" is plain float32. Cards without bfloat16 tensor cores have no "bf16" key.
GPU_PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200 NVL", {"bf16": 835 * T, "fp16": 835 * T, "tf32": 417.5 * T, "fp32": 60 * T}),
    ("H200", {"bf16": 989.4 * T, "fp16": 989.4 * T, "tf32": 494.7 * T, "fp32": 66.9 * T}),
    ("H100 PCIe", {"bf16": 756.5 * T, "fp16": 756.5 * T, "tf32": 378 * T, "fp32": 51.2 * T}),
    ("H100 NVL", {"bf16": 835 * T, "fp16": 835 * T, "tf32": 417.5 * T, "fp32": 60 * T}),
    ("H100", {"bf16": 989.4 * T, "fp16": 989.4 * T, "tf32": 494.7 * T, "fp32": 66.9 * T}),  # SXM
    ("A100", {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}),
    ("A10G", {"bf16": 70 * T, "fp16": 70 * T, "tf32": 35 * T, "fp32": 35 * T}),  # AWS datasheet
    ("L40S", {"bf16": 362 * T, "fp16": 362 * T, "tf32": 183 * T, "fp32": 91.6 * T}),
    ("L40", {"bf16": 181 * T, "fp16": 181 * T, "tf32": 90.5 * T, "fp32": 90.5 * T}),  # before L4: a substring
    ("L4", {"bf16": 121 * T, "fp16": 121 * T, "tf32": 60 * T, "fp32": 30.3 * T}),
    # GeForce cards: fp16/bf16 tensor throughput with float32 accumulation (what training uses).
    ("RTX 4090", {"bf16": 165.2 * T, "fp16": 165.2 * T, "tf32": 82.6 * T, "fp32": 82.6 * T}),
    ("RTX 3090", {"bf16": 71 * T, "fp16": 71 * T, "tf32": 35.6 * T, "fp32": 35.6 * T}),
    ("V100", {"fp16": 125 * T, "fp32": 15.7 * T}),
    ("T4", {"fp16": 65 * T, "fp32": 8.1 * T}),
)


def gpu_peak_flops(device_name: str, dtype: torch.dtype, *, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of the GPU called `device_name` for matmuls in `dtype`; None if not in the table."""
    key = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if dtype == torch.float32:
        key = "tf32" if tf32 else "fp32"
    if key is None:
        return None
    for pattern, peaks in GPU_PEAK_FLOPS:
        if pattern.lower() in device_name.lower():
            return peaks.get(key) or (peaks["fp32"] if key == "tf32" else None)
    return None


def _tf32_matmuls() -> bool:
    # torch >= 2.9 has a per-backend setting ("tf32" / "ieee" / "none" = unset); older ones only the global one.
    setting = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if setting in ("tf32", "ieee"):
        return setting == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


@functools.cache
def _probe(size: int, repeats: int) -> float:
    a = torch.randn(size, size, dtype=torch.float32)
    b = torch.randn(size, size, dtype=torch.float32)
    torch.mm(a, b)  # warm-up: first call allocates and picks a kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-9)


def cpu_matmul_probe(size: int = 1024, repeats: int = 5) -> float | None:
    """Achieved float32 FLOP/s of a `size`x`size` matmul on this CPU (best of `repeats`), cached per process.

    Uses the current `torch.get_num_threads()`, i.e. what training gets. About 0.1-0.3 s the first time.
    Returns None when NANOCORE_MFU_PROBE=0.
    """
    if os.environ.get(ENV_PROBE, "1").strip() == "0":
        return None
    return _probe(size, repeats)


def peak_flops_per_device(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of one `device` for training in `dtype`, or None when unknown.

    CUDA: the datasheet table (float32 counts as TF32 when torch allows TF32 matmuls).
    CPU: the float32 matmul probe, whatever `dtype` (see the module docstring).
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype, tf32=_tf32_matmuls())
    if device.type == "cpu":
        return cpu_matmul_probe()
    return None


def mfu(flops_per_token: float | None, tokens_per_sec_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction (0.42 = 42%); None when the peak or the model's FLOPs are unknown."""
    if peak is None or peak <= 0 or flops_per_token is None:
        return None
    return flops_per_token * tokens_per_sec_per_device / peak
