"""The dummy format: random tokens that are the same wherever and whenever sample i is asked for."""

import pickle

import pytest

from nanocore_plugins.data.dummy import DummyArgs, build_dummy


def test_samples_are_deterministic_in_range_and_distinct(make_ctx):
    [(ds, weight)] = build_dummy(DummyArgs(num_samples=50), make_ctx(sequence_length=16, vocab_size=100))
    assert weight == 1.0 and len(ds) == 50
    again = pickle.loads(pickle.dumps(ds))  # another process (DataLoader worker, rank) sees the same data
    for i in (0, 7, 49):
        sample = ds[i]
        assert sample.shape == (17,) and sample.dtype.is_floating_point is False
        assert 0 <= int(sample.min()) and int(sample.max()) < 100
        assert sample.tolist() == again[i].tolist() == ds[i].tolist()
    assert ds[0].tolist() != ds[1].tolist()
    with pytest.raises(IndexError):
        ds[50]


def test_seed_and_split_change_the_data(make_ctx):
    [(a, _)] = build_dummy(None, make_ctx())
    assert len(a) == 1_000_000
    [(b, _)] = build_dummy(None, make_ctx())
    ctx = make_ctx()
    ctx.seed = 2
    [(other_seed, _)] = build_dummy(None, ctx)
    [(validation, _)] = build_dummy(None, make_ctx(split="validation"))
    assert a[3].tolist() == b[3].tolist()
    assert a[3].tolist() != other_seed[3].tolist()
    assert a[3].tolist() != validation[3].tolist()


def test_check_rejects_empty():
    assert DummyArgs(num_samples=0).check(None) == ["num_samples: must be at least 1, got 0"]
    assert DummyArgs().check(None) == []
