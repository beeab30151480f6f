"""The benchmark scripts keep working (no timing is asserted: speed is measured by running them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_throughput_runs_both_sides_and_reports_a_ratio(tmp_path):
    out = tmp_path / "result.json"
    args = [
        "--hidden",
        "32",
        "--heads",
        "4",
        "--layers",
        "1",
        "--vocab",
        "64",
        "--seq",
        "16",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--micro-batch-size",
        "1",
        "--accumulation",
        "2",
        "--json",
        str(out),
    ]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ratio" in result.stdout
    figures = json.loads(out.read_text())
    text = json.dumps(figures)
    assert "nanocore" in text and "plain" in text


def test_gpu_check_says_when_there_is_no_gpu():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    import torch

    assert line["run"] == ("skipped" if not torch.cuda.is_available() else "1 GPU")
