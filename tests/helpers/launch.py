"""Start `torchrun` on this machine the way a user would, for end-to-end tests of launches."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.paths import REPO

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


# One frame of a Python traceback: `  File "/a/path.py", line 12, in name` (a SyntaxError's has no `, in`).
_FRAME = re.compile(r'^\s*File "([^"\n]+)", line \d+', re.MULTILINE)


def own_code() -> list[Path]:
    """Where nanocore's own code lies: the core, the built-in plugins, the launch scripts and the tests,
    in this checkout and wherever the installed packages are imported from."""
    places = [REPO / "nanocore", REPO / "plugins", REPO / "tests", REPO / "run_train.py", REPO / "run_generate.py"]
    for package in ("nanocore", "nanocore_plugins"):
        spec = importlib.util.find_spec(package)
        places += [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return places


def frames_from(output: str, *places: Path) -> list[str]:
    """The files of the traceback frames in `output` that are one of `places` or lie under one of them.

    Paths are compared as paths, never as text, so the answer does not depend on where the checkout or
    the virtual environment lives: `~/nanocore/.venv/bin/torchrun` is torchrun's code, not nanocore's."""
    roots = [p.resolve() for p in places]
    found = []
    for name in _FRAME.findall(output):
        path = Path(name)
        if path.is_absolute() and any(path.resolve() == r or path.resolve().is_relative_to(r) for r in roots):
            found.append(name)
    return found


def wait_for(path: Path, proc: subprocess.Popen, *, timeout: float, ended: str, late: str) -> None:
    """Until `path` exists: an AssertionError saying `ended` (with the run's last output) if the run
    exits first, or `late` once `timeout` seconds pass (the run is killed)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            output = proc.stdout.read()[-3000:] if proc.stdout is not None else ""
            raise AssertionError(f"{ended}:\n{output}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(late)
        time.sleep(0.05)
