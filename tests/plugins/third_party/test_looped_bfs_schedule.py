"""The nanocore-looped-bfs schedule on paper: action lists, message order, simulator bubble, checks, CLI."""

from __future__ import annotations

import pytest

from nanocore.commands import cli
from nanocore.config.schema import Config, ModelArgs, ParallelismArgs, TokensArgs
from nanocore.pipeline_api import Action, ScheduleError
from nanocore.pipeline_sim import simulate
from nanocore.plugins import load_plugins
from tests.helpers.schedules import message_orders
from tests.helpers.third_party import require

LAYOUTS = [(p, m, v) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 6, 8) for v in (1, 2, 3)]


def schedule():
    """The schedule as the engine gets it: through the pp_engine registry, from the installed package."""
    require("nanocore-looped-bfs")
    return load_plugins().registries.pipeline_schedule.get("looped_bfs").factory(None)


def test_breadth_first_order_forward_by_chunk_then_backward_in_reverse():
    actions = [str(a) for a in schedule().actions(2, 1, 3, 2)]
    # str(Action): F<microbatch>.<chunk>, chunk 0 unprinted
    assert actions == ["F0", "F1", "F2", "F0.1", "F1.1", "F2.1", "B0.1", "B1.1", "B2.1", "B0", "B1", "B2"]


@pytest.mark.parametrize("p,m,v", LAYOUTS)
def test_each_direction_is_received_in_the_order_it_is_sent(p, m, v):
    """NCCL matches point-to-point messages in posting order (see tests/plugins/schedules/test_message_order.py)."""
    sent, received = message_orders(schedule(), p, m, v)
    assert sent.keys() == received.keys()
    for key in sent:
        assert sent[key] == received[key], (
            f"looped_bfs pp={p} m={m} v={v}: {key} sent {sent[key]} received {received[key]}"
        )


@pytest.mark.parametrize("p,m,v", LAYOUTS)
def test_simulated_bubble_equals_the_derived_formula(p, m, v):
    """bubble = 1 - v*m / (v*max(m, p) + min(m, p) - 1), whatever the forward/backward cost ratio."""
    s = schedule()
    expected = 1 - v * m / (v * max(m, p) + min(m, p) - 1)
    assert s.theoretical_bubble(p, m, v) == pytest.approx(expected, abs=1e-12)
    for t_forward, t_backward in ((1.0, 2.0), (1.0, 1.0), (3.0, 2.0)):
        result = simulate(s, p, m, v, t_forward=t_forward, t_backward=t_backward)  # raises on a deadlock
        assert result.bubble_fraction == pytest.approx(expected, abs=1e-9)
    assert result.peak_in_flight == [m * v] * p  # breadth first holds every chunk activation, like AFAB


def test_bubble_equals_interleaved_1f1b_when_microbatches_reach_pp():
    s = schedule()
    for p, m, v in [(4, 8, 2), (8, 8, 4), (2, 64, 3)]:
        assert s.theoretical_bubble(p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))


def test_schedule_check_refuses_values_below_one():
    with pytest.raises(ScheduleError, match="parallelism.pp_virtual_stages: pp_engine looped_bfs needs at least 1"):
        schedule().actions(2, 0, 4, 0)


def _config(pp: int, m: int, v: int, engine: str = "looped_bfs") -> Config:
    return Config(
        model=ModelArgs(model_config=None),
        parallelism=ParallelismArgs(pp=pp, pp_engine=engine, pp_virtual_stages=v),
        tokens=TokensArgs(batch_accumulation_per_replica=m),
    )


def test_registry_check_accepts_layouts_interleaved_refuses():
    require("nanocore-looped-bfs")
    registry = load_plugins().registries.pipeline_schedule
    check = registry.get("looped_bfs").extras["check"]
    assert check(_config(4, 3, 2), None) == []  # 3 microbatches: not a multiple of pp
    assert check(_config(2, 4, 1), None) == []
    assert registry.get("interleaved").extras["check"](_config(4, 3, 2, "interleaved"), None)


def test_pipeline_sim_command_reports_the_bubble_and_its_formula(capsys):
    require("nanocore-looped-bfs")
    code = cli.run(
        [
            "pipeline-sim",
            "--engine",
            "looped_bfs",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--virtual-stages",
            "2",
            "--timeline",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bubble fraction 0.157895  (theory 1 - v*m/(v*max(m,p)+min(m,p)-1) = 0.157895)" in out
    assert "rank 0: 8 microbatches (16 chunk activations)" in out
    assert "rank 3 |...abcdefghabcdefghAABBCCDDEEFFGGHHAABBCCDDEEFFGGHH......|" in out


def test_action_lists_cover_every_forward_and_backward_once():
    s = schedule()
    for p, m, v in LAYOUTS:
        for rank in range(p):
            actions = s.actions(p, rank, m, v)
            expected = {Action(k, c, mb) for k in "FB" for c in range(v) for mb in range(m)}
            assert len(actions) == len(expected) and set(actions) == expected
