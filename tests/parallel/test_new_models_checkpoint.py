"""Checkpoints of Qwen3, Qwen3-MoE and DeepSeek-V3 resume at another layout and continue the
one-process loss curve and weights within the parity tolerances (tests/helpers/parity.py): head
norms, replicated latent projections, head-split up projections and experts are saved whole, in place."""

from __future__ import annotations

import pytest

from tests.helpers.compare import rel_diff
from tests.helpers.deepseek_v3 import TINY_DEEPSEEK_V3
from tests.helpers.parity import GLOBAL_MICROBATCHES, RTOL, layout, weight_diffs
from tests.helpers.qwen3 import TINY_QWEN3, TINY_QWEN3_MOE
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

MODELS = {
    "qwen3": TINY_QWEN3,
    "qwen3_moe": TINY_QWEN3_MOE,
    "deepseek_v3": TINY_DEEPSEEK_V3,
    "deepseek_v3_mtp": {**TINY_DEEPSEEK_V3, "num_nextn_predict_layers": 1},
}
CASES = {
    "qwen3_dp2_tp2_zero1_to_pp2": ("qwen3", (layout(dp=2, tp=2), 1), (layout(pp=2, pp_engine="1f1b"), 0)),
    "qwen3_moe_ep2_to_tp2_reduce_scatter": (
        "qwen3_moe",
        (layout(dp=2, expert_parallel_size=2), 0),
        (layout(tp=2, tp_mode="REDUCE_SCATTER"), 0),
    ),
    "deepseek_v3_tp2_ep2_to_one_process": (
        "deepseek_v3",
        (layout(dp=2, tp=2, expert_parallel_size=2), 1),
        (layout(), 0),
    ),
    # with multi-token prediction: its embedding is tied across the first and last stage after the resume
    "deepseek_v3_mtp_one_process_to_tp2_pp2": (
        "deepseek_v3_mtp",
        (layout(), 0),
        (layout(tp=2, pp=2, pp_engine="1f1b"), 0),
    ),
}


def config(tmp, model: str, par: dict, zero: int = 0, **checkpoints) -> dict:
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // par["dp"]}
    return tiny_config(
        tmp,
        model={"model_config": dict(MODELS[model])},
        parallelism=par,
        tokens=tokens,
        optimizer={"zero_stage": zero},
        checkpoints={"checkpoint_interval": 5, **checkpoints},
    )


_reference: dict[str, dict] = {}


def reference(tmp_path_factory, model: str) -> dict:
    if model not in _reference:
        _reference[model] = run_training(config(tmp_path_factory.mktemp(f"{model}_ckpt_reference"), model, layout()))
    return _reference[model]


def world(par: dict) -> int:
    return par["dp"] * par["tp"] * par["pp"]


@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_another_layout(case, tmp_path, tmp_path_factory):
    model, (before, zero_before), (after, zero_after) = CASES[case]
    ref = reference(tmp_path_factory, model)
    run_training(config(tmp_path / "before", model, before, zero_before), world(before))
    ckpt = tmp_path / "before" / "checkpoints" / "5"
    resumed = run_training(
        config(tmp_path / "after", model, after, zero_after, resume_checkpoint_path=str(ckpt)), world(after)
    )
    assert len(resumed["losses"]) == 5
    diffs = [rel_diff(a, b) for a, b in zip(resumed["losses"], ref["losses"][5:], strict=True)]
    assert max(diffs) <= RTOL, f"{case}: relative loss differences after resume {diffs}"
    bad = {name: diff for name, diff in weight_diffs(resumed["weights"], ref["weights"]).items() if not diff <= RTOL}
    assert not bad, f"{case}: weights differ by more than {RTOL} of their norm: {bad}"
