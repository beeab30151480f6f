"""`nanocore pipeline-probe`: each pipeline block's F/B/I/W times measured in one process, summed per
stage as the engine cuts the model, and handed to the simulator exactly as `nanocore pipeline-sim`
takes them."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml

from nanocore.commands.cli import run as cli_run
from nanocore_plugins.parallel.pipeline_probe import BlockTimes, stage_times
from tests.helpers.training import tiny_config

TIMES = [BlockTimes(f"b{i}", F=1.0 + i, B=2.0 + i, I=1.5 + i, W=1.0 + i) for i in range(5)]


def test_stage_times_sum_the_blocks_of_each_stage_and_the_first_stage_has_no_input_gradient():
    per = stage_times(TIMES, [[0, 1], [2], [3, 4]], recompute=False)
    assert per["F"] == [1.0 + 2.0, 3.0, 4.0 + 5.0]
    assert per["B"] == [2.0 + 3.0, 4.0, 5.0 + 6.0]
    assert per["I"] == [0.0, 3.5, 4.5 + 5.5]  # stage 0's input is token ids: nothing to send back
    assert per["W"] == [5.0, 3.0, 4.0 + 5.0]  # ... and its W is its whole backward
    # full recompute runs the forward again of every block but the pipeline's first and last
    again = stage_times(TIMES, [[0, 1], [2], [3, 4]], recompute=True)
    assert again["B"] == [5.0 + 2.0, 4.0 + 3.0, 11.0 + 4.0]
    assert again["I"] == [0.0, 3.5 + 3.0, 10.0 + 4.0]
    assert again["F"] == per["F"]


def _config(tmp_path, **parallelism) -> str:
    raw = tiny_config(tmp_path, parallelism={"pp": 2, **parallelism})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_probe_measures_every_block_and_predicts_each_schedule(tmp_path, capsys):
    config = _config(tmp_path)
    assert cli_run(["pipeline-probe", config, "--repeats", "1", "--engines", "1f1b,zb1p,zbv", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    blocks = out["blocks"]
    layers = tiny_config(tmp_path)["model"]["model_config"]["num_hidden_layers"]
    assert len(blocks) == layers + 2  # the embedding, each decoder layer, the head with the loss
    assert all(b["F"] > 0 and b["B"] > 0 and b["W"] > 0 for b in blocks)
    assert blocks[0]["I"] == 0 and all(b["I"] > 0 for b in blocks[1:])
    by_engine = {p["engine"]: p for p in out["predictions"]}
    assert [by_engine[e]["virtual_stages"] for e in ("1f1b", "zb1p", "zbv")] == [1, 1, 2]
    total_f = sum(b["F"] for b in blocks)
    for p in out["predictions"]:
        per = p["stage_seconds"]
        assert len(per["F"]) == 2 * p["virtual_stages"]
        assert sum(per["F"]) == pytest.approx(total_f, rel=1e-9)  # every block on exactly one stage
        assert per["I"][0] == 0 and per["W"][0] == per["B"][0]
        # a pipeline step takes at least the busiest rank's compute: m micro-batches of its stages
        owners = [[0], [1]] if p["virtual_stages"] == 1 else [[0, 3], [1, 2]]  # zbv: a V
        backward = per["B"] if p["engine"] == "1f1b" else [i + w for i, w in zip(per["I"], per["W"], strict=True)]
        busiest = max(sum(per["F"][s] + backward[s] for s in stages) for stages in owners)
        assert p["pipeline_seconds"] >= 4 * busiest * (1 - 1e-9)
        assert 0 <= p["bubble_fraction"] < 1


def test_the_printed_pipeline_sim_command_reproduces_the_prediction(tmp_path, capsys):
    config = _config(tmp_path, pp_engine="zbv", pp_virtual_stages=2)
    assert cli_run(["pipeline-probe", config, "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    predicted = float(re.search(r"zbv\s+v=2\s+([0-9.]+) s per step", text).group(1))
    command = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith("nanocore pipeline-sim"))
    assert cli_run(shlex.split(command)[1:]) == 0
    makespan = float(re.search(r"makespan ([0-9.e+-]+)", capsys.readouterr().out).group(1))
    assert makespan == pytest.approx(predicted, abs=1e-4)


def test_probe_errors_name_the_flag(tmp_path, capsys):
    config = _config(tmp_path)
    assert cli_run(["pipeline-probe", config, "--engines", "1f1c"]) == 2
    assert "--engines" in capsys.readouterr().err
    assert cli_run(["pipeline-probe", config, "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


def test_pipeline_sim_takes_times_per_rank_or_per_stage(capsys):
    base = ["pipeline-sim", "--engine", "zbv", "--pp", "2", "--microbatches", "8", "--virtual-stages", "2"]
    assert cli_run([*base, "--t-forward", "1,1,1,1", "--t-backward", "2,2,2,2"]) == 0
    even = capsys.readouterr().out
    assert cli_run([*base, "--t-forward", "2,2", "--t-backward", "4,4"]) == 0
    assert capsys.readouterr().out == even  # per rank: its two chunks share it
    assert cli_run([*base, "--t-forward", "0.5,1,1,1.5", "--t-backward", "1,2,2,3"]) == 0
    skewed = float(re.search(r"makespan ([0-9.]+)", capsys.readouterr().out).group(1))
    assert skewed > float(re.search(r"makespan ([0-9.]+)", even).group(1))
    assert cli_run([*base, "--t-forward", "1,1,1"]) == 2
    assert "--t-forward: expected one time per pipeline rank (2) or per stage (4), got 3" in capsys.readouterr().err
    assert cli_run([*base, "--t-weight", "x"]) == 2
    assert "--t-weight" in capsys.readouterr().err


def test_probe_prints_the_time_models_blocks_beside_its_own(tmp_path, capsys):
    """With --hardware, each block's predicted F/B (the time model, as `nanocore plan` adds it up)
    stands beside the measurement: where the model and the machine part is read per block."""
    from nanocore.hardware import Hardware, Link, hardware_to_yaml

    config = _config(tmp_path)
    runs = {}
    for name, peak in (("fast", 1e11), ("slow", 5e10)):
        hw = tmp_path / f"{name}.yaml"
        box = Hardware(name, "test", {"float32": peak}, 2**30, 1, Link(2e9, 2e-5), Link(2e9, 2e-5))
        hw.write_text(hardware_to_yaml(box))
        assert cli_run(["pipeline-probe", config, "--repeats", "1", "--hardware", str(hw), "--json"]) == 0
        runs[name] = json.loads(capsys.readouterr().out)["time_model_blocks"]
    fast, slow = runs["fast"], runs["slow"]
    assert len(fast) == tiny_config(tmp_path)["model"]["model_config"]["num_hidden_layers"] + 2
    for f, s in zip(fast[1:], slow[1:], strict=True):  # decoder layers and the head: matmuls
        assert f["F"] > 0 and f["B"] == pytest.approx(f["I"] + f["W"])
        assert s["mm"] == pytest.approx(2 * f["mm"])  # half the peak, twice the matmul time
    assert cli_run(["pipeline-probe", config, "--repeats", "1", "--hardware", str(tmp_path / "fast.yaml")]) == 0
    assert "meas/model" in capsys.readouterr().out
