"""The plugin core as a user meets it: built-ins arrive through entry points, local plugins come from
--plugin / the YAML `plugins:` list / NANOCORE_PLUGINS and really train, and every plugin mistake is one
clear message naming the plugin."""

from __future__ import annotations

import csv
import importlib
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nanocore.commands.cli import run as cli_run
from nanocore.plugins import load_plugins

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
BIN = Path(sys.executable).parent
ERROR = "nanocore: error: "

# Entry point name -> the hooks it implements (pyproject.toml's [project.entry-points.nanocore]).
BUILTIN_HOOKS = {
    "data": ["register_commands", "register_dataset_formats"],
    "float8": ["register_float8_recipes"],
    "llama": ["register_models"],
    "loggers": ["register_loggers"],
    "optim": ["register_lr_decays", "register_optimizers"],
    "parallel": ["register_commands", "register_parallel_engines"],
    "schedules": ["register_pipeline_schedules"],
    "tokenizers": ["register_tokenizers"],
    "tp_modes": ["register_tp_modes"],
    "zero": ["register_zero_stages"],
}


def all_builtins() -> str:
    """Every installed entry point of group `nanocore` (built-ins and third-party), for NANOCORE_DISABLE_PLUGINS."""
    return ",".join(sorted({ep.name for ep in importlib.metadata.entry_points(group="nanocore")}))


@pytest.fixture(autouse=True)
def _no_plugin_env(monkeypatch):
    for name in ("NANOCORE_PLUGINS", "NANOCORE_DISABLE_PLUGINS", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


def launch(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("NANOCORE_") and k not in ("RANK", "WORLD_SIZE")}
    full_env = {**base, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300)


def error_message(stderr: str) -> str:
    """The one user-facing error message (no traceback)."""
    assert stderr.startswith(ERROR), stderr
    assert stderr.count(ERROR) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return stderr[len(ERROR) :]


# -- built-ins through entry points -------------------------------------------------------------------


@pytest.fixture(scope="module")
def listing() -> dict:
    result = launch([str(BIN / "nanocore"), "plugins", "--json"], cwd=REPO)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_every_builtin_is_an_entry_point_of_the_nanocore_distribution(listing):
    plugins = {p["name"]: p for p in listing["plugins"]}
    version = importlib.metadata.version("nanocore")
    for name, hooks in BUILTIN_HOOKS.items():
        assert name in plugins, f"built-in plugin {name!r} not loaded"
        info = plugins[name]
        assert (info["source"], info["distribution"], info["version"]) == ("entry point", "nanocore", version)
        assert info["hooks"] == hooks
        assert info["location"].startswith(f"nanocore_plugins.{name}")


def test_registries_list_names_with_their_plugin_and_aliases(listing):
    registries = listing["registries"]
    expected = {
        "model": {"llama": "llama"},
        "parallel_engine": {"nd": "parallel"},
        "pipeline_schedule": {"afab": "schedules", "1f1b": "schedules", "interleaved": "schedules"},
        "tp_mode": {"ALL_REDUCE": "tp_modes", "REDUCE_SCATTER": "tp_modes"},
        "optimizer": {"adam_w": "optim", "sgd": "optim"},
        "lr_decay": {"cosine": "optim", "linear": "optim", "1-sqrt": "optim", "constant": "optim"},
        "zero_stage": {"0": "zero", "1": "zero"},
        "dataset_format": {"dummy": "data", "nanoset": "data", "hf": "data"},
        "tokenizer": {"byte": "tokenizers", "hf": "tokenizers"},
        "logger": {"console": "loggers", "jsonl": "loggers", "tensorboard": "loggers", "wandb": "loggers"},
        # pipeline-sim is a core command (nanocore/commands/); pipeline-probe runs the nd engine's blocks
        "command": {"preprocess": "data", "pipeline-probe": "parallel"},
    }
    for kind, names in expected.items():
        for name, plugin in names.items():
            assert registries[kind][name]["plugin"] == plugin, (kind, name)
    assert sorted(registries["optimizer"]["adam_w"]["aliases"]) == ["adamW", "adamw"]
    assert registries["optimizer"]["sgd"]["aliases"] == []
    assert registries["parallel_engine"]["nd"]["aliases"] == ["3d"]  # configs written before 0.2 keep running


# -- a local plugin (model + dataset format + logger) trains end to end -------------------------------


def assert_trained_with_tiny_plugin(log_dir: Path, steps: int = 3) -> None:
    rows_file = log_dir / "rows.csv"
    assert rows_file.exists(), f"the csv_rows logger wrote nothing in {log_dir}"
    rows = list(csv.DictReader(rows_file.read_text().splitlines()))
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    for row in rows:
        # ln(32): an untrained bigram over the plugin's 32-token vocabulary, not the 64-token llama
        assert abs(float(row["lm_loss"]) - math.log(32)) < 0.05, row
        assert "model bigram hidden_size=8" in row["built"]
        assert "dataset ramp start=5" in row["built"]


def bigram_config(folder: Path, plugins: list[str] | None = None) -> Path:
    config = yaml.safe_load((FIXTURES / "bigram.yaml").read_text())
    config["logging"]["log_dir"] = str(folder / "logs")
    config["checkpoints"]["checkpoints_path"] = str(folder / "checkpoints")
    if plugins is not None:
        config["plugins"] = plugins
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bigram.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def plugin_setup(tmp_path: Path, source: str) -> tuple[Path, Path, list[str], dict[str, str]]:
    """(config file, folder to run in, --plugin arguments, environment) for one way of naming the plugin.

    For the YAML list the plugin sits beside the YAML and the run starts from another folder.
    """
    plugin = str(FIXTURES / "tiny_plugin.py")
    if source == "yaml":
        conf = tmp_path / "conf"
        (conf / "local").mkdir(parents=True)
        shutil.copy(plugin, conf / "local" / "tiny_plugin.py")
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        return bigram_config(conf, plugins=["local/tiny_plugin.py"]), elsewhere, [], {}
    config = bigram_config(tmp_path)
    if source == "cli":
        return config, tmp_path, [plugin], {}
    return config, tmp_path, [], {"NANOCORE_PLUGINS": plugin}


SOURCES = ["cli", "yaml", "env"]


@pytest.mark.parametrize("source", SOURCES)
def test_local_plugin_trains(source, tmp_path, monkeypatch):
    """In-process, through the same loader run_train.py uses (the slow test below runs the commands)."""
    from nanocore.config.load import load_config
    from nanocore.trainer import run_training

    config, cwd, cli_plugins, env = plugin_setup(tmp_path, source)
    monkeypatch.chdir(cwd)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    loaded = load_config(config, cli_plugins)
    assert [p.name for p in loaded.plugins.list() if p.source == "local"] == ["tiny_plugin"]
    run_training(loaded)
    assert_trained_with_tiny_plugin(config.parent / "logs")


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_local_plugin_trains_from_the_command_line(source, tmp_path):
    config, cwd, cli_plugins, env = plugin_setup(tmp_path, source)
    cmd = [sys.executable, str(REPO / "run_train.py"), "--config-file", str(config)]
    if source == "env":  # the console script, for once
        cmd = [str(BIN / "nanocore"), "train", "--config-file", str(config)]
    for plugin in cli_plugins:
        cmd += ["--plugin", plugin]
    result = launch(cmd, cwd=cwd, **env)
    assert result.returncode == 0, result.stderr
    assert_trained_with_tiny_plugin(config.parent / "logs")


def test_config_naming_a_local_plugins_model_needs_the_plugin(tmp_path, capsys):
    # Without the plugin the same YAML is an error listing what is installed (so the runs above used it).
    assert cli_run(["config", str(bigram_config(tmp_path))]) == 2
    message = error_message(capsys.readouterr().err)
    assert "model.model_config.model_type: unknown model 'bigram'; installed: " in message
    assert "llama" in message.split("installed: ")[1]


# -- disabling plugins ---------------------------------------------------------------------------------


def test_disabled_builtin_disappears(tmp_path, monkeypatch, capsys):
    config = yaml.safe_load((FIXTURES / "tiny.yaml").read_text())
    config["logging"]["loggers"] = ["console"]
    path = tmp_path / "console.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli_run(["config", str(path)]) == 0  # fine while the loggers plugin is there
    capsys.readouterr()

    monkeypatch.setenv("NANOCORE_DISABLE_PLUGINS", "loggers")
    assert cli_run(["plugins", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert "loggers" not in [p["name"] for p in listing["plugins"]]
    assert "llama" in [p["name"] for p in listing["plugins"]]
    assert listing["registries"]["logger"] == {}

    assert cli_run(["config", str(path)]) == 2
    message = error_message(capsys.readouterr().err)
    assert message.startswith("logging.loggers[0]: no plugin provides logger 'console': no logger plugin is installed")
    assert "NANOCORE_DISABLE_PLUGINS" in message


def test_a_disabled_name_no_plugin_has_is_warned_about(monkeypatch, caplog):
    """NANOCORE_DISABLE_PLUGINS=parallel3d (a typo of parallel) would leave `parallel` running unsaid."""
    monkeypatch.setenv("NANOCORE_DISABLE_PLUGINS", "parallel3d,loggers")
    with caplog.at_level("WARNING", logger="nanocore"):
        plugins = load_plugins()
    assert "loggers" not in plugins.infos and "parallel" in plugins.infos
    assert "NANOCORE_DISABLE_PLUGINS names 'parallel3d', which no plugin found here is called (plugins: " in caplog.text
    assert "'loggers'" not in caplog.text


# -- plugin mistakes -----------------------------------------------------------------------------------


def test_misspelled_hook_is_an_error_naming_the_plugin(capsys):
    assert cli_run(["plugins", "--plugin", str(FIXTURES / "misspelled_hook.py")]) == 2
    message = error_message(capsys.readouterr().err)
    assert message.startswith("plugin 'misspelled_hook' (")
    assert "unknown hook 'register_modles'" in message
    assert "Known hooks:" in message and "register_models" in message


def test_builtin_and_local_plugin_registering_the_same_name(capsys):
    assert cli_run(["plugins", "--plugin", str(FIXTURES / "duplicate_logger.py")]) == 2
    message = error_message(capsys.readouterr().err)
    assert "logger name 'jsonl' is registered twice: by plugin 'loggers' and by plugin 'duplicate_logger'" in message
    assert "NANOCORE_DISABLE_PLUGINS" in message


def test_two_local_plugins_registering_the_same_name(tmp_path, capsys):
    shutil.copy(FIXTURES / "tiny_plugin.py", tmp_path / "another_plugin.py")
    args = ["plugins", "--plugin", str(FIXTURES / "tiny_plugin.py"), "--plugin", str(tmp_path / "another_plugin.py")]
    assert cli_run(args) == 2
    message = error_message(capsys.readouterr().err)
    assert "model name 'bigram' is registered twice: by plugin 'tiny_plugin' and by plugin 'another_plugin'" in message


def test_plugin_file_with_a_syntax_error_is_reported_with_file_and_line(tmp_path, capsys):
    broken = tmp_path / "broken_syntax.py"
    broken.write_text("from nanocore import hookimpl\n\n\ndef register_models(registry:\n    pass\n")
    assert cli_run(["plugins", "--plugin", str(broken)]) == 2
    message = error_message(capsys.readouterr().err)
    assert "broken_syntax.py" in message and "failed to import: SyntaxError" in message
    assert f"at {broken}:4" in message


def test_missing_local_plugin_file(tmp_path, capsys):
    assert cli_run(["plugins", "--plugin", str(tmp_path / "absent.py")]) == 2
    assert "absent.py' does not exist" in error_message(capsys.readouterr().err)


class _Dist:
    metadata = {"Name": "nanocore-extras"}
    version = "9.9.9"


class _BrokenEntryPoint:
    """An installed third-party entry point whose module does not import."""

    name = "extras"
    value = "nanocore_extras_not_installed.plugin"
    group = "nanocore"
    dist = _Dist()

    def load(self):
        return importlib.import_module(self.value)


def test_broken_entry_point_is_reported_with_distribution_and_how_to_disable(monkeypatch, capsys):
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [*real(group=group), _BrokenEntryPoint()])
    assert cli_run(["plugins"]) == 2
    message = error_message(capsys.readouterr().err)
    assert message.startswith("plugin 'extras' (distribution nanocore-extras 9.9.9, entry point ")
    assert "ModuleNotFoundError" in message and "nanocore_extras_not_installed" in message
    assert "NANOCORE_DISABLE_PLUGINS=extras" in message

    monkeypatch.setenv("NANOCORE_DISABLE_PLUGINS", "extras")
    assert cli_run(["plugins"]) == 0
    assert "llama" in capsys.readouterr().out


# -- the core stands without the built-ins -------------------------------------------------------------

CORE_ALONE = """
import importlib, json, pkgutil, sys
import nanocore
from nanocore.commands.cli import run
from nanocore.plugins import load_plugins

names = [m.name for m in pkgutil.walk_packages(nanocore.__path__, "nanocore.") if m.name != "nanocore.__main__"]
for name in names:
    importlib.import_module(name)
plugins = load_plugins()
sizes = {kind: len(registry) for kind, registry in plugins.registries.by_kind.items()}
code = run(["config", sys.argv[1]])
print(json.dumps({"modules": names, "plugins": [p.name for p in plugins.list()], "sizes": sizes, "code": code,
                  "leaked": sorted(m for m in sys.modules if m.split(".")[0] == "nanocore_plugins")}))
"""


def test_core_imports_and_fails_clearly_without_builtin_plugins(tmp_path):
    config = tmp_path / "tiny.yaml"
    shutil.copy(FIXTURES / "tiny.yaml", config)
    result = launch(
        [sys.executable, "-c", CORE_ALONE, str(config)], cwd=tmp_path, NANOCORE_DISABLE_PLUGINS=all_builtins()
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert "nanocore.trainer" in report["modules"] and "nanocore.config.load" in report["modules"]
    assert report["leaked"] == []
    assert report["plugins"] == []
    assert set(report["sizes"].values()) == {0}
    assert report["code"] == 2
    assert "model.model_config.model_type: no plugin provides model 'llama'" in error_message(result.stderr)
