"""The proof: every parallel layout trains exactly like one process (float32, gloo on CPU).

Each layout runs 10 optimizer steps from the same seed on the same global batches and must match
the single-process run: step-1 loss within 1e-5 relative, later losses within 1e-4 relative, final
weights within 1e-4 relative (`norm_rel_diff`: ||a - b|| of each tensor over its norm).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.compare import norm_rel_diff, rel_diff
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

GLOBAL_MICROBATCHES = 4  # global batch = dp x micro_batch_size(1) x accumulation


def layout(dp=1, tp=1, pp=1, **par):
    return {"dp": dp, "tp": tp, "pp": pp, **par}


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

_reference: dict[bool, dict] = {}


def reference(tmp_path_factory, tied: bool) -> dict:
    if tied not in _reference:
        tmp = tmp_path_factory.mktemp(f"reference_tied{tied}")
        model = {"model_config": {"tie_word_embeddings": tied}}
        _reference[tied] = run_training(tiny_config(tmp, model=model))
    return _reference[tied]


# Relative tolerances: a layout sums the same float32 terms in another order (split over ranks,
# micro-batches, buckets), which moves a result in proportion to its size. Step 1 is one forward of
# the same weights: only the loss reductions differ (a few ulps; measured <= 1.2e-7). Later steps
# and the weights add 10 AdamW updates on reordered gradients; measured <= 1e-5 of a weight tensor's
# norm (tp2 GPT-2; 1.4e-6 for LLaMA at 3D), while single elements of a tensor can differ by 8e-5 of
# its largest value (`norm_rel_diff` says why), hence norms. Wrong gradients show far above 1e-4:
# dropping tp2 REDUCE_SCATTER's gradient sync moves all 39 tensors by over 1e-4 (up to 7e-3), dropping
# it for one norm weight moves 14 tensors by up to 2.4e-3 (while the losses stay within 1e-4).
STEP1_RTOL, RTOL = 1e-5, 1e-4
# A key projection's bias has a gradient of zero in exact arithmetic (it adds q.b to all of a query's
# scores, which softmax ignores): Adam turns its rounding-noise gradient into noise-driven steps that
# differ in every layout, so its trained value (a few 1e-5, noise in the reference too) has no parity.
NO_GRADIENT_SUFFIXES = (".k_proj.bias",)


def weight_diffs(weights: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """`norm_rel_diff` of every trained tensor from the reference's, except those that get no gradient."""
    assert weights.keys() == ref.keys()
    return {
        name: norm_rel_diff(weights[name], tensor)
        for name, tensor in ref.items()
        if not name.endswith(NO_GRADIENT_SUFFIXES)
    }


def assert_matches(run: dict, ref: dict) -> None:
    losses, ref_losses = run["losses"], ref["losses"]
    assert len(losses) == len(ref_losses) == 10
    assert rel_diff(losses[0], ref_losses[0]) <= STEP1_RTOL, (losses[0], ref_losses[0])
    diffs = [rel_diff(a, b) for a, b in zip(losses, ref_losses, strict=True)]
    assert max(diffs) <= RTOL, f"per-step relative loss differences: {diffs}"
    assert max(ref_losses) - min(ref_losses) > 0.01, "the reference must actually train for parity to mean anything"
    bad = {name: diff for name, diff in weight_diffs(run["weights"], ref["weights"]).items() if not diff <= RTOL}
    assert not bad, f"weights differ by more than {RTOL} of their norm: {bad}"


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
            tiny_config(tmp_path / f"z{stage}", parallelism=layout(dp=4), tokens=tokens, optimizer={"zero_stage": stage}),
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
