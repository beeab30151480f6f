"""Gated DeltaNet (Qwen3-Next's linear attention) as a shared part: the layer against transformers'
`Qwen3NextGatedDeltaNet` (pure-PyTorch path), the chunked delta rule against the token-by-token one
(with and without a starting state, split and carried), packed documents, generation with a cache,
gradients, and the initialisation helper."""

from __future__ import annotations

import pytest
import torch

from nanocore.model_parts.gated_deltanet import (
    GatedDeltaNet,
    LinearAttentionCache,
    causal_conv1d,
    chunk_gated_delta_rule,
    init_gated_deltanet_parameter,
    recurrent_gated_delta_rule,
)
from tests.helpers.compare import rel_diff

TOL = 1e-5
HIDDEN, K_HEADS, V_HEADS, DK, DV = 32, 2, 4, 8, 6  # value heads 2x key heads; the head sizes differ
KERNEL = 4


def hf_layer(seed: int = 0):
    """transformers' layer from a tiny config, with every parameter random (norm weight, dt_bias and
    A_log too, so a wrong use of any of them shows)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(
        hidden_size=HIDDEN,
        linear_num_key_heads=K_HEADS,
        linear_num_value_heads=V_HEADS,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=KERNEL,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        layer.A_log.copy_(torch.rand(V_HEADS, generator=gen) * 3 - 2)
        layer.dt_bias.copy_(torch.randn(V_HEADS, generator=gen))
        layer.norm.weight.copy_(torch.rand(DV, generator=gen) + 0.5)
    return layer, config


def our_layer(seed: int = 0, **kwargs) -> GatedDeltaNet:
    ref, config = hf_layer(seed)
    layer = GatedDeltaNet(
        HIDDEN, K_HEADS, V_HEADS, DK, DV, conv_kernel_size=KERNEL, rms_norm_eps=config.rms_norm_eps, **kwargs
    )
    layer.load_state_dict(ref.state_dict(), strict=True)
    return layer.eval()


def hidden(b: int, s: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, s, HIDDEN, generator=torch.Generator().manual_seed(seed))


def rule_inputs(b=2, s=40, k_heads=2, v_heads=4, dk=8, dv=6, seed=0):
    """q, k, v, g (log forget factors, as the layer makes them: -exp(A) * softplus) and beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, k_heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, s, v_heads, dv, generator=gen)
    g = -torch.randn(v_heads, generator=gen).exp() * torch.nn.functional.softplus(
        torch.randn(b, s, v_heads, generator=gen)
    )
    beta = torch.rand(b, s, v_heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("s", [10, 64, 80])  # shorter than, equal to, longer than (not a multiple of) a chunk
def test_layer_equals_transformers(s):
    ref, _ = hf_layer()
    ours = our_layer()
    x = hidden(2, s)
    with torch.no_grad():
        expected, got = ref(x), ours(x)
    assert rel_diff(got, expected) <= TOL


@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent_values_and_gradients(with_state):
    inputs = [t.requires_grad_() for t in rule_inputs()]
    state = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(5)) if with_state else None
    results = []
    for rule in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        out, final = rule(*inputs, chunk_size=16, initial_state=state, output_final_state=True)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1])).sum() + final.sum(), inputs)
        results.append((out, final, grads))
    (out_c, final_c, grads_c), (out_r, final_r, grads_r) = results
    assert rel_diff(out_c, out_r) <= TOL
    assert rel_diff(final_c, final_r) <= TOL
    for grad_c, grad_r in zip(grads_c, grads_r, strict=True):
        assert rel_diff(grad_c, grad_r) <= TOL
    assert chunk_gated_delta_rule(*inputs)[1] is None  # the state only when asked for


def test_splitting_a_sequence_and_carrying_the_state_equals_the_whole():
    q, k, v, g, beta = rule_inputs(s=50)
    whole, whole_final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, output_final_state=True)
    cut = 23  # not on a chunk boundary
    first, mid = chunk_gated_delta_rule(
        *(t[:, :cut] for t in (q, k, v, g, beta)), chunk_size=16, output_final_state=True
    )
    second, final = chunk_gated_delta_rule(
        *(t[:, cut:] for t in (q, k, v, g, beta)), chunk_size=16, initial_state=mid, output_final_state=True
    )
    assert rel_diff(torch.cat([first, second], dim=1), whole) <= TOL
    assert rel_diff(final, whole_final) <= TOL
    # the layer's handover (a context-parallel engine's unit): the convolution's inputs carried too
    layer, x = our_layer(), hidden(2, 50)
    with torch.no_grad():
        full = layer(x)
        a, state = layer.forward_with_state(x[:, :cut])
        b, _ = layer.forward_with_state(x[:, cut:], state)
    assert rel_diff(torch.cat([a, b], dim=1), full) <= TOL


def test_causal_conv1d_in_pieces_with_its_state_equals_the_whole():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 12, 5, generator=gen), torch.randn(5, 1, KERNEL, generator=gen)
    whole, _ = causal_conv1d(x, weight)
    expected = torch.nn.functional.conv1d(x.transpose(1, 2), weight, padding=KERNEL - 1, groups=5)[..., :12]
    assert rel_diff(whole, expected.transpose(1, 2)) <= TOL
    a, state = causal_conv1d(x[:, :2], weight)  # shorter than the kernel
    b, state = causal_conv1d(x[:, 2:3], weight, state)
    c, _ = causal_conv1d(x[:, 3:], weight, state)
    assert state.shape == (2, KERNEL - 1, 5)
    assert rel_diff(torch.cat([a, b, c], dim=1), whole) <= TOL


def test_packed_documents_restart_and_equal_each_document_alone():
    layer = our_layer()
    lengths = [[7, 30, 13], [20, 1, 29]]  # each row three documents; a one-token document too
    x = hidden(2, 50)
    starts = torch.zeros(2, 50, dtype=torch.bool)
    for row, docs in enumerate(lengths):
        starts[row, torch.tensor([0, *docs[:-1]]).cumsum(0)] = True
    with torch.no_grad():
        packed, plain = layer(x, starts=starts), layer(x)
        alone = torch.stack(
            [
                torch.cat([layer(piece.unsqueeze(0))[0] for piece in x[row].split(docs)], dim=0)
                for row, docs in enumerate(lengths)
            ]
        )
    assert rel_diff(packed, alone) <= TOL
    assert rel_diff(plain, alone) > 1e-2  # without `starts` the documents see each other
    no_restart = torch.zeros(2, 50, dtype=torch.bool)  # position 0 starts a document, marked or not
    assert rel_diff(layer(x, starts=no_restart), plain) == 0.0


def test_generation_prefill_then_steps_equals_the_full_forward():
    layer, x = our_layer(), hidden(2, 24)
    cache = LinearAttentionCache()
    with torch.no_grad():
        full = layer(x)
        pieces = [layer(x[:, :13], cache), layer(x[:, 13:19], cache)]  # prefill, then a chunk with the state
        pieces += [layer(x[:, t : t + 1], cache) for t in range(19, 24)]  # one-token steps (recurrent form)
    assert rel_diff(torch.cat(pieces, dim=1), full) <= TOL
    state = cache.linear_state(0)
    assert state is not None and state.conv.shape == (2, KERNEL - 1, 2 * K_HEADS * DK + V_HEADS * DV)
    assert state.recurrent.shape == (2, V_HEADS, DK, DV) and state.recurrent.dtype == torch.float32
    with pytest.raises(ValueError):
        layer(x, cache, starts=torch.ones(2, 24, dtype=torch.bool))


def test_gradients_reach_every_parameter():
    layer = our_layer().train()
    x = hidden(2, 20).requires_grad_()
    starts = torch.zeros(2, 20, dtype=torch.bool)
    starts[0, 9] = True
    (layer(x, starts=starts) * torch.linspace(-1, 1, HIDDEN)).sum().backward()
    for name, p in [("x", x), *layer.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name


def test_init_helper_is_deterministic_and_owns_only_its_names():
    layer = GatedDeltaNet(HIDDEN, K_HEADS, V_HEADS, DK, DV, conv_kernel_size=KERNEL, rms_norm_eps=1e-6)
    drawn = {}
    for name, p in layer.named_parameters():
        for prefix in ("", "model.layers.3.linear_attn."):
            p.data.fill_(float("nan"))
            assert init_gated_deltanet_parameter(prefix + name, p, torch.Generator().manual_seed(7), 0.02)
            drawn.setdefault(name, p.detach().clone())
            assert torch.equal(p, drawn[name]), name  # the same values from the same generator
    assert torch.equal(drawn["dt_bias"], torch.ones(V_HEADS)) and torch.equal(drawn["norm.weight"], torch.ones(DV))
    a = drawn["A_log"].exp()
    assert ((a >= 0.01) & (a <= 16)).all()
    assert 0.01 < drawn["in_proj_qkvz.weight"].std() < 0.03
    p = torch.zeros(3)
    for other in ("model.norm.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.0.xlinear_attn.A_log"):
        assert not init_gated_deltanet_parameter(other, p, torch.Generator(), 0.02)
    assert torch.equal(p, torch.zeros(3))
