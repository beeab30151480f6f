"""The pipeline-schedule benchmark keeps working (no timing or memory figure is asserted: they are
measured by running it; every schedule must compute the same step-1 loss)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanocore.pipeline_sim import simulate
from nanocore.plugins import load_plugins

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pipeline_benchmark_runs_every_schedule_and_predicts_each(tmp_path):
    out = tmp_path / "pp.json"
    args = ["--pp", "2", "--schedules", "1f1b,interleaved,zb1p,zbv", "--microbatches", "4", "--seq", "32"]
    args += ["--hidden", "32", "--layers", "4", "--heads", "4", "--vocab", "64", "--steps", "1", "--rounds", "1"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline_schedules.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["schedule"], r["virtual_stages"]) for r in rows] == [
        ("1f1b", 1),
        ("interleaved", 2),
        ("zb1p", 1),
        ("zbv", 2),
    ]
    for row in rows:
        assert row["losses"][0] == pytest.approx(rows[0]["losses"][0], rel=1e-5)
        assert row["predicted_tokens_per_second"] > 0 and row["tokens_per_second"] > 0
        assert len(row["seconds_per_microbatch_each_rank"]) == 2
        schedule = load_plugins().registries.pipeline_schedule.get(row["schedule"]).factory(None)
        expected = simulate(schedule, 2, 4, row["virtual_stages"]).peak_in_flight_microbatches
        assert row["peak_in_flight_microbatches"] == expected
    split = rows[2]["seconds_per_microbatch_each_rank"]
    assert all(r["B"] == 0 for r in split) and split[1]["I"] > 0 and split[1]["W"] > 0
    assert "meas/pred" in result.stdout
