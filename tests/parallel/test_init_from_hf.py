"""Training from a Hugging Face folder (`model.init_method.path`) at any layout, and exporting what was trained.

The reference is transformers itself: step 1's loss (computed before any update) must equal
transformers' loss on the same first batch, in one process and at dp1 x tp2 x pp2. The model ties
its embeddings (split across the first and last pipeline stage) and has an odd vocabulary (padded
for tp=2, the padding dropped again on export).
"""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file

from nanocore.checkpoint.model import load_checkpoint_model
from nanocore.commands.cli import run as cli
from nanocore.errors import ConfigError
from tests.helpers.compare import rel_diff
from tests.helpers.hf_models import hf_model, save_hf_llama
from tests.helpers.training import TINY_MODEL, run_training, tiny_config, train_in_process

STEPS = 2


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """An HF folder, its converted checkpoint and the model_config that matches it."""
    tmp = tmp_path_factory.mktemp("hf")
    folder = save_hf_llama(tmp / "hf", seed=3, tie_word_embeddings=True)
    assert cli(["convert", "--from-hf", str(folder), str(tmp / "converted")]) == 0
    config = yaml.safe_load((tmp / "converted" / "0" / "config.yaml").read_text())
    return {"folder": folder, "converted": tmp / "converted", "model_config": config["model"]["model_config"]}


def config_from(tmp, hf, init_path, **sections):
    model = {"model_config": hf["model_config"], "init_method": {"path": str(init_path) if init_path else None}}
    return tiny_config(tmp, model=model, tokens={"train_steps": STEPS}, **sections)


@pytest.fixture(scope="module")
def reference(hf, tmp_path_factory):
    losses, batch = train_in_process(config_from(tmp_path_factory.mktemp("one"), hf, hf["folder"]))
    model = hf_model(hf["folder"])
    with torch.no_grad():  # transformers shifts the labels itself; the engine averages micro-batch means
        hf_loss = sum(float(model(input_ids=mb, labels=mb).loss) for mb in batch) / len(batch)
    return {"losses": losses, "hf_loss": hf_loss}


def test_one_process_from_hf_starts_at_transformers_loss(reference):
    assert rel_diff(reference["losses"][0], reference["hf_loss"]) <= 1e-5, reference


def test_converted_checkpoint_and_first_auto_resume_train_like_the_hf_folder(hf, reference, tmp_path):
    as_init, _ = train_in_process(config_from(tmp_path / "init", hf, hf["converted"]))
    resumed, _ = train_in_process(
        config_from(tmp_path / "resume", hf, None, checkpoints={"resume_checkpoint_path": str(hf["converted"])})
    )
    assert len(resumed) == STEPS  # a step-0 checkpoint: every step still to train
    # Auto-resume (resume from the run's own, still empty, checkpoints folder) starts from init_method.path.
    own = str(tmp_path / "auto" / "checkpoints")
    auto, _ = train_in_process(
        config_from(tmp_path / "auto", hf, hf["folder"], checkpoints={"resume_checkpoint_path": own})
    )
    for losses in (as_init, resumed, auto):
        assert max(rel_diff(a, b) for a, b in zip(losses, reference["losses"], strict=True)) <= 1e-6


def test_a_model_config_that_differs_from_the_hf_folder_is_named(hf, tmp_path):
    raw = config_from(tmp_path, hf, hf["folder"])
    raw["model"]["model_config"] = {**TINY_MODEL, "tie_word_embeddings": True}
    with pytest.raises(ConfigError) as info:
        run_training(raw)
    message = str(info.value)
    for field in ("vocab_size", "initializer_range"):
        assert f"model.model_config.{field}" in message
    assert "hidden_size" not in message  # equal fields are not listed
    assert str(hf["folder"]) in message


@pytest.mark.slow
def test_tp2_pp2_from_hf_matches_transformers_and_exports_back(hf, reference, tmp_path):
    raw = config_from(
        tmp_path,
        hf,
        hf["folder"],
        parallelism={"dp": 1, "tp": 2, "pp": 2},
        checkpoints={"save_final_state": True},
    )
    run = run_training(raw, world_size=4)
    assert rel_diff(run["losses"][0], reference["hf_loss"]) <= 1e-5
    assert max(rel_diff(a, b) for a, b in zip(run["losses"], reference["losses"], strict=True)) <= 1e-5
    assert run["weights"]["model.embed_tokens.weight"].shape[0] == 68  # 67 padded for tp=2

    out = tmp_path / "exported"
    assert cli(["convert", "--to-hf", str(tmp_path / "checkpoints"), str(out)]) == 0
    saved = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in saved  # tied: transformers re-ties it
    for name, tensor in run["weights"].items():
        assert torch.equal(saved[name], tensor[:67] if name == "model.embed_tokens.weight" else tensor), name

    theirs = hf_model(out)
    assert theirs.config.tie_word_embeddings and theirs.config.vocab_size == 67
    ours = load_checkpoint_model(tmp_path / "checkpoints").model
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = theirs(ids).logits, ours(ids)[..., :67]
    # the same float32 math in other kernels: relative to the logits' largest magnitude, as in
    # tests/plugins/llama's parity with transformers
    assert rel_diff(got, expected) <= 1e-5, rel_diff(got, expected)
