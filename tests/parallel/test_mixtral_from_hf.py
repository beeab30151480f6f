"""Training a Mixtral from a Hugging Face folder at an expert-parallel layout, and exporting it back.

The reference is transformers itself: step 1's loss (before any update) must equal transformers'
language-model loss on the same first batch, in one process and at dp2 x ep2 x tp2 (experts split
over two ranks, attention over two more); the trained checkpoint, written in pieces by four ranks,
converts back to a folder transformers loads with the same logits as nanocore's model.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from nanocore.checkpoint.model import load_checkpoint_model
from nanocore.commands.cli import run as cli
from tests.helpers.compare import rel_diff
from tests.helpers.hf_models import hf_model
from tests.helpers.training import run_training, tiny_config, train_in_process

STEPS = 2
TINY_HF_MIXTRAL = {
    "vocab_size": 67,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.02,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    tmp = tmp_path_factory.mktemp("hf_mixtral")
    torch.manual_seed(5)
    model = MixtralForCausalLM(MixtralConfig(**TINY_HF_MIXTRAL))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp / "hf", safe_serialization=True)
    assert cli(["convert", "--from-hf", str(tmp / "hf"), str(tmp / "converted")]) == 0
    config = yaml.safe_load((tmp / "converted" / "0" / "config.yaml").read_text())
    assert config["model"]["model_config"]["model_type"] == "mixtral"
    return {"folder": tmp / "hf", "model_config": config["model"]["model_config"]}


def config_from(tmp, hf, accumulation=4, **sections):
    model = {"model_config": hf["model_config"], "init_method": {"path": str(hf["folder"])}}
    tokens = {"train_steps": STEPS, "batch_accumulation_per_replica": accumulation}
    return tiny_config(tmp, model=model, tokens=tokens, **sections)


@pytest.fixture(scope="module")
def reference(hf, tmp_path_factory):
    losses, batch = train_in_process(config_from(tmp_path_factory.mktemp("one"), hf))
    model = hf_model(hf["folder"])
    with torch.no_grad():  # output_router_logits is off: transformers' loss is the LM loss alone
        hf_loss = sum(float(model(input_ids=mb, labels=mb).loss) for mb in batch) / len(batch)
    return {"losses": losses, "hf_loss": hf_loss}


def test_one_process_from_hf_starts_at_transformers_loss(reference):
    assert rel_diff(reference["losses"][0], reference["hf_loss"]) <= 1e-5, reference


@pytest.mark.slow
def test_ep2_tp2_from_hf_matches_transformers_and_exports_back(hf, reference, tmp_path):
    raw = config_from(
        tmp_path,
        hf,
        parallelism={"dp": 2, "tp": 2, "pp": 1, "expert_parallel_size": 2, "tp_mode": "REDUCE_SCATTER"},
        accumulation=2,
        checkpoints={"save_final_state": True},
    )
    run = run_training(raw, world_size=4)
    assert rel_diff(run["losses"][0], reference["hf_loss"]) <= 1e-5
    assert max(rel_diff(a, b) for a, b in zip(run["losses"], reference["losses"], strict=True)) <= 1e-4

    out = tmp_path / "exported"
    assert cli(["convert", "--to-hf", str(tmp_path / "checkpoints"), str(out)]) == 0
    theirs = hf_model(out)
    ours = load_checkpoint_model(tmp_path / "checkpoints").model.eval()
    ids = torch.randint(0, TINY_HF_MIXTRAL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        got = ours(ids)[..., : TINY_HF_MIXTRAL["vocab_size"]]
    assert rel_diff(got, expected) <= 1e-5
    # the export holds the trained weights, not the folder it started from
    with torch.no_grad():
        start = hf_model(hf["folder"])(input_ids=ids).logits
    assert rel_diff(expected, start) > 1e-3
