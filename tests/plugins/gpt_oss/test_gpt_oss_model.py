"""The `gpt_oss` model type: logits equal to transformers' `GptOssForCausalLM` with the same weights
(sinks, windowed and full layers, YaRN, biased routing and experts, the clamped SwiGLU), generation
with a KV cache, and the conversion to and from transformers' layout."""

from __future__ import annotations

import pytest
import torch
import transformers

from nanocore.model_api import KVCache, check_model
from nanocore_plugins.gpt_oss import hf
from tests.helpers.compare import rel_diff
from tests.helpers.gpt_oss import BASE, make, tiny
from tests.helpers.hf_models import assert_same_logits


def hf_model(config):
    fields = {k: getattr(config, k) for k in BASE}
    fields.update(
        num_key_value_heads=config.kv_heads,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        layer_types=config.attention_layer_types,
        rope_parameters={**(config.rope_scaling or {"rope_type": "default"}), "rope_theta": config.rope_theta},
        attn_implementation="eager",
        experts_implementation="eager",
    )
    torch.manual_seed(1)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))  # norms start at one: perturbed, so that a mix-up shows
            elif "sinks" in name:
                p.normal_(0.0, 1.0)  # sinks large enough to take a visible share of each softmax
            elif "experts" in name or "router" in name:
                p.normal_(0.0, 0.3)  # routing that differs across tokens, activations past the clamps
    return model


def ids(batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 101, (batch, length), generator=torch.Generator().manual_seed(seed))


def load(config):
    reference = hf_model(config)
    _, state = hf.from_hf(reference.config.to_dict(), dict(reference.state_dict()))
    ours = make(config)
    ours.load_state_dict(state, strict=True)
    return ours, reference


CASES = {
    "default-pattern": tiny(),
    "every-layer-windowed-window-1": tiny(layer_types=["sliding_attention"] * 4, sliding_window=1),
    "mha-no-yarn": tiny(num_key_value_heads=None, rope_scaling=None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_with_the_same_weights(case):
    ours, reference = load(CASES[case])
    check_model(ours, "gpt_oss")
    assert_same_logits(ours, reference, ids())


def test_the_sinks_are_what_makes_the_logits_match():
    # Guards the test above: the same weights with the sinks at -inf (no sink) differ from transformers'.
    ours, reference = load(tiny())
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.sinks.fill_(-1e9)
        assert rel_diff(ours(ids()), reference(ids()).logits) > 1e-3


def test_kv_cache_generation_equals_the_full_forward():
    model = make(tiny())
    tokens = ids(batch=1, length=14)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        first = model(tokens[:, :7], cache)
        rest = [model(tokens[:, i : i + 1], cache) for i in range(7, 14)]
    assert rel_diff(torch.cat([first, *rest], dim=1), full) <= 1e-5
    assert cache.keys[0].shape[2] == 4 and cache.keys[1].shape[2] == 14


def test_export_to_transformers_is_bit_exact_and_round_trips():
    config = tiny()
    model = make(config)
    hf_config, hf_state = hf.to_hf(config, dict(model.state_dict()))
    reference = transformers.GptOssForCausalLM(
        transformers.GptOssConfig(**{k: v for k, v in hf_config.items() if k != "architectures"})
    )
    reference.load_state_dict(hf_state, strict=True)
    back, state = hf.from_hf(reference.config.to_dict(), dict(reference.state_dict()))
    assert back == config
    assert all(torch.equal(state[n], t) for n, t in model.state_dict().items())


def test_tensor_parallelism_is_refused_with_the_reason():
    problems = tiny().problems(tp=2)
    assert len(problems) == 1 and problems[0].startswith("parallelism.tp:") and "sink" in problems[0]
