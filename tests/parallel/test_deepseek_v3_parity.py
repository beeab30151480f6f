"""DeepSeek-V3 at the layouts issue 21 names, each equal to one process for 10 steps in float32
(tests/helpers/parity.py states the tolerances and why). Multi-head latent attention under TP keeps
its latent projections whole and splits the heads (nanocore.model_parts.mla): tp2 in both modes
proves the gradient bookkeeping of that split; cp2 runs ring attention with value heads narrower
than query/key heads."""

from __future__ import annotations

import pytest

from tests.helpers import moe_parity
from tests.helpers.parity import GLOBAL_MICROBATCHES, layout
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

TINY_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "router_bias_update_rate": 0.01,
}
LAYOUTS = {
    "tp2_all_reduce": (layout(tp=2, tp_mode="ALL_REDUCE"), {}),
    "tp2_reduce_scatter": (layout(tp=2, tp_mode="REDUCE_SCATTER"), {}),
    "cp2": (layout(context_parallel_size=2), {}),
    "ep2_pp2_1f1b": (layout(dp=2, pp=2, expert_parallel_size=2, pp_engine="1f1b"), {}),
    "dp2_zero3": (layout(dp=2), {"optimizer": {"zero_stage": 3}}),
    "dp2_tp2_pp2_ep2": (
        layout(dp=2, tp=2, pp=2, expert_parallel_size=2, tp_mode="REDUCE_SCATTER", pp_engine="1f1b"),
        {},
    ),
}


def deepseek_config(tmp, par: dict | None = None, **sections) -> dict:
    par = par or layout()
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // par["dp"]}
    model = {"model_config": dict(TINY_DEEPSEEK_V3)}
    return tiny_config(tmp, model=model, parallelism=par, tokens=tokens, **sections)


_reference: dict[str, dict] = {}


def reference(tmp_path_factory) -> dict:
    if "ref" not in _reference:
        _reference["ref"] = run_training(deepseek_config(tmp_path_factory.mktemp("deepseek_reference")))
    return _reference["ref"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_v3_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    par, extra = LAYOUTS[name]
    world = par["dp"] * par["tp"] * par["pp"] * par.get("context_parallel_size", 1)
    run = run_training(deepseek_config(tmp_path, par, **extra), world)
    moe_parity.assert_matches(run, reference(tmp_path_factory), metrics=("moe_max_load",))
