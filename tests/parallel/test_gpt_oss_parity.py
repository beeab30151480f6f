"""gpt-oss (sinks, windowed and full layers, biased routing and experts) at expert-, context- and
pipeline-parallel layouts, each equal to one process for 10 steps in float32 (tests/helpers/parity.py
and moe_parity.py state the tolerances and why). The window (6 tokens) is shorter than the sequence
(16); the sinks are trained parameters, so their gradients must add up across context-parallel ranks."""

from __future__ import annotations

import pytest

from tests.helpers import moe_parity
from tests.helpers.gpt_oss import TINY_GPT_OSS
from tests.helpers.parity import GLOBAL_MICROBATCHES, layout
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

LAYOUTS = {
    "gpt_oss_dp2_ep2_pp2_1f1b": (layout(dp=2, pp=2, expert_parallel_size=2, pp_engine="1f1b"), {}),
    "gpt_oss_cp2_ring_ep2_zero1": (
        layout(dp=2, context_parallel_size=2, expert_parallel_size=2),
        {"optimizer": {"zero_stage": 1}},
    ),
    "gpt_oss_cp4_all_to_all": (layout(context_parallel_size=4, context_parallel_mode="all_to_all"), {}),
}


def gpt_oss_config(tmp, par: dict | None = None, **sections) -> dict:
    par = par or layout()
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // par["dp"]}
    return tiny_config(tmp, model={"model_config": dict(TINY_GPT_OSS)}, parallelism=par, tokens=tokens, **sections)


_reference: dict[str, dict] = {}


def reference(tmp_path_factory) -> dict:
    if "gpt_oss" not in _reference:
        _reference["gpt_oss"] = run_training(gpt_oss_config(tmp_path_factory.mktemp("gpt_oss_reference")))
    return _reference["gpt_oss"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpt_oss_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    par, extra = LAYOUTS[name]
    world = par["dp"] * par["tp"] * par["pp"] * par.get("context_parallel_size", 1)
    run = run_training(gpt_oss_config(tmp_path, par, **extra), world)
    moe_parity.assert_matches(run, reference(tmp_path_factory))
