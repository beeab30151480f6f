"""A backward in two halves from one autograd graph: input gradients now (I), weight gradients later (W).

Zero-bubble schedules send the previous stage its input gradient as soon as possible and compute
the weight gradients when the rank would otherwise wait. Nothing in the model has to cooperate:

- I: every autograd node that leads to the stage's input is on the *input path*. A node on that path
  with an edge leading (off the path) to a weight is a *split node*: the matrix multiply of a linear
  layer, a norm's weight, the gate of a router. I runs `torch.autograd.grad` for the input only, so
  autograd skips what only weights need (a linear layer's `x^T g`), and the engine itself keeps the
  gradient each split node received (its edges are among the `inputs` of that call: no Python hook
  runs per node). The graph is retained for W.
- W, linear layers (a built-in `mm` whose weight side is its only edge off the input path): W
  multiplies the kept gradient by the saved input exactly as autograd's `mm` backward would, and one
  `torch.autograd.backward` from all those weight-side edges accumulates them into `.grad` as an
  ordinary backward would (so gradient hooks, buckets and ZeRO reductions fire as usual). This is
  most of W's work; one engine call per split node, each re-entering the node, cost 10 % of a
  backward on CPU (`python benchmarks/pipeline_schedules.py` shows the effect on whole steps).
- W, every other split node (a norm's weight, a router): from the node again with the kept gradient,
  `torch.autograd.backward(..., inputs=weights)` runs only what leads to those weights. Such nodes
  are grouped by the weights they reach; within a group whose nodes lie on one another's path a
  pre-hook replaces what flows into a node with what it kept, so nothing is counted twice.
- A node that is not a built-in (a custom autograd function, a compiled block) computes every output
  whenever it runs; if I already produced its weight-side gradients they are kept and W starts past
  the node (its weight gradients are then not deferred, but not computed twice either).
- A stage without an input gradient (the first) has nothing for I: W is its whole backward.

Activations stay alive from F until W. Whole-block recompute must then recompute once for both
halves (torch's checkpoint recomputes per backward call): see `recompute.recompute_kept`.
"""

from __future__ import annotations

import attrs
import torch
from torch.autograd.graph import GradientEdge, Node


def _node_of(t: torch.Tensor) -> Node:
    """The autograd node a tensor's gradient flows into (a leaf's gradient accumulator)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


@attrs.define
class _Call:
    """One `torch.autograd.backward` of W: its roots, their gradients, the weights it fills, and the
    split nodes whose incoming gradient is pinned to what I kept."""

    roots: list
    grads: list[torch.Tensor]
    weights: list[torch.Tensor]
    pinned: dict[Node, tuple]


@attrs.define
class _Linear:
    """A matrix multiply `x @ w` whose `w` side leads only to weights (a linear layer): W computes
    `w`'s gradient itself, as autograd's `mm` backward would, and hands it to the node below."""

    node: Node
    grad: torch.Tensor  # what the multiply received in I

    def weight_gradient(self) -> torch.Tensor:
        x, g = self.node._saved_self, self.grad
        sizes, strides = self.node._saved_mat2_sym_sizes, self.node._saved_mat2_sym_strides
        # autograd's mm_mat2_backward, branch for branch (so the result is the same to the bit)
        if strides[0] == 1 and strides[1] == sizes[0]:
            return g.t().mm(x).t()
        return x.t().mm(g)


@attrs.define
class WeightGradients:
    """What W needs after I: the calls to make (or, without an input path, the whole backward)."""

    calls: list[_Call]
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None
    linears: list[_Linear] = attrs.Factory(list)

    def run(self) -> None:
        """Compute and accumulate the weight gradients; frees the graph."""
        if self.whole is not None:
            output, grad = self.whole
            self.whole = None
            torch.autograd.backward(output, grad)
            return
        calls, self.calls = self.calls, []
        linears, self.linears = self.linears, []
        if linears:
            # one engine call for every linear layer: each root leads only to its own weight
            roots = [GradientEdge(*lin.node.next_functions[1]) for lin in linears]
            grads = [lin.weight_gradient() for lin in linears]
            del linears
            torch.autograd.backward(roots, grads)
        for call in calls:
            handles = [n.register_prehook(_pinned(kept)) for n, kept in call.pinned.items()]
            try:
                torch.autograd.backward(call.roots, call.grads, inputs=call.weights)
            finally:
                for h in handles:
                    h.remove()


def _pinned(kept: tuple):
    return lambda grad_outputs: kept


def _is_linear(node: Node, edges: list[tuple[int, Node, int]]) -> bool:
    """A built-in `mm` whose only edge off the input path is its second operand's (the weight)."""
    return type(node).__name__ == "MmBackward0" and [i for i, _, _ in edges] == [1]


def backward_input(
    output: torch.Tensor, grad: torch.Tensor | None, input: torch.Tensor | None, weights: list[torch.Tensor]
) -> tuple[torch.Tensor | None, WeightGradients]:
    """Input gradient of `output` (gradient `grad`; None for a scalar loss) w.r.t. `input`, and what
    W needs to compute the gradients of `weights` later."""
    if input is None or not input.requires_grad:
        return None, WeightGradients([], whole=(output, grad))
    accumulators = {_node_of(w): w for w in weights if w.requires_grad}
    target = _node_of(input)
    on_path, to_weight = _classify(output.grad_fn, target, accumulators)

    splits: list[tuple[Node, list[tuple[int, Node, int]]]] = []
    for node, reaches in on_path.items():
        if not reaches:
            continue
        edges = [
            (i, child, nr)
            for i, (child, nr) in enumerate(node.next_functions)
            if child is not None and not on_path.get(child, False) and to_weight.get(child, False)
        ]
        if edges:
            splits.append((node, edges))
    # What each split node receives is captured by the engine itself (a gradient edge among the
    # inputs of `grad`); a custom function's node (it computes every output whenever it runs) is
    # also watched for the weight-side gradients it produces.
    captured = [GradientEdge(node, k) for node, _ in splits for k in range(len(node._input_metadata))]
    kept_out: dict[Node, tuple] = {}
    handles = [
        node.register_hook(lambda gi, go, node=node: kept_out.__setitem__(node, gi))
        for node, _ in splits
        if isinstance(node, torch.autograd.function.BackwardCFunction)
    ]
    try:
        input_grad, *received_all = torch.autograd.grad(
            output, [input, *captured], grad, retain_graph=True, allow_unused=True
        )
    finally:
        for h in handles:
            h.remove()
    kept_in: dict[Node, tuple] = {}
    at = 0
    for node, _ in splits:
        n = len(node._input_metadata)
        kept_in[node] = tuple(received_all[at : at + n])
        at += n

    # roots of W: a linear layer's weight gradient computed directly; otherwise a split node run
    # again from what it received, or (when it already produced them) the weight-side edges it
    # computed; grouped by the weights they reach
    linears: list[_Linear] = []
    groups: list[tuple[list, list, set[Node], list[Node]]] = []  # roots, grads, weight nodes, rerun nodes
    owner: dict[Node, int] = {}
    for node, edges in splits:
        produced = kept_out.get(node)
        received = kept_in.get(node, ())
        if produced is None and _is_linear(node, edges) and received[0] is not None:
            linears.append(_Linear(node, received[0]))
            continue
        if produced is not None and all(produced[i] is not None for i, _, _ in edges):
            roots = [GradientEdge(child, nr) for _, child, nr in edges]
            grads = [produced[i] for i, _, _ in edges]
            rerun: list[Node] = []
        else:
            roots = [GradientEdge(node, k) for k, g in enumerate(received) if g is not None]
            grads = [g for g in received if g is not None]
            rerun = [node]
        if not roots:
            continue
        reached = _weights_below([child for _, child, _ in edges], accumulators)
        merged = {owner[w] for w in reached if w in owner}
        roots_all, grads_all, weights_all, rerun_all = roots, grads, set(reached), rerun
        for g in merged:
            r, gr, ws, rr = groups[g]
            roots_all, grads_all, weights_all, rerun_all = (
                r + roots_all,
                gr + grads_all,
                ws | weights_all,
                rr + rerun_all,
            )
            groups[g] = ([], [], set(), [])
        groups.append((roots_all, grads_all, weights_all, rerun_all))
        for w in weights_all:
            owner[w] = len(groups) - 1
    calls = [
        _Call(
            roots,
            grads,
            [accumulators[w] for w in weights],
            {n: kept_in[n] for n in rerun} if len(rerun) > 1 else {},
        )
        for roots, grads, weights, rerun in groups
        if roots
    ]
    return input_grad, WeightGradients(calls, linears=linears)


def _classify(
    root: Node, target: Node, accumulators: dict[Node, torch.Tensor]
) -> tuple[dict[Node, bool], dict[Node, bool]]:
    """For every node below `root`: does it lead to `target` (the input path), and to a weight?"""
    on_path: dict[Node, bool] = {}
    to_weight: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            children = [child for child, _ in node.next_functions if child is not None]
            on_path[node] = node is target or any(on_path[c] for c in children)
            to_weight[node] = node in accumulators or any(to_weight[c] for c in children)
            continue
        if node in on_path:
            continue
        on_path[node] = False  # visiting; the graph is acyclic
        stack.append((node, True))
        for child, _ in node.next_functions:
            if child is not None and child not in on_path:
                stack.append((child, False))
    return on_path, to_weight


def _weights_below(nodes: list[Node], accumulators: dict[Node, torch.Tensor]) -> set[Node]:
    seen: set[Node] = set()
    found: set[Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in accumulators:
            found.add(node)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return found
