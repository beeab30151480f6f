"""The nanocore-gpt2 package's model, on one process: transformers parity, the model API, config checks."""

from __future__ import annotations

import pytest
import torch
import transformers

from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.config.schema import ModelArgs
from nanocore.errors import ConfigError
from nanocore.generation import generate
from nanocore.model_api import KVCache, check_model
from nanocore.plugins import load_plugins
from tests.helpers.compare import rel_diff
from tests.helpers.third_party import gpt2_config, require

SMALL = dict(n_embd=32, n_head=4, n_layer=2, vocab_size=61, n_positions=24)


def make(tied: bool = True, vocab_multiple: int = 1, **overrides):
    """A GPT-2 with real weights from the model's own init_parameter (LayerNorms perturbed so tests see them)."""
    gpt2 = require("nanocore-gpt2")
    config = gpt2.GPT2Config(**{**SMALL, "tie_word_embeddings": tied, **overrides})
    entry = load_plugins().registries.model.get("gpt2")
    model = entry.factory(ModelArgs(model_config=config, model_type="gpt2"), vocab_multiple=vocab_multiple)
    with torch.no_grad():
        for i, (name, param) in enumerate(model.named_parameters()):
            model.init_parameter(name, param, torch.Generator().manual_seed(i))
            if ".ln_" in name or name.endswith(".bias"):
                param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(100 + i)))
    return model.eval()


def hf_copy(model) -> transformers.GPT2LMHeadModel:
    """transformers' GPT-2 holding the same weights (its Conv1D stores [in, out]; c_attn fuses q, k, v)."""
    c = model.config
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=model.vocab_size,
            n_positions=c.n_positions,
            n_embd=c.n_embd,
            n_layer=c.n_layer,
            n_head=c.n_head,
            activation_function=c.activation_function,
            layer_norm_epsilon=c.layer_norm_epsilon,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=c.tie_word_embeddings,
        )
    )
    ours = model.state_dict()
    state = {
        "transformer.wte.weight": ours["transformer.embeddings.wte.weight"],
        "transformer.wpe.weight": ours["transformer.embeddings.wpe.weight"],
        "transformer.ln_f.weight": ours["transformer.ln_f.weight"],
        "transformer.ln_f.bias": ours["transformer.ln_f.bias"],
        "lm_head.weight": ours["lm_head.weight"],
    }
    for i in range(c.n_layer):
        p = f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            state[f"{p}{norm}.weight"], state[f"{p}{norm}.bias"] = ours[f"{p}{norm}.weight"], ours[f"{p}{norm}.bias"]
        qkv = [f"{p}attn.{x}_proj" for x in "qkv"]
        state[f"{p}attn.c_attn.weight"] = torch.cat([ours[f"{n}.weight"] for n in qkv]).t()
        state[f"{p}attn.c_attn.bias"] = torch.cat([ours[f"{n}.bias"] for n in qkv])
        for linear in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            state[f"{p}{linear}.weight"] = ours[f"{p}{linear}.weight"].t()
            state[f"{p}{linear}.bias"] = ours[f"{p}{linear}.bias"]
    hf.load_state_dict(state, strict=False)  # strict=False: older transformers keep attention-mask buffers
    return hf.eval()


@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers_gpt2(tied):
    model = make(tied=tied)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), hf_copy(model)(ids).logits
    assert ours.shape == (2, 24, SMALL["vocab_size"])
    # The same float32 math in other kernels (reductions of <= 128 terms, typically sqrt(128) eps ~ 1.4e-6
    # each): relative to the logits' largest magnitude; measured 1e-7.
    assert rel_diff(ours, theirs) <= 1e-5, rel_diff(ours, theirs)


def test_forward_equals_the_chain_of_pipeline_blocks():
    model = make()
    blocks = model.pipeline_blocks()
    assert blocks[0] == ["transformer.embeddings"] and blocks[-1] == ["transformer.ln_f", "lm_head"]
    assert len(blocks) == SMALL["n_layer"] + 2
    ids = torch.randint(0, SMALL["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(1))
    x = ids
    with torch.no_grad():
        for block in blocks:
            for name in block:
                x = model.get_submodule(name)(x)
        torch.testing.assert_close(x, model(ids), atol=0, rtol=0)


def test_kv_cache_generation_equals_recomputing_the_whole_sequence():
    model = make()
    prompt = [3, 14, 15, 9]
    cached = generate(model, prompt, 12, temperature=0, use_cache=True)
    full = generate(model, prompt, 12, temperature=0, use_cache=False)
    assert cached == full and len(cached) == 12
    cache, ids = KVCache(), torch.tensor([prompt + cached[:5]])
    with torch.no_grad():
        model(ids[:, :4], kv_cache=cache)
        step = model(ids[:, 4:], kv_cache=cache)  # several new tokens after a cached prefix
        assert rel_diff(step, model(ids)[:, 4:]) <= 1e-5  # attention over cached keys: another order
    assert cache.length == ids.shape[1]


def test_positions_beyond_n_positions_are_an_error():
    model = make()
    with pytest.raises(ValueError, match="n_positions = 24"):
        model(torch.zeros(1, 25, dtype=torch.long))


def test_follows_the_model_api_under_meta():
    gpt2 = require("nanocore-gpt2")
    entry = load_plugins().registries.model.get("gpt2")
    with torch.device("meta"):
        model = entry.factory(ModelArgs(model_config=gpt2.GPT2Config(**SMALL), model_type="gpt2"), vocab_multiple=8)
    check_model(model, "gpt2")  # every member nanocore.model_api.CausalLM requires
    assert all(p.is_meta for p in model.parameters())
    assert list(model.buffers()) == [], "the engine materialises parameters only"
    assert model.vocab_size == 64 and model.true_vocab_size == 61  # padded up to a multiple of 8
    assert model.tied_parameters == [("transformer.embeddings.wte.weight", "lm_head.weight")]
    assert model.lm_head.weight is model.transformer.embeddings.wte.weight
    # separate q/k/v projections so the built-in colwise style splits along heads
    assert model.tp_plan["transformer.h.*.attn.q_proj"] == "colwise"
    assert model.tp_plan["transformer.embeddings.wpe"] == "vocab_embedding"
    # flops: 6 x (every parameter but the two lookup tables, the tied head counted) + attention
    h, layers, inner = 32, 2, 128
    per_layer = 4 * (h * h + h) + (h * inner + inner) + (inner * h + h) + 4 * h
    matmul = layers * per_layer + 2 * h + 64 * h
    assert model.flops_per_token(16) == 6 * matmul + 12 * layers * h * 16


def test_init_scales_output_projections_and_zeroes_biases():
    gpt2 = require("nanocore-gpt2")
    m = gpt2.GPT2LMHeadModel(gpt2.GPT2Config(**{**SMALL, "n_embd": 64}), init_std=0.02)
    stds = {}
    for name, p in m.named_parameters():
        t = torch.empty(p.shape)
        m.init_parameter(name, t, torch.Generator().manual_seed(0))
        stds[name] = t.std().item() if t.numel() > 1 else t.item()
        if name.endswith(".bias"):
            assert t.abs().max() == 0, name
        if ".ln_" in name and name.endswith(".weight"):
            assert (t == 1).all(), name
    assert stds["transformer.h.0.mlp.c_fc.weight"] == pytest.approx(0.02, rel=0.1)
    assert stds["transformer.h.0.attn.c_proj.weight"] == pytest.approx(0.02 / 2, rel=0.1)  # 1/sqrt(2 * 2 layers)


def _check(tmp_path, parallelism: dict, world: int, **model_config):
    plugins = load_plugins()
    raw = gpt2_config(tmp_path, model_config, parallelism=parallelism)
    config = structure_config(raw, plugins.registries)
    check_config(config, plugins.registries, world)
    return config


def test_config_accepts_sequence_parallel_and_reads_back(tmp_path):
    require("nanocore-gpt2")
    config = _check(tmp_path, {"tp": 2, "tp_mode": "REDUCE_SCATTER"}, 2)
    assert type(config.model.model_config).__name__ == "GPT2Config"
    assert config.model.model_type == "gpt2" and config.model.model_config.n_layer == 4


@pytest.mark.parametrize(
    "model_config,parallelism,message",
    [
        ({"n_positions": 8}, {}, "model.model_config.n_positions: tokens.sequence_length = 16 is longer than"),
        ({"n_positions": 30}, {"tp": 4}, "model.model_config.n_positions: the position table (30 rows)"),
        ({"n_head": 6, "n_embd": 36}, {"tp": 4}, "model.model_config.n_head: 6 heads cannot be split"),
        ({"activation_function": "swish"}, {}, "model.model_config.activation_function: unsupported"),
    ],
)
def test_config_check_names_the_field(tmp_path, model_config, parallelism, message):
    require("nanocore-gpt2")
    world = parallelism.get("tp", 1)
    with pytest.raises(ConfigError) as err:
        _check(tmp_path, parallelism, world, **model_config)
    assert message in str(err.value)


def test_unknown_field_is_refused_with_the_yaml_path(tmp_path):
    require("nanocore-gpt2")
    plugins = load_plugins()
    raw = gpt2_config(tmp_path, {"n_embed": 32})
    with pytest.raises(ConfigError, match="n_embed"):
        structure_config(raw, plugins.registries)
