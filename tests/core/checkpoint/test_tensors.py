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
            write_shards(
                folder / f"rank-{k:05d}.safetensors",
                [ShardedTensor(name, piece, Placement(tuple(full.shape), (r0, c0)))],
            )
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


# -- layout padding (Placement.valid_rows): saved without it, zero-filled on load ---------------
def save_padded(folder, full, valid, parts):
    """Write `full` split over rows into `parts` files, its rows from `valid` on marked as padding."""
    for k in range(parts):
        r0, rn = shard_range(full.shape[0], parts, k)
        placement = Placement(tuple(full.shape), (r0, 0), valid_rows=valid)
        write_shards(folder / f"rank-{k:05d}.safetensors", [ShardedTensor("emb", full[r0 : r0 + rn], placement)])


def test_padding_rows_are_not_saved_and_read_back_as_zeros(tmp_path):
    real = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3) + 1
    padded = torch.cat([real, torch.full((5, 3), 99.0)])  # 7 real rows padded to 12 (e.g. tp=4, 3 rows each)
    save_padded(tmp_path, padded, 7, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank-0000{k}.safetensors" for k in range(3)]  # 4th: padding
    reader = ShardReader(tmp_path)
    assert reader.full_shape("emb") == (7, 3)
    # another layout pads to 8 rows over 2 ranks: real rows, then zeros
    for r0 in (0, 4):
        got = reader.read("emb", Placement((8, 3), (r0, 0), valid_rows=7), (4, 3))
        assert torch.equal(got, torch.cat([real, torch.zeros(1, 3)])[r0 : r0 + 4])
    assert torch.equal(reader.read("emb", Placement((7, 3), (0, 0), valid_rows=7), (7, 3)), real)  # no padding


def test_a_rectangle_entirely_in_padding_reads_zeros_of_the_saved_dtype(tmp_path):
    save_padded(tmp_path, torch.ones(6, 2, dtype=torch.bfloat16), 3, 2)
    got = ShardReader(tmp_path).read("emb", Placement((8, 2), (4, 0), valid_rows=3), (4, 2))
    assert got.dtype == torch.bfloat16 and not got.any()


def test_narrowing_keeps_the_padding_and_clips_optimizer_pieces(tmp_path):
    """ZeRO-1 narrows a parameter's placement to its rows: the padding travels with it."""
    param = Placement((8, 2), (4, 0), valid_rows=6)  # rows 4..7 of 8, of which 4 and 5 are real
    narrowed, shape = param.narrow(0, 1, 3, (4, 2))
    assert narrowed == Placement((8, 2), (5, 0), valid_rows=6) and shape == (3, 2)
    assert narrowed.real_rows(3) == 1 and narrowed.real_shape == (6, 2)
    write_shards(tmp_path / "a.safetensors", [ShardedTensor("m", torch.ones(3, 2), narrowed)])
    reader = ShardReader(tmp_path)
    assert reader.full_shape("m") == (6, 2) and reader.pieces["m"][0].shape == (1, 2)
    with pytest.raises(ValueError, match="valid_rows 9"):
        Placement((8, 2), (0, 0), valid_rows=9)


def test_an_old_padded_checkpoint_reads_its_first_real_rows(tmp_path):
    """Format version 1 saved the vocabulary padding (tp=2: 7 rows padded to 10); any layout reads it."""
    real = torch.randn(7, 3)
    save_split(tmp_path, "emb", torch.cat([real, torch.randn(3, 3)]), (2, 1))  # no valid_rows: everything saved
    reader = ShardReader(tmp_path)
    assert reader.full_shape("emb") == (10, 3)
    got = reader.read("emb", Placement((8, 3), (0, 0), valid_rows=7), (8, 3))  # tp=1 padding
    assert torch.equal(got[:7], real) and not got[7:].any()
    assert torch.equal(reader.read("emb", Placement((7, 3), (0, 0), valid_rows=7), (7, 3)), real)


def test_padding_never_hides_a_different_model(tmp_path):
    save_padded(tmp_path, torch.ones(8, 3), 7, 2)
    reader = ShardReader(tmp_path)
    with pytest.raises(NanocoreError, match=r"has shape \[7, 3\] but the model expects \[16, 3\] \(its first 9 rows"):
        reader.read("emb", Placement((16, 3), (0, 0), valid_rows=9), (16, 3))  # a larger vocabulary
    with pytest.raises(NanocoreError, match=r"expects \[8, 4\]"):
        reader.read("emb", Placement((8, 4), (0, 0), valid_rows=7), (8, 4))  # another width
    with pytest.raises(NanocoreError, match=r"expects \[8, 3\]"):
        reader.read("emb", Placement((8, 3), (0, 0)), (8, 3))  # the model says nothing about padding


def test_in_memory_tensors_read_like_a_checkpoint(tmp_path):
    """Weights converted from a Hugging Face folder hold the true vocabulary; a padded layout reads zeros past it."""
    real = torch.randn(5, 2)
    reader = ShardReader.from_tensors({"emb": real, "step": torch.tensor(3.0)}, "hf folder x")
    got = reader.read("emb", Placement((8, 2), (4, 0), valid_rows=5), (4, 2))
    assert torch.equal(got[:1], real[4:]) and not got[1:].any()
    assert reader.read("step", Placement.whole(()), ()).item() == 3.0
    with pytest.raises(NanocoreError, match="hf folder x has no tensor 'nope'"):
        reader.read("nope", Placement.whole((1,)), (1,))
