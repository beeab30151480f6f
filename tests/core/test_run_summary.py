"""What an operator sees: the start-of-run summary, `peak_memory_mb` in every row, `--version`,
`run_train.py --help` under its own name, and `nanocore config` checking the tokenizer and data."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
import yaml

from nanocore import __version__
from nanocore.commands.cli import run as cli_run
from nanocore.memory import MemoryMeter
from tests.helpers.launch import REPO, launch_env
from tests.helpers.training import run_training, tiny_config


def test_start_of_run_summary_says_what_runs_where(tmp_path, caplog):
    raw = tiny_config(tmp_path, checkpoints={"checkpoint_interval": 5, "keep_last_n": 2},
                      logging={"log_dir": str(tmp_path / "logs"), "loggers": ["jsonl"]})  # fmt: skip
    raw["tokens"]["train_steps"] = 2
    with caplog.at_level(logging.INFO, logger="nanocore"):
        run_training(raw)
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start of run")]
    lines = summary.splitlines()
    assert lines[1].strip().startswith(f"nanocore {__version__} | run 'parity' (id ")
    assert "| fresh start" in lines[1]
    plugins = next(line for line in lines if line.strip().startswith("plugins:"))
    for name in ("parallel", "schedules", "llama", "optim", "zero", "data", "loggers"):
        assert name in plugins
    assert f"(nanocore {__version__})" in plugins
    assert (
        "layout: 1 process(es) = dp 1 x tp 1 x pp 1 | pp_engine 1f1b, 1 virtual stage(s) | tp_mode - | ZeRO 0 "
        "| cpu, float32" in summary
    )
    assert "model: llama, " in summary and " parameters; per rank " in summary
    assert (
        "tokens: 64 per step (global batch 4 = dp 1 x micro-batch 1 x accumulation 4, sequence 16); 2 steps = "
        "128 tokens" in summary
    )
    assert "data stage 'stable': steps 1-2 (128 tokens) from dummy;" in summary
    memory = next(line for line in lines if "memory per rank" in line)
    assert "parameters " in memory and "gradients " in memory and "optimizer state " in memory
    # the planner's total for the largest rank, as `nanocore plan` prints it for this config
    from nanocore.config.converter import structure_config
    from nanocore.plan import plan_for
    from nanocore.plugins import load_plugins

    registries = load_plugins().registries
    plan = plan_for(structure_config(raw, registries), registries, "cpu")
    planned = next(line for line in lines if "memory plan (nanocore plan, rank 0)" in line)
    from nanocore.summary import _bytes

    assert f"{_bytes(plan.ranks[0].total_bytes)} at peak" in planned
    assert f"checkpoints: {(tmp_path / 'checkpoints').resolve()} (every 5 steps, keep last 2)" in summary
    assert f"logs: {(tmp_path / 'logs').resolve()} (jsonl)" in summary


def test_summary_memory_estimate_matches_what_the_optimizer_then_holds(tmp_path, caplog):
    raw = tiny_config(tmp_path)
    raw["tokens"]["train_steps"] = 1
    with caplog.at_level(logging.INFO, logger="nanocore"):
        result = run_training(raw)
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start of run")]
    params = sum(t.numel() for t in result["weights"].values())
    assert f"model: llama, {params / 1e3:.3g}K parameters; per rank {params / 1e3:.3g}K" in summary
    # AdamW keeps two fp32 tensors per element: the estimate printed before step 1 is what step 1
    # allocates, but for torch's one-element `step` counter per tensor
    estimate = 2 * 4 * params
    state = result["ranks"][0]["state_bytes"]
    assert abs(state - estimate) <= 0.01 * state, (state, estimate)
    assert f"optimizer state {estimate / 2**10:.3g} KiB" in summary


def test_every_metrics_row_console_line_and_tensorboard_step_has_peak_memory(tmp_path):
    """In a fresh process, as a user runs it (a test process's resident size says nothing of a run)."""
    raw = tiny_config(
        tmp_path, logging={"log_dir": str(tmp_path / "logs"), "loggers": ["console", "jsonl", "tensorboard"]}
    )
    raw["tokens"]["train_steps"] = 3
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    result = subprocess.run(
        [sys.executable, str(REPO / "run_train.py"), "--config-file", str(path)],
        cwd=tmp_path,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the run holds at least its weights, gradients and AdamW state (41K parameters x 16 bytes)
    assert all(r["peak_memory_mb"] > 0.5 for r in rows), rows
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all("peak_memory_mb " in line for line in lines), lines
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/peak_memory_mb")] == [1, 2, 3]


def test_memory_meter_counts_what_an_interval_holds_and_resets():
    meter = MemoryMeter(torch.device("cpu"))
    if not meter.resettable:
        pytest.skip("this platform cannot reset the peak resident size (not Linux)")
    meter.reset()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del block
    high = meter.peak_mb()
    meter.reset()
    low = meter.peak_mb()
    assert high - low > 48, (high, low)  # the freed block counted in its interval, not in the next


def test_version_and_script_names(tmp_path):
    for cmd in (
        [sys.executable, "-m", "nanocore", "--version"],
        [sys.executable, str(REPO / "run_train.py"), "--version"],
    ):
        out = subprocess.run(cmd, cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == f"nanocore {__version__}", out
    helped = subprocess.run([sys.executable, str(REPO / "run_train.py"), "--help"], cwd=tmp_path, env=launch_env(),
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert helped.stdout.startswith("usage: run_train.py "), helped.stdout
    assert "nanocore train" not in helped.stdout and "KEY.PATH=VALUE" in helped.stdout
    helped = subprocess.run([sys.executable, str(REPO / "run_generate.py"), "--help"], cwd=tmp_path,
                            env=launch_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert helped.stdout.startswith("usage: run_generate.py "), helped.stdout


def write(tmp_path, raw) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def test_config_command_checks_that_the_tokenizer_exists(tmp_path, capsys):
    raw = tiny_config(tmp_path, tokenizer={"tokenizer_name_or_path": str(tmp_path / "missing" / "tokenizer.json")})
    assert cli_run(["config", write(tmp_path, raw)]) == 2
    err = capsys.readouterr().err
    assert err.count("nanocore: error:") == 1
    assert "tokenizer.tokenizer_name_or_path:" in err and "missing" in err


def test_config_command_checks_that_the_tokenizer_fits_the_vocabulary(tmp_path, capsys):
    raw = tiny_config(tmp_path, tokenizer={"tokenizer_name_or_path": "byte"})  # 257 tokens, model has 64
    assert cli_run(["config", write(tmp_path, raw)]) == 2
    assert "the tokenizer has 257 tokens but the model's vocab_size is 64" in capsys.readouterr().err


def test_config_command_loads_the_data(tmp_path, capsys):
    raw = tiny_config(tmp_path, tokenizer={"tokenizer_name_or_path": "byte"})
    raw["model"]["model_config"]["vocab_size"] = 257
    corpus = tmp_path / "books"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text " * 200)
    raw["data_stages"][0]["data"]["dataset"] = {"format": "hf", "hf_dataset_or_datasets": str(corpus / "a.txt")}
    assert cli_run(["config", write(tmp_path, raw)]) == 0
    err = capsys.readouterr().err
    assert "ok: tokenizer: byte (257 tokens) fits the model vocabulary (257)" in err
    assert "ok: data_stages[0].data.dataset ('stable', hf): " in err and "samples of 16 tokens" in err
    raw["data_stages"][0]["data"]["dataset"]["hf_dataset_or_datasets"] = str(corpus / "gone.txt")
    assert cli_run(["config", write(tmp_path, raw)]) == 2
    err = capsys.readouterr().err
    assert err.count("nanocore: error:") == 1 and "gone.txt" in err


def test_summary_counts_the_models_parameters_not_the_layouts_padding(tmp_path, caplog):
    raw = tiny_config(tmp_path, model={"make_vocab_size_divisible_by": 16})
    raw["model"]["model_config"]["vocab_size"] = 61  # padded to 64 rows: 3 rows of padding per table
    raw["tokens"]["train_steps"] = 1
    with caplog.at_level(logging.INFO, logger="nanocore"):
        result = run_training(raw)
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start of run")]
    hidden = raw["model"]["model_config"]["hidden_size"]
    padded = sum(t.numel() for t in result["weights"].values())
    true = padded - 2 * 3 * hidden  # untied embedding and head
    assert f"model: llama, {true / 1e3:.3g}K parameters" in summary, summary


def test_summary_gives_the_parameters_a_token_computes_with_for_a_sparse_model(tmp_path, caplog):
    from tests.helpers.deepseek_v3 import TINY_DEEPSEEK_V3

    raw = tiny_config(tmp_path, model={"model_config": dict(TINY_DEEPSEEK_V3)})
    raw["tokens"]["train_steps"] = 1
    with caplog.at_level(logging.INFO, logger="nanocore"):
        result = run_training(raw)
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start of run")]
    weights = result["weights"]
    total = sum(t.numel() for t in weights.values())
    k_of_e = TINY_DEEPSEEK_V3["num_experts_per_tok"] / TINY_DEEPSEEK_V3["n_routed_experts"]
    experts = sum(t.numel() for n, t in weights.items() if ".experts." in n)
    bias = sum(t.numel() for n, t in weights.items() if n.endswith("e_score_correction_bias"))
    active = total - experts * (1 - k_of_e) - bias
    assert active < total - 1000  # a token runs 2 of 4 routed experts
    assert f"model: deepseek_v3, {total / 1e3:.3g}K parameters ({active / 1e3:.3g}K active per token)" in summary


def test_summary_warns_when_the_search_predicts_a_layout_over_20_percent_faster(tmp_path, caplog):
    from nanocore.hardware import Hardware, Link, hardware_to_yaml

    hw = tmp_path / "hw.yaml"  # compute-bound: recompute's extra forward is a third more step
    hw.write_text(hardware_to_yaml(Hardware("slow-box", "test", {"float32": 1e9}, 2**34, 8, Link(1e12, 0.0),
                                            Link(1e12, 0.0), memory_bandwidth=1e13)))  # fmt: skip
    summaries = {}
    for recompute in ("full", None):
        raw = tiny_config(tmp_path / str(recompute), general={"hardware": str(hw)},
                          parallelism={"recompute_granularity": recompute})  # fmt: skip
        raw["tokens"]["train_steps"] = 1
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="nanocore"):
            run_training(raw)
        (summaries[recompute],) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start of")]
    (warning,) = [ln for ln in summaries["full"].splitlines() if "WARNING layout:" in ln]
    assert "on slow-box" in warning and "recompute off" in warning and "nanocore plan --search" in warning
    assert "WARNING layout" not in summaries[None]  # the run's own layout is (within 20 %) the best
