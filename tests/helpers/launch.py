"""Start `torchrun` on this machine the way a user would, for end-to-end tests of launches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
RUN_TRAIN = REPO / "run_train.py"


def launch_env(**env: str) -> dict[str, str]:
    """This environment without nanocore's variables or a parent launch's ranks, one thread per rank."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NANOCORE_") and k not in ("RANK", "WORLD_SIZE")}
    return {**base, "OMP_NUM_THREADS": "1", **env}  # the machine that runs the tests is shared


def torchrun_command(nproc: int, script: Path, args: list[str]) -> list[str]:
    return [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(script), *args]


def torchrun(
    args: list[str], cwd: Path, *, nproc: int = 2, script: Path = RUN_TRAIN, timeout: float = 300, **env: str
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N script ARGS`, waited for, output captured."""
    return subprocess.run(
        torchrun_command(nproc, script, args), cwd=cwd, env=launch_env(**env), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def start_torchrun(
    args: list[str], cwd: Path, *, nproc: int = 2, script: Path = RUN_TRAIN, **env: str
) -> subprocess.Popen:
    """The same launch, not waited for (stdout and stderr to one pipe): to signal or time it."""
    return subprocess.Popen(
        torchrun_command(nproc, script, args), cwd=cwd, env=launch_env(**env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
