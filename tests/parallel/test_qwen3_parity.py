"""Qwen3 and Qwen3-MoE at the layouts issue 21 names, each equal to one process for 10 steps in
float32 (tests/helpers/parity.py states the tolerances and why). Qwen3's qk-norm weights are whole
on every TP rank but see only that rank's heads: `tp2_all_reduce` fails without their gradient sum."""

from __future__ import annotations

import pytest

from tests.helpers import moe_parity, parity
from tests.helpers.parity import GLOBAL_MICROBATCHES, layout
from tests.helpers.qwen3 import TINY_QWEN3, TINY_QWEN3_MOE
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

ZERO1 = {"optimizer": {"zero_stage": 1}}
LAYOUTS = {
    "qwen3_tp2_all_reduce": (TINY_QWEN3, layout(tp=2, tp_mode="ALL_REDUCE"), {}),
    "qwen3_dp2_tp2_pp2_interleaved_zero1": (
        TINY_QWEN3,
        layout(dp=2, tp=2, pp=2, pp_engine="interleaved", pp_virtual_stages=2, tp_mode="REDUCE_SCATTER"),
        ZERO1,
    ),
    "qwen3_cp2_tp2": (TINY_QWEN3, layout(tp=2, context_parallel_size=2, tp_mode="REDUCE_SCATTER"), {}),
    "qwen3_moe_ep4_zero1": (TINY_QWEN3_MOE, layout(dp=4, expert_parallel_size=4), ZERO1),
    "qwen3_moe_ep2_tp2_reduce_scatter_pp2": (
        TINY_QWEN3_MOE,
        layout(dp=2, tp=2, pp=2, expert_parallel_size=2, tp_mode="REDUCE_SCATTER", pp_engine="1f1b"),
        {},
    ),
}


def qwen3_config(tmp, model: dict, par: dict | None = None, **sections) -> dict:
    par = par or layout()
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // par["dp"]}
    return tiny_config(tmp, model={"model_config": dict(model)}, parallelism=par, tokens=tokens, **sections)


_reference: dict[str, dict] = {}


def reference(tmp_path_factory, model: dict) -> dict:
    key = model["model_type"]
    if key not in _reference:
        _reference[key] = run_training(qwen3_config(tmp_path_factory.mktemp(f"{key}_reference"), model))
    return _reference[key]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qwen3_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    model, par, extra = LAYOUTS[name]
    world = par["dp"] * par["tp"] * par["pp"] * par.get("context_parallel_size", 1)
    run = run_training(qwen3_config(tmp_path, model, par, **extra), world)
    ref = reference(tmp_path_factory, model)
    if model["model_type"] == "qwen3_moe":
        moe_parity.assert_matches(run, ref)
    else:
        parity.assert_matches(run, ref)
