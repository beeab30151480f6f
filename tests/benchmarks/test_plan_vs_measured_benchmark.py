"""The time model's benchmark against measured runs keeps working (no timing is asserted: the
figures are measured by running it): every layout trains the same computation (the same step-1
loss), is predicted on the given hardware description, and the summary ranks them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanocore.hardware import Hardware, Link, hardware_to_yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_plan_vs_measured_runs_each_layout_and_predicts_it(tmp_path):
    hw = tmp_path / "hw.yaml"
    hw.write_text(hardware_to_yaml(Hardware("box", "test", {"float32": 1e10}, 2**33, 2, Link(1e9, 1e-4),
                                            Link(1e9, 1e-4), memory_bandwidth=1e10)))  # fmt: skip
    out = tmp_path / "r.json"
    layouts = "dp2_zero1,tp2_reduce_scatter,pp2_zb1p,cp2_all_to_all"
    args = ["--layouts", layouts, "--hardware", str(hw), "--samples", "4", "--seq", "32", "--hidden", "32"]
    args += ["--layers", "2", "--heads", "4", "--vocab", "64", "--steps", "1", "--rounds", "1", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plan_vs_measured.py"), *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
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
