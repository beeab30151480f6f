"""What the parity tests share (tests/parallel/test_parity.py and the tests built on it): the layout
of a run, the one-process reference it is compared with, and the tolerances of that comparison."""

from __future__ import annotations

import torch

from tests.helpers.compare import norm_rel_diff, rel_diff
from tests.helpers.training import run_training, tiny_config

GLOBAL_MICROBATCHES = 4  # global batch = dp x micro_batch_size(1) x accumulation


def layout(dp=1, tp=1, pp=1, **par):
    return {"dp": dp, "tp": tp, "pp": pp, **par}


_reference: dict[bool, dict] = {}


def reference(tmp_path_factory, tied: bool) -> dict:
    if tied not in _reference:
        tmp = tmp_path_factory.mktemp(f"reference_tied{tied}")
        model = {"model_config": {"tie_word_embeddings": tied}}
        _reference[tied] = run_training(tiny_config(tmp, model=model))
    return _reference[tied]


# Relative tolerances: a layout sums the same float32 terms in another order (split over ranks,
# micro-batches, buckets), which moves a result in proportion to its size. Step 1 is one forward of
# the same weights: only the loss reductions differ (a few ulps; measured <= 1.2e-7). Later steps
# and the weights add 10 AdamW updates on reordered gradients; measured <= 1e-5 of a weight tensor's
# norm (tp2 GPT-2; 1.4e-6 for LLaMA at 3D), while single elements of a tensor can differ by 8e-5 of
# its largest value (`norm_rel_diff` says why), hence norms. Wrong gradients show far above 1e-4:
# dropping tp2 REDUCE_SCATTER's gradient sync moves all 39 tensors by over 1e-4 (up to 7e-3), dropping
# it for one norm weight moves 14 tensors by up to 2.4e-3 (while the losses stay within 1e-4).
STEP1_RTOL, RTOL = 1e-5, 1e-4
# A key projection's bias has a gradient of zero in exact arithmetic (it adds q.b to all of a query's
# scores, which softmax ignores): Adam turns its rounding-noise gradient into noise-driven steps that
# differ in every layout, so its trained value (a few 1e-5, noise in the reference too) has no parity.
NO_GRADIENT_SUFFIXES = (".k_proj.bias",)


def weight_diffs(weights: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """`norm_rel_diff` of every trained tensor from the reference's, except those that get no gradient."""
    assert weights.keys() == ref.keys()
    return {
        name: norm_rel_diff(weights[name], tensor)
        for name, tensor in ref.items()
        if not name.endswith(NO_GRADIENT_SUFFIXES)
    }


def assert_matches(run: dict, ref: dict) -> None:
    losses, ref_losses = run["losses"], ref["losses"]
    assert len(losses) == len(ref_losses) == 10
    assert rel_diff(losses[0], ref_losses[0]) <= STEP1_RTOL, (losses[0], ref_losses[0])
    diffs = [rel_diff(a, b) for a, b in zip(losses, ref_losses, strict=True)]
    assert max(diffs) <= RTOL, f"per-step relative loss differences: {diffs}"
    assert max(ref_losses) - min(ref_losses) > 0.01, "the reference must actually train for parity to mean anything"
    bad = {name: diff for name, diff in weight_diffs(run["weights"], ref["weights"]).items() if not diff <= RTOL}
    assert not bad, f"weights differ by more than {RTOL} of their norm: {bad}"
