"""`nanocore plan --search` (nanocore/plan_search.py) with the `nd` engine's planner and time model:
what it ranks first is the fastest layout that passes the checks and fits (checked by planning every
layout), each row is what `plan --hardware` says of that layout, a faster misfit names its overflowing
term, and the command's errors come before any work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.errors import ConfigError
from nanocore.hardware import Hardware, Link, hardware_to_yaml
from nanocore.plan import plan_for, predict_for
from nanocore.plan_search import layouts, search
from nanocore.plugins import load_plugins
from tests.helpers.launch import REPO
from tests.helpers.training import tiny_config

# a machine where communication costs something (so layouts differ), 4 devices per node
HW = Hardware("test-box", "test", {"float32": 1e11}, 2**30, 4, Link(2e9, 2e-5), Link(2e8, 1e-4), memory_bandwidth=2e10)


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def config_of(tmp_path, registries, **sections):
    raw = tiny_config(tmp_path, **sections)
    raw["tokens"]["batch_accumulation_per_replica"] = 8
    return structure_config(raw, registries)


def test_the_first_choice_is_the_fastest_layout_that_passes_the_checks_and_fits(tmp_path, registries):
    config = config_of(tmp_path, registries)
    result = search(config, registries, 4, HW, HW.memory_bytes, device="cpu", top=3)
    assert result.best and len(result.best) == 3 and not result.faster_misfits
    speeds = [r.prediction.tokens_per_sec_per_device for r in result.best]
    assert speeds == sorted(speeds, reverse=True)
    # brute force: every layout checked and predicted; the best one's speed is the first choice's
    fastest = 0.0
    count = 0
    for layout in layouts(config, registries, 4, HW.devices_per_node):
        candidate = layout.apply(config)
        try:
            check_config(candidate, registries, 4)
        except ConfigError:
            continue
        count += 1
        fastest = max(fastest, predict_for(candidate, registries, HW, "cpu").tokens_per_sec_per_device)
    assert count == result.passed_checks > 50
    assert speeds[0] == pytest.approx(fastest)
    for row in result.best:  # each row is what plan --hardware says of that layout
        candidate = row.layout.apply(config)
        again = predict_for(candidate, registries, HW, "cpu")
        assert row.prediction.step_seconds == pytest.approx(again.step_seconds)
        assert row.memory_bytes == plan_for(candidate, registries, "cpu").largest().total_bytes
        assert row.fits and row.memory_bytes <= HW.memory_bytes
    assert result.enumerated > result.passed_checks and result.rejected  # the checks turned some away


def test_a_time_budget_ranks_what_it_reached_and_says_it_stopped(tmp_path, registries):
    """The start-of-run summary searches with a budget (a large model on many devices takes minutes):
    when it runs out, enumeration stops and what was predicted is ranked, marked incomplete."""
    config = config_of(tmp_path, registries)
    whole = search(config, registries, 4, HW, HW.memory_bytes, device="cpu", top=1)
    assert whole.complete
    cut = search(config, registries, 4, HW, HW.memory_bytes, device="cpu", top=1, budget_seconds=0.0)
    assert not cut.complete and cut.enumerated < whole.enumerated


def test_a_faster_layout_that_does_not_fit_says_which_term_overflows(tmp_path, registries):
    config = config_of(tmp_path, registries)
    roomy = search(config, registries, 4, HW, HW.memory_bytes, device="cpu", top=40)
    sizes = sorted({r.memory_bytes for r in roomy.best})
    assert len(sizes) > 1
    tight = sizes[0]  # only the leanest of those layouts fits now
    result = search(config, registries, 4, HW, tight, device="cpu", top=1)
    assert result.best and result.best[0].memory_bytes <= tight
    assert result.faster_misfits
    for misfit in result.faster_misfits:
        assert not misfit.fits and misfit.memory_bytes > tight
        assert misfit.prediction.tokens_per_sec_per_device >= result.best[0].prediction.tokens_per_sec_per_device
        assert "GiB of" in misfit.overflow and "the largest term" in misfit.overflow


def test_layouts_that_need_at_least_a_misfits_memory_are_not_planned_and_the_answer_is_the_same(
    tmp_path, registries, monkeypatch
):
    """A 70B search planned 1,300 layouts one by one, almost all of them larger micro-batches or less
    recompute or sharding of a layout already over the memory: those are skipped unplanned, and the
    layouts that fit come out as planning every one finds them."""
    import nanocore.plan_search as plan_search

    config = config_of(tmp_path, registries)
    roomy = search(config, registries, 4, HW, HW.memory_bytes, device="cpu", top=40)
    sizes = sorted({r.memory_bytes for r in roomy.best})
    tight = sizes[0]  # the leanest of them: most layouts above it are misfits
    skipping = search(config, registries, 4, HW, tight, device="cpu", top=10)
    for row in skipping.best:  # every layout that fits is planned, none skipped
        assert row.fits and row.memory_bytes <= tight
    assert skipping.dominated > 0
    monkeypatch.setattr(plan_search, "_needs_more", lambda lay, misfit: False)
    every = search(config, registries, 4, HW, tight, device="cpu", top=10)
    assert every.dominated == 0 and every.planned > skipping.planned
    assert [r.layout for r in every.best] == [r.layout for r in skipping.best]


def test_only_layouts_whose_bound_could_make_the_top_are_simulated_and_the_answer_is_the_same(tmp_path, registries):
    """The pipeline simulation was half of a 7.5B search's 250 s. Each layout's step is first bounded
    without it (its bubble 0: never longer than the full prediction); only layouts whose bound could
    still beat the next one taken are simulated. The answer, ties and misfits included, is what
    predicting every layout in full gives."""
    from plugins.parallel.time_model import predict_bound

    config = config_of(tmp_path, registries)
    roomy = search(config, registries, 4, HW, HW.memory_bytes, device="cpu", top=10)
    tight = min(r.memory_bytes for r in roomy.best)  # only the leanest of those fits: faster misfits
    pipelined = False
    for memory in (HW.memory_bytes, tight):
        bounded = search(config, registries, 4, HW, memory, device="cpu", top=10)
        every = search(config, registries, 4, HW, memory, device="cpu", top=10, exhaustive=True)
        assert [(r.layout, r.prediction.step_seconds, r.memory_bytes) for r in bounded.best] == [
            (r.layout, r.prediction.step_seconds, r.memory_bytes) for r in every.best
        ]
        assert [r.layout for r in bounded.faster_misfits] == [r.layout for r in every.faster_misfits]
        assert bounded.passed_checks == every.passed_checks
        assert 0 < bounded.simulated < bounded.passed_checks // 2 and every.simulated == 0
        pipelined |= any(r.layout.pp > 1 for r in every.best + every.faster_misfits)
    assert pipelined  # a pipelined layout is among the answers: its bound was not its prediction
    for layout in list(layouts(config, registries, 4, HW.devices_per_node))[:400]:
        candidate = layout.apply(config)
        try:
            check_config(candidate, registries, 4)
        except ConfigError:
            continue
        full = predict_for(candidate, registries, HW, "cpu")
        bound = predict_bound(candidate, registries, HW, "cpu")
        assert bound.step_seconds <= full.step_seconds
        assert [t.seconds for t in bound.terms if t.name != "pipeline_bubble"] == [
            t.seconds for t in full.terms if t.name != "pipeline_bubble"
        ]
        if layout.pp == 1:
            assert bound.step_seconds == pytest.approx(full.step_seconds, rel=1e-12)


def test_only_narrows_the_search_to_the_layouts_a_user_allows(tmp_path, registries):
    """`--only zero=0,recompute=full,tp_mode=ALL_REDUCE` (what 2021's Megatron ran): every layout
    ranked has those values, and its first choice is the fastest of the unrestricted search's layouts
    that have them."""
    from nanocore.plan_search import parse_only

    config = config_of(tmp_path, registries)
    only = parse_only("zero=0, recompute=full|selective ,tp_mode=ALL_REDUCE,tp_async=false")
    assert only == {"zero": (0,), "recompute": ("full", "selective"), "tp_mode": ("ALL_REDUCE",), "tp_async": (False,)}
    narrow = search(config, registries, 4, HW, HW.memory_bytes, device="cpu", top=3, only=only)
    wide = search(config, registries, 4, HW, HW.memory_bytes, device="cpu", top=400)
    assert narrow.best and narrow.enumerated < wide.enumerated
    for r in narrow.best:
        assert r.layout.zero == 0 and r.layout.recompute in ("full", "selective") and not r.layout.tp_async
        assert r.layout.tp == 1 or r.layout.tp_mode == "ALL_REDUCE"
    allowed = [
        r
        for r in wide.best
        if r.layout.zero == 0
        and r.layout.recompute in ("full", "selective")
        and (r.layout.tp == 1 or r.layout.tp_mode == "ALL_REDUCE")
    ]
    assert narrow.best[0].layout == allowed[0].layout
    assert wide.best[0].layout.recompute is None  # the narrowing changed the answer
    assert parse_only("recompute=off") == {"recompute": (None,)}
    bad = {
        "zeros=1": "FIELD one of dp, tp",
        "zero=two": "zero='two': expected int",
        "recompute=some": "expected off, selective or full",
        "tp_async=yes": "expected bool",
    }
    for text, said in bad.items():
        with pytest.raises(ConfigError, match=said):
            parse_only(text)


def test_plan_search_command_prints_the_table_and_json(tmp_path):
    config = tmp_path / "c.yaml"
    raw = tiny_config(tmp_path)
    raw["tokens"]["batch_accumulation_per_replica"] = 8
    config.write_text(yaml.safe_dump(raw))
    hw = tmp_path / "hw.yaml"
    hw.write_text(hardware_to_yaml(HW))
    cmd = [sys.executable, "-m", "nanocore", "plan", str(config), "--search", "--device", "cpu"]
    out = subprocess.run([*cmd, "--world-size", "4", "--hardware", str(hw), "--json", "--top", "2"], **_quiet())
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["best"]) == 2 and data["world_size"] == 4 and data["hardware"] == "test-box"
    assert data["best"][0]["prediction"]["tokens_per_sec_per_device"] > 0
    text = subprocess.run([*cmd, "--world-size", "4", "--hardware", str(hw)], **_quiet())
    assert text.returncode == 0, text.stderr
    assert "pass the config checks" in text.stdout and "tokens/s/dev" in text.stdout
    rows = [ln for ln in text.stdout.splitlines() if ln[:3].strip().isdigit() and ln.startswith(" ")]
    assert len(rows) == 5 and "dp" in rows[0] and "ZeRO-" in rows[0]
    no_world = subprocess.run([*cmd, "--hardware", str(hw)], **_quiet())
    assert no_world.returncode == 2 and "--world-size" in no_world.stderr
    no_hw = subprocess.run([*cmd, "--world-size", "4"], **_quiet())
    assert no_hw.returncode == 2 and "--hardware" in no_hw.stderr
    narrow = subprocess.run(
        [*cmd, "--world-size", "4", "--hardware", str(hw), "--only", "zero=0,recompute=full"], **_quiet()
    )
    assert narrow.returncode == 0, narrow.stderr
    rows = [ln for ln in narrow.stdout.splitlines() if ln[:3].strip().isdigit() and ln.startswith(" ")]
    assert rows and all("ZeRO-0" in r and "recompute full" in r for r in rows), narrow.stdout
    bad = subprocess.run([*cmd, "--world-size", "4", "--hardware", str(hw), "--only", "zero=x"], **_quiet())
    assert bad.returncode == 2 and "--only: zero='x'" in bad.stderr
    alone = [sys.executable, "-m", "nanocore", "plan", str(config), "--only", "zero=0"]
    alone_out = subprocess.run(alone, **_quiet())
    assert alone_out.returncode == 2 and "give --search too" in alone_out.stderr


def _quiet() -> dict:
    return {"capture_output": True, "text": True, "cwd": REPO, "timeout": 300}
