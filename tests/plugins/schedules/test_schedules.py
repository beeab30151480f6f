"""Pipeline schedules as data: completeness, bubble vs theory, memory, deadlocks, config checks, CLI."""

from __future__ import annotations

import argparse
import importlib.metadata

import pytest

from nanocore.commands import pipeline_sim
from nanocore.config.schema import Config, ModelArgs, ParallelismArgs, TokensArgs
from nanocore.pipeline_api import Action, ScheduleError, stage_of
from nanocore.pipeline_sim import render_timeline, simulate
from nanocore.plugins import PluginSet
from nanocore_plugins.schedules import plugin as schedules_plugin
from nanocore_plugins.schedules.afab import AllForwardAllBackwardSchedule
from nanocore_plugins.schedules.interleaved import InterleavedOneFOneBSchedule
from nanocore_plugins.schedules.one_f_one_b import OneFOneBSchedule
from nanocore_plugins.schedules.zero_bubble import ZeroBubbleH1Schedule, ZeroBubbleVSchedule

AFAB, ONE_F_ONE_B, INTERLEAVED = AllForwardAllBackwardSchedule(), OneFOneBSchedule(), InterleavedOneFOneBSchedule()
ZB1P, ZBV = ZeroBubbleH1Schedule(), ZeroBubbleVSchedule()

LAYOUTS = [  # (schedule, pp, microbatches, virtual stages)
    *[(s, p, m, 1) for s in (AFAB, ONE_F_ONE_B) for p in (1, 2, 4) for m in (1, 3, 4, 8)],
    *[(INTERLEAVED, p, m, v) for p in (1, 2, 4) for m in (p, 2 * p, 3 * p) for v in (2, 3)],
]


def _registries():
    plugins = PluginSet()
    plugins.register_object(schedules_plugin, "schedules")
    return plugins.registries


def _config(pp: int, microbatches: int, virtual_stages: int, engine: str = "1f1b") -> Config:
    return Config(
        model=ModelArgs(model_config=None),
        parallelism=ParallelismArgs(pp=pp, pp_engine=engine, pp_virtual_stages=virtual_stages),
        tokens=TokensArgs(batch_accumulation_per_replica=microbatches),
    )


@pytest.mark.parametrize("schedule,p,m,v", LAYOUTS, ids=lambda x: getattr(x, "name", str(x)))
def test_every_rank_runs_each_forward_and_backward_once_forward_first(schedule, p, m, v):
    for rank in range(p):
        actions = schedule.actions(p, rank, m, v)
        expected = {Action(k, c, mb) for k in "FB" for c in range(v) for mb in range(m)}
        assert len(actions) == len(expected) and set(actions) == expected
        assert all(
            actions.index(Action("F", c, mb)) < actions.index(Action("B", c, mb)) for c in range(v) for mb in range(m)
        )


def test_afab_runs_backwards_in_forward_order_like_nanotron():
    assert [str(a) for a in AFAB.actions(2, 0, 3, 1)] == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_1f1b_has_warmup_steady_and_cooldown_phases():
    assert [str(a) for a in ONE_F_ONE_B.actions(4, 1, 4, 1)] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert [str(a) for a in ONE_F_ONE_B.actions(1, 0, 2, 1)] == ["F0", "B0", "F1", "B1"]


def test_interleaved_walks_chunks_in_groups_of_pp_microbatches():
    # pp=2, v=2, rank 1: warmup (v-1)*pp = 2 forwards of chunk 0, then chunk 1 of the same group
    got = [str(a) for a in INTERLEAVED.actions(2, 1, 4, 2)]
    assert got[:4] == ["F0", "F1", "F0.1", "B0.1"]
    # with one rank, chunk c is virtual stage c: F of chunk 0 then chunk 1, backwards in reverse
    assert [str(a) for a in INTERLEAVED.actions(1, 0, 1, 2)] == ["F0", "F0.1", "B0.1", "B0"]


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8)])
@pytest.mark.parametrize("schedule", [AFAB, ONE_F_ONE_B], ids=lambda s: s.name)
def test_simulated_bubble_of_afab_and_1f1b_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    result = simulate(schedule, p, m, 1)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert result.makespan == pytest.approx((m + p - 1) * 3.0)
    assert result.busy == [pytest.approx(3.0 * m)] * p


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_simulated_bubble_of_interleaved_shrinks_by_the_virtual_stages(p, m):
    result = simulate(INTERLEAVED, p, m, 2)
    assert result.bubble_fraction == pytest.approx((p - 1) / (2 * m + p - 1), abs=1e-9)
    assert result.busy == [pytest.approx(3.0 * m)] * p  # chunks take 1/v of a rank's time each


@pytest.mark.parametrize(
    "schedule,v", [(AFAB, 1), (ONE_F_ONE_B, 1), (INTERLEAVED, 3)], ids=["afab", "1f1b", "interleaved"]
)
def test_a_single_rank_has_no_bubble(schedule, v):
    assert simulate(schedule, 1, 5, v).bubble_fraction == pytest.approx(0.0, abs=1e-12)


def test_bubble_matches_theory_at_large_scale():
    result = simulate(ONE_F_ONE_B, 64, 512, 1)
    assert result.bubble_fraction == pytest.approx(63 / (512 + 63), abs=1e-9)
    result = simulate(INTERLEAVED, 32, 128, 4)
    assert result.bubble_fraction == pytest.approx(31 / (4 * 128 + 31), abs=1e-9)


def test_peak_in_flight_activations_per_schedule():
    p, m = 4, 8
    assert simulate(AFAB, p, m, 1).peak_in_flight == [m] * p
    assert simulate(ONE_F_ONE_B, p, m, 1).peak_in_flight == [4, 3, 2, 1]
    assert simulate(ONE_F_ONE_B, p, 2, 1).peak_in_flight == [2, 2, 2, 1]  # fewer microbatches than ranks
    v = 2
    result = simulate(INTERLEAVED, p, m, v)
    warmup = [min((p - r - 1) * 2 + (v - 1) * p, m * v) for r in range(p)]
    assert result.peak_in_flight == [min(w + 1, m * v) for w in warmup] == [11, 9, 7, 5]
    assert result.peak_in_flight_microbatches == [5.5, 4.5, 3.5, 2.5]


def test_a_schedule_with_a_cross_rank_cycle_is_reported_as_a_deadlock():
    # rank 0 waits for rank 1's B0 before it sends F1; rank 1 insists on F1 before F0
    lists = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
        [Action("F", 0, 1), Action("F", 0, 0), Action("B", 0, 0), Action("B", 0, 1)],
    ]
    with pytest.raises(ScheduleError, match="deadlock") as info:
        simulate(lists, 2, 2, 1)
    message = str(info.value)
    assert "rank 0 is stuck at action #1 B0" in message
    assert "rank 1 is stuck at action #0 F1" in message


def test_a_backward_before_its_own_forward_is_reported_as_a_deadlock():
    lists = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("B", 0, 0), Action("F", 0, 0)]]
    with pytest.raises(ScheduleError, match="rank 1 is stuck at action #0 B0.*comes later in its own list"):
        simulate(lists, 2, 1, 1)


def test_incomplete_or_repeated_action_lists_are_rejected_by_name():
    with pytest.raises(ScheduleError, match="rank 1 never runs B0"):
        simulate([[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 0, 0)]], 2, 1, 1)
    with pytest.raises(ScheduleError, match="rank 0 runs F0 .* twice"):
        simulate([[Action("F", 0, 0), Action("F", 0, 0), Action("B", 0, 0)]], 1, 1, 1)


def test_timeline_picture_shows_forwards_backwards_and_idle_time():
    picture = render_timeline(simulate(ONE_F_ONE_B, 2, 2, 1)).splitlines()
    assert picture[:2] == ["rank 0 |ab..AA.BB|", "rank 1 |.aAAbBB..|"]


def test_registered_schedules_check_the_config_layout():
    registries = _registries()
    assert set(registries.pipeline_schedule.names()) == {"afab", "1f1b", "interleaved", "zb1p", "zbv"}

    def check(engine, pp, m, v):
        return registries.pipeline_schedule.get(engine).extras["check"](_config(pp, m, v, engine), None)

    assert check("interleaved", 4, 6, 2) == [
        "tokens.batch_accumulation_per_replica: the interleaved schedule needs a multiple of pp (4) microbatches, got 6"
    ]
    assert check("interleaved", 2, 4, 1)[0].startswith(
        "parallelism.pp_virtual_stages: the interleaved schedule needs at least 2 virtual stages"
    )
    for engine in ("afab", "1f1b"):
        assert check(engine, 2, 4, 2)[0].startswith(
            "parallelism.pp_virtual_stages: afab/1f1b run one chunk per rank; use pp_engine: interleaved for "
            "pp_virtual_stages=2"
        )
        assert check(engine, 4, 3, 1) == []
    assert check("interleaved", 4, 8, 2) == []
    schedule = registries.pipeline_schedule.get("interleaved").factory(_config(4, 8, 2, "interleaved"))
    assert schedule.name == "interleaved"
    with pytest.raises(ScheduleError, match="multiple of pp"):
        schedule.actions(4, 0, 6, 2)


def _run_cli(monkeypatch, *argv, local_plugin=None):
    # only this plugin (and an optional local one) is loaded, whatever else is installed
    others = [ep.name for ep in importlib.metadata.entry_points(group="nanocore") if ep.name != "schedules"]
    monkeypatch.setenv("NANOCORE_DISABLE_PLUGINS", ",".join(others))
    if local_plugin is not None:
        monkeypatch.setenv("NANOCORE_PLUGINS", str(local_plugin))
    else:
        monkeypatch.delenv("NANOCORE_PLUGINS", raising=False)
    parser = argparse.ArgumentParser()
    pipeline_sim.add_arguments(parser)
    return pipeline_sim.cmd_pipeline_sim(parser.parse_args(list(argv)))


def test_pipeline_sim_command_prints_bubble_against_theory(monkeypatch, capsys):
    assert (
        _run_cli(
            monkeypatch,
            "--engine",
            "interleaved",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--virtual-stages",
            "2",
            "--timeline",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "bubble fraction 0.157895  (theory (p-1)/(v*m+p-1) = 0.157895)" in out
    assert "rank 0: 5.5 microbatches (11 chunk activations)" in out
    assert "rank 3 |...abcdaAAbBB" in out


def test_pipeline_sim_command_runs_a_third_party_schedule(monkeypatch, capsys, tmp_path):
    plugin_file = tmp_path / "reverse_gpipe.py"
    plugin_file.write_text(
        "from nanocore import hookimpl\n"
        "from nanocore.pipeline_api import Action\n"
        "class Reverse:\n"
        "    name = 'reverse_gpipe'\n"
        "    def check(self, pp_size, num_microbatches, num_chunks):\n"
        "        return []\n"
        "    def actions(self, pp_size, pp_rank, num_microbatches, num_chunks):\n"
        "        mbs = range(num_microbatches)\n"
        "        return [Action('F', 0, m) for m in mbs] + [Action('B', 0, m) for m in reversed(mbs)]\n"
        "@hookimpl\n"
        "def register_pipeline_schedules(registry):\n"
        "    registry.register('reverse_gpipe', lambda config: Reverse())\n"
    )
    assert (
        _run_cli(monkeypatch, "--engine", "reverse_gpipe", "--pp", "2", "--microbatches", "2", local_plugin=plugin_file)
        == 0
    )
    out = capsys.readouterr().out
    assert "bubble fraction 0.333333\n" in out  # no theory printed for a schedule that has none
    assert "rank 0: 2 microbatches" in out


@pytest.mark.parametrize("p,m", [(p, m) for p in (1, 2, 4, 8) for m in (1, 2, 3, 4, 8, 16, 32)])
def test_zb1p_runs_forward_input_and_weight_halves_once_each_in_order(p, m):
    for rank in range(p):
        actions = ZB1P.actions(p, rank, m, 1)
        assert sorted(map(str, actions)) == sorted(f"{k}{mb}" for k in "FIW" for mb in range(m))
        for mb in range(m):
            f, i, w = (actions.index(Action(k, 0, mb)) for k in "FIW")
            assert f < i < w
    simulate(ZB1P, p, m)  # and the ranks' lists together never deadlock


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [4, 8, 16, 32])
def test_zb1p_has_a_smaller_bubble_than_1f1b_and_no_more_memory(p, m):
    zb, one = simulate(ZB1P, p, m), simulate(ONE_F_ONE_B, p, m)
    assert zb.bubble_fraction < one.bubble_fraction
    assert zb.makespan < one.makespan
    assert max(zb.peak_in_flight) <= max(one.peak_in_flight) == min(p, m)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (2, 32), (4, 4), (4, 16), (4, 32), (8, 8)])
def test_zb1p_reaches_the_papers_bubble_when_f_i_and_w_take_equal_time(p, m):
    result = simulate(ZB1P, p, m, t_forward=1.0, t_backward=2.0)  # I = W = 1 (the first stage: W = 2)
    assert result.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert result.bubble_fraction == pytest.approx(ZB1P.theoretical_bubble(p, m, 1), abs=1e-12)


def test_zb1p_on_two_ranks_sends_input_gradients_first_and_fills_waits_with_w():
    assert [str(a) for a in ZB1P.actions(2, 1, 4, 1)] == [
        *["F0", "I0", "F1", "I1", "W0", "F2", "I2", "W1", "F3", "I3", "W2", "W3"]
    ]
    # the first stage has no input gradient: its I is empty and its W is the whole backward
    picture = render_timeline(simulate(ZB1P, 2, 2, 1)).splitlines()
    assert picture[:2] == ["rank 0 |ab.0011|", "rank 1 |.aAbB01|"]
    assert "0-9: weight-gradient half" in picture[2]
    for m in (4, 8, 32):  # the fewest steps possible: m (F + B) on each rank and one forward of fill
        assert simulate(ZB1P, 2, m).makespan == 3 * m + 1 < simulate(ONE_F_ONE_B, 2, m).makespan


def test_split_backward_times_are_simulated_separately():
    fast_w = simulate(ZB1P, 2, 8, t_forward=1.0, t_backward=2.0, t_input=1.5, t_weight=0.5)
    fast_i = simulate(ZB1P, 2, 8, t_forward=1.0, t_backward=2.0, t_input=0.5, t_weight=1.5)
    assert fast_w.busy == fast_i.busy == [8 * 3.0, 8 * 3.0]
    assert fast_i.makespan < fast_w.makespan  # the input half is on the critical path, W is not


def test_the_checker_rejects_a_weight_gradient_before_its_input_half():
    f, i, w, b = (Action(k, 0, 0) for k in "FIWB")
    with pytest.raises(ScheduleError, match=r"rank 0, action #1: W0 .* before it exists: I0 must run first"):
        simulate([[f, w, i]], 1, 1, 1)
    with pytest.raises(ScheduleError, match="either whole .B. or split .I then W., not both"):
        simulate([[f, i, b]], 1, 1, 1)
    with pytest.raises(ScheduleError, match="rank 0 never runs W0"):
        simulate([[f, i]], 1, 1, 1)
    with pytest.raises(ScheduleError, match="rank 1 is stuck at action #0 I0.*comes later in its own list"):
        simulate([[f, i, w], [i, f, w]], 2, 1, 1)


def test_pipeline_sim_command_prints_a_table_of_schedules(monkeypatch, capsys):
    args = ("--engine", "1f1b,interleaved,zb1p", "--pp", "2,4", "--microbatches", "4,8")
    assert _run_cli(monkeypatch, *args) == 0
    rows = {tuple(line.split()[:4]): line.split()[4:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[("1f1b", "4", "8", "1")] == ["0.2727", "0.2727", "4"]
    assert rows[("interleaved", "4", "8", "2")] == ["0.1579", "0.1579", "5.5"]
    assert rows[("zb1p", "2", "8", "1")] == ["0.0400", "0.0400", "2"]
    assert rows[("zb1p", "4", "4", "1")] == ["0.2000", "0.2000", "4"]


@pytest.mark.parametrize("p,m", [(p, m) for p in (1, 2, 4, 8) for m in (1, 2, 3, 4, 8, 16, 32)])
def test_zbv_places_two_chunks_per_rank_in_a_v_and_runs_each_half_once(p, m):
    for rank in range(p):
        assert [stage_of(ZBV, c, rank, p, 2) for c in (0, 1)] == [rank, 2 * p - 1 - rank]
        actions = ZBV.actions(p, rank, m, 2)
        assert sorted(map(str, actions)) == sorted(
            f"{k}{mb}" + (".1" if c else "") for k in "FIW" for c in (0, 1) for mb in range(m)
        )
        for c in (0, 1):
            for mb in range(m):
                assert (
                    actions.index(Action("F", c, mb))
                    < actions.index(Action("I", c, mb))
                    < actions.index(Action("W", c, mb))
                )
    simulate(ZBV, p, m, 2)


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 4, 8) for m in (4, 8, 16, 32) if m >= p])
def test_zbv_has_the_smallest_bubble_within_1f1bs_memory(p, m):
    zbv, zb1p, one = simulate(ZBV, p, m, 2), simulate(ZB1P, p, m), simulate(ONE_F_ONE_B, p, m)
    interleaved = simulate(INTERLEAVED, p, m, 2)
    assert zbv.bubble_fraction <= zb1p.bubble_fraction < interleaved.bubble_fraction < one.bubble_fraction
    if p > 2:
        assert zbv.bubble_fraction < zb1p.bubble_fraction
    assert max(zbv.peak_in_flight_microbatches) <= max(one.peak_in_flight_microbatches) == p


def test_zbv_needs_two_virtual_stages():
    assert ZBV.check(4, 8, 1)[0].startswith("parallelism.pp_virtual_stages: zbv places exactly 2 chunks per rank")
    with pytest.raises(ScheduleError, match="pp_virtual_stages: 2"):
        ZBV.actions(4, 0, 8, 3)


def test_times_may_be_given_per_stage_where_a_ranks_chunks_differ():
    """Under a V, rank 0 holds the first stage and the last (the loss): giving its two chunks one
    shared time hides that the last stage is the slow one; per-stage times show it."""
    p, m = 2, 8
    even = simulate(ZBV, p, m, 2, t_forward=[2.0, 2.0], t_backward=[4.0, 4.0])
    assert simulate(ZBV, p, m, 2, t_forward=[1.0, 1.0, 1.0, 1.0], t_backward=[2.0] * 4).makespan == even.makespan
    # the same total per rank, but rank 0's last stage (stage 3) takes 3 of its 4 units
    skewed = simulate(ZBV, p, m, 2, t_forward=[0.5, 1.0, 1.0, 1.5], t_backward=[1.0, 2.0, 2.0, 3.0])
    assert skewed.makespan > even.makespan
    stage3 = [t for t in skewed.timelines[0] if t.action.chunk == 1 and t.action.kind == "F"]
    assert all(t.end - t.start == 1.5 for t in stage3)
    with pytest.raises(ScheduleError, match=r"one time per pipeline rank \(2\) or per stage \(4\), got 3"):
        simulate(ZBV, p, m, 2, t_forward=[1.0, 1.0, 1.0])


def test_peak_activation_weighs_each_stages_micro_batches():
    """What a rank holds at its peak, in memory: 1F1B at pp2 holds two micro-batches on rank 0 and one
    on rank 1; under a V, rank 0's heavy last stage (the logits) counts at its own weight."""
    plain = simulate(ONE_F_ONE_B, 2, 4)
    assert plain.peak_activation == plain.peak_in_flight_microbatches == [2.0, 1.0]
    assert simulate(ONE_F_ONE_B, 2, 4, activation=[3.0, 5.0]).peak_activation == [6.0, 5.0]
    even = simulate(ZBV, 2, 8, 2)
    assert even.peak_activation == even.peak_in_flight_microbatches
    only = [simulate(ZBV, 2, 8, 2, activation=[float(s == k) for s in range(4)]).peak_activation for k in range(4)]
    # each stage's own micro-batches, on the rank that holds it (rank 0: stages 0 and 3)
    assert [only[k][0] for k in (1, 2)] == [0.0, 0.0] and [only[k][1] for k in (0, 3)] == [0.0, 0.0]
    assert all(only[k][0] >= 1 for k in (0, 3)) and all(only[k][1] >= 1 for k in (1, 2))
    heavy_last = simulate(ZBV, 2, 8, 2, activation=[1.0, 1.0, 1.0, 3.0]).peak_activation
    assert heavy_last[1] == simulate(ZBV, 2, 8, 2, activation=[1.0] * 4).peak_activation[1]
    assert only[3][0] * 3 + only[0][0] >= heavy_last[0] > even.peak_in_flight[0]


@pytest.mark.parametrize(
    "schedule,p,m,v", [(ONE_F_ONE_B, 4, 8, 1), (INTERLEAVED, 2, 4, 2), (ZB1P, 4, 8, 1), (ZBV, 2, 8, 2)]
)
def test_a_prepared_schedule_costs_any_times_as_simulate_does(schedule, p, m, v):
    """`nanocore plan --search` prepares a schedule once per shape and costs it for each layout's
    stage times (`makespan`): the same number `simulate` draws its timelines for."""
    import random

    from nanocore.pipeline_sim import makespan, prepare

    prepared = prepare(schedule, p, m, v)
    rng = random.Random(0)
    for _ in range(5):
        times = {k: [rng.uniform(0.5, 2.0) for _ in range(p * v)] for k in ("t_forward", "t_input", "t_weight")}
        times["t_backward"] = [i + w for i, w in zip(times["t_input"], times["t_weight"], strict=True)]
        for whole in (True, False):
            expected = simulate(schedule, p, m, v, **times, first_stage_whole=whole).makespan
            assert makespan(prepared, **times, first_stage_whole=whole) == expected
