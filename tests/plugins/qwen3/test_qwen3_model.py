"""The `qwen3` and `qwen3_moe` model types: logits equal to transformers' classes with the same
weights, the KV cache, the TP plan's head norms, and config errors."""

from __future__ import annotations

import attrs
import pytest
import torch
import transformers

from nanocore.config.schema import Config, ModelArgs, ParallelismArgs
from nanocore.model_api import KVCache, check_model
from nanocore_plugins.qwen3.config import Qwen3MoeConfig
from tests.helpers.compare import rel_diff
from tests.helpers.hf_models import assert_same_logits
from tests.helpers.qwen3 import BASE, MOE, make, tiny, tiny_moe


def hf_model(config, **extra):
    fields = {k: getattr(config, k) for k in BASE if k != "head_dim"}
    fields.update(
        head_dim=config.head_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        num_key_value_heads=config.kv_heads,
        attn_implementation="eager",
    )
    if isinstance(config, Qwen3MoeConfig):
        for key in (*MOE, "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
            fields[key] = getattr(config, key)
        hf_config, cls = transformers.Qwen3MoeConfig(**fields, **extra), transformers.Qwen3MoeForCausalLM
    else:
        hf_config, cls = transformers.Qwen3Config(**fields, **extra), transformers.Qwen3ForCausalLM
    torch.manual_seed(1)
    model = cls(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))  # norms start at one: perturbed, so that a mix-up shows
            elif "experts" in name or "gate" in name:
                p.normal_(0.0, 0.3)  # routing that differs across tokens
    return model


def ids(batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 101, (batch, length), generator=torch.Generator().manual_seed(seed))


CASES = {
    "gqa-untied-head24": tiny(),
    "mha-tied-bias": tiny(num_key_value_heads=None, tie_word_embeddings=True, attention_bias=True),
    "head16-theta1e6": tiny(head_dim=None, rope_theta=1e6),
    "moe-top2": tiny_moe(),
    "moe-normalised-dense-first": tiny_moe(norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=3),
    "moe-sparse-step2-tied": tiny_moe(decoder_sparse_step=2, tie_word_embeddings=True, num_hidden_layers=4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_with_the_same_weights(case):
    config = CASES[case]
    reference = hf_model(config)
    ours = make(config)
    ours.load_state_dict(reference.state_dict(), strict=True)
    check_model(ours, "qwen3")
    assert_same_logits(ours, reference, ids())  # measured ~3e-7 of the logits' largest magnitude


def test_the_qk_norm_is_what_makes_the_logits_match():
    # Guards the test above: transformers' Qwen3 differs from the same weights without qk-norm.
    config = tiny()
    reference = hf_model(config)
    ours = make(config)
    ours.load_state_dict(reference.state_dict())
    for layer in ours.model.layers:
        with torch.no_grad():
            layer.self_attn.q_norm.weight.fill_(1.0)
    with torch.no_grad():
        assert rel_diff(ours(ids()), reference(ids()).logits) > 1e-3


def test_sparse_and_dense_layers_follow_transformers_rule():
    model = make(tiny_moe(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert model.moe_layers == ["model.layers.1.mlp", "model.layers.5.mlp"]
    assert hasattr(model.model.layers[0].mlp, "gate_proj") and hasattr(model.model.layers[3].mlp, "gate_proj")
    # the dense layers' MLPs split over TP; the experts stay whole (expert parallelism splits them)
    assert model.tp_plan["model.layers.0.mlp.gate_proj"] == "colwise"
    assert not any("experts" in k for k in model.tp_plan)
    assert model.tp_plan["model.layers.*.self_attn.q_norm"] == "head_norm"


@pytest.mark.parametrize("case", ["gqa-untied-head24", "moe-top2"])
def test_kv_cache_generation_equals_the_full_forward(case):
    model = make(CASES[case])
    tokens = ids(batch=1, length=12)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        first = model(tokens[:, :7], cache)
        rest = [model(tokens[:, i : i + 1], cache) for i in range(7, 12)]
    stepwise = torch.cat([first, *rest], dim=1)
    assert rel_diff(stepwise, full) <= 1e-5


def test_active_parameters_count_k_of_e_experts():
    config = tiny_moe()
    model = make(config)
    dense = make(tiny())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    assert expert_params == config.num_hidden_layers * config.num_experts * 3 * 64 * config.moe_intermediate_size
    # 6N: the experts count k / E of their parameters
    router = config.num_hidden_layers * config.num_experts * 64
    active_experts = expert_params * config.num_experts_per_tok / config.num_experts
    dense_mlps = config.num_hidden_layers * 3 * 64 * 96
    expected = dense._matmul_params - dense_mlps + router + active_experts
    assert model._matmul_params == pytest.approx(expected)


def check(tp: int = 1, ep: int = 1, moe: bool = False, **overrides) -> list[str]:
    model_config = tiny_moe(**overrides) if moe else tiny(**overrides)
    config = Config(
        model=ModelArgs(model_config=model_config), parallelism=ParallelismArgs(tp=tp, expert_parallel_size=ep)
    )
    return config.model.model_config.check(config)


@pytest.mark.parametrize(
    ("tp", "ep", "moe", "overrides", "key"),
    [
        (3, 1, False, {"num_key_value_heads": 1}, "num_attention_heads"),
        (1, 1, False, {"head_dim": 7}, "head_dim"),
        (1, 1, False, {"use_sliding_window": True}, "use_sliding_window"),
        (1, 4, True, {}, "num_experts"),
        (1, 1, True, {"num_experts_per_tok": 7}, "num_experts_per_tok"),
        (1, 1, True, {"mlp_only_layers": [2]}, "mlp_only_layers"),
        (1, 1, True, {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ],
)
def test_check_names_each_config_problem(tp, ep, moe, overrides, key):
    problems = check(tp, ep, moe, **overrides)
    assert len(problems) == 1 and problems[0].startswith(f"{key}: "), problems


def test_check_accepts_valid_layouts():
    assert check() == []
    assert check(tp=2, ep=2, moe=True) == []
    assert check(tp=4) == []  # 2 kv heads replicated over 4 ranks


SLIDING = {
    "qwen3-windows-from-layer-1": tiny(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3-layer-types": tiny(
        use_sliding_window=True, sliding_window=3, layer_types=["sliding_attention", "full_attention"]
    ),
    "moe-every-layer-windowed": tiny_moe(use_sliding_window=True, sliding_window=5),
}


@pytest.mark.parametrize("case", list(SLIDING))
def test_sliding_window_logits_match_transformers(case):
    config = SLIDING[case]
    extra = {"layer_types": config.layer_types} if config.layer_types else {}
    reference = hf_model(
        config,
        use_sliding_window=True,
        sliding_window=config.sliding_window,
        **({"max_window_layers": config.max_window_layers} if not isinstance(config, Qwen3MoeConfig) else {}),
        **extra,
    )
    ours = make(config)
    ours.load_state_dict(reference.state_dict(), strict=True)
    assert any(layer.self_attn.window for layer in ours.model.layers)
    assert_same_logits(ours, reference, ids())  # 24 tokens, windows of 3 and 5
    full = make(attrs.evolve(config, use_sliding_window=False))
    full.load_state_dict(reference.state_dict())
    with torch.no_grad():  # the windows are what makes them match
        assert rel_diff(full(ids()), reference(ids()).logits) > 1e-3


def test_sliding_window_config_json_round_trips():
    from nanocore_plugins.qwen3 import hf

    config = SLIDING["qwen3-windows-from-layer-1"]
    hf_config, state = hf.to_hf(config, dict(make(config).state_dict()))
    saved = transformers.Qwen3Config(**{k: v for k, v in hf_config.items() if k != "architectures"}).to_dict()
    assert saved["layer_types"] == ["full_attention", "sliding_attention"]
    back, _ = hf.from_hf(saved, state)
    assert back == config
