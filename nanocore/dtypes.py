"""Parameter dtypes by name: what `model.dtype` may say and what `auto` means, decided here only.

`auto` is bfloat16 on a CUDA device and float32 elsewhere (CPU kernels are slow or missing in half
precision, and the parity tests compare float32 on CPU). The engine, the memory planner and
`nanocore generate` all resolve the name through this module. torch is imported only when a
`torch.dtype` is asked for, so that the CLI and the config checks stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")  # what model.dtype accepts
CAST_NAMES = DTYPE_NAMES[1:]  # concrete dtypes (e.g. `nanocore convert --to-hf --dtype`)


def resolve_dtype_name(name: str, device_type: str) -> str:
    """The concrete dtype name `name` means on a device of type `device_type` ("cuda", "cpu", ...)."""
    if name == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    if name not in CAST_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a concrete name ("float32", "bfloat16", "float16")."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype `model.dtype: name` means on `device`."""
    import torch

    return torch_dtype(resolve_dtype_name(name, torch.device(device).type))
