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
