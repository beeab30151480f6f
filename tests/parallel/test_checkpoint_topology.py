"""Checkpoints across topologies: save at one (dp, tp, pp), resume at another, same loss curve.

Every piece of state travels: weights and optimizer state (pieces with their place in the full
tensor, resharded on load), LR scheduler and data position (meta.json). The reference is one
uninterrupted process; a resumed run must continue its losses within 1e-4 relative and end at its
weights within 1e-4 of their norm (the tolerances and reasons of tests/parallel/test_parity.py).
"""

from __future__ import annotations

import pytest

from tests.helpers.compare import rel_diff
from tests.helpers.parity import RTOL, weight_diffs
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

GLOBAL_MICROBATCHES = 4


def layout(dp=1, tp=1, pp=1, zero=0, cp=1):
    par = {"dp": dp, "tp": tp, "pp": pp, "context_parallel_size": cp}
    return par, {"zero_stage": zero}, {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // dp}


def config(tmp, lay, **checkpoints):
    par, opt, tokens = lay
    return tiny_config(
        tmp, parallelism=par, optimizer=opt, tokens=tokens, checkpoints={"checkpoint_interval": 5, **checkpoints}
    )


_reference: dict = {}


def reference(tmp_path_factory):
    if not _reference:
        _reference.update(run_training(config(tmp_path_factory.mktemp("reference"), layout())))
    return _reference


CASES = {
    "3d_to_one_process": (layout(dp=2, tp=2, pp=2), layout()),
    "one_process_to_tp2_pp2": (layout(), layout(tp=2, pp=2)),
    "tp2_to_tp4": (layout(tp=2), layout(tp=4)),
    "dp2_zero1_to_dp4_zero1": (layout(dp=2, zero=1), layout(dp=4, zero=1)),
    "3d_same_layout": (layout(dp=2, tp=2, pp=2, zero=1), layout(dp=2, tp=2, pp=2, zero=1)),
    # context parallelism splits activations only: its checkpoints are any other layout's
    "cp2_zero1_to_one_process": (layout(cp=2, zero=1), layout()),
    "cp2_zero1_to_cp4_zero1": (layout(cp=2, zero=1), layout(cp=4, zero=1)),
}


def world(lay) -> int:
    par = lay[0]
    return par["dp"] * par["tp"] * par["pp"] * par["context_parallel_size"]


@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_another_layout_continues_the_loss_curve(case, tmp_path, tmp_path_factory):
    before, after = CASES[case]
    ref = reference(tmp_path_factory)
    saved = run_training(config(tmp_path / "before", before), world(before))
    ckpt = tmp_path / "before" / "checkpoints" / "5"
    assert (ckpt / "meta.json").exists()
    resumed = run_training(config(tmp_path / "after", after, resume_checkpoint_path=str(ckpt)), world(after))
    assert len(resumed["losses"]) == 5, "the resumed run continues at step 6 (step and data position restored)"
    diffs = [rel_diff(a, b) for a, b in zip(resumed["losses"], ref["losses"][5:], strict=True)]
    assert max(diffs) <= RTOL, f"{case}: relative loss differences after resume {diffs}"
    assert max(rel_diff(a, b) for a, b in zip(saved["losses"], ref["losses"], strict=True)) <= RTOL
    bad = {name: diff for name, diff in weight_diffs(resumed["weights"], ref["weights"]).items() if not diff <= RTOL}
    assert not bad, f"{case}: weights differ by more than {RTOL} of their norm: {bad}"


@pytest.mark.parametrize("first_stage", [2, 3])
def test_resume_across_zero_stages_and_sizes(first_stage, tmp_path, tmp_path_factory):
    """ZeRO-2 or ZeRO-3 at dp4 -> ZeRO-1 at dp2 -> one process: every stage saves its pieces with their
    place in the full tensor (ZeRO-3 each rank's rows of the weights too), so each hop continues the
    uninterrupted run's losses."""
    ref = reference(tmp_path_factory)
    first = run_training(config(tmp_path / "a", layout(dp=4, zero=first_stage), checkpoint_interval=3), 4)
    second = run_training(
        config(
            tmp_path / "b",
            layout(dp=2, zero=1),
            checkpoint_interval=3,
            resume_checkpoint_path=str(tmp_path / "a" / "checkpoints" / "3"),
        ),
        2,
    )
    third = run_training(
        config(tmp_path / "c", layout(), resume_checkpoint_path=str(tmp_path / "b" / "checkpoints" / "6"))
    )
    assert (len(first["losses"]), len(second["losses"]), len(third["losses"])) == (10, 7, 4)
    for run, start in ((first, 0), (second, 3), (third, 6)):
        diffs = [rel_diff(a, b) for a, b in zip(run["losses"], ref["losses"][start:], strict=True)]
        assert max(diffs) <= RTOL, f"resumed at step {start + 1}: relative loss differences {diffs}"
    bad = {name: diff for name, diff in weight_diffs(third["weights"], ref["weights"]).items() if not diff <= RTOL}
    assert not bad, f"weights differ by more than {RTOL} of their norm: {bad}"
