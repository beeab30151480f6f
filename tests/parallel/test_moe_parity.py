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

from tests.helpers.compare import rel_diff
from tests.helpers.training import run_training, tiny_config
from tests.parallel.test_parity import RTOL, STEP1_RTOL, weight_diffs

pytestmark = pytest.mark.slow

GLOBAL_MICROBATCHES = 4

TINY_MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.05,
}

# DeepSeek-style options: a shared expert, sigmoid scores balanced by a per-expert bias, z-loss
DEEPSEEK_STYLE = {
    "num_shared_experts": 1,
    "shared_expert_intermediate_size": 16,
    "scoring_func": "sigmoid",
    "router_bias_update_rate": 0.01,
    "router_aux_loss_coef": 0.0,
    "router_z_loss_coef": 0.01,
}


def layout(dp=1, tp=1, pp=1, **par):
    return {"dp": dp, "tp": tp, "pp": pp, **par}


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


def moe_config(tmp, par=None, deepseek=False, **sections):
    model = dict(TINY_MIXTRAL, **(DEEPSEEK_STYLE if deepseek else {}))
    par = par or layout()
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // par["dp"], **sections.pop("tokens", {})}
    return tiny_config(tmp, model={"model_config": model}, parallelism=par, tokens=tokens, **sections)


_reference: dict[bool, dict] = {}


def reference(tmp_path_factory, deepseek=False) -> dict:
    if deepseek not in _reference:
        _reference[deepseek] = run_training(moe_config(tmp_path_factory.mktemp("moe_reference"), deepseek=deepseek))
    return _reference[deepseek]


def assert_matches(run: dict, ref: dict, metrics=("moe_aux_loss", "moe_max_load")) -> None:
    losses, ref_losses = run["losses"], ref["losses"]
    assert len(losses) == len(ref_losses) == 10
    assert rel_diff(losses[0], ref_losses[0]) <= STEP1_RTOL, (losses[0], ref_losses[0])
    diffs = [rel_diff(a, b) for a, b in zip(losses, ref_losses, strict=True)]
    assert max(diffs) <= RTOL, f"per-step relative loss differences: {diffs}"
    assert max(ref_losses) - min(ref_losses) > 0.01, "the reference must actually train"
    for name in metrics:
        ours = [row[name] for row in run["metrics"]]
        theirs = [row[name] for row in ref["metrics"]]
        worst = max(rel_diff(a, b) for a, b in zip(ours, theirs, strict=True))
        assert worst <= RTOL, f"{name}: {ours} vs {theirs}"
    bad = {name: diff for name, diff in weight_diffs(run["weights"], ref["weights"]).items() if not diff <= RTOL}
    assert not bad, f"weights differ by more than {RTOL} of their norm: {bad}"


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
