"""The proof for mixture-of-experts: every expert-parallel layout trains exactly like one process.

A tiny Mixtral (4 experts, top-2, auxiliary loss on) runs 10 optimizer steps from the same seed on
the same global batches; each layout must match the single-process run within the dense parity
tests' tolerances (step-1 loss 1e-5 relative, later losses and final weights 1e-4 relative), and
its logged `moe_aux_loss` / `moe_max_load` must equal the reference's. Every layout cuts the global
batch into the same micro-batches (micro_batch_size 1), so the per-micro-batch auxiliary loss is
the same sum of the same terms.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.moe_parity import assert_matches, moe_config, reference
from tests.helpers.parity import RTOL, STEP1_RTOL, layout, weight_diffs
from tests.helpers.training import run_training

pytestmark = pytest.mark.slow

LAYOUTS = {
    "ep2_dp2": (layout(dp=2, expert_parallel_size=2), {}),
    "ep2_tp2_all_reduce": (layout(dp=2, tp=2, expert_parallel_size=2, tp_mode="ALL_REDUCE"), {}),
    "ep2_tp2_reduce_scatter": (layout(dp=2, tp=2, expert_parallel_size=2, tp_mode="REDUCE_SCATTER"), {}),
    "ep2_pp2_1f1b": (layout(dp=2, pp=2, expert_parallel_size=2, pp_engine="1f1b"), {}),
    # recomputation re-runs the MoE forwards (and their collectives) inside backward: nothing counted twice
    "ep2_pp2_afab_recompute": (
        layout(dp=2, pp=2, expert_parallel_size=2, pp_engine="afab", recompute_layer=True, tp_mode="ALL_REDUCE"),
        {},
    ),
    "ep4_dp4_zero1": (layout(dp=4, expert_parallel_size=4), {"optimizer": {"zero_stage": 1}}),
    "dp2_tp2_pp2_ep2_interleaved_zero1": (
        layout(
            dp=2,
            tp=2,
            pp=2,
            expert_parallel_size=2,
            pp_engine="interleaved",
            pp_virtual_stages=2,
            tp_mode="REDUCE_SCATTER",
        ),
        {"optimizer": {"zero_stage": 1}},
    ),
    # ZeRO-2: expert gradients reduce-scattered over the 2 ranks holding the same experts, the rest over dp4
    "ep2_dp4_zero2": (layout(dp=4, expert_parallel_size=2), {"optimizer": {"zero_stage": 2}}),
    # ZeRO-3: expert weights' rows over their 2 replicas, gathered per block like the rest
    "ep2_dp4_zero3": (layout(dp=4, expert_parallel_size=2), {"optimizer": {"zero_stage": 3}}),
    "ep1_dp2": (layout(dp=2), {}),  # experts replicated over DP: the plain data-parallel path
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    par, extra = LAYOUTS[name]
    world = par["dp"] * par["tp"] * par["pp"]
    run = run_training(moe_config(tmp_path, par, **extra), world)
    assert_matches(run, reference(tmp_path_factory))


def test_reference_really_uses_the_auxiliary_loss(tmp_path, tmp_path_factory):
    """The auxiliary loss enters the gradient: without it the weights end elsewhere, and it is logged."""
    ref = reference(tmp_path_factory)
    assert all(row["moe_aux_loss"] > 0 and row["moe_max_load"] >= 1.0 for row in ref["metrics"])
    assert all("moe_z_loss" not in row for row in ref["metrics"]), "z-loss is off in this model"
    config = moe_config(tmp_path)
    config["model"]["model_config"]["router_aux_loss_coef"] = 0.0
    plain = run_training(config)
    moved = max(weight_diffs(plain["weights"], ref["weights"]).values())
    assert moved > 10 * RTOL, f"turning the auxiliary loss off moved no weight beyond the tolerance ({moved})"
    assert plain["losses"][0] == pytest.approx(ref["losses"][0], rel=STEP1_RTOL), "lm_loss excludes the aux loss"


def test_shared_experts_and_bias_balanced_router_at_ep2(tmp_path, tmp_path_factory):
    run = run_training(moe_config(tmp_path, layout(dp=2, expert_parallel_size=2), deepseek=True), 2)
    ref = reference(tmp_path_factory, deepseek=True)
    assert_matches(run, ref, metrics=("moe_z_loss", "moe_max_load"))
    biases = [name for name in ref["weights"] if name.endswith("e_score_correction_bias")]
    assert len(biases) == 4
    assert all(ref["weights"][name].abs().sum() > 0 for name in biases), "the balancing bias never moved"


def test_bfloat16_grouped_expert_gemms_at_ep2_match_one_process(tmp_path):
    """In bfloat16 the experts run through torch's grouped matmul (`nanocore.moe_api.expert_matmul`;
    on this CPU too). ep2 hands each expert the rows of both data-parallel ranks in one matmul, where
    one process runs them a micro-batch at a time, so the bfloat16 products round differently;
    nothing else changes. Tolerances for that reordering in bfloat16 (8 significant bits to
    float32's 24: its rounding is 2^16 times larger): each step's loss within 1e-3 relative
    (measured 9.6e-5: the loss is a float32 mean over all tokens, which averages the rounding), the
    trained weights within 5e-2 of their norm (measured 2.0e-2: Adam turns the rounding of near-zero
    gradients into whole steps, as `norm_rel_diff` explains)."""
    from tests.helpers.compare import rel_diff

    def bf16(tmp, par):
        config = moe_config(tmp, par)
        config["model"]["dtype"] = "bfloat16"
        return config

    one = run_training(bf16(tmp_path / "one", layout()))
    ep2 = run_training(bf16(tmp_path / "ep2", layout(dp=2, expert_parallel_size=2)), 2)
    assert max(one["losses"]) - min(one["losses"]) > 0.01, "the reference must train"
    diffs = [rel_diff(a, b) for a, b in zip(ep2["losses"], one["losses"], strict=True)]
    assert max(diffs) <= 1e-3, diffs
    weights = weight_diffs(ep2["weights"], one["weights"])
    assert max(weights.values()) <= 5e-2, {k: v for k, v in weights.items() if v > 5e-2}
    assert all(t.dtype == torch.bfloat16 for t in ep2["weights"].values())
