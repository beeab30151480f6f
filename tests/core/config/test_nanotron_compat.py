"""nanotron configs as a migrating user meets them: nanotron's example trains, the keys nanocore does not act
on are listed in one warning (only those whose value matters), typos are still errors, renamed keys are
read under their nanocore names, and docs/migrating-from-nanotron.md says exactly what the code does."""

from __future__ import annotations

import copy
import logging
import math
import re
from typing import Any

import attrs
import pytest
import yaml

from nanocore.config import schema
from nanocore.config.converter import structure_config
from nanocore.config.load import load_config
from nanocore.config.nanotron import IGNORED, NANOTRON_SHAPE, NO_QUIET_VALUE, RENAMED, sections
from nanocore.errors import ConfigError
from nanocore.plugins import load_plugins
from nanocore.trainer import run_training
from tests.helpers.paths import REPO

EXAMPLE = REPO / "examples" / "nanotron_config_tiny_llama.yaml"
DOC = REPO / "docs" / "migrating-from-nanotron.md"

# What the example sets to a value nanocore does not honour (its other ignored keys are null/off).
EXAMPLE_WARNS = [
    "checkpoints.checkpoints_path_is_shared_file_system",
    "parallelism.tp_recompute_allgather",
    "model.model_config._attn_implementation",
    "model.model_config.z_loss_coefficient",
    "data_stages[0].data.num_loading_workers",
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    for name in ("NANOCORE_PLUGINS", "NANOCORE_DISABLE_PLUGINS", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "nanotron" in r.getMessage()]


QUIET_PREFIX = "  (at a value that changes nothing) "


def listed_paths(message: str) -> list[str]:
    """The YAML paths the warning lists with a reason, one per indented line."""
    return [line.strip().split(": ", 1)[0] for line in message.splitlines()[1:] if not line.startswith(QUIET_PREFIX)]


def quiet_paths(message: str) -> list[str]:
    """The YAML paths the warning names on its last line: ignored keys at a value that changes nothing."""
    last = message.splitlines()[-1]
    return last[len(QUIET_PREFIX) :].split(", ") if last.startswith(QUIET_PREFIX) else []


# -- the example ----------------------------------------------------------------------------------------


def test_nanotron_example_trains_and_warns_once(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # its relative checkpoints and logs folders land here
    loaded = load_config(EXAMPLE)
    config = loaded.config
    assert config.model.model_type == "llama"  # is_llama_config: true
    assert config.optimizer.optimizer_factory.name == "adam_w"  # adamW
    assert [d.format for d in config.data_stages[0].data.dataset] == ["dummy"]  # dataset: null
    assert config.model.model_config.hidden_size == 16 and config.model.dtype == "float32"
    assert config.model.init_method.std == 0.025 and config.logging.log_level == "info"

    config.tokens.train_steps = 2
    losses = run_training(loaded)
    assert len(losses) == 2 and all(abs(loss - math.log(256)) < 0.2 for loss in losses), losses
    assert (tmp_path / "checkpoints" / "nanotron_tiny_llama" / "latest.txt").read_text().strip() == "2"
    assert (tmp_path / "logs" / "metrics.jsonl").exists()

    (message,) = warnings(caplog)  # one warning for the whole run
    assert listed_paths(message) == EXAMPLE_WARNS
    quiet = quiet_paths(message)  # the example's other ignored keys (null/off) are named too, never dropped
    assert {"lighteval", "profiler", "s3_upload", "general.benchmark_csv_path"} <= set(quiet)
    assert message.startswith(f"{5 + len(quiet)} nanotron config key(s) accepted but not acted on by nanocore")
    reason = IGNORED["parallelism"]["tp_recompute_allgather"].reason
    assert f"parallelism.tp_recompute_allgather: {reason}" in message


def test_only_rank_zero_warns(registries, monkeypatch, caplog):
    monkeypatch.setenv("RANK", "1")
    structure_config(example(), registries)
    assert warnings(caplog) == []
    monkeypatch.setenv("RANK", "0")
    structure_config(example(), registries)
    assert len(warnings(caplog)) == 1


def test_a_config_nanocore_wrote_loads_without_a_warning(registries, caplog):
    from nanocore.config import dump_yaml

    first = structure_config(example(), registries)
    caplog.clear()
    assert structure_config(yaml.safe_load(dump_yaml(first)), registries) == first
    assert warnings(caplog) == []


# -- the warning lists exactly the ignored keys whose value matters ------------------------------------


def put(raw: dict, pattern: str, key: str, value: Any) -> str:
    """Set `key` in the first section at `pattern`; returns its YAML path."""
    path, section = next(sections(raw, pattern))
    section[key] = value
    return f"{path}.{key}" if path else key


def tiny_nanotron() -> dict:
    """The example without any key of the tables: the canvas the tests below paint keys on."""
    raw = example()
    for pattern, keys in IGNORED.items():
        for _, section in sections(raw, pattern):
            for key in keys:
                section.pop(key, None)
    raw["data_stages"][0]["data"]["dataset"] = {}  # nanotron's shape: no `format`, every key inferred
    return raw


def test_warning_lists_every_ignored_key_set_to_a_value_that_matters(registries, caplog):
    raw, expected = tiny_nanotron(), []
    for pattern, keys in IGNORED.items():
        for key, ignored in keys.items():
            path = put(raw, pattern, key, "set by the user")
            expected.append(f"{path}: {ignored.reason}")
    config = structure_config(raw, registries)
    (message,) = warnings(caplog)
    assert message.splitlines()[1:] == [f"  {line}" for line in expected]
    assert config == structure_config(tiny_nanotron(), registries)  # nothing of them reached the config


def test_ignored_keys_at_their_quiet_value_are_named_without_a_reason(registries, caplog):
    for pattern, keys in IGNORED.items():
        for key, ignored in keys.items():
            for value in ignored.quiet:
                raw = tiny_nanotron()
                path = put(raw, pattern, key, copy.deepcopy(value))
                caplog.clear()
                structure_config(raw, registries)
                (message,) = warnings(caplog)
                assert listed_paths(message) == [] and quiet_paths(message) == [path], (path, value)


def test_nanotron_keys_are_read_only_where_the_section_is_written_nanotrons_way(registries, caplog):
    raw = tiny_nanotron()
    model_config = raw["model"]["model_config"]
    del model_config["is_llama_config"]
    model_config.update(model_type="llama", z_loss_enabled=True)
    raw["data_stages"][0]["data"]["dataset"] = [{"format": "dummy", "vocab_size": 256}]
    with pytest.raises(ConfigError) as err:
        structure_config(raw, registries)
    model_problem, dataset_problem = err.value.problems
    assert model_problem.startswith("model.model_config: unknown key 'z_loss_enabled'")
    assert dataset_problem.startswith("data_stages[0].data.dataset[0]: unknown key 'vocab_size'")
    assert warnings(caplog) == []
    assert set(NANOTRON_SHAPE) <= set(IGNORED)


# -- typos stay errors --------------------------------------------------------------------------------


def test_a_typo_in_a_nanotron_config_is_an_error_with_did_you_mean(registries, caplog):
    raw = example()
    raw["parallelism"]["tp_recompute_allgater"] = raw["parallelism"].pop("tp_recompute_allgather")
    raw["general"]["benchmark_csv_pth"] = raw["general"].pop("benchmark_csv_path")
    raw["model"]["model_config"]["rope_thetta"] = raw["model"]["model_config"].pop("rope_theta")
    raw["s3_uplod"] = raw.pop("s3_upload")
    with pytest.raises(ConfigError) as err:
        structure_config(raw, registries)
    assert sorted(err.value.problems) == [
        "<top level>: unknown key 's3_uplod' (did you mean 's3_upload'?)",
        "general: unknown key 'benchmark_csv_pth' (did you mean 'benchmark_csv_path'?)",
        "model.model_config: unknown key 'rope_thetta' (did you mean 'rope_theta'?)",
        "parallelism: unknown key 'tp_recompute_allgater' (did you mean 'tp_recompute_allgather'?)",
    ]
    assert warnings(caplog) == []  # a config that does not load warns about nothing


# -- renamed keys ---------------------------------------------------------------------------------------


def test_renamed_nanoset_key_is_read_under_its_nanocore_name(registries):
    raw = tiny_nanotron()
    raw["data_stages"][0]["data"]["dataset"] = {"dataset_folder": "tokenized", "token_size_in_bytes": 2}
    config = structure_config(raw, registries)
    (spec,) = config.data_stages[0].data.dataset
    assert (spec.format, spec.args.dataset_folder, spec.args.token_size) == ("nanoset", "tokenized", 2)

    raw["data_stages"][0]["data"]["dataset"]["token_size"] = 4
    with pytest.raises(ConfigError) as err:
        structure_config(raw, registries)
    assert err.value.problems == [
        "data_stages[0].data.dataset.token_size_in_bytes: nanotron's name for 'token_size', which is also "
        "given; keep one"
    ]


# -- the migration guide and the code say the same thing --------------------------------------------------

STATUS = re.compile(r"^(supported|ignored|renamed to `([^`]+)`)$")


def doc_rows() -> list[tuple[str, str, str | None, str, str]]:
    """(key, status, new name if renamed, 'no warning when', notes) for every table row naming a key."""
    rows, in_key_table = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("| nanotron key |"):
            in_key_table = True
        if not line.startswith("|"):
            in_key_table = False
        if not (in_key_table and line.startswith("| `")):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        key, status, quiet, notes = cells  # a row with a stray "|" would not unpack
        match = STATUS.match(status)
        assert match, f"unknown status {status!r} in row {line!r}"
        rows.append((key.strip("`"), status.split()[0], match.group(2), quiet, notes))
    return rows


def quiet_text(quiet: tuple) -> str:
    if quiet == NO_QUIET_VALUE:
        return "never"
    return ", ".join(yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip() for v in quiet)


def table_key(pattern: str, key: str) -> str:
    return f"{pattern}.{key}" if pattern else key


def test_doc_ignored_and_renamed_rows_are_the_code_tables():
    rows = doc_rows()
    keys = [row[0] for row in rows]
    assert len(keys) == len(set(keys)), "a key is listed twice"
    ignored = {(key, quiet, notes) for key, status, _, quiet, notes in rows if status == "ignored"}
    assert ignored == {
        (table_key(pattern, key), quiet_text(i.quiet), i.reason)
        for pattern, keys in IGNORED.items()
        for key, i in keys.items()
    }
    renamed = {(key, new) for key, status, new, _, _ in rows if status == "renamed"}
    assert renamed == {
        (table_key(pattern, old), new) for pattern, names in RENAMED.items() for old, new in names.items()
    }


def test_doc_supported_rows_are_fields_nanocore_has(registries):
    optimizer, dataset = registries.optimizer, registries.dataset_format
    classes: dict[str, list[type]] = {
        "": [schema.Config],
        "general": [schema.GeneralArgs],
        "checkpoints": [schema.CheckpointsArgs],
        "parallelism": [schema.ParallelismArgs],
        "model": [schema.ModelArgs],
        "model.init_method": [schema.InitMethod],
        "model.model_config": [registries.model.get("llama").config_class],
        "tokenizer": [schema.TokenizerArgs],
        "tokens": [schema.TokensArgs],
        "optimizer": [schema.OptimizerArgs],
        "optimizer.optimizer_factory": [schema.OptimizerFactory, optimizer.get("adam_w").config_class],
        "optimizer.learning_rate_scheduler": [schema.LRSchedulerArgs],
        "data_stages[]": [schema.DatasetStageArgs],
        "data_stages[].data": [schema.DataArgs],
        "data_stages[].data.dataset": [dataset.get("hf").config_class, dataset.get("nanoset").config_class],
        "logging": [schema.LoggingArgs],
    }
    selectors = {"model.model_config": {"is_llama_config"}}  # read by the converter, not a field
    supported = [key for key, status, *_ in doc_rows() if status == "supported"]
    assert len(supported) > 80
    for key in supported:
        section, _, name = key.rpartition(".")
        fields = {f.name for cls in classes[section] for f in attrs.fields(cls)} | selectors.get(section, set())
        assert name in fields, f"{key} is documented as supported but nanocore has no such field"


def test_every_key_of_the_nanotron_example_is_in_the_doc():
    documented = {row[0] for row in doc_rows()}

    def paths(node: Any, prefix: str) -> list[str]:
        out = []
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else key
            out.append(path)
            if isinstance(value, list) and value and isinstance(value[0], dict):
                out += paths(value[0], path + "[]")
            elif isinstance(value, dict):
                out += paths(value, path)
        return out

    missing = [p for p in paths(example(), "") if p not in documented]
    assert missing == []
