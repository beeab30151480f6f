"""Peak memory of this process per logging interval: `peak_memory_mb` in every metrics row.

On CUDA it is torch's peak of allocated tensor memory since the last reset. On CPU it is the peak
resident set size (Linux `VmHWM`, reset through `/proc/self/clear_refs`) above the resident size
measured when the meter was made (after start-up: Python, torch and the plugins are loaded, nothing
of the run is built yet), less the file-backed pages the process has mapped in since then (`RssFile`:
the code of the kernels the run calls for the first time, memory-mapped data and checkpoints, all
page cache the kernel can take back), so it counts what the run itself holds: weights, gradients,
optimizer state, activations, buffers. The code pages alone are 30-50 MiB on a small LLaMA, more
than its weights. Where the peak cannot be reset (not Linux), it is the peak since start.

Freed host memory: glibc's allocator keeps freed heap memory resident and, by default, raises its
mmap threshold each time a large block is freed (up to 32 MiB), so after the first step most
activation-sized buffers come from the heap and stay resident when freed: a run held 10-25 % more
than it used (more under ZeRO-3, whose gathered parameters come and go every block). At start-up
the trainer therefore fixes the threshold at 64 KiB (`return_freed_memory`): every larger allocation
is its own mapping, returned to the system when freed. A user who sets `MALLOC_MMAP_THRESHOLD_`
keeps their value, `NANOCORE_HOST_ALLOCATOR=default` leaves glibc's dynamic threshold as it is, and
other C libraries (musl, macOS) are left alone. Cost and saving are measured in docs/memory.md.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 64 * 1024


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 64 KiB so freed buffers leave the resident set (see the module
    docstring). Returns whether it was set: False off glibc, where the user set
    MALLOC_MMAP_THRESHOLD_ themselves, or with NANOCORE_HOST_ALLOCATOR=default."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None or not sys.platform.startswith("linux"):
        return False
    if os.environ.get("NANOCORE_HOST_ALLOCATOR", "").lower() == "default":
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  glibc only: musl's mallopt ignores the parameter
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def _status_kb(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _max_rss_kb() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # macOS reports bytes


class MemoryMeter:
    """`reset()` starts an interval; `peak_mb()` is the peak since then (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.baseline_kb = 0 if self.cuda else (_status_kb("VmRSS") or _max_rss_kb())
        self.file_baseline_kb = None if self.cuda else _status_kb("RssFile")  # Linux >= 4.5
        self.resettable = self.cuda or self._clear_peak()

    def _clear_peak(self) -> bool:
        try:
            _CLEAR_REFS.write_text("5")  # Linux >= 4.0: reset VmHWM to the current RSS
            return _status_kb("VmHWM") is not None
        except OSError:
            return False

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            self._clear_peak()

    def peak_mb(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        peak = _status_kb("VmHWM") if self.resettable else None
        if peak is None:
            peak = _max_rss_kb()
        mapped = 0
        if self.file_baseline_kb is not None:
            # file pages mapped in since start-up; they are rarely dropped, so the count now is at
            # least the count at the peak: what remains is, if anything, below the run's true peak
            mapped = max((_status_kb("RssFile") or self.file_baseline_kb) - self.file_baseline_kb, 0)
        return max(peak - self.baseline_kb - mapped, 0) / 1024
