"""The YAML config as a user meets it: error messages (path + expectation, one message, exit 2, no
traceback, once under torchrun), `nanocore config` output, and YAML -> config -> YAML round trips."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from nanocore.commands.cli import run as cli_run
from nanocore.config import dump_yaml, structure_config
from nanocore.plugins import load_plugins
from tests.helpers.launch import frames_from, own_code
from tests.helpers.paths import CORE_FIXTURES as FIXTURES
from tests.helpers.paths import REPO

BIN = Path(sys.executable).parent
ERROR = "nanocore: error: "


@pytest.fixture(autouse=True)
def _no_plugin_env(monkeypatch):
    monkeypatch.delenv("NANOCORE_PLUGINS", raising=False)
    monkeypatch.delenv("NANOCORE_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def tiny() -> dict:
    return yaml.safe_load((FIXTURES / "tiny.yaml").read_text())


def write(tmp_path: Path, config: dict, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def subprocess_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOCORE_") and k not in ("RANK", "WORLD_SIZE")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def launch(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def problems(stderr: str) -> list[str]:
    """The problem lines of the one error message on stderr."""
    assert stderr.startswith(ERROR), stderr
    assert stderr.count(ERROR) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return stderr[len(ERROR) :].strip().splitlines()


def assert_reported(lines: list[str], *parts: str) -> None:
    """Some line contains every part (a problem is one line: its YAML path, then what was expected)."""
    assert any(all(p in line for p in parts) for line in lines), f"no line with {parts} in:\n" + "\n".join(lines)


# -- each kind of mistake, through `nanocore config` (in-process: fast) ---------------------------------


def _set(config: dict, dotted: str, value: Any) -> None:
    keys = [int(k) if k.isdigit() else k for k in dotted.split(".")]
    node = config
    for key in keys[:-1]:
        node = node[key]
    if value is DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value


DELETE = object()

MISTAKES = {
    "wrong type": ({"parallelism": {"tp": "two"}}, ["parallelism.tp: expected an integer, got 'two'"]),
    "float for int": ({"general.seed": 1.5}, ["general.seed: expected an integer, got float 1.5"]),
    "unknown key": (
        {"parallelism": {"pipline": 2}},
        ["parallelism: unknown key 'pipline' (did you mean 'pp_engine'?)"],
    ),
    "unknown key in model_config": (
        {"model.model_config.hiden_size": 32},
        ["model.model_config: unknown key 'hiden_size' (did you mean 'hidden_size'?)"],
    ),
    "unknown optimizer argument": (
        {"optimizer": {"optimizer_factory": {"name": "adam_w", "beta1": 0.9}}},
        ["optimizer.optimizer_factory: unknown key 'beta1' (did you mean 'adam_beta1'?)"],
    ),
    "unknown model type": (
        {"model.model_config.model_type": "mamba"},
        ["model.model_config.model_type: unknown model 'mamba'; installed: ", "llama"],
    ),
    "unknown pp_engine": (
        {"parallelism": {"pp_engine": "1f1c"}},
        [
            "parallelism.pp_engine: unknown pipeline schedule '1f1c' (did you mean '1f1b'?); installed: ",
            "afab",
            "interleaved",
        ],
    ),
    "unknown tp_mode": (
        {"parallelism": {"tp_mode": "ALLREDUCE"}},
        [
            "parallelism.tp_mode: unknown tp mode 'ALLREDUCE' (did you mean 'ALL_REDUCE'?); installed: ",
            "REDUCE_SCATTER",
        ],
    ),
    "unknown logger": (
        {"logging.loggers": ["jsonl", "tensorbord"]},
        [
            "logging.loggers[1]: unknown logger 'tensorbord' (did you mean 'tensorboard'?); installed: ",
            "console",
            "wandb",
        ],
    ),
    "kv heads": (
        {"model.model_config.num_key_value_heads": 3},
        ["model.model_config.num_key_value_heads: num_attention_heads = 4 is not divisible by num_key_value_heads = 3"],
    ),
    "missing nanoset folder": (
        {"data_stages.0.data.dataset": {"format": "nanoset", "dataset_folder": "no_such_folder"}},
        ["data_stages[0].data.dataset[0].dataset_folder: folder 'no_such_folder' does not exist"],
    ),
    "unordered data stages": (
        {
            "data_stages": [
                {"name": "stable", "start_training_step": 1},
                {"name": "late", "start_training_step": 4},
                {"name": "early", "start_training_step": 2},
            ]
        },
        ["data_stages[2].start_training_step: stages must be ordered by start_training_step; 2 does not come after 4"],
    ),
    "missing model section": ({"model": DELETE}, ["model: required key is missing"]),
    "section is a list": ({"parallelism": [1, 2]}, ["parallelism: expected a mapping, got a list"]),
    "loggers is a string": ({"logging.loggers": "console"}, ["logging.loggers: expected a list, got 'console'"]),
    "model_config is null": (
        {"model.model_config": None},
        ["model.model_config: expected a mapping (the model's config), got null"],
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_config_mistake_is_one_message_naming_the_yaml_path(mistake, tmp_path, monkeypatch, capsys):
    changes, expected = MISTAKES[mistake]
    config = tiny()
    for key, value in changes.items():
        _set(config, key, value)
    monkeypatch.chdir(tmp_path)  # relative folders in the message are relative to the cwd
    assert cli_run(["config", str(write(tmp_path, config))]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert_reported(problems(out.err), *expected)


def test_base_config_is_valid(tmp_path, capsys):
    # The mistakes above are mistakes only: the same config without them loads.
    assert cli_run(["config", str(write(tmp_path, tiny()))]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err and all(line.startswith("ok: ") for line in err), err  # what it loaded: tokenizer, data


def test_world_size_check_uses_world_size_option(tmp_path, capsys):
    path = write(tmp_path, tiny())
    assert cli_run(["config", str(path), "--world-size", "4"]) == 2
    assert_reported(
        problems(capsys.readouterr().err),
        "parallelism: dp x tp x pp = 1 x 1 x 1 = 1 but the launch has 4 process(es)",
    )
    config = tiny()
    config["parallelism"] = {"dp": 2, "tp": 2}
    assert cli_run(["config", str(write(tmp_path, config)), "--world-size", "4"]) == 0


def test_structural_problems_are_reported_together(tmp_path, capsys):
    config = tiny()
    config["parallelism"] = {"tp": "two", "pipline": 1}
    config["tokens"]["train_steps"] = "many"
    config["logging"]["loggers"] = ["tensorbord"]
    config["colour"] = "blue"
    assert cli_run(["config", str(write(tmp_path, config))]) == 2
    lines = problems(capsys.readouterr().err)
    assert_reported(lines, "parallelism.tp: expected an integer, got 'two'")
    assert_reported(lines, "parallelism: unknown key 'pipline'")
    assert_reported(lines, "tokens.train_steps: expected an integer, got 'many'")
    assert_reported(lines, "logging.loggers[0]: unknown logger 'tensorbord'")
    assert_reported(lines, "<top level>: unknown key 'colour'; known keys: model, general")
    assert len(lines) == 5


def test_missing_config_file_is_an_error(tmp_path, capsys):
    assert cli_run(["config", str(tmp_path / "nope.yaml")]) == 2
    assert_reported(problems(capsys.readouterr().err), "nope.yaml", "does not exist")


# -- the same contract from a shell: run_train.py and `nanocore config` as processes -------------------


def cross_field_mistakes() -> dict:
    config = tiny()
    config["parallelism"] = {"dp": 2, "pp_engine": "1f1c", "tp_mode": "ALLREDUCE"}
    config["model"]["model_config"]["num_key_value_heads"] = 3
    config["data_stages"] = [
        {"name": "a", "start_training_step": 1, "data": {"dataset": {"format": "nanoset", "dataset_folder": "gone"}}},
        {"name": "b", "start_training_step": 5},
        {"name": "c", "start_training_step": 3},
    ]
    return config


CROSS_FIELD_LINES = [
    ("parallelism: dp x tp x pp = 2 x 1 x 1 = 2 but the launch has 1 process(es)",),
    ("parallelism.pp_engine: unknown pipeline schedule '1f1c'",),
    ("parallelism.tp_mode: unknown tp mode 'ALLREDUCE'",),
    ("model.model_config.num_key_value_heads: num_attention_heads = 4 is not divisible by num_key_value_heads = 3",),
    ("data_stages[0].data.dataset[0].dataset_folder: folder 'gone' does not exist",),
    ("data_stages[2].start_training_step: stages must be ordered", "3 does not come after 5 (stage 'b')"),
]


def test_run_train_reports_every_cross_field_problem_once(tmp_path):
    # No torchrun: world size 1, so dp=2 is a mistake too.
    path = write(tmp_path, cross_field_mistakes())
    result = launch([sys.executable, str(REPO / "run_train.py"), "--config-file", str(path)], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = problems(result.stderr)
    for parts in CROSS_FIELD_LINES:
        assert_reported(lines, *parts)
    assert len(lines) == len(CROSS_FIELD_LINES)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "checkpoints").exists()


def test_run_train_reports_type_and_key_mistakes(tmp_path):
    config = tiny()
    config["parallelism"] = {"tp": "two", "pipline": 1}
    config["model"]["model_config"]["model_type"] = "mamba"
    path = write(tmp_path, config)
    result = launch([sys.executable, str(REPO / "run_train.py"), "--config-file", str(path)], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = problems(result.stderr)
    assert_reported(lines, "parallelism.tp: expected an integer, got 'two'")
    assert_reported(lines, "parallelism: unknown key 'pipline' (did you mean")
    assert_reported(lines, "model.model_config.model_type: unknown model 'mamba'; installed: ", "llama")


def test_nanocore_config_command_reports_world_size(tmp_path):
    path = write(tmp_path, tiny())
    result = launch([str(BIN / "nanocore"), "config", str(path), "--world-size", "4"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert problems(result.stderr) == [
        "parallelism: dp x tp x pp = 1 x 1 x 1 = 1 but the launch has 4 process(es); "
        "change the layout or torchrun --nproc_per_node"
    ]


@pytest.mark.slow
def test_torchrun_prints_a_config_error_once(tmp_path):
    config = tiny()
    config["parallelism"] = {"tp": "two"}
    path = write(tmp_path, config)
    result = launch(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "run_train.py"),
            "--config-file",
            str(path),
        ],
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count(ERROR) == 1, output
    assert output.count("parallelism.tp: expected an integer, got 'two'") == 1, output
    # torchrun's own report may have a traceback; nanocore's frames may not (told by path, not by name)
    assert not frames_from(output, *own_code()), output


# -- `nanocore config` output and round trips ---------------------------------------------------------


def test_config_command_prints_every_default(tmp_path, capsys):
    path = write(tmp_path, tiny())
    assert cli_run(["config", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["parallelism"] == {
        "dp": 1,
        "tp": 1,
        "pp": 1,
        "pp_engine": "1f1b",
        "pp_virtual_stages": 1,
        "tp_mode": "ALL_REDUCE",
        "tp_linear_async_communication": False,
        "expert_parallel_size": 1,
        "context_parallel_size": 1,
        "context_parallel_mode": "ring",
        "recompute_layer": False,
        "recompute_granularity": None,
        "collective_timeout_seconds": 600.0,
        "engine": "nd",
    }
    model_config = printed["model"]["model_config"]
    assert model_config["model_type"] == "llama"
    assert model_config["hidden_size"] == 32  # from the file
    assert model_config["rms_norm_eps"] == 1e-6 and model_config["rope_theta"] == 10000.0  # plugin defaults
    # The optimizer section is absent from the file: its plugin's arguments are printed all the same.
    assert printed["optimizer"]["optimizer_factory"] == {
        "name": "adam_w",
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_eps": 1e-8,
        "torch_adam_is_fused": True,
    }
    assert printed["data_stages"][0]["data"]["dataset"] == [{"format": "dummy", "num_samples": 1_000_000}]
    assert printed["checkpoints"]["save_final_state"] is False


def test_printed_config_is_a_fixed_point(tmp_path, capsys):
    config = tiny()
    del config["logging"]  # default loggers, whose options come from their plugins
    assert cli_run(["config", str(write(tmp_path, config))]) == 0
    first = capsys.readouterr().out
    assert yaml.safe_load(first)["logging"]["loggers"] == [
        {"name": "console", "every": 1, "progress_bar": None},
        "jsonl",
        {"name": "tensorboard", "subdir": "tensorboard"},
    ]
    printed = tmp_path / "printed.yaml"
    printed.write_text(first)
    assert cli_run(["config", str(printed)]) == 0
    assert capsys.readouterr().out == first


def round_trip(raw: dict, registries) -> tuple[Any, Any]:
    first = structure_config(copy.deepcopy(raw), registries)
    second = structure_config(yaml.safe_load(dump_yaml(first)), registries)
    return first, second


def test_round_trip_keeps_plugin_owned_sections(registries):
    raw = yaml.safe_load((FIXTURES / "plugin_sections.yaml").read_text())
    first, second = round_trip(raw, registries)
    assert second == first
    assert dump_yaml(second) == dump_yaml(first)
    # ...and the values are the file's, not the plugins' defaults
    assert second.model.model_config.num_key_value_heads == 3
    assert second.model.model_config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert second.optimizer.optimizer_factory.args.adam_beta1 == 0.85
    assert second.optimizer.optimizer_factory.args.torch_adam_is_fused is False
    warmup, mix = second.data_stages
    assert warmup.data.dataset[0].args.num_samples == 500
    assert warmup.data.validation_dataset[0].args.num_samples == 50
    nanoset, hf = mix.data.dataset
    assert (nanoset.format, nanoset.weight, nanoset.args.token_size) == ("nanoset", 0.7, 2)
    assert nanoset.args.dataset_folder == {"data/a": 2.0, "data/b": 1.0}
    assert (hf.format, hf.args.text_column_name) == ("hf", "content")
    console, jsonl, tensorboard, wandb = second.logging.loggers
    assert (console.options.every, console.options.progress_bar) == (5, False)
    assert jsonl.name == "jsonl" and jsonl.options is None
    assert tensorboard.options.subdir == "tb"
    assert (wandb.options.mode, wandb.options.tags) == ("offline", ["tiny", "roundtrip"])


def test_nanotron_spellings_read_as_canonical_ones(registries):
    raw = yaml.safe_load((FIXTURES / "nanotron_style.yaml").read_text())
    canonical = copy.deepcopy(raw)
    del canonical["lighteval"], canonical["profiler"]
    model_config = canonical["model"]["model_config"]
    del model_config["is_llama_config"]
    model_config["model_type"] = "llama"
    canonical["optimizer"]["optimizer_factory"]["name"] = "adam_w"
    canonical["data_stages"][0]["data"]["dataset"] = [{"format": "dummy"}]

    first, second = round_trip(raw, registries)
    assert first == structure_config(canonical, registries)
    assert second == first
    assert first.model.model_type == "llama"
    assert first.optimizer.optimizer_factory.name == "adam_w"
    assert [d.format for d in first.data_stages[0].data.dataset] == ["dummy"]
    assert math.isclose(first.model.init_method.std, 0.025)
    dumped = yaml.safe_load(dump_yaml(first))
    assert "is_llama_config" not in dumped["model"]["model_config"]
    assert "lighteval" not in dumped
