"""The spike guard's judgement (nanocore/spike_guard.py) on its own: what it rejects, from when, and
what it keeps across a resume. Training with it: tests/e2e/test_skip_spikes.py."""

from __future__ import annotations

import math

import pytest

from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.config.schema import SkipSpikesArgs
from nanocore.errors import ConfigError
from nanocore.plugins import load_plugins
from nanocore.spike_guard import SpikeGuard
from tests.helpers.training import tiny_config


def warmed(**args) -> SpikeGuard:
    """A guard that has accepted 10 steps of a noisy, falling loss (sd ~0.06) and norm (sd ~0.03)."""
    guard = SpikeGuard(SkipSpikesArgs(enabled=True, min_history=10, **args))
    for i in range(10):
        assert guard.accept(4.0 - 0.02 * i + 0.05 * (-1) ** i, 1.0 + 0.03 * (-1) ** i)
    return guard


def test_non_finite_values_are_rejected_from_the_first_step():
    guard = SpikeGuard(SkipSpikesArgs(enabled=True))
    assert not guard.accept(math.nan, math.nan)
    assert not guard.accept(3.0, math.inf)
    assert "not finite" in guard.last.reason
    assert guard.skipped == 2 and guard.consecutive == 2


def test_a_spike_in_loss_or_norm_is_rejected_and_ordinary_noise_is_not():
    guard = warmed()
    assert guard.accept(4.1, 1.05)  # within 6 sd
    assert not guard.accept(5.0, 1.0)  # the loss ~15 sd above the mean of the last ten
    assert guard.last.reason.startswith("loss spike: 5 > ")
    assert not guard.accept(3.8, 2.0)
    assert guard.last.reason.startswith("gradient norm spike: 2 > ")
    assert guard.consecutive == 2
    assert guard.accept(3.8, 1.0) and guard.consecutive == 0 and guard.skipped == 2


def test_spikes_are_not_judged_before_min_history_steps():
    guard = SpikeGuard(SkipSpikesArgs(enabled=True, min_history=5))
    for loss in (10.0, 7.0, 5.0, 4.5, 50.0):  # early training falls fast: nothing to judge by yet
        assert guard.accept(loss, 1.0)
    assert not guard.accept(500.0, 1.0)


def test_rejected_steps_do_not_enter_the_window_and_max_consecutive_exhausts():
    guard = warmed(max_consecutive=3)
    before = list(guard.losses)
    for _ in range(2):
        assert not guard.accept(40.0, 1.0)
        assert not guard.exhausted
    assert list(guard.losses) == before
    assert not guard.accept(40.0, 1.0) and guard.exhausted


def test_a_resumed_guard_judges_like_the_one_that_saved():
    guard = warmed()
    guard.accept(math.nan, math.nan)
    again = SpikeGuard(SkipSpikesArgs(enabled=True, min_history=10))
    again.load_state_dict(guard.state_dict())
    assert (again.skipped, again.consecutive, list(again.losses)) == (1, 1, list(guard.losses))
    for values in ((4.1, 1.05), (5.0, 1.0), (3.8, 2.0)):
        assert again.accept(*values) == guard.accept(*values)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("sigmas", 0, "optimizer.skip_spikes.sigmas: must be positive, got 0"),
        ("window", 1, "optimizer.skip_spikes.window: must be at least 2, got 1"),
        ("min_history", 200, "optimizer.skip_spikes.min_history: must be between 2 and window (100), got 200"),
        ("max_consecutive", 0, "optimizer.skip_spikes.max_consecutive: must be at least 1, got 0"),
    ],
)
def test_bad_settings_are_refused_with_their_yaml_path(tmp_path, field, value, message):
    registries = load_plugins().registries
    raw = tiny_config(tmp_path, optimizer={"skip_spikes": {"enabled": True, field: value}})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(structure_config(raw, registries), registries, world_size=1)
