"""The example plugin packages are real third-party distributions: found through their entry points,
listed by `nanocore plugins` under their own names, and unknown to the core and built-in plugins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanocore.commands import cli
from tests.helpers.third_party import PACKAGES, require

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("distribution", list(PACKAGES))
def test_nanocore_plugins_json_lists_the_package_under_its_own_distribution(distribution, capsys):
    require(distribution)
    folder, module, entry_point, kind = PACKAGES[distribution]
    assert cli.run(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    info = {p["name"]: p for p in data["plugins"]}[entry_point]
    assert info["source"] == "entry point"
    assert info["distribution"] == distribution and info["version"] == "0.1.0"
    assert info["location"] == f"{module}.plugin"
    registered = data["registries"][kind]
    assert registered[entry_point]["plugin"] == entry_point  # gpt2 in "model", looped_bfs in "pipeline_schedule"
    assert (ROOT / "examples" / "plugins" / folder / "pyproject.toml").is_file()


def test_core_and_builtin_plugins_never_name_the_example_packages():
    """The packages use only the public plugin API: nothing in nanocore/ or plugins/ knows them."""
    names = ("gpt2", "looped_bfs", "looped-bfs", "nanocore_gpt2", "nanocore-gpt2", "nanocore_looped_bfs")
    scanned, offenders = 0, []
    for folder in ("nanocore", "plugins"):
        for path in (ROOT / folder).rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            text = path.read_bytes().decode("utf-8", errors="ignore").lower()
            scanned += 1
            offenders += [f"{path.relative_to(ROOT)}: {name}" for name in names if name in text]
    assert scanned > 20, "expected to scan the core and the built-in plugins"
    assert not offenders, offenders
