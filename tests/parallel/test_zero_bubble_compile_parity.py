"""The zero-bubble schedules compiled (`model.compile: true`) at the layouts of
`test_zero_bubble_parity.py` that need more than one extra process group or model: pp4 and Mixtral
at ep2. Same tolerances as test_parity.py (step-1 loss 1e-5, later losses and final weights 1e-4
relative) against the eager one-process run."""

from __future__ import annotations

import pytest

from tests.helpers import moe_parity as moe
from tests.helpers.parity import assert_matches, layout, reference
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

ENGINES = {"zb1p": {"pp_engine": "zb1p"}, "zbv": {"pp_engine": "zbv", "pp_virtual_stages": 2}}


def test_compiled_zb1p_at_pp4_matches_eager_single_process(tmp_path, tmp_path_factory):
    par = layout(pp=4, **ENGINES["zb1p"])
    run = run_training(tiny_config(tmp_path, parallelism=par, model={"compile": True}), 4)
    assert_matches(run, reference(tmp_path_factory, tied=False))


def test_compiled_zbv_at_pp4_matches_eager_single_process(tmp_path):
    """Eight layers (zbv at pp4 runs 8 virtual stages), against their own eager one-process run."""
    model = {"model_config": {"num_hidden_layers": 8}}
    one = run_training(tiny_config(tmp_path / "one", model=model))
    par = layout(pp=4, **ENGINES["zbv"])
    assert_matches(
        run_training(tiny_config(tmp_path / "pp4", parallelism=par, model={**model, "compile": True}), 4), one
    )


@pytest.mark.parametrize("engine", list(ENGINES))
def test_compiled_mixtral_at_pp2_ep2_matches_eager_single_process(engine, tmp_path, tmp_path_factory):
    par = layout(dp=2, pp=2, expert_parallel_size=2, **ENGINES[engine])
    config = moe.moe_config(tmp_path, par)
    config["model"].update({"compile": True})
    moe.assert_matches(run_training(config, 4), moe.reference(tmp_path_factory))
