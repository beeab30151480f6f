"""The third-party plugins train exactly like one process under the built-in 3D engine.

Same protocol and tolerances as tests/parallel/test_parity.py (10 steps, float32, gloo ranks):
GPT-2 from nanocore-gpt2 at tp2 (ALL_REDUCE, and REDUCE_SCATTER, which its learned positions
support) and at pp2 1f1b against GPT-2's own single-process run; LLaMA under the looped_bfs
schedule of nanocore-looped-bfs at pp2 with 2 virtual stages against LLaMA's single-process run.
"""

from __future__ import annotations

import pytest

from tests.helpers.parity import assert_matches
from tests.helpers.third_party import gpt2_config, require
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

_references: dict[str, dict] = {}


def reference(tmp_path_factory, key: str, config_for) -> dict:
    """One single-process run per model variant, shared by the tests of this module."""
    if key not in _references:
        _references[key] = run_training(config_for(tmp_path_factory.mktemp(f"reference_{key}")))
    return _references[key]


GPT2_LAYOUTS = {  # name -> (parallelism, tie_word_embeddings)
    "tp2_all_reduce": ({"tp": 2, "tp_mode": "ALL_REDUCE"}, True),
    "tp2_reduce_scatter_untied": ({"tp": 2, "tp_mode": "REDUCE_SCATTER"}, False),
    "pp2_1f1b": ({"pp": 2, "pp_engine": "1f1b"}, True),  # the tied embedding sits on both stages
}


@pytest.mark.parametrize("name", list(GPT2_LAYOUTS))
def test_gpt2_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    require("nanocore-gpt2")
    parallelism, tied = GPT2_LAYOUTS[name]
    model = {"tie_word_embeddings": tied}
    ref = reference(tmp_path_factory, f"gpt2_tied{tied}", lambda tmp: gpt2_config(tmp, model))
    run = run_training(gpt2_config(tmp_path, model, parallelism=parallelism), 2)
    assert_matches(run, ref)
    assert ("lm_head.weight" in run["weights"]) == (not tied)
    assert "transformer.embeddings.wpe.weight" in run["weights"]


def test_looped_bfs_pp2_v2_matches_llama_single_process(tmp_path, tmp_path_factory):
    require("nanocore-looped-bfs")
    ref = reference(tmp_path_factory, "llama", tiny_config)
    parallelism = {"pp": 2, "pp_engine": "looped_bfs", "pp_virtual_stages": 2}
    assert_matches(run_training(tiny_config(tmp_path, parallelism=parallelism), 2), ref)
