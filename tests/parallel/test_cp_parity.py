"""Context parallelism trains exactly like one process (float32, gloo on CPU), at every layout it
composes with: the same 10 steps, losses and final weights as the one-process run (tolerances of
`tests/parallel/test_parity.py`: step-1 loss within 1e-5 relative, later losses and weights 1e-4)."""

from __future__ import annotations

import pytest

from tests.helpers import moe_parity as moe
from tests.helpers.parity import GLOBAL_MICROBATCHES, assert_matches, layout, reference
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

ZERO1 = {"optimizer": {"zero_stage": 1}}
A2A = "all_to_all"
LAYOUTS = {
    "cp2": (layout(context_parallel_size=2), {}),
    "cp4": (layout(context_parallel_size=4), {}),
    "cp2_tp2_reduce_scatter": (layout(context_parallel_size=2, tp=2, tp_mode="REDUCE_SCATTER"), {}),
    "cp2_pp2_1f1b": (layout(context_parallel_size=2, pp=2, pp_engine="1f1b"), {}),
    "cp2_dp2_zero1": (layout(context_parallel_size=2, dp=2), ZERO1),
    "dp2_cp2_tp2": (layout(context_parallel_size=2, dp=2, tp=2), {}),
    "cp2_pp2_interleaved_tp2": (
        layout(context_parallel_size=2, pp=2, tp=2, pp_engine="interleaved", pp_virtual_stages=2),
        {},
    ),
    "cp2_tp2_all_reduce_recompute": (layout(context_parallel_size=2, tp=2, recompute_layer=True), {}),
    # ring attention run again in backward (its exchanges too) instead of keeping what it saves
    "cp2_dp2_selective_recompute_zero2": (
        layout(context_parallel_size=2, dp=2, recompute_granularity="selective"),
        {"optimizer": {"zero_stage": 2}},
    ),
    # all_to_all mode: heads split over the cp ranks, the whole sequence on each (4 query heads, 2 kv heads:
    # at cp4 and at cp2·tp2 each kv head is repeated so every rank holds one)
    "all_to_all_cp2": (layout(context_parallel_size=2, context_parallel_mode=A2A), {}),
    "all_to_all_cp4": (layout(context_parallel_size=4, context_parallel_mode=A2A), {}),
    "all_to_all_cp2_tp2_reduce_scatter": (
        layout(context_parallel_size=2, tp=2, tp_mode="REDUCE_SCATTER", context_parallel_mode=A2A),
        {},
    ),
    "all_to_all_cp2_pp2_interleaved": (
        layout(context_parallel_size=2, pp=2, pp_engine="interleaved", pp_virtual_stages=2, context_parallel_mode=A2A),
        {},
    ),
    "all_to_all_dp2_cp2_tp2": (layout(context_parallel_size=2, dp=2, tp=2, context_parallel_mode=A2A), {}),
}


def world(par: dict) -> int:
    return par["dp"] * par["tp"] * par["pp"] * par.get("context_parallel_size", 1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    par, extra = LAYOUTS[name]
    accumulation = GLOBAL_MICROBATCHES // par["dp"]
    config = tiny_config(tmp_path, parallelism=par, tokens={"batch_accumulation_per_replica": accumulation}, **extra)
    assert_matches(run_training(config, world(par)), reference(tmp_path_factory, tied=False))


def test_context_parallel_with_tied_embeddings_across_stages(tmp_path, tmp_path_factory):
    """Tied embeddings on the first and last stage, under the third schedule (afab)."""
    model = {"model_config": {"tie_word_embeddings": True}}
    par = layout(context_parallel_size=2, pp=2, pp_engine="afab")
    run = run_training(tiny_config(tmp_path, parallelism=par, model=model), world(par))
    assert_matches(run, reference(tmp_path_factory, tied=True))


@pytest.mark.parametrize("mode", ["ring", A2A])
def test_context_parallel_with_expert_parallel_mixtral(mode, tmp_path, tmp_path_factory):
    """Experts split over the two context-parallel ranks (EP carved from DP x CP), each holding half
    of every sequence: the auxiliary loss sums its statistics over both halves, like one process."""
    par = layout(
        context_parallel_size=2, expert_parallel_size=2, tp=2, tp_mode="REDUCE_SCATTER", context_parallel_mode=mode
    )
    run = run_training(moe.moe_config(tmp_path, par), world(par))
    moe.assert_matches(run, moe.reference(tmp_path_factory))
