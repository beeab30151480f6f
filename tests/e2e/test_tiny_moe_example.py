"""The tiny mixture-of-experts example as a user runs it: its config script, run_train.py (shortened)
with the MoE metrics in every logger, and run_generate.py sampling from its checkpoint."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers.examples import copy_example, run_python
from tests.helpers.paths import EXAMPLES, REPO
from tests.helpers.tensorboard import read_scalars

COMMITTED_YAML = EXAMPLES / "config_tiny_moe.yaml"


def test_config_script_writes_exactly_the_committed_yaml(tmp_path):
    folder = copy_example(tmp_path, "config_tiny_moe.py")
    result = run_python(str(folder / "config_tiny_moe.py"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (folder / "config_tiny_moe.yaml").read_bytes() == COMMITTED_YAML.read_bytes(), (
        "examples/config_tiny_moe.yaml is stale: run `python examples/config_tiny_moe.py` and commit the result"
    )
    config = yaml.safe_load(COMMITTED_YAML.read_text())
    dense = yaml.safe_load((EXAMPLES / "config_tiny_llama.yaml").read_text())
    assert config["model"]["model_config"]["model_type"] == "mixtral"
    # the same data, batch and schedule as the dense example, so their losses compare
    for key in ("tokens", "optimizer", "data_stages"):
        assert config[key] == dense[key], key


@pytest.mark.slow
def test_tiny_moe_trains_logs_moe_metrics_and_generates(tmp_path):
    folder = copy_example(tmp_path, "config_tiny_moe.py")
    config = yaml.safe_load(COMMITTED_YAML.read_text())
    config["tokens"].update(
        train_steps=20, sequence_length=128, micro_batch_size=4, val_check_interval=10, limit_val_batches=2
    )
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 5
    for spec in config["data_stages"][0]["data"]["dataset"] + config["data_stages"][0]["data"]["validation_dataset"]:
        spec["max_megabytes"] = 0.5
    config["checkpoints"].update(checkpoints_path=str(tmp_path / "checkpoints"), checkpoint_interval=20)
    config["logging"]["log_dir"] = str(tmp_path / "logs")
    config["logging"]["loggers"][0]["every"] = 10  # console rows at steps 10 and 20
    config_file = folder / "short.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))

    train = run_python(str(REPO / "run_train.py"), "--config-file", str(config_file), cwd=REPO)
    assert train.returncode == 0, train.stderr[-3000:]

    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "lm_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    for r in steps:
        # top-2: the auxiliary loss is 2 at perfect balance and above it otherwise
        assert 1.9 < r["moe_aux_loss"] < 8.0, r
        assert 1.0 <= r["moe_max_load"] <= 8 / 2, r
        assert "moe_z_loss" not in r, "z-loss is off in the example"
    assert steps[-1]["lm_loss"] < steps[0]["lm_loss"] - 1.0
    console = [line for line in train.stderr.splitlines() if line.startswith("step 20/20")]
    assert console and "moe_aux_loss" in console[0] and "moe_max_load" in console[0], train.stderr[-2000:]
    scalars = read_scalars(tmp_path / "logs" / "tensorboard")
    assert [s for s, _ in scalars["train/moe_aux_loss"]] == list(range(1, 21))
    assert [s for s, _ in scalars["train/moe_max_load"]] == list(range(1, 21))

    args = ["--ckpt-path", str(tmp_path / "checkpoints"), "--prompt", "def ", "--max-new-tokens", "20"]
    generated = run_python(str(REPO / "run_generate.py"), *args, "--temperature", "0", cwd=REPO)
    assert generated.returncode == 0, generated.stderr[-3000:]
    text = generated.stdout.rstrip("\n")
    assert text.startswith("def ") and len(text) > len("def ")
