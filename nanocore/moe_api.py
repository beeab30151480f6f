"""Mixture-of-experts: what a model's MoE layer declares and the engine-side runtime it calls.

Models declare, engines apply. A model with experts lists its MoE layers in `moe_layers` (module
names). Each such module provides (see `MoELayer`):

- `num_experts: int` and `expert_parameters: tuple[str, ...]`: names (relative to the module) of
  parameters stacked by expert on dim 0 (`[num_experts, ...]` in the full model). Under expert
  parallelism the engine keeps only this rank's experts' rows of them, so model code derives the
  number of local experts from `param.shape[0]`, never from the config.
- `set_runtime(runtime: ExpertRuntime)`: the engine hands over its `ExpertRuntime`; until then the
  layer uses `LocalExperts()` (one process, every expert local).
- `pop_statistics() -> MoEStatistics | None`: what the layer recorded since the last call (training
  forwards only; never during recomputation or evaluation).
- optionally `update_router_bias(tokens_per_expert: Tensor)`: called after each optimizer step with
  the step's global tokens per expert (every micro-batch, every data-parallel rank) for routers
  balanced by a per-expert bias (DeepSeek-V3); the bias is a parameter with `requires_grad=False`,
  which engines checkpoint like weights but never give to the optimizer.

A layer routes its tokens, sorts them by expert and calls `runtime.dispatch`; it receives the rows
of its local experts, runs them (`expert_matmul` helps), and `runtime.combine` brings the results
back in the order sent. The runtime decides where experts live (all-to-all over the expert-parallel
group, or nothing at all for `LocalExperts`), so a third-party MoE layer gets expert parallelism
for free.

Auxiliary losses are per micro-batch: the layer computes them over every token of the micro-batch,
summing its statistics over the ranks that hold other tokens of it (`runtime.token_sum`: the TP
group under sequence parallelism, identity otherwise), and attaches their gradient to its output with
`attach_aux_loss` scaled by `runtime.grad_scale` (the weight of one micro-batch in the step's loss).
Per micro-batch is what makes the loss independent of the layout: every layout cuts the global
batch into the same micro-batches.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import torch
from torch.autograd.function import FunctionCtx


@attrs.define
class MoEStatistics:
    """What one MoE layer saw in a step, summed over its recorded micro-batches (each micro-batch
    counted whole: statistics are already summed over the ranks that hold its token shards)."""

    tokens_per_expert: torch.Tensor  # [num_experts] float64: routed token slots (top-k counts each)
    aux_loss: float | None  # sum over micro-batches of the load-balancing loss (None: the layer has none)
    z_loss: float | None  # sum over micro-batches of the router z-loss (None: off)
    micro_batches: int


class ExpertRuntime(Protocol):
    """Engine-side functions an MoE layer calls. Implementations: `LocalExperts` (here) and the
    engine's expert-parallel one."""

    ep_size: int  # ranks the experts are split over
    ep_rank: int  # this rank's index among them: it holds experts [ep_rank * E/ep_size, ...)
    grad_scale: float  # weight of one micro-batch in the step's loss (1 / micro-batches), for aux losses

    def dispatch(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, list[int], object]:
        """`x`: [n, hidden] rows sorted by expert (all experts of the model); `tokens_per_expert`: [E]
        int64 counts. Returns the rows this rank's experts must process, sorted by local expert, the
        row count of each local expert, and a handle for `combine` (opaque to the layer: it only hands it
        back). Differentiable."""
        ...

    def combine(self, y: torch.Tensor, handle: object) -> torch.Tensor:
        """The processed rows back on the rank and in the order `dispatch` took them from. Differentiable."""
        ...

    def token_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks holding other tokens of the same micro-batch (not differentiable)."""
        ...


class LocalExperts:
    """Every expert on this process: dispatch and combine hand the rows straight through."""

    ep_size = 1
    ep_rank = 0

    def __init__(self, grad_scale: float = 1.0):
        self.grad_scale = grad_scale

    def dispatch(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, list[int], object]:
        return x, [int(n) for n in tokens_per_expert.tolist()], None

    def combine(self, y: torch.Tensor, handle: object) -> torch.Tensor:
        return y

    def token_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t


@runtime_checkable
class MoELayer(Protocol):
    num_experts: int
    expert_parameters: tuple[str, ...]

    def set_runtime(self, runtime: ExpertRuntime) -> None: ...

    def pop_statistics(self) -> MoEStatistics | None: ...


def moe_layers(model: torch.nn.Module) -> list[str]:
    """The MoE layer names a model declares (empty for a dense model)."""
    return list(getattr(model, "moe_layers", ()) or ())


def recomputing() -> bool:
    """True while autograd runs a backward pass, i.e. when a forward runs again for recomputation."""
    return torch._C._current_graph_task_id() != -1


class _AuxLossCtx(FunctionCtx):
    """What `_AttachAuxLoss` keeps from forward for backward (declared for the type checker)."""

    scale: float
    saved_tensors: tuple[torch.Tensor, ...]


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _AuxLossCtx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx: _AuxLossCtx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux, ctx.scale), None


def attach_aux_loss(output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """Return `output` unchanged, such that the backward pass through it also back-propagates
    `scale * aux` (a scalar auxiliary loss with its coefficient): the auxiliary gradient flows with
    the main one, through any pipeline stage, without a second backward."""
    if not aux.requires_grad or scale == 0:
        return output
    attached: torch.Tensor = _AttachAuxLoss.apply(output, aux, scale)
    return attached


# False: one matmul per expert even where torch's grouped matmul runs (benchmarks compare the two paths)
USE_GROUPED_MM = True


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether `expert_matmul` takes torch's grouped matmul for rows like `x`: bfloat16 on CUDA (where
    the GPU has the kernel) and on CPU (torch >= 2.9 has a CPU kernel)."""
    return (
        USE_GROUPED_MM
        and hasattr(torch, "_grouped_mm")
        and x.dtype == torch.bfloat16
        and x.device.type in ("cuda", "cpu")
    )


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of `x` grouped by expert (`counts[e]` rows for local expert e, in order) times each
    expert's matrix: `weight` [experts, out, in] -> [rows, out]. One grouped matmul for all experts
    where torch has it for the device and dtype (`grouped_mm_supported`), else one matmul per expert
    over all its rows; never a loop over tokens."""
    if grouped_mm_supported(x) and x.shape[0] > 0:
        offsets = torch.tensor(counts, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        try:
            product: torch.Tensor = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
        except RuntimeError:  # not supported on this GPU: fall back to one matmul per expert
            pass
        else:
            if product.requires_grad:  # its backward refuses a broadcast (stride 0) output gradient
                product.register_hook(_contiguous)
            return product
    parts = []
    # unbind, not weight[e]: indexing's backward would build a zero [experts, out, in] gradient per expert
    for part, w in zip(torch.split(x, counts, dim=0), weight.unbind(0), strict=True):
        parts.append(part @ w.t())
    if not parts:
        return x.new_empty((0, weight.shape[1]))
    return torch.cat(parts, dim=0)
