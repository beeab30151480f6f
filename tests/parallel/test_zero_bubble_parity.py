"""Zero-bubble schedules train exactly like one process (float32, gloo on CPU).

`pp_engine: zb1p` and `zbv` split every backward into its input-gradient half (I) and its
weight-gradient half (W, run later from the same autograd graph); zbv also places two chunks per rank
in a V (rank 0 holds the first and the last stage). Each layout runs 10 optimizer steps from the same seed
on the same global batches and must match the single-process run within the tolerances of
`test_parity.py` (step-1 loss 1e-5 relative, later losses and final weights 1e-4 relative), eager
and with `model.compile: true`.
"""

from __future__ import annotations

import pytest

from tests.helpers import moe_parity as moe
from tests.helpers.parity import GLOBAL_MICROBATCHES, assert_matches, layout, reference
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

ZB = {"pp_engine": "zb1p"}
LAYOUTS = {
    "pp2": (layout(pp=2, **ZB), {}),
    "pp4": (layout(pp=4, **ZB), {}),
    "pp2_tp2_reduce_scatter": (layout(pp=2, tp=2, tp_mode="REDUCE_SCATTER", **ZB), {}),
    # the overlapped linear layers are custom autograd functions: their weight gradients come with I
    "pp2_tp2_reduce_scatter_async": (
        layout(pp=2, tp=2, tp_mode="REDUCE_SCATTER", tp_linear_async_communication=True, **ZB),
        {},
    ),
    "dp2_pp2_zero3": (layout(dp=2, pp=2, **ZB), {"optimizer": {"zero_stage": 3}}),
    "dp2_pp2_zero2": (layout(dp=2, pp=2, **ZB), {"optimizer": {"zero_stage": 2}}),
    "pp2_full_recompute": (layout(pp=2, recompute_layer=True, **ZB), {}),
    "pp2_selective_recompute": (layout(pp=2, recompute_granularity="selective", **ZB), {}),
    "dp2_pp2_full_recompute_zero3": (layout(dp=2, pp=2, recompute_layer=True, **ZB), {"optimizer": {"zero_stage": 3}}),
    "dp2_tp2_pp2_zero1": (layout(dp=2, tp=2, pp=2, **ZB), {"optimizer": {"zero_stage": 1}}),
    # context parallelism: the ring's (and all_to_all's) collectives run in I, attention's weights have none
    "pp2_cp2_ring": (layout(pp=2, context_parallel_size=2, **ZB), {}),
}
ZBV = {"pp_engine": "zbv", "pp_virtual_stages": 2}
LAYOUTS |= {
    "zbv_pp2": (layout(pp=2, **ZBV), {}),
    "zbv_pp2_tp2_reduce_scatter": (layout(pp=2, tp=2, tp_mode="REDUCE_SCATTER", **ZBV), {}),
    "zbv_dp2_pp2_zero3": (layout(dp=2, pp=2, **ZBV), {"optimizer": {"zero_stage": 3}}),
    "zbv_pp2_full_recompute": (layout(pp=2, recompute_layer=True, **ZBV), {}),
    "zbv_dp2_tp2_pp2_zero1": (layout(dp=2, tp=2, pp=2, **ZBV), {"optimizer": {"zero_stage": 1}}),
    "zbv_pp2_cp2_all_to_all": (layout(pp=2, context_parallel_size=2, context_parallel_mode="all_to_all", **ZBV), {}),
}
COMPILED = [
    *["pp2", "pp2_tp2_reduce_scatter", "dp2_pp2_zero3", "pp2_full_recompute", "dp2_tp2_pp2_zero1"],
    *["zbv_pp2", "zbv_dp2_pp2_zero3"],
]


def _run(name: str, tmp_path, compiled: bool) -> dict:
    par, extra = LAYOUTS[name]
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // par["dp"]}
    model = {"compile": True} if compiled else {}
    config = tiny_config(tmp_path, parallelism=par, tokens=tokens, model=model, **extra)
    return run_training(config, par["dp"] * par["tp"] * par["pp"] * par.get("context_parallel_size", 1))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zb1p_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    assert_matches(_run(name, tmp_path, compiled=False), reference(tmp_path_factory, tied=False))


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_zb1p_layout_matches_eager_single_process(name, tmp_path, tmp_path_factory):
    assert_matches(_run(name, tmp_path, compiled=True), reference(tmp_path_factory, tied=False))


def test_zb1p_tied_embeddings_across_stages(tmp_path, tmp_path_factory):
    model = {"model_config": {"tie_word_embeddings": True}}
    run = run_training(tiny_config(tmp_path, parallelism=layout(pp=2, **ZB), model=model), 2)
    assert_matches(run, reference(tmp_path_factory, tied=True))


def test_zb1p_mixtral_at_ep2_matches_single_process(tmp_path, tmp_path_factory):
    """Experts, router and auxiliary loss: the expert all-to-alls run in I, the expert GEMMs' weight
    gradients in W."""
    par = layout(dp=2, pp=2, expert_parallel_size=2, **ZB)
    moe.assert_matches(run_training(moe.moe_config(tmp_path, par), 4), moe.reference(tmp_path_factory))


def test_zbv_at_pp4_matches_single_process(tmp_path):
    """Eight layers (zbv at pp4 runs 8 virtual stages), against their own one-process run."""
    model = {"model_config": {"num_hidden_layers": 8}}
    one = run_training(tiny_config(tmp_path / "one", model=model))
    par = layout(pp=4, **ZBV)
    assert_matches(run_training(tiny_config(tmp_path / "pp4", parallelism=par, model=model), 4), one)


def test_zbv_tied_embeddings_on_the_rank_holding_first_and_last_stage(tmp_path, tmp_path_factory):
    model = {"model_config": {"tie_word_embeddings": True}}
    run = run_training(tiny_config(tmp_path, parallelism=layout(pp=2, **ZBV), model=model), 2)
    assert_matches(run, reference(tmp_path_factory, tied=True))


def test_zbv_mixtral_at_ep2_matches_single_process(tmp_path, tmp_path_factory):
    par = layout(dp=2, pp=2, expert_parallel_size=2, **ZBV)
    moe.assert_matches(run_training(moe.moe_config(tmp_path, par), 4), moe.reference(tmp_path_factory))
