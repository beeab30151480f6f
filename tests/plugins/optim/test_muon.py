"""Muon (`optimizer_factory.name: muon`, plugins/optim/muon.py): the Newton-Schulz iteration, one step
by hand, AdamW for what is not a hidden matrix, which parameters are hidden matrices, and every
layout (ZeRO rows, TP pieces, pipeline stages, experts) equal to one process."""

from __future__ import annotations

import math

import pytest
import torch

from nanocore.checkpoint.tensors import ShardReader
from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.errors import ConfigError
from nanocore.model_api import is_hidden_matrix
from nanocore.plugins import load_plugins
from nanocore_plugins.optim.muon import KELLER_COEFFICIENTS, MuonArgs, newton_schulz, ns_dtype
from tests.helpers import parity
from tests.helpers.parity import layout
from tests.helpers.training import run_training, tiny_config


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (3, 24, 40)], ids=["tall", "wide", "experts"])
def test_newton_schulz_gives_the_orthogonal_factor_approximately(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    o = newton_schulz(g, 5, KELLER_COEFFICIENTS)
    assert o.shape == g.shape
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    exact = u @ vh  # the orthogonal factor U V^T, per matrix
    s = torch.linalg.svdvals(o)
    # Keller Jordan's coefficients trade exactness for speed: singular values land in about [0.7, 1.2]
    assert s.min() > 0.6 and s.max() < 1.25, s
    cosine = (o * exact).sum(dim=(-2, -1)) / (o.norm(dim=(-2, -1)) * exact.norm(dim=(-2, -1)))
    assert cosine.min() > 0.98, cosine


def muon(params, registries, lr=0.1, weight_decay=0.5, **args):
    entry = registries.optimizer.get("muon")
    return entry.factory(params, MuonArgs(**args), lr=lr, weight_decay=weight_decay, device=torch.device("cpu"))


def test_one_muon_step_by_hand(registries):
    w = torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)))
    optimizer = muon([{"params": [w], "hidden_matrix": True}], registries)
    start = w.detach().clone()
    grads = [torch.randn(6, 4, generator=torch.Generator().manual_seed(s)) for s in (2, 3)]
    buf = torch.zeros(6, 4)
    expected = start
    for g in grads:
        w.grad = g.clone()
        optimizer.step()
        buf = 0.95 * buf + g
        update = newton_schulz(g + 0.95 * buf, 5, KELLER_COEFFICIENTS)
        expected = expected * (1 - 0.1 * 0.5) - 0.1 * 0.2 * math.sqrt(6) * update
        torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-6)
    # the update's RMS is Moonlight's 0.2 (times lr): AdamW's learning rate carries over
    rms = (update * 0.2 * math.sqrt(6)).pow(2).mean().sqrt()
    assert 0.15 < rms < 0.25, rms


def test_what_is_not_a_hidden_matrix_takes_torchs_adamw_update(registries):
    torch.manual_seed(0)
    ours, theirs = torch.nn.Parameter(torch.randn(5, 3)), None
    theirs = torch.nn.Parameter(ours.detach().clone())
    optimizer = muon([{"params": [ours], "hidden_matrix": False}], registries, lr=0.01, weight_decay=0.1)
    reference = torch.optim.AdamW([theirs], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for seed in range(3):
        g = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))
        ours.grad, theirs.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)


def test_which_parameters_are_hidden_matrices(registries, tmp_path):
    from tests.helpers.deepseek_v3 import make as make_deepseek
    from tests.helpers.deepseek_v3 import tiny as tiny_deepseek

    model = make_deepseek(tiny_deepseek(num_nextn_predict_layers=1))
    named = list(model.named_parameters(remove_duplicate=False))  # both names of a tied pair
    matrices = {n for n, p in named if is_hidden_matrix(model, n, p.dim())}
    others = {n for n, _ in named} - matrices
    for name in ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.experts.gate_up_proj",
                 "model.layers.1.mlp.shared_experts.up_proj.weight", "model.mtp.0.eh_proj.weight"):  # fmt: skip
        assert name in matrices, name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.norm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight",
                 "model.mtp.0.shared_head.head.weight", "model.mtp.0.embed_tokens.weight"):  # fmt: skip
        assert name in others, name


def test_bad_muon_settings_are_refused_with_their_yaml_path(registries, tmp_path):
    raw = muon_config(tmp_path)
    raw["optimizer"]["optimizer_factory"]["muon_momentum"] = 1.0
    raw["optimizer"]["optimizer_factory"]["update_scale"] = "huge"
    with pytest.raises(ConfigError) as error:
        check_config(structure_config(raw, registries), registries, world_size=1)
    assert "optimizer.optimizer_factory.muon_momentum: must be in [0, 1), got 1.0" in str(error.value)
    assert "optimizer.optimizer_factory.update_scale: must be one of moonlight, spectral, none" in str(error.value)


def muon_config(tmp, **sections) -> dict:
    raw = tiny_config(tmp, **sections)
    raw["optimizer"]["optimizer_factory"] = {"name": "muon"}  # AdamW's keys out
    return raw


ZERO1, ZERO3 = {"zero_stage": 1}, {"zero_stage": 3}
# the layouts: ZeRO rows, TP columns and rows, pipeline stages, 3-D, and experts split over EP
LAYOUTS = {
    "dp2": (layout(dp=2), {}),
    "dp4_zero1": (layout(dp=4), ZERO1),
    "dp2_zero3": (layout(dp=2), ZERO3),
    "tp2_all_reduce": (layout(tp=2, tp_mode="ALL_REDUCE"), {}),
    "tp2_reduce_scatter": (layout(tp=2, tp_mode="REDUCE_SCATTER"), {}),
    "pp2_1f1b": (layout(pp=2, pp_engine="1f1b"), {}),
    "dp2_tp2_pp2_1f1b_zero1": (layout(dp=2, tp=2, pp=2, pp_engine="1f1b"), ZERO1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_at_every_layout_trains_like_one_process(tmp_path, tmp_path_factory, name):
    """Each hidden matrix's update comes from the whole matrix, put together from ZeRO rows and TP
    pieces: the parity tests' tolerances (10 steps, step-1 loss 1e-5, later losses and weights 1e-4)."""
    par, optimizer = LAYOUTS[name]
    accumulation = {"batch_accumulation_per_replica": parity.GLOBAL_MICROBATCHES // par["dp"]}
    world = par["dp"] * par["tp"] * par["pp"]
    run = run_training(muon_config(tmp_path, parallelism=par, tokens=accumulation, optimizer=optimizer), world)
    parity.assert_matches(run, muon_reference(tmp_path_factory))


_reference: dict = {}


def muon_reference(tmp_path_factory) -> dict:
    if "dense" not in _reference:
        _reference["dense"] = run_training(muon_config(tmp_path_factory.mktemp("muon_reference")))
    return _reference["dense"]


@pytest.mark.slow
def test_mixtral_at_ep2_tp2_trains_like_one_process(tmp_path):
    """Each expert is its own matrix: stacks split over EP ranks, rows over ZeRO-1's replicas."""
    from tests.helpers.moe_parity import moe_config

    def muon_moe(tmp, par, **extra):
        config = moe_config(tmp, par, **extra)
        config["optimizer"]["optimizer_factory"] = {"name": "muon"}
        return config

    one = run_training(muon_moe(tmp_path / "one", layout()))
    par = layout(dp=2, tp=2, expert_parallel_size=2, tp_mode="REDUCE_SCATTER")
    run = run_training(muon_moe(tmp_path / "run", par, optimizer=ZERO1), 4)
    parity.assert_matches(run, one)


@pytest.mark.slow
def test_muon_state_resumes_at_another_layout(tmp_path, tmp_path_factory):
    """Momentum buffers (and AdamW's moments) are saved with their place in the full tensor: five
    steps at dp2·tp2·pp2 ZeRO-1, five more at dp2 ZeRO-3, the losses and weights of ten steps at one
    process (the parity tolerances)."""
    from tests.helpers.compare import rel_diff

    def config(tmp, par, optimizer, **checkpoints):
        accumulation = {"batch_accumulation_per_replica": parity.GLOBAL_MICROBATCHES // par["dp"]}
        checkpoints = {"checkpoint_interval": 5, **checkpoints}
        return muon_config(tmp, parallelism=par, tokens=accumulation, optimizer=optimizer, checkpoints=checkpoints)

    ref = muon_reference(tmp_path_factory)
    run_training(config(tmp_path / "before", layout(dp=2, tp=2, pp=2, pp_engine="1f1b"), ZERO1), 8)
    ckpt = tmp_path / "before" / "checkpoints" / "5"
    saved = ShardReader(ckpt / "optimizer").names()
    assert "model.layers.0.mlp.down_proj.weight::momentum_buffer" in saved, "Muon's momentum is saved"
    assert "model.embed_tokens.weight::exp_avg_sq" in saved, "and AdamW's moments for the rest"
    resumed = run_training(config(tmp_path / "after", layout(dp=2), ZERO3, resume_checkpoint_path=str(ckpt)), 2)
    assert len(resumed["losses"]) == 5
    diffs = [rel_diff(a, b) for a, b in zip(resumed["losses"], ref["losses"][5:], strict=True)]
    assert max(diffs) <= parity.RTOL, diffs
    bad = {k: v for k, v in parity.weight_diffs(resumed["weights"], ref["weights"]).items() if not v <= parity.RTOL}
    assert not bad, bad


def test_newton_schulz_of_a_shard_is_not_a_shard_of_newton_schulz():
    """Why the distributed step gathers each matrix whole: orthogonalising ZeRO's half of the rows, or
    TP's half of the columns, gives another update than the same half of the whole matrix's (by
    far more than the parity tolerance; at layouts, a per-shard iteration misses one-process losses
    by up to 1.2e-3 relative, measured when the distributed step was written)."""
    g = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    whole = newton_schulz(g, 5, KELLER_COEFFICIENTS)
    rows = newton_schulz(g[:4], 5, KELLER_COEFFICIENTS)
    cols = newton_schulz(g[:, :6], 5, KELLER_COEFFICIENTS)
    assert (rows - whole[:4]).norm() > 0.1 * whole[:4].norm()
    assert (cols - whole[:, :6]).norm() > 0.1 * whole[:, :6].norm()
    # a permutation of rows (TP's interleaved pieces) commutes with the iteration: order does not matter
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(newton_schulz(g[perm], 5, KELLER_COEFFICIENTS), whole[perm], rtol=1e-5, atol=1e-6)


def test_newton_schulz_in_bfloat16_stays_close_to_float32():
    """`ns_dtype: bfloat16` (auto's choice on CUDA) iterates in bfloat16 and returns the optimizer's
    float32: within bfloat16's rounding of the float32 iteration (8 bits: ~0.4 % per operation, a few
    percent after 5 steps of three matmuls; measured 3.4 %)."""
    g = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    exact = newton_schulz(g, 5, KELLER_COEFFICIENTS)
    low = newton_schulz(g, 5, KELLER_COEFFICIENTS, torch.bfloat16)
    assert low.dtype == torch.float32
    assert (low - exact).norm() / exact.norm() < 0.05
    assert not torch.equal(low, exact), "the iteration really ran in bfloat16"
    assert ns_dtype("auto", torch.device("cpu")) == torch.float32
    assert ns_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_planner_and_summary_count_muons_state_and_its_matrix_buffers(registries, tmp_path):
    """Muon keeps one momentum buffer per element of a hidden matrix and AdamW's two moments for the
    rest: the start-of-run estimate equals what the optimizer holds after training, the planner says
    the same, and the planner's optimizer step holds one temporary per element (AdamW's multi-tensor
    kernel, counted over all) and 6 float32 buffers of the largest whole matrix."""
    from nanocore.plan import plan_for

    raw = muon_config(tmp_path / "muon", tokens={"train_steps": 2})
    run = run_training(raw)
    model = run["weights"]
    # what the optimizer holds, but AdamW's step counters (one float32 scalar per tensor it updates)
    adam_tensors = sum(1 for name, t in model.items() if t.dim() < 2 or "embed" in name or "lm_head" in name)
    held = run["ranks"][0]["state_bytes"] - 4 * adam_tensors
    assert run["ranks"][0]["memory"]["optimizer_bytes"] == held
    planned = plan_for(structure_config(raw, registries), registries, "cpu")
    assert planned is not None and planned.ranks[0].optimizer_bytes == held
    adam = plan_for(structure_config(tiny_config(tmp_path / "adam"), registries), registries, "cpu")
    assert adam is not None
    matrices = sum(
        t.numel() for name, t in model.items() if t.dim() >= 2 and "embed" not in name and "lm_head" not in name
    )
    # every hidden matrix element keeps one float32 state fewer than under AdamW
    assert adam.ranks[0].optimizer_bytes - planned.ranks[0].optimizer_bytes == matrices * 4
    largest = max(
        t.numel() for name, t in model.items() if t.dim() >= 2 and "embed" not in name and "lm_head" not in name
    )
    elements = sum(t.numel() for t in model.values())
    assert planned.ranks[0].optimizer_step_bytes == elements * 4 + largest * 4 * 6
