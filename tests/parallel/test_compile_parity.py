"""`model.compile: true` trains exactly like the eager one-process run, at every layout.

Each block (decoder layer, embedding, final norm and head) and the loss are compiled regionally
(`nanocore_plugins.parallel.compile`); communication inside a block runs eagerly. Tolerances are
those of `test_parity.py` (step-1 loss within 1e-5 relative, later losses and the final weights
within 1e-4): inductor fuses pointwise work and changes the order of a few float32 sums, nothing more.

Compiling is the slow part on CPU (inductor's C++ backend): shapes are the tiny ones of the other
parity tests and the inductor cache (TORCHINDUCTOR_CACHE_DIR, by default a folder under the
system's temporary directory) is shared by every rank and every test of a run.
"""

from __future__ import annotations

import pytest

from tests.helpers import moe_parity as moe
from tests.helpers.document_masking import corpus, masked_config
from tests.helpers.document_masking import reference as masked_reference
from tests.helpers.parity import GLOBAL_MICROBATCHES, assert_matches, layout, reference
from tests.helpers.third_party import gpt2_config, require
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

COMPILE = {"compile": True}
ZERO3 = {"optimizer": {"zero_stage": 3}}
LAYOUTS = {
    "one_process": (layout(), {}),
    "dp2": (layout(dp=2), {}),
    "tp2_reduce_scatter": (layout(tp=2, tp_mode="REDUCE_SCATTER"), {}),
    "pp2_1f1b": (layout(pp=2, pp_engine="1f1b"), {}),
    "pp2_interleaved": (layout(pp=2, pp_engine="interleaved", pp_virtual_stages=2), {}),
    "cp2": (layout(context_parallel_size=2), {}),
    "dp2_zero3": (layout(dp=2), ZERO3),
    "dp2_tp2_pp2_1f1b": (layout(dp=2, tp=2, pp=2, pp_engine="1f1b"), {}),
    # the rest of what compile composes with: the other TP mode, both recompute granularities
    "tp2_all_reduce_full_recompute": (layout(tp=2, tp_mode="ALL_REDUCE", recompute_layer=True), {}),
    "dp2_selective_recompute_zero2": (
        layout(dp=2, recompute_granularity="selective"),
        {"optimizer": {"zero_stage": 2}},
    ),
}


def world(par: dict) -> int:
    return par["dp"] * par["tp"] * par["pp"] * par.get("context_parallel_size", 1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_eager_single_process(name, tmp_path, tmp_path_factory):
    par, extra = LAYOUTS[name]
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // par["dp"]}
    config = tiny_config(tmp_path, parallelism=par, tokens=tokens, model=COMPILE, **extra)
    assert_matches(run_training(config, world(par)), reference(tmp_path_factory, tied=False))


def test_compiled_tied_embeddings_across_stages(tmp_path, tmp_path_factory):
    model = {"model_config": {"tie_word_embeddings": True}, **COMPILE}
    run = run_training(tiny_config(tmp_path, parallelism=layout(pp=2), model=model), 2)
    assert_matches(run, reference(tmp_path_factory, tied=True))


def test_compiled_mixtral_at_ep2_matches_eager_single_process(tmp_path, tmp_path_factory):
    """Routing is compiled; dispatch, the experts and combine run eagerly (their row counts change
    every step): the losses, auxiliary-loss statistics and weights equal the eager one-process run."""
    par = layout(dp=2, expert_parallel_size=2)
    config = moe.moe_config(tmp_path, par)
    config["model"].update(COMPILE)
    moe.assert_matches(run_training(config, 2), moe.reference(tmp_path_factory))


def test_compiled_document_masking_matches_eager_single_process(tmp_path, tmp_path_factory):
    """Packed documents: per-document attention runs eagerly inside the compiled layers (afab at pp2)."""
    par = layout(dp=2, pp=2, pp_engine="afab")
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // 2}
    config = masked_config(tmp_path, corpus(tmp_path / "data"), parallelism=par, tokens=tokens, model=COMPILE)
    assert_matches(run_training(config, 4), masked_reference(tmp_path_factory))


def test_compiled_gpt2_example_matches_its_eager_single_process(tmp_path, tmp_path_factory):
    """The third-party GPT-2 model (learned positions, tied head) compiled at tp2 REDUCE_SCATTER."""
    require("nanocore-gpt2")
    ref = run_training(gpt2_config(tmp_path_factory.mktemp("gpt2_eager"), {"tie_word_embeddings": True}))
    config = gpt2_config(tmp_path, {"tie_word_embeddings": True}, parallelism={"tp": 2, "tp_mode": "REDUCE_SCATTER"})
    config["model"].update(COMPILE)
    assert_matches(run_training(config, 2), ref)


def test_compiled_installable_schedule_matches_eager_single_process(tmp_path, tmp_path_factory):
    """A schedule from a pip-installed plugin (nanocore-looped-bfs) runs compiled blocks like its own."""
    require("nanocore-looped-bfs")
    parallelism = {"pp": 2, "pp_engine": "looped_bfs", "pp_virtual_stages": 2}
    run = run_training(tiny_config(tmp_path, parallelism=parallelism, model=COMPILE), 2)
    assert_matches(run, reference(tmp_path_factory, tied=False))


def test_layers_of_one_shape_share_one_compiled_graph(tmp_path):
    """Regional compile: a model twice as deep compiles no more graphs (nor frames), so compile time
    does not grow with depth; and ten steps compile nothing after the first (no recompilation)."""
    from torch._dynamo.utils import counters

    from tests.helpers.training import train_in_process

    compiled = {}
    for layers in (2, 4):
        model = {"model_config": {"num_hidden_layers": layers}, **COMPILE}
        counters.clear()
        losses, _ = train_in_process(tiny_config(tmp_path / str(layers), model=model))
        assert len(losses) == 10
        compiled[layers] = (counters["stats"]["unique_graphs"], counters["frames"]["ok"])
    assert compiled[2][0] > 0, compiled
    assert compiled[4] == compiled[2], f"(graphs, frames) compiled at 2 and 4 layers: {compiled}"
