"""The MoE benchmark keeps working: four sides (grouped and per-expert expert GEMMs among them),
each with a positive rate, and the ratios reported (no timing is asserted: speed is measured by
running the script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_moe_vs_dense_runs_four_sides_and_reports_ratios(tmp_path):
    out = tmp_path / "result.json"
    tiny = "--hidden 32 --heads 4 --layers 1 --vocab 64 --seq 16 --experts 4 --expert-intermediate 16"
    args = [*tiny.split(), "--steps", "2", "--rounds", "1", "--micro-batch-size", "1", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "moe_vs_dense.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["median_tokens_per_sec"]) == {"moe", "moe_loop", "dense", "hf_mixtral"}
    assert all(rate > 0 for rate in data["median_tokens_per_sec"].values())
    assert all(len(times) == 2 for times in data["step_wall_seconds"].values())
    # the same shape on both MoE sides; the dense model has the active parameters only
    assert data["sides"]["moe"]["parameters"] == data["sides"]["hf_mixtral"]["parameters"]
    assert data["sides"]["moe_loop"]["parameters"] == data["sides"]["moe"]["parameters"]
    assert data["sides"]["dense"]["parameters"] < data["sides"]["moe"]["parameters"]
    # same active parameters: the FLOPs estimates agree (the router adds E x hidden per layer)
    moe, dense = data["sides"]["moe"]["flops_per_token"], data["sides"]["dense"]["flops_per_token"]
    assert abs(moe - dense) / dense < 0.05
    assert data["ratios"]["moe_over_dense"] > 0 and "moe / dense" in result.stdout
    assert data["ratios"]["grouped_over_loop"] > 0 and "grouped / per-expert" in result.stdout
