"""The 3D example launches as the README says: torchrun with 8 CPU processes (dp2 x tp2 x pp2)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from tests.helpers.launch import torchrun
from tests.helpers.paths import EXAMPLES


@pytest.mark.slow
def test_3d_example_trains_on_eight_cpu_processes(tmp_path):
    examples = tmp_path / "examples"
    shutil.copytree(EXAMPLES / "local_plugins", examples / "local_plugins")
    config = yaml.safe_load((EXAMPLES / "config_tiny_llama_3d.yaml").read_text())
    assert (config["parallelism"]["dp"], config["parallelism"]["tp"], config["parallelism"]["pp"]) == (2, 2, 2)
    config["tokens"].update(train_steps=3, val_check_interval=3, limit_val_batches=1, sequence_length=64)
    config["data_stages"][0]["data"]["dataset"][0]["max_megabytes"] = 0.3
    config["data_stages"][0]["data"]["validation_dataset"][0]["max_megabytes"] = 0.3
    config["checkpoints"]["checkpoint_interval"] = 0
    (examples / "config.yaml").write_text(yaml.safe_dump(config))
    # --standalone: the rendezvous takes a port the OS gives, not the fixed 29500 a second launch would also want
    result = torchrun(["--config-file", str(examples / "config.yaml")], tmp_path, nproc=8, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / "logs" / "tiny_llama_3d" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if "lm_loss" in r] == [1, 2, 3]
    assert any("val_lm_loss" in r for r in rows)
    assert (tmp_path / "checkpoints" / "tiny_llama_3d" / "3" / "model").is_dir()
    meta = json.loads((tmp_path / "checkpoints" / "tiny_llama_3d" / "3" / "meta.json").read_text())
    assert meta["topology"] == {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "world_size": 8}
