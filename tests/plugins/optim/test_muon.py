"""Muon (`optimizer_factory.name: muon`, plugins/optim/muon.py): the Newton-Schulz iteration, one step
by hand, AdamW for what is not a hidden matrix, which parameters are hidden matrices, the layouts it
refuses until the distributed step exists, and dp2 / pp2 (matrices whole on each rank) equal to one
process."""

from __future__ import annotations

import math

import pytest
import torch

from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.errors import ConfigError
from nanocore.model_api import is_hidden_matrix
from nanocore.plugins import load_plugins
from nanocore_plugins.optim.muon import KELLER_COEFFICIENTS, MuonArgs, newton_schulz
from tests.helpers import parity
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


@pytest.mark.parametrize(("section", "value"), [("optimizer", {"zero_stage": 1}), ("parallelism", {"tp": 2})])
def test_layouts_that_split_matrices_are_refused_for_now(registries, tmp_path, section, value):
    raw = muon_config(tmp_path, **{section: value})
    with pytest.raises(ConfigError, match="optimizer.optimizer_factory.muon needs each hidden matrix whole on a rank"):
        check_config(structure_config(raw, registries), registries, world_size=2)


def muon_config(tmp, **sections) -> dict:
    raw = tiny_config(tmp, **sections)
    raw["optimizer"]["optimizer_factory"] = {"name": "muon"}  # AdamW's keys out
    return raw


@pytest.mark.slow
@pytest.mark.parametrize("par", [{"dp": 2}, {"pp": 2}], ids=["dp2", "pp2_1f1b"])
def test_layouts_with_whole_matrices_train_like_one_process(tmp_path, par):
    one = run_training(muon_config(tmp_path / "one"))
    accumulation = {"batch_accumulation_per_replica": 4 // par.get("dp", 1)}
    run = run_training(muon_config(tmp_path / "run", parallelism=par, tokens=accumulation), 2)
    parity.assert_matches(run, one)
