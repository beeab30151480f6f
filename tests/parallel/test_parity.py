"""The proof: every parallel layout trains exactly like one process (float32, gloo on CPU).

Each layout runs 10 optimizer steps from the same seed on the same global batches and must match
the single-process run: step-1 loss within 1e-5 relative, later losses within 1e-4 relative, final
weights within 1e-4 relative (`norm_rel_diff`: ||a - b|| of each tensor over its norm).
"""

from __future__ import annotations

import pytest

from tests.helpers.compare import rel_diff
from tests.helpers.parity import (
    GLOBAL_MICROBATCHES,
    RTOL,
    STEP1_RTOL,
    assert_matches,
    layout,
    reference,
    weight_diffs,
)
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

LAYOUTS = {
    "dp2": (layout(dp=2), {}),
    "tp2_all_reduce": (layout(tp=2, tp_mode="ALL_REDUCE"), {}),
    "tp2_reduce_scatter_async": (layout(tp=2, tp_mode="REDUCE_SCATTER", tp_linear_async_communication=True), {}),
    "pp2_afab": (layout(pp=2, pp_engine="afab"), {}),
    "pp2_1f1b": (layout(pp=2, pp_engine="1f1b"), {}),
    "pp4_1f1b": (layout(pp=4, pp_engine="1f1b"), {}),
    "pp2_interleaved_v2": (layout(pp=2, pp_engine="interleaved", pp_virtual_stages=2), {}),
    "dp2_tp2_pp2_1f1b_zero1": (layout(dp=2, tp=2, pp=2, pp_engine="1f1b"), {"optimizer": {"zero_stage": 1}}),
    "recompute": (layout(pp=2, recompute_layer=True), {}),
    "selective_recompute_dp2_tp2_reduce_scatter": (
        layout(dp=2, tp=2, tp_mode="REDUCE_SCATTER", recompute_granularity="selective"),
        {},
    ),
    "selective_recompute_pp2_1f1b": (layout(pp=2, pp_engine="1f1b", recompute_granularity="selective"), {}),
    # ZeRO-2: gradients reduce-scattered during backward, each rank steps and exchanges its rows
    "dp2_zero2": (layout(dp=2), {"optimizer": {"zero_stage": 2}}),
    "dp4_zero2": (layout(dp=4), {"optimizer": {"zero_stage": 2}}),
    # tp4 with 2 key/value heads: each kv head's gradient is summed over the 2 ranks sharing it, row for row
    "dp2_tp4_reduce_scatter_zero2": (layout(dp=2, tp=4, tp_mode="REDUCE_SCATTER"), {"optimizer": {"zero_stage": 2}}),
    "dp2_pp2_interleaved_recompute_zero2": (
        layout(dp=2, pp=2, pp_engine="interleaved", pp_virtual_stages=2, recompute_layer=True),
        {"optimizer": {"zero_stage": 2}},
    ),
    # ZeRO-3: parameters sharded at rest, each block gathered for its forward and again for its backward
    "dp2_zero3": (layout(dp=2), {"optimizer": {"zero_stage": 3}}),
    "dp4_zero3": (layout(dp=4), {"optimizer": {"zero_stage": 3}}),
    "dp2_tp2_reduce_scatter_zero3": (layout(dp=2, tp=2, tp_mode="REDUCE_SCATTER"), {"optimizer": {"zero_stage": 3}}),
    "dp2_tp2_all_reduce_recompute_zero3": (
        layout(dp=2, tp=2, tp_mode="ALL_REDUCE", recompute_layer=True),
        {"optimizer": {"zero_stage": 3}},
    ),
    "dp2_pp2_1f1b_zero3": (layout(dp=2, pp=2, pp_engine="1f1b"), {"optimizer": {"zero_stage": 3}}),
    "dp2_pp2_interleaved_zero3": (
        layout(dp=2, pp=2, pp_engine="interleaved", pp_virtual_stages=2),
        {"optimizer": {"zero_stage": 3}},
    ),
    "dp2_tp2_pp2_1f1b_zero3": (layout(dp=2, tp=2, pp=2, pp_engine="1f1b"), {"optimizer": {"zero_stage": 3}}),
    "dp2_pp2_afab_selective_recompute_zero3": (
        layout(dp=2, pp=2, pp_engine="afab", recompute_granularity="selective"),
        {"optimizer": {"zero_stage": 3}},
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    par, extra = LAYOUTS[name]
    world = par["dp"] * par["tp"] * par["pp"]
    accumulation = GLOBAL_MICROBATCHES // par["dp"]
    config = tiny_config(tmp_path, parallelism=par, tokens={"batch_accumulation_per_replica": accumulation}, **extra)
    assert_matches(run_training(config, world), reference(tmp_path_factory, tied=False))


def test_tied_embeddings_across_pipeline_stages(tmp_path, tmp_path_factory):
    model = {"model_config": {"tie_word_embeddings": True}}
    config = tiny_config(tmp_path, parallelism=layout(pp=2), model=model)
    run = run_training(config, 2)
    ref = reference(tmp_path_factory, tied=True)
    assert "lm_head.weight" not in run["weights"], "a tied head is saved once, under the embedding's name"
    assert_matches(run, ref)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("pp", [1, 2])
def test_zero2_and_zero3_tied_embeddings(stage, pp, tmp_path, tmp_path_factory):
    """At pp2 the tied pair's two sides hold the same rows of their reduce-scattered gradients and sum
    them; at pp1 (ZeRO-3) the one parameter is gathered for the embedding and again for the head."""
    model = {"model_config": {"tie_word_embeddings": True}}
    par = layout(dp=2, pp=pp, pp_engine="1f1b")
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // 2}
    config = tiny_config(tmp_path, parallelism=par, model=model, tokens=tokens, optimizer={"zero_stage": stage})
    assert_matches(run_training(config, 2 * pp), reference(tmp_path_factory, tied=True))


def test_zero_stages_shard_state_gradients_and_parameters(tmp_path):
    """At dp4, ZeRO-1 keeps ~1/4 of stage 0's optimizer state on each rank, ZeRO-2 also ~1/4 of its
    gradients (nothing else holds a gradient between steps), ZeRO-3 also ~1/4 of its parameters (no
    parameter is whole between steps); all four take the same step."""
    tokens = {"batch_accumulation_per_replica": 1, "train_steps": 1}
    runs = {
        stage: run_training(
            tiny_config(
                tmp_path / f"z{stage}", parallelism=layout(dp=4), tokens=tokens, optimizer={"zero_stage": stage}
            ),
            4,
        )
        for stage in (0, 1, 2, 3)
    }
    full_state = runs[0]["ranks"][0]["state_bytes"]
    full_grads = runs[0]["ranks"][0]["memory"]["grads_held_bytes"]
    full_params = runs[0]["ranks"][0]["memory"]["params_held_bytes"]
    assert all(r["state_bytes"] == full_state for r in runs[0]["ranks"])
    assert full_grads == full_params == sum(p.numel() for p in runs[0]["weights"].values()) * 4  # float32
    for stage in (1, 2, 3):
        per_rank = [r["state_bytes"] for r in runs[stage]["ranks"]]
        for b in per_rank:
            assert abs(b - full_state / 4) <= 0.05 * full_state / 4, (stage, per_rank, full_state)
        # the shards add up to the whole (only the per-parameter scalar step counters are replicated)
        assert abs(sum(per_rank) - full_state) <= 0.01 * full_state
        # one step: the same forward at the same layout, so the step-1 tolerance
        losses = zip(runs[stage]["losses"], runs[0]["losses"], strict=True)
        assert max(rel_diff(a, b) for a, b in losses) <= STEP1_RTOL
        assert max(weight_diffs(runs[stage]["weights"], runs[0]["weights"]).values()) <= RTOL
    assert [r["memory"]["grads_held_bytes"] for r in runs[1]["ranks"]] == [full_grads] * 4
    for stage in (2, 3):
        sharded = [r["memory"]["grads_held_bytes"] for r in runs[stage]["ranks"]]
        for b in sharded:
            assert abs(b - full_grads / 4) <= 0.05 * full_grads / 4, (stage, sharded, full_grads)
        assert [r["memory"]["grads_bytes"] for r in runs[stage]["ranks"]] == sharded  # what the summary reports
    for stage in (0, 1, 2):
        assert [r["memory"]["params_held_bytes"] for r in runs[stage]["ranks"]] == [full_params] * 4
    params = [r["memory"]["params_held_bytes"] for r in runs[3]["ranks"]]
    for b in params:
        assert abs(b - full_params / 4) <= 0.05 * full_params / 4, (params, full_params)
    assert [r["memory"]["params_bytes"] for r in runs[3]["ranks"]] == params
