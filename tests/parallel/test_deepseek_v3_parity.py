"""DeepSeek-V3 at the layouts issue 21 names, each equal to one process for 10 steps in float32
(tests/helpers/parity.py states the tolerances and why). Multi-head latent attention under TP keeps
its latent projections whole and splits the heads (nanocore.model_parts.mla): tp2 in both modes
proves the gradient bookkeeping of that split; cp2 runs ring attention with value heads narrower
than query/key heads."""

from __future__ import annotations

import pytest

from tests.helpers import moe_parity
from tests.helpers.deepseek_v3 import TINY_DEEPSEEK_V3
from tests.helpers.parity import GLOBAL_MICROBATCHES, layout
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

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


def deepseek_config(tmp, par: dict | None = None, mtp: bool = False, **sections) -> dict:
    par = par or layout()
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // par["dp"]}
    model = {"model_config": {**TINY_DEEPSEEK_V3, **(MTP if mtp else {})}}
    return tiny_config(tmp, model=model, parallelism=par, tokens=tokens, **sections)


MTP = {"num_nextn_predict_layers": 1, "mtp_loss_coef": 0.3}
_reference: dict[bool, dict] = {}


def reference(tmp_path_factory, mtp: bool = False) -> dict:
    if mtp not in _reference:
        _reference[mtp] = run_training(deepseek_config(tmp_path_factory.mktemp("deepseek_reference"), mtp=mtp))
    return _reference[mtp]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_v3_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    par, extra = LAYOUTS[name]
    world = par["dp"] * par["tp"] * par["pp"] * par.get("context_parallel_size", 1)
    run = run_training(deepseek_config(tmp_path, par, **extra), world)
    moe_parity.assert_matches(run, reference(tmp_path_factory), metrics=("moe_max_load",))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_v3_with_mtp_matches_single_process(name, tmp_path, tmp_path_factory):
    par, extra = LAYOUTS[name]
    world = par["dp"] * par["tp"] * par["pp"] * par.get("context_parallel_size", 1)
    run = run_training(deepseek_config(tmp_path, par, mtp=True, **extra), world)
    moe_parity.assert_matches(run, reference(tmp_path_factory, mtp=True), metrics=("moe_max_load", "mtp_loss"))
