"""The `olmo3` model type: logits equal to transformers' `Olmo3ForCausalLM` with the same weights
(windowed and full layers, sequences longer than the window), generation with a KV cache, the
config and config.json rules."""

from __future__ import annotations

import pytest
import torch
import transformers

from nanocore.errors import ConfigError
from nanocore.model_api import KVCache, check_model
from nanocore_plugins.olmo3 import hf
from tests.helpers.compare import rel_diff
from tests.helpers.hf_models import assert_same_logits
from tests.helpers.olmo3 import BASE, make, tiny


def hf_model(config, **extra):
    fields = {k: getattr(config, k) for k in BASE}
    fields.update(
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        layer_types=config.attention_layer_types,
        head_dim=config.head_size,
        attn_implementation="eager",
    )
    if config.rope_scaling:
        fields["rope_scaling"] = dict(config.rope_scaling)
    torch.manual_seed(1)
    model = transformers.Olmo3ForCausalLM(transformers.Olmo3Config(**fields, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))  # norms start at one: perturbed, so that a mix-up shows
    return model


def ids(batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 101, (batch, length), generator=torch.Generator().manual_seed(seed))


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    "default-pattern": tiny(),
    "alternating-tied-bias": tiny(
        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=True, attention_bias=True
    ),
    "yarn-on-full-layers": tiny(rope_scaling=YARN, max_position_embeddings=64),
    "mha-window-1": tiny(num_key_value_heads=None, sliding_window=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_with_the_same_weights(case):
    config = CASES[case]
    reference = hf_model(config)
    ours = make(config)
    ours.load_state_dict(reference.state_dict(), strict=True)
    check_model(ours, "olmo3")
    assert_same_logits(ours, reference, ids())


def test_the_window_is_what_makes_the_logits_match():
    # Guards the test above: the same weights with every layer full differ from transformers' OLMo 3.
    config = tiny()
    reference = hf_model(config)
    ours = make(tiny(layer_types=["full_attention"] * 4))
    ours.load_state_dict(reference.state_dict())
    with torch.no_grad():
        assert rel_diff(ours(ids()), reference(ids()).logits) > 1e-3
    # and inside the window (a sequence of 5 tokens) the windows change nothing
    short = ids(length=5)
    with torch.no_grad():
        assert rel_diff(ours(short), reference(short).logits) < 1e-5


def test_layers_get_the_windows_layer_types_give():
    model = make(tiny(num_hidden_layers=8))
    windows = [layer.self_attn.window for layer in model.model.layers]
    assert windows == [5, 5, 5, None, 5, 5, 5, None]
    assert not hasattr(model.model.layers[0], "input_layernorm")
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (4 * 16,)


@pytest.mark.parametrize("case", ["default-pattern", "yarn-on-full-layers"])
def test_kv_cache_generation_equals_the_full_forward(case):
    model = make(CASES[case])
    tokens = ids(batch=1, length=14)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        first = model(tokens[:, :7], cache)
        rest = [model(tokens[:, i : i + 1], cache) for i in range(7, 14)]
    stepwise = torch.cat([first, *rest], dim=1)
    assert rel_diff(stepwise, full) <= 1e-5
    # the windowed layers keep only their window's keys
    assert cache.keys[0].shape[2] == 4 and cache.keys[3].shape[2] == 14


def test_flops_count_each_windowed_layer_over_its_window():
    model = make(tiny())
    full = make(tiny(layer_types=["full_attention"] * 4))
    width = 4 * 16
    assert full.flops_per_token(24) - model.flops_per_token(24) == pytest.approx(12 * width * 3 * (24 - 5))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(layer_types=["full_attention"] * 3), "layer_types: 3 entries for num_hidden_layers = 4"),
        (dict(layer_types=["full_attention"] * 3 + ["chunked_attention"]), "unknown ['chunked_attention']"),
        (dict(sliding_window=0), "sliding_window: sliding_attention layers need a window"),
    ],
)
def test_bad_configs_are_named_by_their_field(overrides, message):
    assert any(message in p for p in tiny(**overrides).problems())


def test_tensor_parallelism_is_refused_with_the_reason():
    (problem,) = tiny().problems(tp=2)
    assert problem.startswith("parallelism.tp:") and "whole query and key projections" in problem


def test_config_json_round_trips_and_reads_transformers_5_rope_parameters():
    config = tiny(rope_scaling=YARN)
    model = make(config)
    hf_config, hf_state = hf.to_hf(config, dict(model.state_dict()))
    saved = transformers.Olmo3Config(**{k: v for k, v in hf_config.items() if k != "architectures"}).to_dict()
    assert "rope_parameters" in saved and saved["rope_parameters"]["full_attention"]["rope_type"] == "yarn"
    back, state = hf.from_hf(saved, hf_state)
    assert back == config
    assert state.keys() == dict(model.state_dict()).keys()
    saved["rope_parameters"]["sliding_attention"] = {"rope_type": "yarn", **YARN, "rope_theta": 500000.0}
    with pytest.raises(ConfigError, match="scaled RoPE on windowed layers"):
        hf.from_hf(saved, hf_state)
