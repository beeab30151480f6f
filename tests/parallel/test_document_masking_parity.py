"""Document masking trains exactly like one process at every layout, context parallelism included.

Short documents (each ending with the byte tokenizer's end-of-document token) are packed into
32-token samples, so every sample holds several documents and boundaries fall inside chunks, TP
shards and pipeline micro-batches alike. Tolerances as in `test_parity.py`."""

from __future__ import annotations

import pytest

from tests.helpers.compare import rel_diff
from tests.helpers.document_masking import corpus, masked_config, reference
from tests.helpers.parity import GLOBAL_MICROBATCHES, assert_matches, layout
from tests.helpers.training import run_training

pytestmark = pytest.mark.slow

LAYOUTS = {
    "dp2": layout(dp=2),
    "tp2_reduce_scatter": layout(tp=2, tp_mode="REDUCE_SCATTER"),
    "pp2_interleaved": layout(pp=2, pp_engine="interleaved", pp_virtual_stages=2),
    "cp2": layout(context_parallel_size=2),
    "cp4": layout(context_parallel_size=4),
    "dp2_cp2_tp2": layout(dp=2, context_parallel_size=2, tp=2),
    # all_to_all: the ordinary document-masked kernel over the whole sequence, heads split over cp
    "all_to_all_cp2": layout(context_parallel_size=2, context_parallel_mode="all_to_all"),
    "all_to_all_cp4": layout(context_parallel_size=4, context_parallel_mode="all_to_all"),
    "all_to_all_dp2_cp2_tp2": layout(dp=2, context_parallel_size=2, tp=2, context_parallel_mode="all_to_all"),
}


def test_masking_changes_training(tmp_path_factory):
    """Without this the parity below would prove nothing about masking."""
    masked, plain = reference(tmp_path_factory, True), reference(tmp_path_factory, False)
    assert rel_diff(masked["losses"][0], plain["losses"][0]) > 1e-3


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_document_masking_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    par = LAYOUTS[name]
    world = par["dp"] * par["tp"] * par["pp"] * par.get("context_parallel_size", 1)
    accumulation = GLOBAL_MICROBATCHES // par["dp"]
    config = masked_config(
        tmp_path, corpus(tmp_path / "data"), parallelism=par, tokens={"batch_accumulation_per_replica": accumulation}
    )
    assert_matches(run_training(config, world), reference(tmp_path_factory))
