"""The attention variants of 2026's open models as shared parts: sliding windows, attention sinks,
partial rotary, gated output, and the sliding-window KV cache, each against a plain reference written
out here (scores, mask, softmax), with gradients."""

from __future__ import annotations

import pytest
import torch

from nanocore.model_api import KVCache
from nanocore.model_parts.attention import GroupedQueryAttention, attention
from nanocore.model_parts.rotary import Rotary, apply_rotary, rotate_half
from nanocore.sequence_api import DocumentMasking, document_ids
from tests.helpers.compare import rel_diff


def reference(q, k, v, window=None, sinks=None, docs=None):
    """transformers' eager attention (gpt-oss's with sinks): scores, mask, softmax with the sink column."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    s_q, s_k = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    i = torch.arange(s_k - s_q, s_k)[:, None]
    j = torch.arange(s_k)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (j > i - window)
    allowed = allowed[None, None]
    if docs is not None:
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, s_q, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs @ v


def qkv(b=2, heads=4, kv_heads=2, s=20, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g, requires_grad=True) for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize(("window", "with_sinks"), [(None, True), (5, False), (5, True), (1, True)])
def test_window_and_sinks_equal_the_eager_reference_with_gradients(window, with_sinks):
    q, k, v = qkv()
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3)).mul(2).requires_grad_(with_sinks)
    s = sinks if with_sinks else None
    ours, ref = attention(q, k, v, window, s), reference(q, k, v, window, s)
    assert rel_diff(ours, ref) <= 1e-5
    grads = torch.autograd.grad(ours.square().sum(), [q, k, v] + ([sinks] if with_sinks else []))
    ref_grads = torch.autograd.grad(ref.square().sum(), [q, k, v] + ([sinks] if with_sinks else []))
    for a, b in zip(grads, ref_grads, strict=True):
        assert rel_diff(a, b) <= 1e-5
    # the variant changes the numbers: the plain causal kernel is far from it
    assert rel_diff(attention(q, k, v), ref) > 1e-2


def test_a_window_as_long_as_the_sequence_is_full_causal_attention():
    q, k, v = qkv()
    assert rel_diff(attention(q, k, v, window=20), attention(q, k, v)) <= 1e-6


def test_document_masking_composes_with_windows_and_sinks():
    q, k, v = qkv(b=2, s=24)
    ids = torch.randint(3, 50, (2, 24), generator=torch.Generator().manual_seed(1))
    ids[0, [5, 15]] = 0  # three documents in the first sample, one in the second
    runtime = DocumentMasking(separator=0)
    runtime.set_tokens(ids)
    sinks = torch.randn(4)
    ours = runtime.attend(q, k, v, window=6, sinks=sinks)
    ref = reference(q, k, v, window=6, sinks=sinks, docs=document_ids(ids, 0))
    assert rel_diff(ours, ref) <= 1e-5
    # a window never reaches across a document: sample 0 differs from the same window without documents
    assert rel_diff(ours[0], reference(q, k, v, window=6, sinks=sinks)[0]) > 1e-2


def test_partial_rotary_rotates_the_first_features_only():
    x = torch.randn(1, 2, 6, 16)
    rotary = Rotary(4, 10000.0, None, 8)
    cos, sin = rotary.cos_sin(6, 0, x.device, x.dtype)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert torch.allclose(out[..., :4], x[..., :4] * cos + rotate_half(x[..., :4]) * sin)


def gqa(**options):
    torch.manual_seed(0)
    layer = GroupedQueryAttention(32, 4, 2, 8, bias=False, layer_idx=0, rotary=Rotary(8, 1e4, None, 64), **options)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer.eval()


def test_output_gate_multiplies_each_heads_output_by_the_sigmoid_of_its_gate_rows():
    gated = gqa(output_gate=True)
    assert gated.q_proj.weight.shape == (2 * 4 * 8, 32)
    plain = gqa()
    # the same query rows: each head's 8 query rows come first, then its 8 gate rows
    with torch.no_grad():
        rows = gated.q_proj.weight.view(4, 2, 8, 32)
        plain.q_proj.weight.copy_(rows[:, 0].reshape(32, 32))
        for name in ("k_proj", "v_proj", "o_proj"):
            getattr(plain, name).weight.copy_(getattr(gated, name).weight)
    x = torch.randn(2, 10, 32)
    captured = []
    plain.o_proj.register_forward_hook(lambda m, inputs, out: captured.append(inputs[0]) and None)
    plain(x)
    gate = torch.sigmoid(x @ rows[:, 1].reshape(32, 32).T)
    expected = plain.o_proj(captured[0] * gate)
    assert rel_diff(gated(x), expected) <= 1e-6


@pytest.mark.parametrize("options", [{"window": 4}, {"window": 4, "sinks": True}, {"sinks": True}])
def test_the_kv_cache_of_a_windowed_layer_keeps_only_the_window(options):
    layer = gqa(**options)
    x = torch.randn(1, 14, 32)
    with torch.no_grad():
        full = layer(x)
        cache = KVCache()
        first = layer(x[:, :6], cache)
        cache.advance(6)
        steps = []
        for i in range(6, 14):
            steps.append(layer(x[:, i : i + 1], cache))
            cache.advance(1)
            if "window" in options:
                assert cache.keys[0].shape[2] == options["window"] - 1
    assert rel_diff(torch.cat([first, *steps], dim=1), full) <= 1e-5
