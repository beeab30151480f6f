"""`nanocore convert` with transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM: folders
transformers wrote convert to nanocore checkpoints with equal logits and greedy generations, and
back to folders transformers loads with the same tensors and logits; nanocore -> HF -> nanocore
is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nanocore.checkpoint.model import load_checkpoint_model
from nanocore.commands.cli import run as cli
from nanocore.config.load import load_config
from nanocore_plugins.qwen3 import hf as qwen3_hf
from tests.helpers.hf_models import assert_hf_round_trip_exact, assert_logits_and_greedy_generation_equal, hf_model
from tests.helpers.hf_models import save_hf_qwen3 as save_hf
from tests.helpers.qwen3 import make, tiny, tiny_moe


def hf_config_fields(folder: Path) -> dict:
    from transformers import AutoConfig

    fields = AutoConfig.from_pretrained(folder).to_dict()
    for key in ("_name_or_path", "transformers_version", "head_dim", "layer_types"):
        fields.pop(key, None)
    return fields


@pytest.fixture(scope="module", params=["qwen3", "qwen3_tied", "qwen3_moe"])
def converted(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    moe = request.param == "qwen3_moe"
    hf_dir = save_hf(tmp / "hf", moe, tie_word_embeddings=request.param == "qwen3_tied")
    assert cli(["convert", "--from-hf", str(hf_dir), str(tmp / "nanocore")]) == 0
    return {"case": request.param, "moe": moe, "hf": hf_dir, "checkpoints": tmp / "nanocore", "tmp": tmp}


def test_converted_checkpoint_has_the_config_transformers_had(converted):
    c = load_config(converted["checkpoints"] / "0" / "config.yaml", world_size=1).config.model
    assert c.model_type == ("qwen3_moe" if converted["moe"] else "qwen3")
    m = c.model_config
    assert (m.head_dim, m.rope_theta, m.vocab_size) == (16, 1e6, 67)
    assert m.tie_word_embeddings == (converted["case"] == "qwen3_tied")
    if converted["moe"]:
        assert (m.num_experts, m.moe_intermediate_size, m.norm_topk_prob, m.mlp_only_layers) == (4, 24, True, [0])


def test_logits_and_greedy_generation_equal_transformers(converted):
    ours = load_checkpoint_model(converted["checkpoints"]).model
    assert_logits_and_greedy_generation_equal(ours, hf_model(converted["hf"]), eos=2)


def test_back_to_hf_gives_the_same_tensors_and_logits(converted):
    out = converted["tmp"] / "back"
    assert cli(["convert", "--to-hf", str(converted["checkpoints"]), str(out)]) == 0
    original = load_file(converted["hf"] / "model.safetensors")
    if converted["moe"]:
        original = qwen3_hf.fuse_per_expert(original)
    back = load_file(out / "model.safetensors")
    if converted["moe"]:
        back = qwen3_hf.fuse_per_expert(back)
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    assert hf_config_fields(out) == hf_config_fields(converted["hf"])
    reloaded, theirs = hf_model(out), hf_model(converted["hf"])
    ids = torch.randint(0, 67, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, theirs(ids).logits)


@pytest.mark.parametrize("moe", [False, True])
def test_nanocore_to_hf_to_nanocore_is_exact(tmp_path, moe):
    config = tiny_moe(router_z_loss_coef=0.01, mlp_only_layers=[1]) if moe else tiny(tie_word_embeddings=True)
    model = make(config)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        del state["lm_head.weight"]  # a checkpoint holds a tied pair once
    to_hf, from_hf = (qwen3_hf.to_hf_moe, qwen3_hf.from_hf_moe) if moe else (qwen3_hf.to_hf, qwen3_hf.from_hf)
    assert_hf_round_trip_exact(tmp_path, model, config, state, to_hf, from_hf)
