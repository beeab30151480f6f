"""The `nanocore` command line: `python -m nanocore`, `plugins [--json]`, help listing plugin commands,
running a plugin command, and usage errors."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanocore.commands.cli import run as cli_run

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BIN = Path(sys.executable).parent
BUILTINS = ["data", "llama", "loggers", "optim", "parallel", "schedules", "tokenizers", "tp_modes", "zero"]


@pytest.fixture(autouse=True)
def _no_plugin_env(monkeypatch):
    for name in ("NANOCORE_PLUGINS", "NANOCORE_DISABLE_PLUGINS", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


def launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOCORE_") and k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_python_m_nanocore_plugins_lists_plugins_and_registries(tmp_path):
    result = launch([sys.executable, "-m", "nanocore", "plugins"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    version = importlib.metadata.version("nanocore")
    for name in BUILTINS:
        (line,) = [ln for ln in lines if ln.split()[:1] == [name]]
        assert f"nanocore {version}" in line and "[entry point]" in line
    assert "registries:" in lines
    (optimizers,) = [ln for ln in lines if ln.split()[:1] == ["optimizer"]]
    assert "adam_w (adamW, adamw) <optim>" in optimizers and "sgd <optim>" in optimizers
    (models,) = [ln for ln in lines if ln.split()[:1] == ["model"]]
    assert "llama <llama>" in models


def test_help_lists_builtin_and_plugin_commands(tmp_path):
    result = launch([str(BIN / "nanocore"), "--help"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    commands = {ln.split()[0] for ln in result.stdout.splitlines() if ln.startswith("    ") and ln.split()}
    assert {"plugins", "config", "train", "pipeline-sim", "preprocess"} <= commands
    assert "Simulate a pipeline schedule" in result.stdout  # the plugin's description is the help text


def test_plugins_json_parses_and_shows_a_local_plugin(capsys):
    assert cli_run(["plugins", "--json", "--plugin", str(FIXTURES / "tiny_plugin.py")]) == 0
    listing = json.loads(capsys.readouterr().out)
    (local,) = [p for p in listing["plugins"] if p["name"] == "tiny_plugin"]
    assert local["source"] == "local"
    assert local["distribution"] is None and local["version"] is None
    assert local["location"] == str((FIXTURES / "tiny_plugin.py").resolve())
    assert local["hooks"] == ["register_commands", "register_dataset_formats", "register_loggers", "register_models"]
    assert listing["registries"]["model"]["bigram"]["plugin"] == "tiny_plugin"
    assert listing["registries"]["dataset_format"]["ramp"]["plugin"] == "tiny_plugin"
    assert listing["registries"]["logger"]["csv_rows"]["plugin"] == "tiny_plugin"


def test_plugin_command_runs_with_its_own_arguments(capsys):
    assert cli_run(["pipeline-sim", "--engine", "afab", "--pp", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "schedule afab: pp=2 microbatches=4 virtual_stages=1" in out
    assert "bubble fraction 0.200000" in out


def test_plugin_command_user_error_is_one_message(capsys):
    assert cli_run(["pipeline-sim", "--engine", "1f1c"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nanocore: error: --engine: unknown pipeline schedule '1f1c' (did you mean '1f1b'?)")
    assert err.count("nanocore: error:") == 1 and "Traceback" not in err


def test_local_plugin_command_from_environment(monkeypatch, capsys):
    monkeypatch.setenv("NANOCORE_PLUGINS", str(FIXTURES / "tiny_plugin.py"))
    with pytest.raises(SystemExit) as exit_info:
        cli_run(["--help"])
    assert exit_info.value.code == 0
    assert "tiny-hello" in capsys.readouterr().out
    assert cli_run(["tiny-hello", "--name", "nanocore"]) == 0
    assert capsys.readouterr().out == "hello nanocore from tiny_plugin\n"


def test_missing_or_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_run([])
    assert exit_info.value.code == 2
    assert "the following arguments are required: command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_run(["tiny-hello"])  # only exists while tiny_plugin is loaded
    assert exit_info.value.code == 2
    assert "invalid choice: 'tiny-hello'" in capsys.readouterr().err
