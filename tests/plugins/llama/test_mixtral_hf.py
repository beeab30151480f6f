"""`nanocore convert` with transformers' MixtralForCausalLM: round trips in both directions with equal
logits and greedy generations, the per-expert (Hub) and fused (transformers 5) weight names, and clear
refusals of the options transformers' Mixtral lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nanocore.checkpoint.model import load_checkpoint_model
from nanocore.commands.cli import run as cli
from nanocore.config.load import load_config
from nanocore.errors import ConfigError
from nanocore_plugins.llama import mixtral_hf
from tests.helpers.hf_models import assert_hf_round_trip_exact, assert_logits_and_greedy_generation_equal, hf_model
from tests.helpers.mixtral import make, tiny

TINY_HF_MIXTRAL = {
    "vocab_size": 67,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "initializer_range": 0.2,  # large enough for varied routing and greedy continuations
}


def save_hf_mixtral(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random `MixtralForCausalLM` saved with `save_pretrained` (transformers 5 writes the per-expert
    `block_sparse_moe` names); norm weights random too, so that a mapping mistake changes the logits."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**{**TINY_HF_MIXTRAL, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_config_fields(folder: Path) -> dict:
    from transformers import AutoConfig

    fields = AutoConfig.from_pretrained(folder).to_dict()
    for key in ("_name_or_path", "transformers_version", "head_dim"):  # nanocore writes head_dim explicitly
        fields.pop(key, None)
    return fields


@pytest.fixture(scope="module", params=["untied", "tied"])
def converted(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    hf_dir = save_hf_mixtral(tmp / "hf", tie_word_embeddings=request.param == "tied")
    assert cli(["convert", "--from-hf", str(hf_dir), str(tmp / "nanocore")]) == 0
    return {"case": request.param, "hf": hf_dir, "checkpoints": tmp / "nanocore", "tmp": tmp}


def test_transformers_saves_per_expert_names(converted):
    names = load_file(converted["hf"] / "model.safetensors").keys()
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names  # the classic names are read


def test_converted_checkpoint_is_a_mixtral_config(converted):
    loaded = load_config(converted["checkpoints"] / "0" / "config.yaml", world_size=1).config
    assert loaded.model.model_type == "mixtral"
    c = loaded.model.model_config
    assert (c.num_local_experts, c.num_experts_per_tok, c.vocab_size, c.rope_theta) == (4, 2, 67, 1e6)
    assert c.tie_word_embeddings == (converted["case"] == "tied")


def test_logits_and_greedy_generation_equal_transformers(converted):
    ours = load_checkpoint_model(converted["checkpoints"]).model
    theirs = hf_model(converted["hf"])
    assert_logits_and_greedy_generation_equal(ours, theirs, eos=theirs.config.eos_token_id)


def test_back_to_hf_writes_fused_names_transformers_loads(converted):
    out = converted["tmp"] / "back"
    assert cli(["convert", "--to-hf", str(converted["checkpoints"]), str(out)]) == 0
    original = mixtral_hf.fuse_classic_experts(load_file(converted["hf"] / "model.safetensors"))
    back = load_file(out / "model.safetensors")
    assert back.keys() == original.keys()
    assert "model.layers.1.mlp.experts.gate_up_proj" in back
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert hf_config_fields(out) == hf_config_fields(converted["hf"])
    reloaded, theirs = hf_model(out), hf_model(converted["hf"])
    ids = torch.randint(0, 67, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, theirs(ids).logits)


@pytest.mark.parametrize("tied", [False, True])
def test_nanocore_to_hf_to_nanocore_is_exact(tmp_path, tied):
    config = tiny(tie_word_embeddings=tied, router_z_loss_coef=0.01, rope_theta=5e5)
    model = make(config, seed=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if tied:
        del state["lm_head.weight"]  # a checkpoint holds a tied pair once
    assert_hf_round_trip_exact(tmp_path, model, config, state, mixtral_hf.to_hf, mixtral_hf.from_hf)


def test_classic_and_fused_names_give_the_same_tensors():
    torch.manual_seed(0)
    w1, w2, w3 = torch.randn(3, 48, 32), torch.randn(3, 32, 48), torch.randn(3, 48, 32)
    classic = {"model.layers.0.block_sparse_moe.gate.weight": torch.randn(3, 32), "model.norm.weight": torch.ones(32)}
    for j in range(3):
        classic.update(
            {
                f"model.layers.0.block_sparse_moe.experts.{j}.{n}.weight": t[j]
                for n, t in zip(("w1", "w2", "w3"), (w1, w2, w3), strict=True)
            }
        )
    fused = mixtral_hf.fuse_classic_experts(classic)
    assert sorted(fused) == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.gate.weight",
        "model.norm.weight",
    ]
    assert torch.equal(fused["model.layers.0.mlp.experts.gate_up_proj"], torch.cat([w1, w3], dim=1))
    assert torch.equal(fused["model.layers.0.mlp.experts.down_proj"], w2)
    assert mixtral_hf.fuse_classic_experts(fused) == fused  # fused names pass through
    del classic["model.layers.0.block_sparse_moe.experts.1.w3.weight"]
    with pytest.raises(ConfigError, match=r"experts\.1\.w3"):
        mixtral_hf.fuse_classic_experts(classic)


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        ({"num_shared_experts": 1}, "num_shared_experts"),
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_to_hf_refuses_options_transformers_mixtral_lacks(overrides, option):
    config = tiny(**overrides)
    with pytest.raises(ConfigError, match=f"model.model_config.{option}: .*transformers"):
        mixtral_hf.to_hf(config, make(config).state_dict())


def test_from_hf_refuses_sliding_window_and_drops_jitter(tmp_path, capfd):
    folder = save_hf_mixtral(tmp_path / "sw", sliding_window=16)
    assert cli(["convert", "--from-hf", str(folder), str(tmp_path / "out")]) == 2
    state = load_file(folder / "model.safetensors")
    raw = {**json.loads((folder / "config.json").read_text()), "sliding_window": None, "router_jitter_noise": 0.1}
    capfd.readouterr()
    config, _ = mixtral_hf.from_hf(raw, state)
    warned = capfd.readouterr().err
    assert config.router_jitter_noise == 0.0 and "router_jitter_noise 0.1 is dropped" in warned, warned
    with pytest.raises(ConfigError, match="sliding_window"):
        mixtral_hf.from_hf({**raw, "sliding_window": 16}, state)
