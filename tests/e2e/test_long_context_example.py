"""The long-context example as a user runs it: its config script writes the committed YAML, and
torchrun trains it on 4 CPU processes (context parallel, document masking), shortened; the
checkpoint (written at cp4) samples with run_generate.py on one process."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers.examples import copy_example, run_python
from tests.helpers.launch import torchrun
from tests.helpers.paths import EXAMPLES, REPO

COMMITTED_YAML = EXAMPLES / "config_long_context.yaml"


def test_config_script_writes_exactly_the_committed_yaml(tmp_path):
    folder = copy_example(tmp_path, "config_long_context.py")
    result = run_python(str(folder / "config_long_context.py"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (folder / "config_long_context.yaml").read_bytes() == COMMITTED_YAML.read_bytes(), (
        "examples/config_long_context.yaml is stale: run `python examples/config_long_context.py` and commit it"
    )
    config = yaml.safe_load(COMMITTED_YAML.read_text())
    tiny = yaml.safe_load((EXAMPLES / "config_tiny_llama.yaml").read_text())
    assert config["tokens"]["sequence_length"] >= 8 * tiny["tokens"]["sequence_length"]
    assert config["parallelism"]["context_parallel_size"] == 4 and config["tokens"]["document_masking"] is True
    tokens = config["tokens"]["sequence_length"] * config["tokens"]["micro_batch_size"]
    assert tokens == tiny["tokens"]["sequence_length"] * tiny["tokens"]["micro_batch_size"], "same tokens per step"


@pytest.mark.slow
def test_long_context_example_trains_on_four_cpu_processes_and_generates(tmp_path):
    folder = copy_example(tmp_path, "config_long_context.py")
    config = yaml.safe_load(COMMITTED_YAML.read_text())
    config["tokens"].update(train_steps=8, val_check_interval=8, limit_val_batches=1, sequence_length=512)
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 2
    for spec in config["data_stages"][0]["data"]["dataset"] + config["data_stages"][0]["data"]["validation_dataset"]:
        spec["max_megabytes"] = 0.3
    config["checkpoints"].update(checkpoints_path=str(tmp_path / "checkpoints"), checkpoint_interval=8)
    config["logging"]["log_dir"] = str(tmp_path / "logs")
    config_file = folder / "short.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    # --standalone: the rendezvous takes a port the OS gives, not the fixed 29500 a second launch would also want
    train = torchrun(["--config-file", str(config_file)], REPO, nproc=4, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "x cp 4 (each sequence split over 4 ranks)" in train.stderr and "documents masked" in train.stderr
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "lm_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert steps[-1]["lm_loss"] < steps[0]["lm_loss"] - 0.5
    assert any("val_lm_loss" in r for r in rows)
    meta = json.loads((tmp_path / "checkpoints" / "8" / "meta.json").read_text())
    assert meta["topology"]["cp"] == 4 and meta["topology"]["world_size"] == 4

    args = ["--ckpt-path", str(tmp_path / "checkpoints"), "--prompt", "def ", "--max-new-tokens", "20"]
    generated = run_python(str(REPO / "run_generate.py"), *args, "--temperature", "0", cwd=REPO)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert generated.stdout.startswith("def ")
