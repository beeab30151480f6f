"""The context-parallel memory benchmark keeps working (no timing or memory figure is asserted:
they are measured by running it; the step-1 loss must be the same at every cp)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cp_memory_benchmark_runs_cp1_and_cp2_side_by_side(tmp_path):
    out = tmp_path / "cp.json"
    args = ["--cp", "1,2", "--seq", "64", "--hidden", "32", "--layers", "1", "--vocab", "64", "--steps", "1"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "context_parallel_memory.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["cp"] for r in rows] == [1, 2]
    assert len(rows[1]["activation_mib_each_rank"]) == 2
    assert rows[0]["losses"][0] == pytest.approx(rows[1]["losses"][0], rel=1e-5)
    assert "activation MiB/rank" in result.stdout
