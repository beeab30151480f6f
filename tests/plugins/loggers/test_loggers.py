"""Each logger writes what a user would look at: the console, metrics.jsonl, TensorBoard, a W&B run."""

from __future__ import annotations

import json
import re
import struct
import time
from pathlib import Path

import attrs
import pytest
import torch

from nanocore.logging_api import LoggerContext
from nanocore.plugins import load_plugins
from tests.helpers.tensorboard import read_scalars


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def context(log_dir: Path, *, start_step: int = 0, total_steps: int = 4, run_id: str | None = None) -> LoggerContext:
    """A fresh run's context; a resumed one (start_step > 0) continues the run and appends."""
    config = {"general": {"project": "proj", "run": "tiny"}, "tokens": {"train_steps": total_steps}}
    return LoggerContext(
        log_dir, "proj", "tiny", None, config, start_step, total_steps, append=start_step > 0, run_id=run_id
    )


def train_row(step: int) -> dict:
    return {
        "lm_loss": 3.0 - 0.25 * step,
        "lr": 1e-3 * step,
        "grad_norm": 1.5,
        "tokens_per_sec": 12345.0,
        "tokens_per_sec_per_gpu": 6172.5,
        "consumed_tokens": 1024 * step,
        "mfu": None if step == 1 else 0.25,
    }


def make(registries, name: str, ctx: LoggerContext, **options):
    entry = registries.logger.get(name)
    opts = entry.config_class(**options) if entry.config_class is not None else None
    return entry.factory(opts, ctx)


def run(logger, steps, val_at: int | None = None) -> None:
    for step in steps:
        logger.log_metrics(step, train_row(step))
        if step == val_at:
            logger.log_metrics(step, {"val_lm_loss": 2.75})
    logger.close()


def test_registered_loggers(registries):
    assert registries.logger.names() == ["console", "jsonl", "tensorboard", "wandb"]
    for entry in registries.logger:
        for field in attrs.fields(entry.config_class) if entry.config_class else ():
            assert field.metadata.get("doc"), f"{entry.name}.{field.name} has no doc"


# -- jsonl -----------------------------------------------------------------------------------


def read_jsonl(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_writes_one_object_per_row(registries, tmp_path):
    log_dir = tmp_path / "logs" / "run1"  # created by the logger
    logger = make(registries, "jsonl", context(log_dir))
    logger.log_metrics(1, train_row(1))
    assert len(read_jsonl(log_dir)) == 1, "rows must be on disk as soon as they are logged"
    logger.log_metrics(2, {**train_row(2), "lm_loss": torch.tensor(2.5)})  # tensors become numbers
    logger.log_metrics(2, {"val_lm_loss": 2.75})
    logger.close()
    rows = read_jsonl(log_dir)
    assert rows[0] == {"step": 1, **train_row(1)}
    assert rows[1]["lm_loss"] == 2.5 and rows[1]["mfu"] == 0.25
    assert rows[2] == {"step": 2, "val_lm_loss": 2.75}
    assert list(rows[0]) == ["step", "lm_loss", "lr", "grad_norm", "tokens_per_sec", "tokens_per_sec_per_gpu",
                             "consumed_tokens", "mfu"]  # fmt: skip


def test_jsonl_resume_appends_and_keeps_every_earlier_row(registries, tmp_path):
    run(make(registries, "jsonl", context(tmp_path)), [1, 2, 3], val_at=2)
    # A crash tore the last line; the resumed launch restarts from the checkpoint at step 2.
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "lm_lo')
    run(make(registries, "jsonl", context(tmp_path, start_step=2)), [3, 4])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[4] == '{"step": 4, "lm_lo', "the torn row stays; nothing an earlier launch wrote is removed"
    rows = [json.loads(line) for i, line in enumerate(lines) if i != 4]
    assert [r["step"] for r in rows] == [1, 2, 2, 3, 3, 4]  # the crashed launch's step 3, then the resumed one
    assert rows[2] == {"step": 2, "val_lm_loss": 2.75}


def test_jsonl_fresh_run_in_an_existing_folder_starts_a_new_file(registries, tmp_path):
    run(make(registries, "jsonl", context(tmp_path)), [1, 2])
    run(make(registries, "jsonl", context(tmp_path)), [1])
    assert [r["step"] for r in read_jsonl(tmp_path)] == [1]


# -- tensorboard ------------------------------------------------------------------------------


def test_tensorboard_scalars_are_train_tags(registries, tmp_path):
    run(make(registries, "tensorboard", context(tmp_path)), [1, 2, 3], val_at=2)
    scalars = read_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {
        "train/lm_loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/tokens_per_sec_per_gpu",
        "train/consumed_tokens", "train/mfu", "train/val_lm_loss",
    }  # fmt: skip
    assert scalars["train/lm_loss"] == [(1, 2.75), (2, 2.5), (3, 2.25)]
    assert scalars["train/mfu"] == [(2, 0.25), (3, 0.25)]  # unknown at step 1: not written
    assert scalars["train/val_lm_loss"] == [(2, 2.75)]


def test_tensorboard_subdir_option(registries, tmp_path):
    run(make(registries, "tensorboard", context(tmp_path), subdir="tb"), [1])
    assert read_scalars(tmp_path / "tb")["train/lr"] == [(1, pytest.approx(1e-3))]


# -- wandb ------------------------------------------------------------------------------------


def read_wandb_records(path: Path):
    """Records of a .wandb file (a LevelDB-style log: 32 KiB blocks of crc32/length/type-framed chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a header: the block is padded
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def finished_wandb_records(path: Path, timeout: float = 60.0) -> list:
    """The records of an offline run file once wandb's service has written its last one (`exit`).

    `run.finish()` can return before the service process (wandb-core) has flushed and closed the
    file: under load CI once read a file holding only its 7-byte header. So wait for the exit record.
    """
    deadline = time.monotonic() + timeout
    while True:
        records = list(read_wandb_records(path)) if path.stat().st_size > 7 else []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            kinds = [r.WhichOneof("record_type") for r in records]
            raise AssertionError(f"{path} has no exit record after {timeout:.0f} s; records: {kinds}")
        time.sleep(0.1)


def test_wandb_offline_run_holds_config_and_history(registries, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    run(make(registries, "wandb", context(tmp_path / "logs"), tags=["smoke"]), [1, 2, 3], val_at=2)

    run_files = list((tmp_path / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    records = finished_wandb_records(run_files[0])
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs[0].project == "proj" and runs[0].display_name == "tiny"
    assert list(runs[0].tags) == ["smoke"]
    config = {i.key: json.loads(i.value_json) for i in runs[0].config.update}
    assert config["general"] == {"project": "proj", "run": "tiny"}
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.append({k: v for k, v in items.items() if not k.startswith("_")} | {"step": r.history.step.num})
    assert [(h["step"], h["lm_loss"]) for h in history] == [(1, 2.75), (2, 2.5), (3, 2.25)]
    assert history[1]["val_lm_loss"] == 2.75  # same step: merged into that step's row
    assert "mfu" not in history[0] and history[1]["mfu"] == 0.25


def test_wandb_resumed_launch_continues_the_same_run(registries, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    run(make(registries, "wandb", context(tmp_path / "logs", run_id="nc1234abcd")), [1, 2])
    run(make(registries, "wandb", context(tmp_path / "logs", start_step=2, run_id="nc1234abcd")), [3, 4])
    run_files = sorted((tmp_path / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2, run_files  # one offline file per launch, ...
    ids = set()
    for file in run_files:
        runs = [r.run for r in finished_wandb_records(file) if r.WhichOneof("record_type") == "run"]
        ids |= {r.run_id for r in runs}
    assert ids == {"nc1234abcd"}, "...both of the one W&B run the checkpoint names (wandb sync joins them)"


# -- console ----------------------------------------------------------------------------------


def test_console_plain_lines_when_not_a_terminal(registries, tmp_path, capsys):
    run(make(registries, "console", context(tmp_path, total_steps=5), every=2), [1, 2, 3, 4, 5], val_at=4)
    lines = capsys.readouterr().err.splitlines()
    train_lines = [line for line in lines if "/5 |" in line]
    assert [line.split(" |")[0] for line in train_lines] == ["step 2/5", "step 4/5", "step 5/5"]
    assert "lm_loss 2.5000" in train_lines[0] and "lr 2.000e-03" in train_lines[0]
    assert "tokens_per_sec 12.3K" in train_lines[0] and "mfu 25.0%" in train_lines[0]
    assert re.search(r"ETA \d+:\d\d", train_lines[0])
    assert "step 4 | val_lm_loss 2.7500" in lines


def test_console_progress_bar_shows_loss_and_eta(registries, tmp_path, capsys):
    logger = make(registries, "console", context(tmp_path, start_step=2, total_steps=6), progress_bar=True)
    run(logger, [3, 4], val_at=4)
    err = capsys.readouterr().err
    assert "4/6" in err  # resumed at step 2: the bar continues from there
    assert "loss=2.0000" in err and "lr=4.000e-03" in err and "tok/s=12.3K" in err
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", err), "tqdm's elapsed<remaining (ETA) must be shown"
    assert "step 4 | val_lm_loss 2.7500" in err


def test_yaml_logger_entries_become_option_objects(registries):
    from nanocore.config.converter import make_converter
    from nanocore.config.schema import LoggingArgs

    raw = {
        "loggers": [
            "console",
            "jsonl",
            {"name": "tensorboard", "subdir": "tb"},
            {"name": "wandb", "mode": "offline", "tags": ["a"]},
        ]
    }
    loggers = make_converter(registries).structure(raw, LoggingArgs).loggers
    console, jsonl, tensorboard, wandb = (spec.options for spec in loggers)
    assert console == registries.logger.get("console").config_class()  # defaults when only named
    assert jsonl is None
    assert tensorboard.subdir == "tb"
    assert (wandb.mode, wandb.tags, wandb.entity) == ("offline", ["a"], None)
    assert wandb.check(None) == []
    assert [p.split(":")[0] for p in attrs.evolve(wandb, mode="offlin").check(None)] == ["mode"]
    assert [p.split(":")[0] for p in attrs.evolve(console, every=0).check(None)] == ["every"]


def test_tensorboard_resume_hides_steps_after_the_checkpoint(registries, tmp_path):
    run(make(registries, "tensorboard", context(tmp_path)), [1, 2, 3])
    resumed_row = {**train_row(3), "lm_loss": 9.0}
    logger = make(registries, "tensorboard", context(tmp_path, start_step=2))
    logger.log_metrics(3, resumed_row)
    logger.close()
    assert read_scalars(tmp_path / "tensorboard")["train/lm_loss"] == [(1, 2.75), (2, 2.5), (3, 9.0)]


def test_tensorboard_fresh_run_replaces_an_overwritten_runs_curves(registries, tmp_path):
    run(make(registries, "tensorboard", context(tmp_path)), [1, 2, 3])
    run(make(registries, "tensorboard", context(tmp_path)), [1])  # checkpoints.overwrite: a fresh run
    assert read_scalars(tmp_path / "tensorboard")["train/lm_loss"] == [(1, 2.75)]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
