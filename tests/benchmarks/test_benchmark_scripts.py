"""The benchmark scripts keep working (no timing is asserted: speed is measured by running them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("baseline", ["transformers", "plain"])
def test_train_throughput_runs_both_sides_and_reports_a_ratio(tmp_path, baseline):
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
        "--baseline",
        baseline,
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
    assert figures["baseline"] == baseline
    assert set(figures["median_tokens_per_sec"]) == {"nanocore", "baseline"}
    assert all(figures["memory"][side]["peak_mib"] > 0 for side in ("nanocore", "baseline"))
    # both sides start from the same weights: the first losses agree (different random tokens)
    assert f"{baseline} " in result.stdout


def test_gpu_check_says_when_there_is_no_gpu():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    import torch

    assert line["run"] == ("skipped" if not torch.cuda.is_available() else "1 GPU")


TINY = ["--hidden", "32", "--heads", "4", "--layers", "1", "--vocab", "64", "--seq", "16"]


def _run_script(name: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_compile_throughput_runs_all_four_sides(tmp_path):
    out = tmp_path / "compile.json"
    args = [*TINY, "--steps", "2", "--rounds", "1", "--micro-batch-size", "1", "--accumulation", "1"]
    result = _run_script("compile_throughput.py", [*args, "--keep-cache", "--no-memory", "--json", str(out)], tmp_path)
    figures = json.loads(out.read_text())
    assert set(figures["tokens_per_s"]) == {
        "nanocore eager",
        "nanocore compiled",
        "transformers eager",
        "transformers compiled",
    }
    assert "nanocore compiled / eager" in result.stdout


@pytest.mark.slow
def test_async_checkpoint_times_both_modes(tmp_path):
    out = tmp_path / "async.json"
    args = [*TINY, "--steps", "4", "--interval", "2", "--rounds", "1", "--micro-batch-size", "1", "--threads", "1"]
    result = _run_script("async_checkpoint.py", [*args, "--json", str(out)], tmp_path)
    figures = json.loads(out.read_text())
    assert figures["save_call_s"]["sync"] > 0 and figures["save_call_s"]["async"] > 0
    assert "ratio async / sync" in result.stdout


@pytest.mark.slow
def test_zero3_vs_fsdp2_runs_both_sides_on_the_same_computation(tmp_path):
    out = tmp_path / "fsdp2.json"
    args = ["--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "512", "--seq", "32", "--dp", "2"]
    result = _run_script("zero3_vs_fsdp2.py", [*args, "--rounds", "1", "--steps", "2", "--json", str(out)], tmp_path)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["nanocore_zero3_peak_mib"] > 0 and row["fsdp2_peak_mib"] > 0
    assert row["nanocore_zero3_tokens_per_second"] > 0 and row["fsdp2_tokens_per_second"] > 0
    # the same weights, samples and AdamW: the losses agree to float32 summation-order noise
    assert len(row["nanocore_zero3_losses"]) == 3 and row["max_loss_difference"] < 1e-4
    assert "peak ratio" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("example", ["tiny_llama", "tiny_moe"])
def test_muon_vs_adamw_trains_every_side_on_the_example(tmp_path, example):
    out = tmp_path / "muon.json"
    args = ["--example", example, "--steps", "4", "--val-every", "2", "--muon-lr-factors", "1,2", "--threads", "1"]
    result = _run_script("muon_vs_adamw.py", [*args, "--json", str(out)], tmp_path)
    figures = json.loads(out.read_text())
    assert sorted(figures["sides"]) == ["adam_w", "muon@0.003", "muon@0.006"]
    for side in figures["sides"].values():
        assert sorted(side["val_lm_loss"]) == ["2", "4"] and side["tokens_per_sec"] > 0
    # AdamW reaches its own final loss at its last step, by definition
    assert figures["sides"]["adam_w"]["steps_to_adam_w_final"] == 4
    assert "steps to AdamW final" in result.stdout
