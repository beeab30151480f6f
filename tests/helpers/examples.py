"""The examples as a user runs them: copied into a fresh folder, run with this interpreter."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import EXAMPLES


def run_python(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python ARGS` in `cwd`, waited for, output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the machine that runs the tests is shared
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def copy_example(tmp_path: Path, *config_scripts: str) -> Path:
    """The example's files in a fresh folder, so nothing a test writes lands in the repository:
    config_tiny_llama.py (which the other config scripts build on), `config_scripts` and local_plugins/."""
    folder = tmp_path / "examples"
    folder.mkdir()
    for name in ("config_tiny_llama.py", *config_scripts):
        shutil.copy(EXAMPLES / name, folder)
    shutil.copytree(EXAMPLES / "local_plugins", folder / "local_plugins", ignore=shutil.ignore_patterns("__pycache__"))
    return folder
