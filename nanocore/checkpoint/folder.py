"""Checkpoint folders: one per step plus latest.txt, written under a temporary name and renamed
when complete, so a crash mid-save never damages the last good checkpoint.

    checkpoints/
      latest.txt                 "20"
      20/
        meta.json                step, topology, data positions, LR scheduler, consumed tokens
        config.yaml              the config the run was trained with
        model/rank-00003.safetensors       pieces of parameters with their place in the full tensor
        optimizer/rank-00003.safetensors   pieces of optimizer state, same scheme
        rng/rank-00003.pt        every rank's RNG states (loaded with weights_only=True)
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanocore.errors import NanocoreError

LATEST = "latest.txt"
FORMAT_VERSION = 1


def step_folder(root: Path, step: int) -> Path:
    return root / str(step)


def tmp_folder(root: Path, step: int) -> Path:
    return root / f".tmp-{step}"


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoints folder (follow latest.txt) or a step folder -> the step folder."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    latest = path / LATEST
    if latest.exists():
        step = latest.read_text().strip()
        folder = path / step
        if not (folder / "meta.json").exists():
            raise NanocoreError(f"{latest} points to step {step}, but {folder} is missing or incomplete")
        return folder
    if not path.exists():
        raise NanocoreError(f"checkpoint path {str(path)!r} does not exist")
    raise NanocoreError(f"{str(path)!r} is neither a checkpoint step folder (no meta.json) nor a checkpoints folder (no {LATEST})")


def begin_save(root: Path, step: int, is_main: bool, barrier: Callable[[], None]) -> Path:
    """Create an empty temporary folder for `step` (rank 0), visible to all ranks after the barrier."""
    tmp = tmp_folder(root, step)
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)  # a previous crash left it half-written
        tmp.mkdir(parents=True)
    barrier()
    return tmp


def finish_save(root: Path, step: int, is_main: bool, barrier: Callable[[], None]) -> Path:
    """After every rank has written into the temporary folder: rename it and point latest.txt to it."""
    barrier()
    final = step_folder(root, step)
    if is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp_folder(root, step), final)
        tmp_latest = root / f".{LATEST}.tmp"
        tmp_latest.write_text(f"{step}\n")
        os.replace(tmp_latest, root / LATEST)
    barrier()
    return final


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def read_json(path: Path) -> Any:
    if not path.exists():
        raise NanocoreError(f"checkpoint file {path} is missing (incomplete checkpoint?)")
    return json.loads(path.read_text())


# -- RNG -------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every RNG this process uses, in a form torch.load(weights_only=True) accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tuples(obj: Any) -> Any:
    return tuple(_tuples(o) for o in obj) if isinstance(obj, (list, tuple)) else obj


def save_rng(folder: Path, rank: int) -> None:
    (folder / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), folder / "rng" / f"rank-{rank:05d}.pt")


def load_rng(folder: Path, rank: int) -> bool:
    """Restore this rank's RNG states if the checkpoint has them (same rank count); False otherwise."""
    path = folder / "rng" / f"rank-{rank:05d}.pt"
    if not path.exists():
        return False
    set_rng_state(torch.load(path, weights_only=True))
    return True
