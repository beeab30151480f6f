"""One version: `nanocore.__version__` is written once, and the package metadata, `nanocore --version`
and the changelog's newest entry say the same."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nanocore

REPO = Path(__file__).resolve().parents[2]


def _outside_the_checkout(args: list[str], tmp_path: Path) -> str:
    """Run python with `args` as an installed nanocore is used: from another folder, the checkout not on
    sys.path (a build folder such as nanocore.egg-info in the checkout would otherwise answer for the install)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _table(text: str, name: str) -> str:
    """The body of TOML table `[name]` (the lines up to the next table)."""
    return re.split(rf"^\[{re.escape(name)}\]$", text, flags=re.M)[1].split("\n[", 1)[0]


def test_pyproject_reads_the_version_from_the_package():
    text = (REPO / "pyproject.toml").read_text()
    project = _table(text, "project")
    assert not re.search(r"^version\s*=", project, re.M), "write the version once, in nanocore/__init__.py"
    assert re.search(r'^dynamic\s*=\s*\[[^]]*"version"', project, re.M)
    dynamic = _table(text, "tool.setuptools.dynamic")
    assert re.search(r'^version\s*=\s*\{\s*attr\s*=\s*"nanocore.__version__"\s*\}', dynamic, re.M)


def test_installed_metadata_and_version_flag_agree_with_the_package(tmp_path):
    metadata = _outside_the_checkout(["-c", "import importlib.metadata as m; print(m.version('nanocore'))"], tmp_path)
    assert metadata == nanocore.__version__, (
        f"the installed metadata says {metadata}, nanocore/__init__.py says {nanocore.__version__}: "
        "reinstall (pip install -e .)"
    )
    flag = _outside_the_checkout(["-m", "nanocore", "--version"], tmp_path)
    assert flag == f"nanocore {nanocore.__version__}"


def test_changelog_starts_with_this_version():
    headings = re.findall(r"^## (\d+\.\d+\.\d+)\b", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert headings and headings[0] == nanocore.__version__, f"CHANGELOG.md's newest entry is {headings[:1]}"
