"""A backward in two halves from one autograd graph: input gradients now (I), weight gradients later (W).

Zero-bubble schedules send the previous stage its input gradient as soon as possible and compute
the weight gradients when the rank would otherwise wait. Nothing in the model has to cooperate:

- I: every autograd node that leads to the stage's input is on the *input path*. A node on that path
  with an edge leading (off the path) to a weight is a *split node*: the matrix multiply of a linear
  layer, a norm's weight, the gate of a router. I runs `torch.autograd.grad` for the input only, so
  autograd skips what only weights need (a linear layer's `x^T g`), and the engine itself keeps the
  gradient each split node received (its edges are among the `inputs` of that call: no Python hook
  runs per node). The graph is retained for W unless W needs none of it (below).
- W, linear layers and elementwise weights (a built-in `mm` whose weight side is its second
  operand, a `mul` by a weight such as a norm's): W computes the weight-side gradient itself from the
  kept gradient and the other operand, exactly as autograd's backward of that node would (the same
  bits), and one `torch.autograd.backward` from all those weight-side edges accumulates them into
  `.grad` as an ordinary backward would (so gradient hooks, buckets and ZeRO reductions fire as
  usual). When every split node is such a node and its operand is a plain saved tensor (no
  saved-tensor hook such as recomputation), the operands are taken before I and I frees the graph as
  it goes, as an ordinary backward does: between I and W a micro-batch holds only those operands and
  gradients, not every activation. (On CPU, 4 LLaMA layers: I + W = 1.10 of one backward; one engine
  call per split node, each re-entering the node, and a Python hook per node took 1.23.)
- W, every other split node (a LayerNorm, a router, a custom function): from the node again with the
  kept gradient, `torch.autograd.backward(..., inputs=weights)` runs only what leads to those
  weights, the graph retained by I. Such nodes are grouped by the weights they reach; within a group
  whose nodes lie on one another's path a pre-hook replaces what flows into a node with what it
  kept, so nothing is counted twice.
- A node that is not a built-in (a custom autograd function, a compiled block) computes every output
  whenever it runs; if I already produced its weight-side gradients they are kept and W starts past
  the node (its weight gradients are then not deferred, but not computed twice either).
- A stage without an input gradient (the first) has nothing for I: W is its whole backward.

Where the graph is retained, activations stay alive from F until W. Whole-block recompute must then
recompute once for both halves (torch's checkpoint recomputes per backward call): see
`recompute.recompute_kept`.
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
class _Direct:
    """A split node whose weight gradient W computes itself, as autograd's backward of the node would
    (branch for branch: the same bits): a linear layer's multiply `x @ w` (the weight side its second
    operand) or a weight's elementwise product (a norm's `weight * x`). The other operand is taken
    before I, so I can free the rest of the graph as an ordinary backward does."""

    kind: str  # "mm" or "mul"
    root: GradientEdge  # where the weight side's gradient goes
    node: Node | None  # the node, while its operand is read only in W (see `saved`)
    operand: str  # the other operand's name among the node's saved tensors
    layout: tuple  # mm: the weight operand's sizes and strides; mul: the weight side's shape
    saved: torch.Tensor | None = None  # the other operand, taken before I (None: read in W, the
    # graph retained: a saved-tensor hook such as recomputation must unpack it where the backward
    # would, e.g. with ZeRO-3's parameters gathered)
    grad: torch.Tensor | None = None  # what the node received in I

    def weight_gradient(self) -> torch.Tensor:
        g = self.grad
        saved = self.saved if self.saved is not None else getattr(self.node, f"_saved_{self.operand}")
        assert g is not None
        if self.kind == "mm":  # autograd's mm_mat2_backward
            sizes, strides = self.layout
            if strides[0] == 1 and strides[1] == sizes[0]:
                return g.t().mm(saved).t()
            return saved.t().mm(g)
        out = g * saved  # mul_tensor_backward, then the engine's sum to the weight's shape
        return out if tuple(out.shape) == self.layout else out.sum_to_size(self.layout)


def _direct(node: Node, edges: list[tuple[int, Node, int]]) -> _Direct | None:
    """The node as a `_Direct` when W can compute its weight side itself, else None."""
    if len(edges) != 1:
        return None
    i, child, nr = edges[0]
    name = type(node).__name__
    try:
        if name == "MmBackward0" and i == 1:
            kind, operand, layout = (
                "mm",
                "self",
                (tuple(node._saved_mat2_sym_sizes), tuple(node._saved_mat2_sym_strides)),
            )
        elif name == "MulBackward0":
            kind, operand, layout = "mul", ("other" if i == 0 else "self"), tuple(child._input_metadata[nr].shape)
        else:
            return None
        if getattr(node, f"_raw_saved_{operand}").unpack_hook is not None:
            return _Direct(kind, GradientEdge(child, nr), node, operand, layout)
        saved = getattr(node, f"_saved_{operand}")
    except RuntimeError:  # a saved operand that is not there
        return None
    if name == "MulBackward0" and saved.dtype != child._input_metadata[nr].dtype:
        return None  # the engine would also cast: left to it
    return _Direct(kind, GradientEdge(child, nr), None, operand, layout, saved)


@attrs.define
class WeightGradients:
    """What W needs after I: the calls to make (or, without an input path, the whole backward)."""

    calls: list[_Call]
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None
    direct: list[_Direct] = attrs.Factory(list)
    frees_graph: bool = False  # I freed the graph: W holds only the operands and gradients it needs

    def run(self) -> None:
        """Compute and accumulate the weight gradients; frees the graph."""
        if self.whole is not None:
            output, grad = self.whole
            self.whole = None
            torch.autograd.backward(output, grad)
            return
        calls, self.calls = self.calls, []
        direct, self.direct = self.direct, []
        if direct:
            # one engine call for all of them: their roots lie off the input path, and where two
            # reach the same node (a weight used twice) the engine sums, as one backward would
            roots = [d.root for d in direct]
            grads = [d.weight_gradient() for d in direct]
            del direct
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
    # W computes most weight gradients itself (`_Direct`); when it can compute all of them, I frees
    # the graph as it goes, as an ordinary backward does.
    direct = [_direct(node, edges) for node, edges in splits]
    frees = all(d is not None and d.saved is not None for d in direct)
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
            output, [input, *captured], grad, retain_graph=not frees, allow_unused=True
        )
    finally:
        for h in handles:
            h.remove()
    if input_grad is None:
        raise RuntimeError("split backward: the stage's output does not depend on its input")
    kept_in: dict[Node, tuple] = {}
    at = 0
    for node, _ in splits:
        n = len(node._input_metadata)
        kept_in[node] = tuple(received_all[at : at + n])
        at += n

    # roots of W: a weight gradient W computes itself; otherwise a split node run again from what it
    # received, or (when it already produced them) the weight-side edges it computed; grouped by the
    # weights they reach
    computed: list[_Direct] = []
    groups: list[tuple[list, list, set[Node], list[Node]]] = []  # roots, grads, weight nodes, rerun nodes
    owner: dict[Node, int] = {}
    for (node, edges), d in zip(splits, direct, strict=True):
        produced = kept_out.get(node)
        received = kept_in.get(node, ())
        if d is not None and produced is None:
            if received[0] is not None:  # else no gradient reached it: its weight gets none, as in B
                d.grad = received[0]
                computed.append(d)
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
    return input_grad, WeightGradients(calls, direct=computed, frees_graph=frees)


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
