"""The gpt-oss and Qwen3-Next variants of the shared sparse MoE block, against transformers' own modules.

Each test builds a `SparseMoeBlock` from a tiny `MoESpec` and transformers' block from a tiny config,
copies random weights over (gpt-oss's experts through `gpt_oss_experts_from_hf`), and compares outputs
and gradients in float32. The weights are large enough that tokens pick different experts and that
gpt-oss's clamp clips some pre-activations (both asserted, so a missing clamp or a wrong routing rule
fails the comparison instead of hiding in values that never reach the limits)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.qwen3_next import modeling_qwen3_next

from nanocore.model_parts.moe import (
    EXPERT_BIAS_PARAMETERS,
    EXPERT_PARAMETERS,
    MoESpec,
    SparseMoeBlock,
    gpt_oss_experts_from_hf,
    gpt_oss_experts_to_hf,
)

H, INTER, E, K = 16, 8, 4, 2  # hidden, expert width, experts, top-k
SHARED = 12
TOKENS = (2, 7)  # [batch, sequence]
STD = 0.5  # x ~ N(0, 1): logits and pre-activations ~ N(0, 2), far beyond LIMIT in places
LIMIT, ALPHA = 3.0, 1.702
RTOL = 1e-5  # of the largest magnitude


def _randomise(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * STD)


def _inputs(seed: int = 1) -> torch.Tensor:
    return torch.randn(*TOKENS, H, generator=torch.Generator().manual_seed(seed))


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    scale = ref.abs().max().clamp_min(1e-30)
    rel = float((ours - ref).detach().abs().max() / scale.detach())
    assert rel <= RTOL, f"{what}: max difference {rel:.3g} of the largest magnitude"
    return rel


def _assert_varied_routing(experts: torch.Tensor) -> None:
    """Tokens pick different expert sets, and every expert gets some token."""
    sets = {tuple(sorted(row)) for row in experts.tolist()}
    assert len(sets) >= 3, sets
    assert torch.bincount(experts.reshape(-1), minlength=E).min() > 0


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in module.named_parameters():
        assert p.grad is not None, f"no gradient reached {name}"
        assert p.grad.abs().sum() > 0, f"zero gradient for {name}"
        grads[name] = p.grad
    return grads


# -- gpt-oss ---------------------------------------------------------------------------------------


def _gpt_oss_spec(limit: float = LIMIT, **kw: object) -> MoESpec:
    return MoESpec(
        hidden_size=H,
        num_experts=E,
        top_k=K,
        intermediate_size=INTER,
        scoring_func="topk_softmax",
        router_bias=True,
        expert_bias=True,
        swiglu_limit=limit,
        swiglu_alpha=ALPHA,
        **kw,  # type: ignore[arg-type]
    )


def _gpt_oss_pair() -> tuple[SparseMoeBlock, nn.Module]:
    config = transformers.GptOssConfig(
        hidden_size=H,
        intermediate_size=INTER,
        num_local_experts=E,
        num_experts_per_tok=K,
        swiglu_limit=LIMIT,
        experts_implementation="eager",
    )
    assert config.swiglu_alpha == ALPHA
    ref = modeling_gpt_oss.GptOssMLP(config)
    _randomise(ref, seed=0)
    ours = SparseMoeBlock(_gpt_oss_spec())
    ours.load_state_dict(_gpt_oss_to_nanocore(ref.state_dict()), strict=True)
    return ours, ref


def _gpt_oss_to_nanocore(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' `GptOssMLP` state -> `SparseMoeBlock`'s (the router renamed, as an HF mapping will)."""
    return {k.replace("router.", "gate.", 1): v for k, v in gpt_oss_experts_from_hf(hf).items()}


def test_gpt_oss_conversion_round_trip_is_bit_exact():
    _, ref = _gpt_oss_pair()
    hf = {f"model.layers.3.mlp.{k}": v for k, v in ref.state_dict().items()}
    ours = gpt_oss_experts_from_hf(hf)
    assert ours["model.layers.3.mlp.experts.gate_up_proj"].shape == (E, 2 * INTER, H)
    assert ours["model.layers.3.mlp.experts.down_proj"].shape == (E, H, INTER)
    # gate rows first: nanocore's row j is transformers' column 2j (gate j), row INTER + j column 2j + 1 (up j)
    w, b = hf["model.layers.3.mlp.experts.gate_up_proj"], hf["model.layers.3.mlp.experts.gate_up_proj_bias"]
    assert torch.equal(ours["model.layers.3.mlp.experts.gate_up_proj"][1, 2], w[1, :, 4])
    assert torch.equal(ours["model.layers.3.mlp.experts.gate_up_proj"][1, INTER + 2], w[1, :, 5])
    assert torch.equal(ours["model.layers.3.mlp.experts.gate_up_proj_bias"][1, INTER + 2], b[1, 5])
    back = gpt_oss_experts_to_hf(ours)
    assert back.keys() == hf.keys()
    for k, v in hf.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k
        assert back[k].is_contiguous()
    with pytest.raises(ValueError, match="odd length"):
        gpt_oss_experts_from_hf({"experts.gate_up_proj": torch.zeros(E, H, 2 * INTER + 1)})


def test_gpt_oss_block_matches_transformers():
    ours, ref = _gpt_oss_pair()
    x = _inputs()
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()

    # The routing differs across tokens and the clamps clip routed pre-activations, gate and up alike.
    flat = x.reshape(-1, H)
    with torch.no_grad():
        _, _, chosen = ref.router(flat)
        pre = (
            torch.einsum("nh,nkho->nko", flat, ref.experts.gate_up_proj[chosen]) + ref.experts.gate_up_proj_bias[chosen]
        )
    _assert_varied_routing(chosen)
    assert (pre[..., ::2] > LIMIT).any() and (pre[..., ::2] < LIMIT).any()
    assert (pre[..., 1::2].abs() > LIMIT).any() and (pre[..., 1::2].abs() < LIMIT).any()

    out_ref, _ = ref(x_ref)
    out = ours(x_ours)
    _assert_close(out, out_ref, "gpt-oss output")

    # Without the clamp (or with the wrong activation) the outputs would differ far beyond the tolerance.
    unclamped = SparseMoeBlock(_gpt_oss_spec(limit=1e9))
    unclamped.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (unclamped(x) - out_ref).abs().max() > 100 * RTOL * out_ref.abs().max()

    # Gradients: every parameter (router bias and expert biases included) and the input, as transformers'.
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * g).sum().backward()
    (out_ref * g).sum().backward()
    _assert_close(x_ours.grad, x_ref.grad, "gpt-oss input gradient")
    ref_grads = _gpt_oss_to_nanocore(_grads(ref))
    for name, grad in _grads(ours).items():
        _assert_close(grad, ref_grads[name], f"gpt-oss gradient of {name}")


def test_gpt_oss_load_balancing_statistics_match_transformers():
    """aux is transformers' `load_balancing_loss_func` of the router logits (softmax over all experts,
    router bias included); the aux and z losses send gradients to the router's weight and bias."""
    ours, ref = _gpt_oss_pair()
    ours = SparseMoeBlock(_gpt_oss_spec(aux_loss_coef=0.5, z_loss_coef=0.1))
    ours.load_state_dict(_gpt_oss_to_nanocore(ref.state_dict()))
    ours.train()
    x = _inputs()
    out = ours(x)
    stats = ours.pop_statistics()
    assert stats is not None and stats.aux_loss is not None
    with torch.no_grad():
        logits, _, chosen = ref.router(x.reshape(-1, H))
    expected = modeling_gpt_oss.load_balancing_loss_func((logits,), E, K)
    assert abs(stats.aux_loss - float(expected)) <= 1e-6 * float(expected)
    assert torch.equal(stats.tokens_per_expert, torch.bincount(chosen.reshape(-1), minlength=E).double())
    # The auxiliary gradient alone (zero output gradient) reaches the router.
    out.backward(torch.zeros_like(out))
    assert ours.gate.weight.grad is not None and ours.gate.weight.grad.abs().sum() > 0
    assert ours.gate.bias is not None and ours.gate.bias.grad is not None and ours.gate.bias.grad.abs().sum() > 0


def test_expert_biases_are_expert_parameters_and_split_by_expert_parallelism():
    from nanocore_plugins.parallel.expert_parallel import is_expert, shard_experts

    block = SparseMoeBlock(_gpt_oss_spec())
    assert block.expert_parameters == EXPERT_PARAMETERS + EXPERT_BIAS_PARAMETERS
    assert SparseMoeBlock(MoESpec(H, E, K, INTER)).expert_parameters == EXPERT_PARAMETERS  # unchanged without biases
    expert_names = {n for n, _ in block.named_parameters() if n.startswith("experts.")}
    assert expert_names == set(block.expert_parameters)

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("meta"):
                self.mlp = SparseMoeBlock(_gpt_oss_spec())
            self.moe_layers = ["mlp"]

    model = Holder()
    shard_experts(model, ep_size=2, ep_rank=1)
    shapes = {n: (tuple(p.shape), is_expert(p)) for n, p in model.named_parameters()}
    assert shapes == {
        "mlp.gate.weight": ((E, H), False),
        "mlp.gate.bias": ((E,), False),
        "mlp.experts.gate_up_proj": ((E // 2, 2 * INTER, H), True),
        "mlp.experts.down_proj": ((E // 2, H, INTER), True),
        "mlp.experts.gate_up_proj_bias": ((E // 2, 2 * INTER), True),
        "mlp.experts.down_proj_bias": ((E // 2, H), True),
    }


# -- Qwen3-Next ------------------------------------------------------------------------------------


def _qwen3_next_to_nanocore(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' `Qwen3NextSparseMoeBlock` state -> `SparseMoeBlock`'s: only the shared MLP's name differs."""
    return {k.replace("shared_expert.", "shared_experts.", 1): v for k, v in hf.items()}


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_next_block_matches_transformers(norm_topk_prob: bool):
    config = transformers.Qwen3NextConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=SHARED,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=norm_topk_prob,
        experts_implementation="eager",
    )
    ref = modeling_qwen3_next.Qwen3NextSparseMoeBlock(config)
    _randomise(ref, seed=0)
    spec = MoESpec(
        hidden_size=H,
        num_experts=E,
        top_k=K,
        intermediate_size=INTER,
        hidden_act=config.hidden_act,
        norm_topk_prob=norm_topk_prob,
        shared_intermediate_size=SHARED,
        shared_expert_gate=True,
    )
    ours = SparseMoeBlock(spec)
    ours.load_state_dict(_qwen3_next_to_nanocore(ref.state_dict()), strict=True)
    x = _inputs()
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.no_grad():
        _, _, chosen = ref.gate(x)
        gate = torch.sigmoid(ref.shared_expert_gate(x))
    _assert_varied_routing(chosen)
    assert gate.min() < 0.2 and gate.max() > 0.8  # the shared gate really scales tokens differently

    out_ref = ref(x_ref)
    out = ours(x_ours)
    _assert_close(out, out_ref, "Qwen3-Next output")

    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * g).sum().backward()
    (out_ref * g).sum().backward()
    _assert_close(x_ours.grad, x_ref.grad, "Qwen3-Next input gradient")
    ref_grads = _qwen3_next_to_nanocore(_grads(ref))
    ours_grads = _grads(ours)
    assert ours_grads.keys() == ref_grads.keys()
    for name, grad in ours_grads.items():
        _assert_close(grad, ref_grads[name], f"Qwen3-Next gradient of {name}")
