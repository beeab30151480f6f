"""The example local plugins (examples/local_plugins/csv_logger.py and jsonl_dataset.py) on a real
two-rank launch: `torchrun --nproc_per_node=2 run_train.py` with dp=2, each plugin named once through
`--plugin`, once through the YAML `plugins:` list and once through NANOCORE_PLUGINS.

The corpus is documents of one repeated letter: a model that really trains on those tokens falls far
below the loss of guessing among 257 byte tokens (ln 257 = 5.55) within three steps, which random
tokens (the default data) could never do. A broken plugin on the same launch path is one message.
The two fast tests at the end cover what a short run does not reach: a resumed csv log, bad JSONL lines."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers.launch import frames_from, own_code, torchrun
from tests.helpers.paths import EXAMPLES

LOCAL_PLUGINS = EXAMPLES / "local_plugins"
CSV_LOGGER = LOCAL_PLUGINS / "csv_logger.py"
JSONL_DATASET = LOCAL_PLUGINS / "jsonl_dataset.py"
STEPS = 3
COLUMNS = [
    "step",
    "lm_loss",
    "lr",
    "grad_norm",
    "tokens_per_sec",
    "tokens_per_sec_per_gpu",
    "consumed_tokens",
    "mfu",
    "peak_memory_mb",
    "val_lm_loss",
]


def write_corpus(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": i, "body": "a" * 60}) + "\n" for i in range(40)))
    return path


def write_config(folder: Path, corpus: Path, plugins: list[str]) -> Path:
    """A tiny LLaMA on the corpus with dp=2, logging to the csv logger only."""
    config = {
        "general": {"project": "test", "run": "local_plugins", "seed": 3},
        "parallelism": {"dp": 2},
        "model": {
            "dtype": "float32",
            "init_method": {"std": 0.02},
            "model_config": {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 257,
                "max_position_embeddings": 64,
            },
        },
        "tokenizer": {"tokenizer_name_or_path": "byte"},
        "tokens": {
            "sequence_length": 32,
            "train_steps": STEPS,
            "micro_batch_size": 2,
            "batch_accumulation_per_replica": 1,
        },
        "optimizer": {
            "learning_rate_scheduler": {"learning_rate": 0.1, "lr_warmup_steps": 0, "lr_decay_style": "constant"},
            "optimizer_factory": {"name": "adam_w", "torch_adam_is_fused": False},
        },
        "data_stages": [
            {
                "name": "letters",
                "start_training_step": 1,
                "data": {"dataset": {"format": "jsonl_documents", "path": str(corpus), "text_key": "body"}},
            }
        ],
        "checkpoints": {"checkpoints_path": str(folder / "checkpoints"), "save_final_state": False},
        "logging": {"log_dir": str(folder / "logs"), "loggers": ["csv"]},
        "plugins": plugins,
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# Each launch names the csv logger one way and the jsonl dataset another, so that over the three
# launches each plugin comes through each route, on both ranks.
LAUNCHES = {
    "csv by --plugin, jsonl by YAML": {"csv": "cli", "jsonl": "yaml"},
    "csv by YAML, jsonl by NANOCORE_PLUGINS": {"csv": "yaml", "jsonl": "env"},
    "csv by NANOCORE_PLUGINS, jsonl by --plugin": {"csv": "env", "jsonl": "cli"},
}


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_local_plugins_train_on_two_ranks(launch, tmp_path):
    routes = LAUNCHES[launch]
    conf = tmp_path / "conf"
    yaml_plugins, cli_args, env_plugins = [], [], []
    for name, source in (("csv", CSV_LOGGER), ("jsonl", JSONL_DATASET)):
        if routes[name] == "yaml":  # beside the YAML, named relative to it; the launch starts elsewhere
            (conf / "local").mkdir(parents=True, exist_ok=True)
            shutil.copy(source, conf / "local" / source.name)
            yaml_plugins.append(f"local/{source.name}")
        elif routes[name] == "cli":
            cli_args += ["--plugin", str(source)]
        else:
            env_plugins.append(str(source))
    config = write_config(conf, write_corpus(tmp_path / "letters.jsonl"), yaml_plugins)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"NANOCORE_PLUGINS": ",".join(env_plugins)} if env_plugins else {}

    result = torchrun(["--config-file", str(config), *cli_args], cwd=elsewhere, **env)
    assert result.returncode == 0, result.stderr[-4000:]

    rows_file = conf / "logs" / "metrics.csv"
    lines = rows_file.read_text().splitlines()
    assert lines[0].split(",") == COLUMNS
    rows = list(csv.DictReader(lines))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))  # rank 0 logs, once per step
    assert all(r["val_lm_loss"] == "" for r in rows)
    assert [int(r["consumed_tokens"]) for r in rows] == [4 * 32 * s for s in range(1, STEPS + 1)]  # dp 2 x mbs 2
    losses = [float(r["lm_loss"]) for r in rows]
    assert losses[0] > math.log(257) - 0.5, losses  # an untrained model guesses among 257 tokens...
    assert losses[-1] < 1.5, losses  # ...and two updates on the letter corpus take it far below that
    assert (conf / "local").exists() == ("yaml" in routes.values())
    # The dataset says what it read, once: only rank 0 logs.
    summary = re.findall(r"jsonl_documents \S+letters\.jsonl: (\d+) documents", result.stderr + result.stdout)
    assert summary == ["40"], result.stderr[-4000:]


@pytest.mark.slow
def test_broken_plugin_on_a_two_rank_launch_is_one_message(tmp_path):
    broken = tmp_path / "broken_syntax.py"
    broken.write_text("from nanocore import hookimpl\n\n\ndef register_models(registry:\n    pass\n")
    config = write_config(tmp_path / "conf", write_corpus(tmp_path / "letters.jsonl"), [])
    result = torchrun(
        ["--config-file", str(config), "--plugin", str(CSV_LOGGER), "--plugin", str(JSONL_DATASET)],
        cwd=tmp_path,
        NANOCORE_PLUGINS=str(broken),
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("nanocore: error:") == 1, output  # both ranks fail to load it; rank 0 says so
    message = output[output.index("nanocore: error:") :]
    assert message.startswith(f"nanocore: error: local plugin '{broken}' failed to import: SyntaxError")
    assert f"at {broken}:4" in message
    assert "NANOCORE_PLUGINS" in message
    # torchrun adds its own report of the failed launch; no traceback frame is nanocore's code or a plugin's
    # (told by where the frame's file is, not by its name: torchrun may live in `.../nanocore/.venv/bin`).
    assert not frames_from(output, *own_code(), LOCAL_PLUGINS, broken), output
    assert not (tmp_path / "conf" / "logs").exists()


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"under_test_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resumed_csv_log_appends_and_never_truncates(tmp_path):
    from nanocore.logging_api import LoggerContext

    m = load_module(CSV_LOGGER)

    def context(start_step: int, append: bool) -> LoggerContext:
        return LoggerContext(tmp_path, "p", "r", None, {}, start_step=start_step, total_steps=6, append=append)

    logger = m.CsvLogger(m.CsvOptions(), context(0, False))
    for step in range(1, 5):  # a run that crashed after step 4, with its last checkpoint at step 2
        logger.log_metrics(step, {"step": step, "lm_loss": 5.0 - step, "lr": 0.1})
    logger.log_metrics(4, {"step": 4, "val_lm_loss": 3.5})
    logger.close()
    with (tmp_path / "metrics.csv").open("a") as f:
        f.write("5,0.5")  # torn by the crash
    logger = m.CsvLogger(m.CsvOptions(), context(2, True))
    logger.log_metrics(3, {"step": 3, "lm_loss": 1.5, "lr": 0.1, "custom_metric": 7})
    logger.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert [(r["step"], r["lm_loss"], r["val_lm_loss"]) for r in rows] == [
        ("1", "4.0", ""),
        ("2", "3.0", ""),
        ("3", "2.0", ""),
        ("4", "1.0", ""),
        ("4", "", "3.5"),
        ("5", "0.5", None),  # the torn row stays as it was, and the next row starts on a line of its own
        ("3", "1.5", ""),
    ]
    assert list(rows[0]) == COLUMNS
    # A fresh run (its log_dir was checked empty, or overwrite was asked for) starts the file.
    logger = m.CsvLogger(m.CsvOptions(), context(0, False))
    logger.close()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [",".join(COLUMNS)]


def test_jsonl_documents_reports_bad_lines_with_file_and_line(tmp_path):
    from nanocore.data.api import DatasetContext
    from nanocore.errors import DataError
    from nanocore_plugins.tokenizers.byte import ByteTokenizer

    m = load_module(JSONL_DATASET)
    ctx = DatasetContext(tokenizer=ByteTokenizer(), sequence_length=8, vocab_size=257, seed=0, cache_dir=tmp_path)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"text": "abcdefgh"}\n\n{"title": "no text"}\n{"text": "ijklmnop"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:3 has no string under 'text'"):
        m.build_jsonl_documents(m.JsonlDocumentsArgs(path=str(corpus)), ctx)
    ((dataset, weight),) = m.build_jsonl_documents(m.JsonlDocumentsArgs(path=str(corpus), skip_missing=True), ctx)
    assert (len(dataset), weight) == (2, 1.0)  # 2 documents + 2 EOS = 18 tokens = 2 windows of 9
    assert bytes(dataset[0][:8].tolist()) == b"abcdefgh" and dataset[0][8] == 256
    corpus.write_text('{"text": "fine"}\n{"text": broken}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2 is not valid JSON"):
        m.build_jsonl_documents(m.JsonlDocumentsArgs(path=str(corpus)), ctx)
