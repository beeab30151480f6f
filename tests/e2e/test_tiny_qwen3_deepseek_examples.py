"""The tiny Qwen3 and DeepSeek-V3 examples as a user runs them: the config script writes the committed
YAML, run_train.py trains it (shortened) on the stdlib corpus, run_generate.py samples from it."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers.examples import copy_example, run_python
from tests.helpers.paths import EXAMPLES, REPO

EXAMPLES_BY_MODEL = {"qwen3": "config_tiny_qwen3", "deepseek_v3": "config_tiny_deepseek_v3"}


@pytest.mark.parametrize("model_type", list(EXAMPLES_BY_MODEL))
def test_config_script_writes_exactly_the_committed_yaml(model_type, tmp_path):
    name = EXAMPLES_BY_MODEL[model_type]
    folder = copy_example(tmp_path, f"{name}.py")
    result = run_python(str(folder / f"{name}.py"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (folder / f"{name}.yaml").read_bytes() == (EXAMPLES / f"{name}.yaml").read_bytes(), (
        f"examples/{name}.yaml is stale: run `python examples/{name}.py` and commit the result"
    )
    config = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    dense = yaml.safe_load((EXAMPLES / "config_tiny_llama.yaml").read_text())
    assert config["model"]["model_config"]["model_type"] == model_type
    for key in ("tokens", "optimizer", "data_stages"):  # the dense example's data, batch and schedule
        assert config[key] == dense[key], key


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(EXAMPLES_BY_MODEL))
def test_tiny_example_trains_and_generates(model_type, tmp_path):
    name = EXAMPLES_BY_MODEL[model_type]
    folder = copy_example(tmp_path, f"{name}.py")
    config = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    config["tokens"].update(
        train_steps=20, sequence_length=128, micro_batch_size=4, val_check_interval=20, limit_val_batches=2
    )
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 5
    for spec in config["data_stages"][0]["data"]["dataset"] + config["data_stages"][0]["data"]["validation_dataset"]:
        spec["max_megabytes"] = 0.5
    config["checkpoints"].update(checkpoints_path=str(tmp_path / "checkpoints"), checkpoint_interval=20)
    config["logging"]["log_dir"] = str(tmp_path / "logs")
    config_file = folder / "short.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))

    train = run_python(str(REPO / "run_train.py"), "--config-file", str(config_file), cwd=REPO)
    assert train.returncode == 0, train.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "lm_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert steps[-1]["lm_loss"] < steps[0]["lm_loss"] - 1.0
    assert any("val_lm_loss" in r for r in rows)
    if model_type == "deepseek_v3":
        assert all(1.0 <= r["moe_max_load"] <= 4.0 for r in steps)  # 8 experts, top-2
        assert "active per token" in train.stderr

    args = ["--ckpt-path", str(tmp_path / "checkpoints"), "--prompt", "def ", "--max-new-tokens", "20"]
    generated = run_python(str(REPO / "run_generate.py"), *args, "--temperature", "0", cwd=REPO)
    assert generated.returncode == 0, generated.stderr[-3000:]
    text = generated.stdout.rstrip("\n")
    assert text.startswith("def ") and len(text) > len("def ")
