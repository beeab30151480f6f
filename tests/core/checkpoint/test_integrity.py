"""Checkpoint integrity: the manifest written at save, its verification on load (one message naming
the file and the previous checkpoint), durable saves, full disks and unwritable folders,
`checkpoints.keep_last_n`."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nanocore.checkpoint.folder import (
    LATEST,
    CheckpointError,
    begin_save,
    finish_save,
    resolve_checkpoint,
    save_rng,
    write_json,
)
from nanocore.checkpoint.manifest import MANIFEST, describe
from nanocore.checkpoint.tensors import ShardedTensor, write_shards
from nanocore.checkpoint.verify import verify_checkpoint, verify_for_resume
from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.errors import ConfigError
from nanocore.plugins import load_plugins
from nanocore.sharding import Placement
from tests.helpers.training import tiny_config

RANKS = 2
WEIGHTS = "model/rank-00000.safetensors"


def noop() -> None:
    pass


def save(root: Path, step: int, *, ranks: int = RANKS, keep_last_n: int | None = None) -> Path:
    """A small checkpoint as `ranks` ranks write it: weights split by rows, AdamW-like state, RNG."""
    tmp = begin_save(root, step, True, noop)
    full = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6) + step
    rows = 64 // ranks
    for rank in range(ranks):
        place = Placement((64, 6), (rank * rows, 0))
        piece = full[rank * rows : (rank + 1) * rows]
        write_shards(tmp / "model" / f"rank-{rank:05d}.safetensors", [ShardedTensor("w", piece, place)])
        state = [
            ShardedTensor("w::exp_avg", piece * 0.1, place),
            ShardedTensor("w::step", torch.tensor(float(step)), Placement.whole(())),
        ]
        write_shards(tmp / "optimizer" / f"rank-{rank:05d}.safetensors", state)
        save_rng(tmp, rank)
    meta = {
        "step": step,
        "consumed_tokens": 64 * step,
        "topology": {"dp": 1, "tp": 1, "pp": ranks, "world_size": ranks},
        "data": {"consumed_samples": {}},
        "lr_scheduler": {"step": step},
    }
    write_json(tmp / "meta.json", meta)
    (tmp / "config.yaml").write_text("general:\n  seed: 1\n")
    for rank in range(1, ranks):  # the other ranks seal their files, then rank 0 finishes
        finish_save(root, step, False, noop, rank=rank)
    return finish_save(root, step, True, noop, rank=0, keep_last_n=keep_last_n)


@pytest.fixture
def two_steps(tmp_path) -> Path:
    """A checkpoints folder with complete steps 1 and 2; returns step 2's folder."""
    save(tmp_path, 1)
    return save(tmp_path, 2)


def resume(folder: Path, load_optimizer: bool = True) -> dict:
    return verify_for_resume(
        folder, rank=0, world_size=1, gather=lambda verdict: [verdict], load_optimizer=load_optimizer
    )


def damaged(folder: Path, file: str, load_optimizer: bool = True) -> str:
    """The one message a resume from `folder` gives; it names `file` and the previous checkpoint."""
    with pytest.raises(CheckpointError) as info:
        resume(folder, load_optimizer)
    message = str(info.value)
    assert file in message, message
    assert f"checkpoints.resume_checkpoint_path: {folder.parent / '1'}" in message, message
    assert "\n" not in message
    return message


# -- the manifest ------------------------------------------------------------------------------
def test_manifest_lists_every_file_of_every_rank_with_size_and_checksum(two_steps):
    manifest = json.loads((two_steps / MANIFEST).read_text())
    on_disk = sorted(p.relative_to(two_steps).as_posix() for p in two_steps.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [name for name in on_disk if name != MANIFEST]
    assert {
        f"{kind}/rank-{r:05d}.{ext}" for kind, ext in [("model", "safetensors"), ("rng", "pt")] for r in (0, 1)
    } <= set(manifest["files"])
    for name, entry in manifest["files"].items():
        assert entry == describe(two_steps / name)
    assert manifest["checksum"] == "crc32" and manifest["step"] == 2
    assert not (two_steps / ".manifest-parts").exists()
    report = verify_checkpoint(two_steps)
    assert report.has_manifest and report.meta.step == 2


# -- each kind of damage is one message naming the file and the previous checkpoint ------------------
def test_truncated_weights(two_steps):
    path = two_steps / WEIGHTS
    os.truncate(path, path.stat().st_size // 2)
    assert "truncated" in damaged(two_steps, WEIGHTS)


def test_zeroed_bytes_inside_weights(two_steps):
    path = two_steps / WEIGHTS
    data = bytearray(path.read_bytes())
    before = bytes(data)
    data[-300:-200] = bytes(100)  # inside the tensor data (768 bytes, after the header)
    assert data != before and len(data) == len(before)
    path.write_bytes(bytes(data))
    assert "does not match its checksum" in damaged(two_steps, WEIGHTS)


def test_meta_json_that_is_not_json(two_steps):
    (two_steps / "meta.json").write_text("{ not json")
    damaged(two_steps, "meta.json")


def test_missing_optimizer_file_is_an_error_unless_load_optimizer_is_false(two_steps):
    (two_steps / "optimizer" / "rank-00001.safetensors").unlink()
    message = damaged(two_steps, "optimizer/rank-00001.safetensors is missing")
    assert "checkpoints.load_optimizer: false" in message
    assert resume(two_steps, load_optimizer=False).step == 2  # the moments restart, knowingly


def test_missing_rng_file(two_steps):
    (two_steps / "rng" / "rank-00001.pt").unlink()
    damaged(two_steps, "rng/rank-00001.pt is missing")


def test_invalid_manifest(two_steps):
    (two_steps / MANIFEST).write_text("[1, 2")
    damaged(two_steps, "manifest.json is not valid JSON")


def test_ranks_share_the_checksums_and_all_raise_the_lowest_ranks_verdict(two_steps):
    """Two ranks each hash half the files; the rank that finds the damage decides what both say."""
    files = sorted(json.loads((two_steps / MANIFEST).read_text())["files"])
    with (two_steps / "config.yaml").open("r+b") as f:  # same size, other bytes
        f.seek(0)
        f.write(b"#")
    owner = files.index("config.yaml") % 2
    verdicts = {}
    for rank in (0, 1):
        try:
            verify_checkpoint(two_steps, share=(rank, 2))
            verdicts[rank] = None
        except CheckpointError as exc:
            verdicts[rank] = str(exc)
    assert verdicts[1 - owner] is None, "the other rank does not hash config.yaml"
    assert "config.yaml does not match its checksum" in verdicts[owner]
    for rank in (0, 1):  # what each rank raises, given both verdicts
        with pytest.raises(CheckpointError) as info:
            verify_for_resume(two_steps, rank=rank, world_size=2, gather=lambda _: [verdicts[0], verdicts[1]],
                              load_optimizer=True)  # fmt: skip
        assert str(info.value) == verdicts[owner]


def test_no_previous_checkpoint_says_so(tmp_path):
    folder = save(tmp_path, 1)
    (folder / WEIGHTS).write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"no earlier complete checkpoint in {re.escape(str(tmp_path))}"):
        resume(folder)


def test_the_previous_checkpoint_named_is_a_complete_one(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    folder = save(tmp_path, 3)
    os.truncate(tmp_path / "2" / WEIGHTS, 10)  # 2 is damaged too: 1 is the way on
    (folder / "meta.json").unlink()
    message = str(pytest.raises(CheckpointError, resume, folder).value)
    assert f"resume_checkpoint_path: {tmp_path / '1'}" in message


def test_latest_pointing_to_a_missing_folder_names_the_previous_checkpoint(two_steps):
    root = two_steps.parent
    (root / LATEST).write_text("7\n")
    with pytest.raises(CheckpointError, match=f"points to step '7'.*resume_checkpoint_path: {two_steps}"):
        resolve_checkpoint(root)


# -- checkpoints written before manifests ----------------------------------------------------------
def test_a_checkpoint_without_manifest_still_loads(two_steps, caplog):
    (two_steps / MANIFEST).unlink()
    with caplog.at_level(logging.INFO, logger="nanocore"):
        assert resume(two_steps).step == 2
    assert "written before checkpoints had a manifest" in caplog.text


def test_an_old_checkpoint_is_still_parsed(two_steps):
    (two_steps / MANIFEST).unlink()
    os.truncate(two_steps / WEIGHTS, 5)
    assert "is not a readable safetensors file" in damaged(two_steps, WEIGHTS)


def test_an_old_checkpoint_missing_a_rank_is_not_covered(two_steps):
    (two_steps / MANIFEST).unlink()
    (two_steps / "model" / "rank-00001.safetensors").unlink()
    assert "does not cover all of tensor 'w'" in damaged(two_steps, "model/")


def test_an_old_checkpoint_without_optimizer_state_is_an_error(two_steps):
    (two_steps / MANIFEST).unlink()
    for path in (two_steps / "optimizer").iterdir():
        path.unlink()
    assert "checkpoints.load_optimizer: false" in damaged(two_steps, "optimizer/ holds no optimizer state")


# -- durability --------------------------------------------------------------------------------
def test_every_file_and_folder_is_synced_before_the_rename_and_latest(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def record_replace(src, dst):
        events.append(("replace", f"{src} -> {dst}"))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    save(tmp_path, 1)
    rename = events.index(("replace", f"{tmp_path / '.tmp-1'} -> {tmp_path / '1'}"))
    synced_before = {path for kind, path in events[:rename] if kind == "fsync"}
    final = tmp_path / "1"
    for path in [final, *final.rglob("*")]:
        assert str(path).replace(str(final), str(tmp_path / ".tmp-1")) in synced_before, path
    after = events[rename + 1 :]
    assert after[0] == ("fsync", str(tmp_path))  # the rename itself
    latest = after.index(("replace", f"{tmp_path / '.latest.txt.tmp'} -> {tmp_path / LATEST}"))
    assert ("fsync", str(tmp_path / ".latest.txt.tmp")) in after[:latest]
    assert after[latest + 1] == ("fsync", str(tmp_path))


# -- a full disk, an unwritable folder ------------------------------------------------------------
FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    import torch
    from nanocore.checkpoint.folder import CheckpointError, begin_save, finish_save
    from nanocore.checkpoint.tensors import ShardedTensor, write_shards
    from nanocore.sharding import Placement

    root = Path(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    tmp = begin_save(root, 2, True, lambda: None)
    failure = None
    try:  # as Trainer.save_checkpoint does
        big = torch.zeros(4096)
        write_shards(tmp / "model" / "rank-00000.safetensors", [ShardedTensor("w", big, Placement.whole((4096,)))])
    except Exception as exc:
        failure = exc
    try:
        finish_save(root, 2, True, lambda: None, failure=failure)
    except CheckpointError as exc:
        print(exc)
        sys.exit(3)
    """
)


def test_a_full_disk_is_one_message_and_leaves_the_last_checkpoint(tmp_path):
    first = save(tmp_path, 1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    message = result.stdout.strip()
    assert f"could not save the checkpoint of step 2 in {tmp_path}" in message
    assert "File too large" in message and "Traceback" not in result.stderr
    assert f"the last good checkpoint ({first})" in message
    assert not (tmp_path / ".tmp-2").exists() and not (tmp_path / "2").exists()
    assert (tmp_path / LATEST).read_text().strip() == "1"
    verify_checkpoint(first)


def test_a_folder_under_a_file_is_one_message(tmp_path):
    (tmp_path / "file").write_text("")
    root = tmp_path / "file" / "checkpoints"
    with pytest.raises(
        CheckpointError, match=f"could not save the checkpoint of step 1 in {re.escape(str(root))}: .*Not a directory"
    ):
        save(root, 1)


def test_a_read_only_folder_is_one_message_and_leaves_the_last_checkpoint(tmp_path):
    first = save(tmp_path, 1)
    tmp_path.chmod(0o500)
    try:
        probe = tmp_path / "probe"
        try:
            probe.mkdir()
        except PermissionError:
            pass
        else:
            probe.rmdir()
            pytest.skip("this user writes into read-only folders (root): see test_a_folder_under_a_file_is_one_message")
        with pytest.raises(CheckpointError, match=f"step 2 in {re.escape(str(tmp_path))}: .*Permission denied") as info:
            save(tmp_path, 2)
        assert f"the last good checkpoint ({first})" in str(info.value)
    finally:
        tmp_path.chmod(0o700)
    assert (tmp_path / LATEST).read_text().strip() == "1"
    verify_checkpoint(first)


# -- checkpoints.keep_last_n ----------------------------------------------------------------------
def steps(root: Path) -> list[str]:
    return sorted((p.name for p in root.iterdir() if p.name.isdigit()), key=int)


def test_keep_last_n_removes_older_step_folders(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step, keep_last_n=2)
    assert steps(tmp_path) == ["4", "5"]
    assert (tmp_path / LATEST).read_text().strip() == "5"
    assert not list(tmp_path.glob(".*"))  # no temporary or half-removed folders left


def test_keep_last_n_leaves_later_steps_of_an_earlier_resume_alone(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step)
    save(tmp_path, 3, keep_last_n=2)  # resumed from 2, saved 3 again: 4 and 5 are the old run's future
    assert steps(tmp_path) == ["2", "3", "4", "5"]
    assert (tmp_path / LATEST).read_text().strip() == "3"


@pytest.mark.parametrize("value", [0, -1])
def test_keep_last_n_must_be_positive(tmp_path, value):
    plugins = load_plugins()
    config = structure_config(tiny_config(tmp_path, checkpoints={"keep_last_n": value}), plugins.registries)
    with pytest.raises(ConfigError, match=f"checkpoints.keep_last_n: must be at least 1, .*got {value}"):
        check_config(config, plugins.registries)
