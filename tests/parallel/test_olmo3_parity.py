"""OLMo 3 (windowed and full layers, post-norm blocks) at context- and pipeline-parallel layouts, each
equal to one process for 10 steps in float32 (tests/helpers/parity.py states the tolerances and why).
The window (6 tokens) is shorter than the sequence (16) and than what a context-parallel rank holds
with its zigzag neighbours, so a layout that ignored it, or masked the wrong blocks, would differ."""

from __future__ import annotations

import pytest

from tests.helpers import parity
from tests.helpers.olmo3 import TINY_OLMO3
from tests.helpers.parity import GLOBAL_MICROBATCHES, layout
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

ZERO1 = {"optimizer": {"zero_stage": 1}}
LAYOUTS = {
    "olmo3_cp2_ring_pp2_1f1b": (layout(pp=2, context_parallel_size=2, pp_engine="1f1b"), {}),
    "olmo3_cp4_all_to_all": (layout(context_parallel_size=4, context_parallel_mode="all_to_all"), {}),
    "olmo3_dp2_cp2_ring_zero1": (layout(dp=2, context_parallel_size=2), ZERO1),
}


def olmo3_config(tmp, model: dict, par: dict | None = None, **sections) -> dict:
    par = par or layout()
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // par["dp"]}
    return tiny_config(tmp, model={"model_config": dict(model)}, parallelism=par, tokens=tokens, **sections)


_reference: dict[str, dict] = {}


def reference(tmp_path_factory) -> dict:
    if "olmo3" not in _reference:
        _reference["olmo3"] = run_training(olmo3_config(tmp_path_factory.mktemp("olmo3_reference"), TINY_OLMO3))
    return _reference["olmo3"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_olmo3_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    par, extra = LAYOUTS[name]
    world = par["dp"] * par["tp"] * par["pp"] * par.get("context_parallel_size", 1)
    run = run_training(olmo3_config(tmp_path, TINY_OLMO3, par, **extra), world)
    parity.assert_matches(run, reference(tmp_path_factory))


def test_the_window_changes_the_training_run(tmp_path, tmp_path_factory):
    # Guards the layouts above: with every layer full, the same run trains to other losses.
    full = {**TINY_OLMO3, "layer_types": ["full_attention"] * TINY_OLMO3["num_hidden_layers"]}
    run = run_training(olmo3_config(tmp_path, full))
    diffs = [abs(a - b) / abs(b) for a, b in zip(run["losses"], reference(tmp_path_factory)["losses"], strict=True)]
    assert max(diffs) > 1e-3, diffs
