"""Checkpoints across expert layouts: expert weights and their optimizer state are saved with their
place in the full model, so a run saved at one expert-parallel size resumes at another (or at none)
and continues the single-process loss curve (tolerances of tests/parallel/test_parity.py)."""

from __future__ import annotations

import pytest

from tests.helpers.compare import rel_diff
from tests.helpers.moe_parity import TINY_MIXTRAL, moe_config
from tests.helpers.parity import RTOL, layout, weight_diffs
from tests.helpers.training import run_training

pytestmark = pytest.mark.slow


def config(tmp, par, zero=0, **checkpoints):
    return moe_config(tmp, par, optimizer={"zero_stage": zero}, checkpoints={"checkpoint_interval": 5, **checkpoints})


CASES = {
    "ep2_zero1_to_one_process": ((layout(dp=2, expert_parallel_size=2), 1), (layout(), 0)),
    "one_process_to_ep4_zero1": ((layout(), 0), (layout(dp=4, expert_parallel_size=4), 1)),
    "dp2_ep2_tp2_to_tp2": ((layout(dp=2, tp=2, expert_parallel_size=2), 1), (layout(tp=2), 0)),
}

_reference: dict = {}


def reference(tmp_path_factory):
    if not _reference:
        _reference.update(run_training(config(tmp_path_factory.mktemp("moe_ckpt_reference"), layout())))
    return _reference


def world(par) -> int:
    return par["dp"] * par["tp"] * par["pp"]


@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_another_expert_layout(case, tmp_path, tmp_path_factory):
    (before, zero_before), (after, zero_after) = CASES[case]
    ref = reference(tmp_path_factory)
    saved = run_training(config(tmp_path / "before", before, zero_before), world(before))
    experts = saved["weights"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.shape[0] == TINY_MIXTRAL["num_local_experts"], "expert weights are saved whole, in place"
    ckpt = tmp_path / "before" / "checkpoints" / "5"
    resumed = run_training(
        config(tmp_path / "after", after, zero_after, resume_checkpoint_path=str(ckpt)), world(after)
    )
    assert len(resumed["losses"]) == 5
    diffs = [rel_diff(a, b) for a, b in zip(resumed["losses"], ref["losses"][5:], strict=True)]
    assert max(diffs) <= RTOL, f"{case}: relative loss differences after resume {diffs}"
    bad = {name: diff for name, diff in weight_diffs(resumed["weights"], ref["weights"]).items() if not diff <= RTOL}
    assert not bad, f"{case}: weights differ by more than {RTOL} of their norm: {bad}"


def test_bias_balanced_router_resumes_at_ep2(tmp_path, tmp_path_factory):
    """The balancing bias (no gradient, no optimizer state) is saved with the weights and restored."""
    one = moe_config(tmp_path / "one", deepseek=True, checkpoints={"checkpoint_interval": 5})
    ref = run_training(one)
    ckpt = tmp_path / "one" / "checkpoints" / "5"
    after = moe_config(
        tmp_path / "after",
        layout(dp=2, expert_parallel_size=2),
        deepseek=True,
        checkpoints={"checkpoint_interval": 5, "resume_checkpoint_path": str(ckpt)},
    )
    resumed = run_training(after, 2)
    diffs = [rel_diff(a, b) for a, b in zip(resumed["losses"], ref["losses"][5:], strict=True)]
    assert max(diffs) <= RTOL, diffs
    bias = "model.layers.0.mlp.gate.e_score_correction_bias"
    assert ref["weights"][bias].abs().sum() > 0
    assert not {n: d for n, d in weight_diffs(resumed["weights"], ref["weights"]).items() if not d <= RTOL}
