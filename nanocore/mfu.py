"""Model FLOPs utilisation: achieved training FLOP/s divided by the device's peak.

The peak in force, in order (`mfu_peak`; the start-of-run summary names the one it uses):
1. `general.hardware`: a shipped hardware description (`a100-80gb`, `h100-sxm`, `h200`) or a file
   `nanocore calibrate` wrote; its `peak_flops` for the training dtype.
2. On NVIDIA GPUs, a table of dense (no 2:4 sparsity) tensor-core numbers from the vendors'
   datasheets, looked up by `torch.cuda.get_device_name`.
3. On CPU, a probe (`cpu_matmul_probe`): a float32 matmul on one thread timed by that thread's CPU
   time, not the wall clock, times the threads training uses. Another job on the machine takes wall
   time from the probe, not CPU time, so a busy machine at start-up no longer makes the peak too low
   (a wall-clock probe taken while another job ran once gave the tiny example `mfu 229.1%`). CPU MFU
   says how close the training step gets to plain matmul speed on the threads it has, not to the
   silicon's limit. NANOCORE_MFU_PROBE=0 skips the probe (MFU is then unknown on CPU).

MFU is never above 1: the trainer measures a beaten CPU probe again, and reports no MFU against a
peak the step still beats (with a warning naming it).
"""

from __future__ import annotations

import functools
import os
import time

import attrs
import torch

from nanocore.hardware import Hardware

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
    """Float32 FLOP/s of one thread, by that thread's CPU time (best of `repeats`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the matmul runs on this thread: its CPU time is the matmul's
    try:
        a = torch.randn(size, size, dtype=torch.float32)
        b = torch.randn(size, size, dtype=torch.float32)
        torch.mm(a, b)  # warm-up: first call allocates and picks a kernel
        best = float("inf")
        for _ in range(repeats):
            start = time.thread_time()
            torch.mm(a, b)
            best = min(best, time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / max(best, 1e-9)


def cpu_matmul_probe(size: int = 512, repeats: int = 7) -> float | None:
    """Float32 matmul FLOP/s this process can reach on this CPU: one thread's rate (a `size` x `size`
    matmul timed by the thread's CPU time, best of `repeats`, measured once per process) times
    `torch.get_num_threads()`, the threads training uses. About 0.1 s. None when NANOCORE_MFU_PROBE=0.
    """
    if os.environ.get(ENV_PROBE, "1").strip() == "0":
        return None
    return _probe(size, repeats) * torch.get_num_threads()


def remeasure_cpu_probe() -> float | None:
    """`cpu_matmul_probe` measured again (the trainer asks when a step beat the first measurement)."""
    _probe.cache_clear()
    return cpu_matmul_probe()


@attrs.frozen
class Peak:
    """The peak MFU divides by: FLOP/s per device, and where it comes from (the summary prints it)."""

    flops: float
    source: str


def _dtype_name(dtype: torch.dtype, device: torch.device) -> str:
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float32 and device.type == "cuda" and _tf32_matmuls():
        return "tf32"
    return name


def mfu_peak(device: torch.device, dtype: torch.dtype, hardware: Hardware | None = None) -> Peak | None:
    """The peak in force for training in `dtype` on `device` (see the module docstring), or None."""
    device = torch.device(device)
    if hardware is not None:
        key = _dtype_name(dtype, device)
        if key not in hardware.peak_flops and key == "tf32":
            key = "float32"
        if key in hardware.peak_flops:
            return Peak(hardware.peak_flops[key], f"{hardware.name} {key} (hardware description)")
        return None
    if device.type == "cuda":
        peak = peak_flops_per_device(device, dtype)
        if peak is None:
            return None
        name = torch.cuda.get_device_name(device)
        return Peak(peak, f"{name} {_dtype_name(dtype, device)} (datasheet table)")
    if device.type == "cpu":
        peak = cpu_matmul_probe()
        if peak is None:
            return None
        threads = torch.get_num_threads()
        return Peak(peak, f"CPU float32 matmul probe ({threads} thread{'s' if threads > 1 else ''}, CPU time)")
    return None


def peak_flops_per_device(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of one `device` for training in `dtype`, or None when unknown.

    CUDA: the datasheet table (float32 counts as TF32 when torch allows TF32 matmuls).
    CPU: the float32 matmul probe, whatever `dtype` (see the module docstring). `mfu_peak` also
    takes the hardware description in force and says where its figure comes from.
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
