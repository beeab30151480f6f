"""A backward split into its input-gradient half (I) and weight-gradient half (W) gives exactly the
gradients of one backward, fires the usual gradient hooks, and defers the work it should."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanocore_plugins.parallel.recompute import recompute_kept
from nanocore_plugins.parallel.split_backward import backward_input


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d, bias=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Scale(torch.autograd.Function):
    """A custom function (like the overlapped TP linear layers) that computes every gradient at once."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(dim=tuple(range(g.dim() - 1)))


def _pair(d=16, layers=3, seed=0):
    torch.manual_seed(seed)
    a = nn.ModuleList(Block(d) for _ in range(layers))
    b = nn.ModuleList(Block(d) for _ in range(layers))
    b.load_state_dict(a.state_dict())
    return a, b


def _forward(blocks, x, kept=False, scale=None):
    for block in blocks:
        x = recompute_kept(block, x) if kept else block(x)
    if scale is not None:
        x = Scale.apply(x, scale)
    return x


def _assert_same_grads(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_input_then_weight_halves_equal_one_backward_and_fire_the_hooks():
    a, b = _pair()
    x = torch.randn(2, 5, 16, requires_grad=True)
    g = torch.randn(2, 5, 16)
    _forward(a, x).backward(g)
    fired = []
    for p in b.parameters():
        p.register_post_accumulate_grad_hook(fired.append)
    x2 = x.detach().clone().requires_grad_()
    input_grad, work = backward_input(_forward(b, x2), g, x2, list(b.parameters()))
    torch.testing.assert_close(input_grad, x.grad, rtol=0, atol=0)
    assert all(p.grad is None for p in b.parameters()), "I computed no weight gradient"
    assert not fired
    work.run()
    _assert_same_grads(a, b)
    assert len(fired) == len(list(b.parameters())), "every weight's accumulate hook ran once, in W"


def test_a_first_stage_without_input_gradient_does_everything_in_w():
    a, b = _pair()
    ids = torch.randint(0, 16, (2, 5))
    emb_a, emb_b = nn.Embedding(16, 16), nn.Embedding(16, 16)
    emb_b.load_state_dict(emb_a.state_dict())
    _forward(a, emb_a(ids)).sum().backward()
    input_grad, work = backward_input(_forward(b, emb_b(ids)).sum(), None, None, [*b.parameters(), *emb_b.parameters()])
    assert input_grad is None and emb_b.weight.grad is None
    work.run()
    _assert_same_grads(a, b)
    torch.testing.assert_close(emb_b.weight.grad, emb_a.weight.grad, rtol=0, atol=0)


def test_recompute_runs_once_for_both_halves_and_custom_functions_are_not_run_twice():
    a, b = _pair()
    scale_a = nn.Parameter(torch.rand(16) + 0.5)
    scale_b = nn.Parameter(scale_a.detach().clone())
    x = torch.randn(2, 5, 16, requires_grad=True)
    _forward(a, x, scale=scale_a).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    calls = []
    original = Scale.backward
    Scale.backward = staticmethod(lambda ctx, g: calls.append(1) or original(ctx, g))
    try:
        y = _forward(b, x2, kept=True, scale=scale_b)
        assert [blk.calls for blk in b] == [1, 1, 1]
        input_grad, work = backward_input(y.sum(), None, x2, [*b.parameters(), scale_b])
        assert [blk.calls for blk in b] == [2, 2, 2], "I recomputes each block once"
        work.run()
    finally:
        Scale.backward = original
    assert [blk.calls for blk in b] == [2, 2, 2], "W reuses what I recomputed"
    assert len(calls) == 1, "W starts past a custom function whose weight gradient I already produced"
    torch.testing.assert_close(input_grad, x.grad, rtol=0, atol=0)
    _assert_same_grads(a, b)
    torch.testing.assert_close(scale_b.grad, scale_a.grad, rtol=0, atol=0)


def test_w_does_not_recompute_the_input_path():
    """W runs only the weight side: on a chain of linear layers it multiplies once per layer (x^T g),
    where a second full backward would also run every g W."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(4)])
    x = torch.randn(3, 8, requires_grad=True)
    y = layers(x)
    _, work = backward_input(y.sum(), None, x, list(layers.parameters()))
    seen = []
    handles = [torch.autograd.graph.register_multi_grad_hook((x,), lambda grads: seen.append("input"))]
    with torch.autograd.profiler.profile() as prof:
        work.run()
    for h in handles:
        h.remove()
    mms = [e for e in prof.function_events if e.name == "aten::mm"]
    assert len(mms) == 4 and not seen


def test_linear_weight_gradients_computed_in_w_match_autograd_bit_for_bit_in_either_layout():
    """W computes a linear layer's weight gradient itself (no second pass through its node): the
    same bits as autograd's for a weight stored [out, in] (nn.Linear) or [in, out] (x @ w), and a
    weight used twice in the stage gets both uses."""
    torch.manual_seed(0)
    row = nn.Parameter(torch.randn(8, 12))  # x @ row: mm's second operand as stored
    lin = nn.Linear(12, 8, bias=False)  # used twice below: x @ weight.T, column-major
    params = [row, lin.weight]

    def stage(x):
        h = torch.tanh(x @ row)
        return lin(torch.tanh(lin(h) @ row))

    x = torch.randn(3, 5, 8, requires_grad=True)
    g = torch.randn(3, 5, 8)
    stage(x).backward(g)
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    x2 = x.detach().clone().requires_grad_()
    input_grad, work = backward_input(stage(x2), g, x2, params)
    assert all(p.grad is None for p in params)
    assert len(work.direct) == 4 and not work.calls, "every multiply is a linear layer's"
    work.run()
    torch.testing.assert_close(input_grad, x.grad, rtol=0, atol=0)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)


def _nodes(root):
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(child for child, _ in node.next_functions)


def test_linear_layers_and_norm_weights_let_i_free_the_graph_as_one_backward_does():
    """RMSNorm weights and linear layers (a LLaMA block's weights): W computes each weight gradient
    itself from an operand taken before I, so I frees the graph as it goes (a split stage then holds
    only what W multiplies, not every activation) and the gradients are still autograd's to the bit."""
    from nanocore.model_parts.layers import GatedMLP, RMSNorm

    torch.manual_seed(0)
    a = nn.Sequential(RMSNorm(16, 1e-6), GatedMLP(16, 40), RMSNorm(16, 1e-6), GatedMLP(16, 40))
    for p in a.parameters():
        p.data.normal_()
    b = nn.Sequential(RMSNorm(16, 1e-6), GatedMLP(16, 40), RMSNorm(16, 1e-6), GatedMLP(16, 40))
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, 16, requires_grad=True)
    g = torch.randn(2, 5, 16)
    a(x).backward(g)
    x2 = x.detach().clone().requires_grad_()
    y = b(x2)
    silu = [n for n in _nodes(y.grad_fn) if type(n).__name__ == "SiluBackward0"]
    input_grad, work = backward_input(y, g, x2, list(b.parameters()))
    assert work.frees_graph and len(work.direct) == 8 and not work.calls
    with pytest.raises(RuntimeError, match="freed"):
        silu[0]._saved_self  # noqa: B018  an activation only I needed: gone, as after one backward
    work.run()
    torch.testing.assert_close(input_grad, x.grad, rtol=0, atol=0)
    _assert_same_grads(a, b)


def test_an_output_that_does_not_depend_on_the_input_is_an_error():
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    y = torch.randn(2, 4, requires_grad=True) @ w  # not from x
    with pytest.raises(RuntimeError, match="does not depend on its input"):
        backward_input(y.sum(), None, x, [w])
