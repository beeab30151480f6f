"""Command-line overrides `key.path=value`: YAML-typed, applied before the config is structured (so
mistakes get the usual message with their YAML path), shown by `nanocore config`, stored in checkpoints."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from nanocore.commands.cli import run as cli_run
from nanocore.config.overrides import apply_overrides
from nanocore.errors import ConfigError
from tests.helpers.launch import REPO, launch_env
from tests.helpers.training import tiny_config


def test_values_are_yaml_and_paths_reach_lists_and_new_sections():
    raw = {"tokens": {"train_steps": 5}, "data_stages": [{"name": "a", "data": {"dataset": None}}]}
    apply_overrides(raw, [
        "tokens.train_steps=10", "optimizer.clip_grad=null", "logging.loggers=[console, jsonl]",
        "data_stages[0].data.seed=3", "general.run='007'", "model.model_config.rope_scaling={factor: 8.0}",
        "data_stages[0].data.dataset.format=dummy",
    ])  # fmt: skip
    assert raw["tokens"] == {"train_steps": 10}
    assert raw["optimizer"] == {"clip_grad": None}
    assert raw["logging"] == {"loggers": ["console", "jsonl"]}
    assert raw["data_stages"][0]["data"] == {"dataset": {"format": "dummy"}, "seed": 3}
    assert raw["general"] == {"run": "007"}  # quoted: a string, not the integer 7
    assert raw["model"] == {"model_config": {"rope_scaling": {"factor": 8.0}}}


@pytest.mark.parametrize(
    "item, message",
    [
        ("tokens.train_steps", "expected key.path=value"),
        ("=3", "expected key.path=value"),
        ("data_stages[4].name=x", "data_stages has 1 entries, so there is no data_stages[4]"),
        ("tokens.train_steps.x=1", "tokens.train_steps is not a mapping, so it has no key 'x'"),
        ("tokens..x=1", "is not a key path"),
        ("tokens.train_steps=[1, 2", "the value is not valid YAML"),
    ],
)
def test_malformed_overrides_say_what_is_wrong(item, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        apply_overrides({"tokens": {"train_steps": 5}, "data_stages": [{"name": "a"}]}, [item])


def write(tmp_path, **sections):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path, **sections), sort_keys=False))
    return path


def test_nanocore_config_shows_the_overridden_config(tmp_path, capsys):
    path = write(tmp_path)
    assert cli_run(["config", str(path), "tokens.train_steps=12", "optimizer.clip_grad=null", "--skip-data"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["tokens"]["train_steps"] == 12 and printed["optimizer"]["clip_grad"] is None


def test_a_bad_override_gets_the_message_of_the_same_mistake_in_the_file(tmp_path, capsys):
    path = write(tmp_path)
    assert cli_run(["config", str(path), "tokens.train_steps=two", "parallelism.pipline=2"]) == 2
    err = capsys.readouterr().err
    assert "tokens.train_steps: expected an integer, got 'two'" in err
    assert "parallelism: unknown key 'pipline' (did you mean 'pipeline'?)" in err or "unknown key 'pipline'" in err


def test_run_train_applies_overrides_and_the_checkpoint_keeps_them(tmp_path):
    path = write(tmp_path, logging={"log_dir": str(tmp_path / "logs"), "loggers": []})
    result = subprocess.run(
        [sys.executable, str(REPO / "run_train.py"), "--config-file", str(path), "tokens.train_steps=2",
         "general.run=overridden", "checkpoints.save_final_state=true"],
        cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "checkpoints" / "2" / "config.yaml").read_text())
    assert saved["tokens"]["train_steps"] == 2 and saved["general"]["run"] == "overridden"
    assert "run 'overridden'" in result.stderr  # the start-of-run summary shows the overridden config
    assert "overrides: tokens.train_steps=2, general.run=overridden" in result.stderr
