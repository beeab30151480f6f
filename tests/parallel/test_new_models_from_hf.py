"""Training Qwen3-MoE and DeepSeek-V3 from a transformers folder (`model.init_method.path`): step 1's
loss (before any update) equals transformers' loss on the same first batch, on one process and at
tp2 x pp2 (the folder's tensors read and cut for each rank)."""

from __future__ import annotations

import pytest
import torch
import yaml

from nanocore.commands.cli import run as cli
from tests.helpers.compare import rel_diff
from tests.helpers.hf_models import hf_model, save_hf_deepseek_v3, save_hf_qwen3
from tests.helpers.training import run_training, tiny_config, train_in_process

pytestmark = pytest.mark.slow

SAVERS = {
    "qwen3_moe": lambda folder: save_hf_qwen3(folder, moe=True),
    "deepseek_v3": lambda folder: save_hf_deepseek_v3(folder),
}


def config_from(tmp, model_config: dict, folder, **sections) -> dict:
    model = {"model_config": model_config, "init_method": {"path": str(folder)}}
    return tiny_config(tmp, model=model, tokens={"train_steps": 1}, **sections)


@pytest.mark.parametrize("model_type", list(SAVERS))
def test_training_from_a_transformers_folder_starts_at_its_loss(model_type, tmp_path):
    folder = SAVERS[model_type](tmp_path / "hf")
    assert cli(["convert", "--from-hf", str(folder), str(tmp_path / "converted")]) == 0
    model_config = yaml.safe_load((tmp_path / "converted" / "0" / "config.yaml").read_text())["model"]["model_config"]
    assert model_config["model_type"] == model_type
    losses, batch = train_in_process(config_from(tmp_path / "one", model_config, folder))
    reference = hf_model(folder)
    with torch.no_grad():  # transformers shifts the labels itself; the engine averages micro-batch means
        hf_loss = sum(float(reference(input_ids=mb, labels=mb).loss) for mb in batch) / len(batch)
    assert rel_diff(losses[0], hf_loss) <= 1e-5, (losses[0], hf_loss)
    parallelism = {"tp": 2, "pp": 2, "pp_engine": "1f1b", "tp_mode": "REDUCE_SCATTER"}
    split = run_training(config_from(tmp_path / "tp2pp2", model_config, folder, parallelism=parallelism), 4)
    assert rel_diff(split["losses"][0], hf_loss) <= 1e-5, (split["losses"][0], hf_loss)
