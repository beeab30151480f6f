"""The time model's benchmark against measured runs keeps working (no timing is asserted: the
figures are measured by running it): every layout trains the same computation (the same step-1
loss), is predicted on the given hardware description, and the summary ranks them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanocore.hardware import Hardware, Link, hardware_to_yaml

ROOT = Path(__file__).resolve().parents[2]


def _benchmark(tmp_path: Path, args: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    """Run benchmarks/plan_vs_measured.py for one round with `args`; its output and its --json file."""
    out = tmp_path / "r.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plan_vs_measured.py"), *args, "--rounds", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, json.loads(out.read_text())


@pytest.mark.slow
def test_plan_vs_measured_runs_each_layout_and_predicts_it(tmp_path):
    hw = tmp_path / "hw.yaml"
    hw.write_text(hardware_to_yaml(Hardware("box", "test", {"float32": 1e10}, 2**33, 2, Link(1e9, 1e-4),
                                            Link(1e9, 1e-4), memory_bandwidth=1e10)))  # fmt: skip
    layouts = "dp2_zero1,tp2_reduce_scatter,pp2_zb1p,cp2_all_to_all"
    args = ["--layouts", layouts, "--hardware", str(hw), "--samples", "4", "--seq", "32", "--hidden", "32"]
    args += ["--layers", "2", "--heads", "4", "--vocab", "64", "--steps", "1"]
    result, data = _benchmark(tmp_path, args)
    rows = data["rows"]
    assert [r["layout"] for r in rows] == layouts.split(",")
    for row in rows:
        assert row["step1_loss"] == pytest.approx(rows[0]["step1_loss"], rel=1e-5)
        assert row["measured_step_seconds"] > 0 and row["predicted_step_seconds"] > 0
        assert row["predicted_step_seconds"] == pytest.approx(sum(row["terms"].values()))
    summary = data["summary"]
    assert summary["layouts"] == 4 and -1 <= summary["spearman"] <= 1
    assert 0 < summary["first_choice_over_fastest"] <= 1
    assert "Spearman" in result.stdout


@pytest.mark.slow
def test_after_calibrate_the_model_predicts_a_few_measured_layouts(tmp_path):
    """Issue 24's check in small: `nanocore calibrate` on this machine, then three layouts whose steps
    differ in what they pay (gradients once per step; a collective at every layer's edge; a gather
    per parameter tensor per pass) trained and predicted. The benchmark holds each within 25 %; here,
    with two steps and a short calibration, within a factor of 2, and the layout measured fastest is
    the one the model ranks first.

    Like the benchmark, it assumes nothing else runs on the machine (as in CI, which runs tests one at
    a time): calibrate takes the best of its matmuls and the mean of its collectives, so foreign load
    moves them apart. One busy-looping process beside it moved dp2_zero1 from 0.93 to 0.62 and tp2
    from 0.90 to 1.42; a second multi-process test beside it failed it once.

    Before calibrate timed collectives as a step pays them, the model (with the best of a tight loop,
    and one gather per block) predicted ZeRO-3 at 0.42-0.53 of its measured step, and tp2 at
    0.43-0.58: it fails this."""
    hw = tmp_path / "here.yaml"
    calibrate = [sys.executable, "-m", "nanocore", "calibrate", "--world-size", "2", "--threads", "1"]
    done = subprocess.run([*calibrate, "--seconds", "0.01", "--output", str(hw)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    layouts = "dp2_zero1,tp2_reduce_scatter,dp2_zero3"
    args = ["--layouts", layouts, "--hardware", str(hw), "--samples", "4", "--seq", "128", "--hidden", "128"]
    args += ["--layers", "2", "--heads", "4", "--vocab", "512", "--steps", "2"]
    result, data = _benchmark(tmp_path, args)
    ratios = {r["layout"]: r["predicted_over_measured"] for r in data["rows"]}
    assert all(0.5 <= x <= 2.0 for x in ratios.values()), (ratios, result.stdout[-2000:])
    assert data["summary"]["first_choice"] == data["summary"]["fastest_measured"], result.stdout[-2000:]


@pytest.mark.slow
def test_expert_parallel_runs_feed_their_routing_imbalance_back(tmp_path):
    """Under expert parallelism the run's logged moe_sync_load (each dispatch's busiest ep rank's routed
    rows over its share, the mean over the step's dispatches: 1 to ep, at least moe_rank_load) is what
    the prediction is made with, as `plan --expert-load-factor`; a rank that gets more than its share
    predicts a slower step than a balanced one."""
    hw = tmp_path / "hw.yaml"
    hw.write_text(hardware_to_yaml(Hardware("box", "test", {"float32": 1e10}, 2**33, 2, Link(1e9, 1e-4),
                                            Link(1e9, 1e-4), memory_bandwidth=1e10)))  # fmt: skip
    args = ["--layouts", "moe_ep2", "--hardware", str(hw), "--samples", "4", "--seq", "32", "--hidden", "32"]
    args += ["--layers", "2", "--heads", "4", "--vocab", "64", "--steps", "2"]
    _, data = _benchmark(tmp_path, args)
    (row,) = data["rows"]
    assert 1.0 <= row["moe_rank_load"] <= row["moe_sync_load"] + 1e-9 <= 2.0 + 1e-9
    spec = importlib.util.spec_from_file_location("plan_vs_measured", ROOT / "benchmarks" / "plan_vs_measured.py")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    ns = module.parse_args(args)
    assert row["predicted_step_seconds"] == pytest.approx(
        module.predicted_step(ns, "moe_ep2", str(hw), row["moe_sync_load"])["step_seconds"]
    )
    if row["moe_sync_load"] > 1.01:
        assert row["predicted_step_seconds"] > module.predicted_step(ns, "moe_ep2", str(hw), 1.0)["step_seconds"]
