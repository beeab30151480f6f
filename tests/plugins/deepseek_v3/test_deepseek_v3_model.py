"""The `deepseek_v3` model type: logits equal to transformers' DeepseekV3ForCausalLM with the same
weights (MLA with and without a query bottleneck, interleaved and rotate-half rotary, YaRN with its
softmax mscale, group-limited sigmoid routing with a balancing bias, shared experts, dense first
layers), the latent KV cache, and config errors."""

from __future__ import annotations

import pytest
import torch
import transformers

from nanocore.config.schema import Config, ModelArgs, ParallelismArgs
from nanocore.model_api import KVCache, check_model
from tests.helpers.compare import rel_diff
from tests.helpers.deepseek_v3 import BASE, YARN, make, tiny
from tests.helpers.hf_models import assert_same_logits


def hf_model(config):
    fields = {k: getattr(config, k) for k in BASE}
    fields.update(
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        rope_scaling=dict(config.rope_scaling) if config.rope_scaling else None,
        rope_interleave=config.rope_interleave,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        norm_topk_prob=config.norm_topk_prob,
        num_key_value_heads=config.num_attention_heads,
        attn_implementation="eager",
    )
    torch.manual_seed(1)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))  # norms start at one: perturbed, so that a mix-up shows
            elif "experts" in name or "gate" in name:
                p.normal_(0.0, 0.3)  # routing that differs across tokens
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)  # the balancing bias changes which experts are picked
    return model


def ids(batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 101, (batch, length), generator=torch.Generator().manual_seed(seed))


CASES = {
    "mla-q-lora-interleaved": tiny(),
    "mla-no-q-lora-rotate-half-tied": tiny(q_lora_rank=None, rope_interleave=False, tie_word_embeddings=True),
    "yarn-mscale": tiny(rope_scaling=YARN, rope_theta=50000.0),
    "no-groups-unnormalised-bias": tiny(n_group=1, topk_group=1, norm_topk_prob=False, attention_bias=True),
    "all-dense": tiny(first_k_dense_replace=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_with_the_same_weights(case):
    config = CASES[case]
    reference = hf_model(config)
    ours = make(config)
    missing = ours.load_state_dict(reference.state_dict(), strict=True)
    assert not missing.missing_keys
    check_model(ours, "deepseek_v3")
    assert_same_logits(ours, reference, ids())  # measured ~3e-7 of the logits' largest magnitude


def test_group_limited_routing_changes_the_logits():
    # Guards the test above: with two of four groups allowed, some tokens lose an expert they would pick.
    grouped, free = CASES["mla-q-lora-interleaved"], tiny(n_group=1, topk_group=1)
    reference = hf_model(grouped)
    a, b = make(grouped), make(free)
    a.load_state_dict(reference.state_dict())
    b.load_state_dict(reference.state_dict())
    with torch.no_grad():
        assert rel_diff(a(ids()), b(ids())) > 1e-4


def test_kv_cache_holds_the_latent_and_equals_the_full_forward():
    config = tiny()
    model = make(config)
    tokens = ids(batch=1, length=12)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        first = model(tokens[:, :7], cache)
        rest = [model(tokens[:, i : i + 1], cache) for i in range(7, 12)]
    assert rel_diff(torch.cat([first, *rest], dim=1), full) <= 1e-5
    # per token and layer: the latent and the shared rotary key, not keys and values per head
    assert cache.keys[0].shape == (1, 1, 12, config.kv_lora_rank)
    assert cache.values[0].shape == (1, 1, 12, config.qk_rope_head_dim)


def test_tp_plan_splits_heads_and_keeps_the_latent_whole():
    plan = make(tiny()).tp_plan
    attn = "model.layers.*.self_attn"
    assert plan[f"{attn}.q_b_proj"] == plan[f"{attn}.kv_b_proj"] == "colwise_local"
    assert plan[f"{attn}.kv_a_proj_with_mqa"] == {"style": "colwise_kv", "head_dim": 24 + 8}
    assert plan[f"{attn}.kv_a_layernorm"] == plan[f"{attn}.q_a_layernorm"] == "head_norm"
    assert plan[f"{attn}.o_proj"] == "rowwise"
    assert plan["model.layers.0.mlp.gate_proj"] == "colwise"  # the dense first layer
    assert plan["model.layers.*.mlp.shared_experts.down_proj"] == "rowwise"


def check(tp: int = 1, ep: int = 1, **overrides) -> list[str]:
    config = Config(
        model=ModelArgs(model_config=tiny(**overrides)), parallelism=ParallelismArgs(tp=tp, expert_parallel_size=ep)
    )
    return config.model.model_config.check(config)


@pytest.mark.parametrize(
    ("tp", "ep", "overrides", "key"),
    [
        (3, 1, {}, "num_attention_heads"),
        (1, 1, {"n_group": 3}, "n_group"),
        (1, 1, {"topk_group": 5}, "topk_group"),
        (1, 1, {"n_group": 8, "topk_group": 1}, "topk_group"),  # one group of one expert < top-2
        (1, 3, {}, "n_routed_experts"),
        (1, 1, {"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        (1, 1, {"num_nextn_predict_layers": 1, "mtp_loss_coef": -1.0}, "mtp_loss_coef"),
    ],
)
def test_check_names_each_config_problem(tp, ep, overrides, key):
    problems = check(tp, ep, **overrides)
    assert len(problems) == 1 and problems[0].startswith(f"{key}: "), problems


def test_check_accepts_valid_layouts():
    assert check() == []
    assert check(tp=2, ep=4) == []
