"""The LLaMA plugin: parity with transformers, pipeline blocks, KV cache, init and config checks."""

from __future__ import annotations

import math
import zlib

import attrs
import pytest
import torch
import transformers
import yaml

from nanocore.config.converter import make_converter
from nanocore.config.schema import Config, ModelArgs, ParallelismArgs
from nanocore.model_api import KVCache, check_model
from nanocore.registry import Registries
from nanocore_plugins.llama.config import LlamaConfig
from nanocore_plugins.llama.plugin import build, register_models
from tests.helpers.compare import rel_diff

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def tiny(**overrides) -> LlamaConfig:
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=101,
    )
    return LlamaConfig(**{**base, **overrides})


def make(config: LlamaConfig, seed: int = 0, vocab_multiple: int = 1):
    torch.manual_seed(seed)
    model = build(ModelArgs(model_config=config), vocab_multiple=vocab_multiple)
    with torch.no_grad():  # norms start at one; perturb them so that the tests see them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def hf_model(config: LlamaConfig) -> transformers.LlamaForCausalLM:
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        rope_scaling=dict(config.rope_scaling or {}) or None,  # transformers edits the dict it is given
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        attn_implementation="eager",
    )
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="gqa-untied"),
        pytest.param({"tie_word_embeddings": True, "num_key_value_heads": None}, id="mha-tied"),
        pytest.param(
            {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0, "attention_bias": True}, id="llama3-rope-bias"
        ),
    ],
)
def test_logits_match_transformers_with_the_same_weights(overrides):
    config = tiny(max_position_embeddings=32, **overrides)
    reference = hf_model(config)
    ours = make(config)
    ours.load_state_dict(reference.state_dict(), strict=True)
    if config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours(ids)
    assert got.shape == expected.shape
    # The same float32 math in other kernels (two layers of hidden 64 / ffn 96: reductions of <= 96
    # terms, typically sqrt(96) eps ~ 1e-6 each); measured 3e-7 of the logits' largest magnitude.
    assert rel_diff(got, expected) <= 1e-5


def test_llama3_rope_scaling_changes_the_logits():
    # Guards the parity test above: with positions past the original context the scaling matters.
    plain, scaled = make(tiny()), make(tiny(rope_scaling=LLAMA3_ROPE))
    scaled.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 101, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_diff(plain(ids), scaled(ids)) > 1e-3


def test_forward_equals_the_chain_of_pipeline_blocks():
    model = make(tiny(num_hidden_layers=3))
    blocks = model.pipeline_blocks()
    assert blocks == [
        ["model.embed_tokens"],
        ["model.layers.0"],
        ["model.layers.1"],
        ["model.layers.2"],
        ["model.norm", "lm_head"],
    ]
    x = torch.randint(0, 101, (2, 16))
    ids = x
    with torch.no_grad():
        for block in blocks:
            for name in block:
                x = model.get_submodule(name)(x)
        assert torch.equal(x, model(ids))


@pytest.mark.parametrize(
    "chunks", [[20, 1, 1, 1], [1] * 8, [5, 3, 1, 4]], ids=["prefill-decode", "token-by-token", "multi-token-chunks"]
)
def test_kv_cache_gives_the_full_forward_logits(chunks):
    model = make(tiny())
    ids = torch.randint(0, 101, (2, sum(chunks)), generator=torch.Generator().manual_seed(3))
    cache = KVCache()
    pieces, start = [], 0
    with torch.no_grad():
        full = model(ids)
        for n in chunks:
            pieces.append(model(ids[:, start : start + n], kv_cache=cache))
            start += n
    assert cache.length == ids.shape[1]
    assert cache.keys[0].shape == (2, 2, ids.shape[1], 16)  # kv heads are cached, not repeated
    assert rel_diff(torch.cat(pieces, dim=1), full) <= 1e-5  # attention over cached keys: another order


def test_vocab_is_padded_and_init_is_reproducible_from_meta():
    config = tiny(tie_word_embeddings=True)
    args = ModelArgs(model_config=config)

    def materialise(seed: int):
        with torch.device("meta"):
            model = build(args, vocab_multiple=8)
        model.to_empty(device="cpu")
        for name, p in model.named_parameters():
            model.init_parameter(name, p, torch.Generator().manual_seed(seed * 1000 + zlib.crc32(name.encode())))
        return model

    a, b, c = materialise(0), materialise(0), materialise(1)
    assert (a.vocab_size, a.true_vocab_size) == (104, 101)
    assert a.model.embed_tokens.weight.shape == (104, 64)
    assert a.lm_head.weight is a.model.embed_tokens.weight  # still tied after to_empty
    assert a.tied_parameters == [("model.embed_tokens.weight", "lm_head.weight")]
    check_model(a, "llama")  # every member nanocore.model_api.CausalLM requires
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones(64))
    std = sa["model.layers.0.mlp.up_proj.weight"].std().item()
    out_std = torch.cat([sa[f"model.layers.{i}.self_attn.o_proj.weight"].flatten() for i in range(2)]).std().item()
    assert abs(std - 0.02) < 0.002
    assert abs(out_std - 0.02 / math.sqrt(4)) < 0.002


def test_flops_and_tp_plan_describe_the_model():
    model = make(tiny())
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if n != "model.embed_tokens.weight")
    assert model.flops_per_token(32) == 6 * non_embedding + 12 * 2 * 64 * 32
    assert model.tp_plan["model.layers.*.self_attn.k_proj"] == {"style": "colwise_kv", "head_dim": 16}
    assert model.tp_plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert model.tp_plan["lm_head"] == "lm_head"


def test_no_buffers_so_the_engine_only_materialises_parameters():
    with torch.device("meta"):
        model = build(ModelArgs(model_config=tiny(rope_scaling=LLAMA3_ROPE)))
    assert list(model.buffers()) == []
    assert model(torch.zeros(1, 4, dtype=torch.long, device="meta")).shape == (1, 4, 101)


def check(tp: int = 1, **overrides) -> list[str]:
    config = Config(model=ModelArgs(model_config=tiny(**overrides)), parallelism=ParallelismArgs(tp=tp))
    return config.model.model_config.check(config)


@pytest.mark.parametrize(
    ("tp", "overrides", "key"),
    [
        (1, {"hidden_size": 66}, "hidden_size"),
        (1, {"num_key_value_heads": 3}, "num_key_value_heads"),
        (3, {"num_key_value_heads": 1}, "num_attention_heads"),
        (2, {"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 48}, "num_key_value_heads"),
        (1, {"hidden_act": "swish"}, "hidden_act"),
        (1, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        (1, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        (1, {"rope_interleaved": True}, "rope_interleaved"),
    ],
)
def test_check_names_each_config_problem(tp, overrides, key):
    problems = check(tp, **overrides)
    assert len(problems) == 1 and problems[0].startswith(f"{key}: "), problems


def test_check_accepts_valid_layouts():
    assert check() == []
    assert check(tp=4, num_key_value_heads=2) == []  # kv heads replicated across tp
    assert check(tp=2, num_key_value_heads=2, rope_scaling=LLAMA3_ROPE) == []


def test_build_refuses_an_invalid_config():
    with pytest.raises(Exception, match="model.model_config.hidden_size"):
        build(ModelArgs(model_config=attrs.evolve(tiny(), hidden_size=66)))


def test_nanotron_style_yaml_section_round_trips():
    registries = Registries()
    register_models(registry=registries.model)
    converter = make_converter(registries)
    section = yaml.safe_load(
        """
        model_config:
          is_llama_config: true
          hidden_size: 64
          num_attention_heads: 4
          num_key_value_heads: 2
          rms_norm_eps: 1e-5
          rope_theta: 500000
          rope_scaling: {rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0,
                         original_max_position_embeddings: 16}
        """
    )
    args = converter.structure(section, ModelArgs)
    assert args.model_type == "llama"
    assert args.model_config == tiny(
        intermediate_size=256, vocab_size=256, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE
    )
    assert converter.structure(converter.unstructure(args), ModelArgs) == args


def test_grouped_query_attention_uses_sdpa_without_repeating_key_values(monkeypatch):
    """Where torch has `enable_gqa`, key/value heads reach SDPA unrepeated (no group-times copies) and
    the result equals attention over explicitly repeated heads."""
    from nanocore.model_parts import attention as llama_model

    if not llama_model.SDPA_HAS_GQA:
        pytest.skip("this torch has no enable_gqa (before 2.5): key/value heads are repeated instead")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, 4, generator=g)
    k, v = torch.randn(2, 2, 16, 4, generator=g), torch.randn(2, 2, 16, 4, generator=g)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q_, k_, v_, **kwargs):
        seen.append((k_.shape[1], kwargs.get("enable_gqa")))
        return sdpa(q_, k_, v_, **kwargs)

    monkeypatch.setattr(llama_model.F, "scaled_dot_product_attention", spy)
    out = llama_model.attention(q, k, v)
    assert seen == [(2, True)]
    expected = sdpa(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
