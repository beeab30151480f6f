"""Global batches are independent of how they are split, mixtures follow their weights, stages switch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanocore.data.mixture import Mixture
from nanocore.data.schedule import DataSchedule
from nanocore.errors import DataError


class Numbered:
    """Sample i is [tag, i, i, ...] so tests can see where every sample came from."""

    def __init__(self, tag: int, size: int, length: int = 5):
        self.tag, self.size, self.length = tag, size, length

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return torch.tensor([self.tag] + [i] * (self.length - 1))


def schedule(dp_rank, dp_size, mbs, global_batch, stages=((1, 0),)):
    mixtures = {i: Mixture([(Numbered(tag, 100), 1.0)], seed=3) for i, (_, tag) in enumerate(stages)}
    return DataSchedule(
        [f"s{i}" for i in range(len(stages))],
        [start for start, _ in stages],
        lambda i: mixtures[i],
        global_batch_size=global_batch,
        micro_batch_size=mbs,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def global_batch(dp_size, mbs, global_size, step_count=3):
    """Every rank's micro-batches for each step, concatenated in rank order."""
    ranks = [schedule(r, dp_size, mbs, global_size) for r in range(dp_size)]
    steps = []
    for step in range(1, step_count + 1):
        rows = [torch.cat(s.next_batch(step)) for s in ranks]
        steps.append(torch.cat(rows))
    return steps


@pytest.mark.parametrize("dp,mbs", [(2, 1), (2, 2), (4, 1), (1, 4), (1, 1)])
def test_global_batch_is_the_same_samples_for_any_split(dp, mbs):
    reference = global_batch(1, 8, 8)
    for got, want in zip(global_batch(dp, mbs, 8), reference, strict=True):
        assert torch.equal(got, want)


def test_consecutive_steps_take_fresh_samples_and_epochs_reshuffle():
    batches = global_batch(1, 10, 10, step_count=20)  # 200 samples: two epochs of 100
    first_epoch = torch.cat(batches[:10])[:, 1]
    second_epoch = torch.cat(batches[10:])[:, 1]
    assert sorted(first_epoch.tolist()) == list(range(100))
    assert sorted(second_epoch.tolist()) == list(range(100))
    assert not torch.equal(first_epoch, second_epoch)


def test_mixture_follows_weights_exactly_and_deterministically():
    mixture = Mixture([(Numbered(0, 1000), 3.0), (Numbered(1, 1000), 1.0)], seed=5)
    tags = np.array([int(mixture[i][0]) for i in range(4000)])
    assert (tags == 0).sum() == 3000
    for n in (4, 40, 400):  # every prefix is as close to 3:1 as integers allow
        assert abs((tags[:n] == 0).sum() - 0.75 * n) <= 1
    again = Mixture([(Numbered(0, 1000), 3.0), (Numbered(1, 1000), 1.0)], seed=5)
    assert all(torch.equal(again[i], mixture[i]) for i in (0, 17, 3999, 150_000))


def test_stages_switch_at_their_start_step_and_keep_their_own_position():
    s = schedule(0, 1, 2, 2, stages=((1, 0), (3, 1)))
    tags = [int(s.next_batch(step)[0][0, 0]) for step in range(1, 6)]
    assert tags == [0, 0, 1, 1, 1]
    assert s.state_dict() == {"consumed_samples": {"s0": 4, "s1": 6}}
    resumed = schedule(0, 1, 2, 2, stages=((1, 0), (3, 1)))
    resumed.load_state_dict(s.state_dict())
    assert torch.equal(resumed.next_batch(6)[0], s.next_batch(6)[0])


def test_an_empty_dataset_is_a_clear_error():
    with pytest.raises(DataError, match="fewer tokens than sequence_length"):
        Mixture([(Numbered(0, 0), 1.0)], seed=1)
