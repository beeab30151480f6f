"""Resume at any layout, whatever the vocabulary padding.

The vocabulary is padded to a multiple of `make_vocab_size_divisible_by x tp`, so a 257-token
vocabulary is 320 rows at tp=1, 384 at tp=2 and 512 at tp=4. Checkpoints hold the 257 real rows
only (weights and optimizer state, with or without ZeRO-1) and a resumed run pads again for its own
layout. A run trained N steps at layout A and resumed at layout B continues the losses of an
uninterrupted 2N-step run at B.
"""

from __future__ import annotations

import pytest

from nanocore.checkpoint.tensors import ShardReader
from tests.helpers.compare import rel_diff
from tests.helpers.parity import RTOL, weight_diffs
from tests.helpers.training import TINY_MODEL, run_training, tiny_config

pytestmark = pytest.mark.slow

VOCAB, HIDDEN, STEPS = 257, TINY_MODEL["hidden_size"], 3  # train STEPS at A, then STEPS more at B
VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")


def real_rows(name: str, tensor):
    """The tensor without the layout's vocabulary padding (the padding is compared separately)."""
    return tensor[:VOCAB] if name in VOCAB_PARAMS else tensor


def layout(dp=1, tp=1, pp=1, zero=0) -> dict:
    return {"parallelism": {"dp": dp, "tp": tp, "pp": pp}, "zero_stage": zero}


def config(tmp, lay: dict, steps: int, tied: bool, **checkpoints) -> dict:
    raw = tiny_config(
        tmp,
        model={"model_config": {**TINY_MODEL, "vocab_size": VOCAB, "tie_word_embeddings": tied}},
        parallelism=lay["parallelism"],
        # The schedule is fixed by lr_decay_steps, not train_steps, so a STEPS-step run is the first
        # half of the 2 x STEPS run.
        optimizer={"zero_stage": lay["zero_stage"], "learning_rate_scheduler": {"lr_decay_steps": 2 * STEPS}},
        tokens={"train_steps": steps, "batch_accumulation_per_replica": 4 // lay["parallelism"]["dp"]},
        checkpoints={"checkpoint_interval": STEPS, **checkpoints},
    )
    raw["model"]["make_vocab_size_divisible_by"] = 64
    return raw


def world(lay: dict) -> int:
    par = lay["parallelism"]
    return par["dp"] * par["tp"] * par["pp"]


_references: dict = {}


def reference(tmp_path_factory, lay: dict, tied: bool) -> dict:
    """The uninterrupted 2 x STEPS run at layout `lay`, once per module."""
    key = (repr(lay), tied)
    if key not in _references:
        tmp = tmp_path_factory.mktemp("reference")
        _references[key] = run_training(config(tmp, lay, 2 * STEPS, tied), world(lay))
    return _references[key]


CASES = {  # name -> (layout A, layout B, tied embeddings)
    "tp2_to_tp1": (layout(tp=2), layout(), False),
    "tp1_to_tp4": (layout(), layout(tp=4), False),  # at tp=4 the last rank's 128 rows are all padding
    "dp2_tp2_pp2_zero1_to_tp1": (layout(dp=2, tp=2, pp=2, zero=1), layout(), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_another_padding_continues_the_loss_curve(case, tmp_path, tmp_path_factory):
    before, after, tied = CASES[case]
    ref = reference(tmp_path_factory, after, tied)
    run_training(config(tmp_path / "before", before, STEPS, tied), world(before))
    ckpt = tmp_path / "before" / "checkpoints" / str(STEPS)

    names = VOCAB_PARAMS[:1] if tied else VOCAB_PARAMS
    model, optimizer = ShardReader(ckpt / "model"), ShardReader(ckpt / "optimizer")
    for name in names:
        assert model.full_shape(name) == (VOCAB, HIDDEN), f"{name}: checkpoints hold the true vocabulary"
        for state in ("exp_avg", "exp_avg_sq"):
            assert optimizer.full_shape(f"{name}::{state}") == (VOCAB, HIDDEN)

    resumed = run_training(
        config(tmp_path / "after", after, 2 * STEPS, tied, resume_checkpoint_path=str(ckpt)), world(after)
    )
    assert len(resumed["losses"]) == STEPS, "the resumed run continues at step STEPS + 1"
    diffs = [rel_diff(a, b) for a, b in zip(resumed["losses"], ref["losses"][STEPS:], strict=True)]
    assert max(diffs) <= RTOL, f"{case}: relative loss differences after resume {diffs}"
    real = {name: real_rows(name, t) for name, t in resumed["weights"].items()}
    reference_rows = {name: real_rows(name, t) for name, t in ref["weights"].items()}
    bad = {name: d for name, d in weight_diffs(real, reference_rows).items() if d > RTOL}
    assert not bad, f"{case}: weights differ from the uninterrupted run (relative to their norm): {bad}"
    for name in names:  # the padding was filled with zeros, and nothing ever moves it
        assert not resumed["weights"][name][VOCAB:].any(), name
