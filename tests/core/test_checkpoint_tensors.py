"""Pieces saved at one layout are read back at any other; checkpoint folders are atomic."""

from __future__ import annotations

import pytest
import torch

from nanocore.checkpoint.folder import begin_save, finish_save, resolve_checkpoint
from nanocore.checkpoint.tensors import ShardedTensor, ShardReader, write_shards
from nanocore.errors import NanocoreError
from nanocore.sharding import Placement, shard_range


def save_split(folder, name, full, parts_per_dim):
    """Write `full` as a grid of pieces, one file per piece (like one file per rank)."""
    rows, cols = parts_per_dim
    k = 0
    for r in range(rows):
        r0, rn = shard_range(full.shape[0], rows, r)
        for c in range(cols):
            c0, cn = shard_range(full.shape[1], cols, c)
            piece = full[r0 : r0 + rn, c0 : c0 + cn]
            write_shards(folder / f"rank-{k:05d}.safetensors", [ShardedTensor(name, piece, Placement(tuple(full.shape), (r0, c0)))])
            k += 1


@pytest.mark.parametrize("saved,read", [((2, 1), (1, 1)), ((1, 1), (4, 1)), ((2, 2), (1, 3)), ((3, 1), (2, 2))])
def test_any_layout_reads_any_other(tmp_path, saved, read):
    full = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    save_split(tmp_path, "w", full, saved)
    reader = ShardReader(tmp_path)
    rows, cols = read
    for r in range(rows):
        r0, rn = shard_range(7, rows, r)
        for c in range(cols):
            c0, cn = shard_range(6, cols, c)
            got = reader.read("w", Placement((7, 6), (r0, c0)), (rn, cn))
            assert torch.equal(got, full[r0 : r0 + rn, c0 : c0 + cn])


def test_missing_piece_and_wrong_shape_are_clear_errors(tmp_path):
    full = torch.ones(4, 4)
    write_shards(tmp_path / "a.safetensors", [ShardedTensor("w", full[:2], Placement((4, 4), (0, 0)))])
    reader = ShardReader(tmp_path)
    with pytest.raises(NanocoreError, match="does not cover all of 'w'"):
        reader.read("w", Placement((4, 4), (0, 0)), (4, 4))
    with pytest.raises(NanocoreError, match="expects \\[8, 4\\]"):
        reader.read("w", Placement((8, 4), (0, 0)), (8, 4))
    with pytest.raises(NanocoreError, match="no tensor 'nope'"):
        reader.read("nope", Placement((1,), (0,)), (1,))


def test_scalars_round_trip(tmp_path):
    write_shards(tmp_path / "a.safetensors", [ShardedTensor("step", torch.tensor(5.0), Placement.whole(()))])
    assert ShardReader(tmp_path).read("step", Placement.whole(()), ()).item() == 5.0


def test_a_crash_mid_save_leaves_the_last_checkpoint_intact(tmp_path):
    def save(step):
        tmp = begin_save(tmp_path, step, True, lambda: None)
        (tmp / "meta.json").write_text("{}")
        return tmp

    save(2)
    finish_save(tmp_path, 2, True, lambda: None)
    half = save(4)  # crash before finish_save: never renamed, latest untouched
    assert resolve_checkpoint(tmp_path) == tmp_path / "2"
    assert half.name.startswith(".tmp")
    save(4)  # the next attempt cleans the half-written folder
    finish_save(tmp_path, 4, True, lambda: None)
    assert resolve_checkpoint(tmp_path) == tmp_path / "4"
    assert not (tmp_path / ".tmp-4").exists()


def test_resolve_reports_bad_paths(tmp_path):
    with pytest.raises(NanocoreError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(NanocoreError, match="neither a checkpoint step folder"):
        resolve_checkpoint(tmp_path)
