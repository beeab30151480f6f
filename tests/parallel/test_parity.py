"""The proof: every parallel layout trains exactly like one process (float32, gloo on CPU).

Each layout runs 10 optimizer steps from the same seed on the same global batches and must match
the single-process run: step-1 loss within 1e-5 relative, later losses within 1e-4, final weights
within 1e-4 (absolute, weights are O(0.1)).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

GLOBAL_MICROBATCHES = 4  # global batch = dp x micro_batch_size(1) x accumulation


def layout(dp=1, tp=1, pp=1, **par):
    return {"dp": dp, "tp": tp, "pp": pp, **par}


LAYOUTS = {
    "dp2": (layout(dp=2), {}),
    "tp2_all_reduce": (layout(tp=2, tp_mode="ALL_REDUCE"), {}),
    "tp2_reduce_scatter_async": (layout(tp=2, tp_mode="REDUCE_SCATTER", tp_linear_async_communication=True), {}),
    "pp2_afab": (layout(pp=2, pp_engine="afab"), {}),
    "pp2_1f1b": (layout(pp=2, pp_engine="1f1b"), {}),
    "pp4_1f1b": (layout(pp=4, pp_engine="1f1b"), {}),
    "pp2_interleaved_v2": (layout(pp=2, pp_engine="interleaved", pp_virtual_stages=2), {}),
    "dp2_tp2_pp2_1f1b_zero1": (layout(dp=2, tp=2, pp=2, pp_engine="1f1b"), {"optimizer": {"zero_stage": 1}}),
    "recompute": (layout(pp=2, recompute_layer=True), {}),
}

_reference: dict[bool, dict] = {}


def reference(tmp_path_factory, tied: bool) -> dict:
    if tied not in _reference:
        tmp = tmp_path_factory.mktemp(f"reference_tied{tied}")
        model = {"model_config": {"tie_word_embeddings": tied}}
        _reference[tied] = run_training(tiny_config(tmp, model=model))
    return _reference[tied]


def assert_matches(run: dict, ref: dict) -> None:
    losses, ref_losses = run["losses"], ref["losses"]
    assert len(losses) == len(ref_losses) == 10
    assert abs(losses[0] - ref_losses[0]) <= 1e-5 * abs(ref_losses[0]), (losses[0], ref_losses[0])
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses, strict=True)]
    assert max(diffs) <= 1e-4, f"per-step loss differences: {diffs}"
    assert max(ref_losses) - min(ref_losses) > 0.01, "the reference must actually train for parity to mean anything"
    assert run["weights"].keys() == ref["weights"].keys()
    for name, tensor in ref["weights"].items():
        diff = (run["weights"][name] - tensor).abs().max().item()
        assert diff <= 1e-4, f"{name}: max weight difference {diff}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, tmp_path, tmp_path_factory):
    par, extra = LAYOUTS[name]
    world = par["dp"] * par["tp"] * par["pp"]
    accumulation = GLOBAL_MICROBATCHES // par["dp"]
    config = tiny_config(tmp_path, parallelism=par, tokens={"batch_accumulation_per_replica": accumulation}, **extra)
    assert_matches(run_training(config, world), reference(tmp_path_factory, tied=False))


def test_tied_embeddings_across_pipeline_stages(tmp_path, tmp_path_factory):
    model = {"model_config": {"tie_word_embeddings": True}}
    config = tiny_config(tmp_path, parallelism=layout(pp=2), model=model)
    run = run_training(config, 2)
    ref = reference(tmp_path_factory, tied=True)
    assert "lm_head.weight" not in run["weights"], "a tied head is saved once, under the embedding's name"
    assert_matches(run, ref)


def test_zero1_shards_optimizer_state(tmp_path):
    """ZeRO-1 keeps ~1/dp of the optimizer state bytes of zero_stage 0 on each rank."""
    tokens = {"batch_accumulation_per_replica": 1, "train_steps": 1}
    plain = run_training(tiny_config(tmp_path / "z0", parallelism=layout(dp=4), tokens=tokens), 4)
    zero = run_training(
        tiny_config(tmp_path / "z1", parallelism=layout(dp=4), tokens=tokens, optimizer={"zero_stage": 1}), 4
    )
    full = plain["ranks"][0]["state_bytes"]
    per_rank = [r["state_bytes"] for r in zero["ranks"]]
    assert all(r["state_bytes"] == full for r in plain["ranks"])
    for b in per_rank:
        assert abs(b - full / 4) <= 0.05 * full / 4, (per_rank, full)
    # the shards add up to the whole (only the per-parameter scalar step counters are replicated)
    assert abs(sum(per_rank) - full) <= 0.01 * full
    assert torch.allclose(torch.tensor(zero["losses"]), torch.tensor(plain["losses"]), atol=1e-6)
