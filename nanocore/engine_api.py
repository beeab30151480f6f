"""What a parallel-engine plugin provides to the trainer.

The trainer is generic: it owns the config, data, LR schedule, loop, logging and checkpoint folders.
An engine (registry kind `parallel_engine`, `parallelism.engine`, built-in: `nd`) owns processes,
devices, the model's placement across them, forward/backward, gradient reduction and the optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

import attrs
import torch
import torch.distributed

from nanocore.checkpoint.tensors import ShardedTensor, ShardReader
from nanocore.registry import Entry
from nanocore.sharding import Placement

if TYPE_CHECKING:
    from nanocore.config.schema import ModelArgs, OptimizerArgs

T = TypeVar("T")


@attrs.frozen
class StepOutput:
    """Result of one optimizer step, identical on every rank."""

    loss: float  # mean token loss over the global batch
    grad_norm: float | None  # global gradient norm before clipping
    skipped: bool = False  # no update was made: a non-finite loss or gradient norm, or the step guard said no
    # further figures the engine measured (MoE: moe_aux_loss, moe_z_loss, moe_max_load), logged beside lm_loss
    metrics: dict[str, float] = attrs.field(factory=dict)


class StepGuard(Protocol):
    """Asked by `Engine.train_step` once the step's loss and global gradient norm are known (both reduced:
    identical on every rank) and before the optimizer steps: False leaves weights and optimizer state
    untouched (`StepOutput.skipped`). `nanocore.spike_guard.SpikeGuard` is the trainer's."""

    def accept(self, loss: float, grad_norm: float) -> bool: ...


class Engine(Protocol):
    """What the trainer uses of an engine; every member here is called by nanocore/trainer.py or the
    summary it prints."""

    rank: int
    world_size: int
    dp_rank: int  # which share of each global batch this rank reads (ranks that split a sequence share one)
    dp_size: int  # how many shares the global batch is cut into
    device: torch.device
    dtype: torch.dtype  # the parameters' dtype (model.dtype resolved for the device)
    is_main: bool  # global rank 0: prints, logs and finalises checkpoints
    true_vocab_size: int  # the model's vocabulary before any padding (set by setup_model)

    def set_document_separator(self, token_id: int) -> None:
        """Under `tokens.document_masking`, called before `setup_model` with the end-of-document token."""

    def setup_model(self, entry: Entry, model_args: ModelArgs, seed: int) -> None:
        """Build the model on meta, parallelise it and materialise this rank's part of it."""

    def setup_optimizer(self, optimizer: Entry, zero: Entry, optimizer_args: OptimizerArgs) -> None:
        """Create the optimizer over this rank's parameters (ZeRO stage `zero`)."""

    def train_step(self, micro_batches: list[torch.Tensor], lr: float, guard: StepGuard | None = None) -> StepOutput:
        """Forward + backward over the micro-batches, reduce gradients, clip, and step at `lr`. No update (and
        `skipped`) when the loss or the gradient norm is not finite, or when `guard` rejects the step; with a
        guard, it is asked about non-finite values too (a NaN gradient norm when the loss is NaN)."""

    def eval_loss(self, micro_batches: list[torch.Tensor]) -> float:
        """Mean token loss of the micro-batches (no gradients); identical on every rank."""

    def model_shards(self) -> list[ShardedTensor]:
        """Pieces of parameters this rank writes to a checkpoint (each piece written by one rank)."""

    def optimizer_shards(self) -> list[ShardedTensor]:
        """Pieces of optimizer state this rank writes."""

    def load_model(self, reader: ShardReader) -> None: ...

    def load_optimizer(self, reader: ShardReader) -> None: ...

    def flops_per_token(self, sequence_length: int) -> float: ...

    def memory_estimate(self) -> MemoryEstimate:
        """What this rank holds once the model and optimizer are set up (the start-of-run summary)."""

    def barrier(self) -> None: ...

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's `obj` in rank order, on every rank (sizes for the summary, verification verdicts)."""

    def all_ranks_ok(self, ok: bool) -> bool:
        """True on every rank iff `ok` is True on every rank (coordinated stops and errors)."""

    def shutdown(self) -> None:
        """Destroy the process groups and join their threads (drop every reference to them first)."""


@attrs.frozen
class MemoryEstimate:
    """This rank's share of the model once set up, for the start-of-run summary."""

    parameters: int  # elements of parameters this rank holds (ZeRO-3: its rows)
    written_parameters: int  # elements this rank saves; over all ranks they add up to the model's size
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int | None  # None when the optimizer plugin gives no estimate (`states_per_element`)
    # of `written_parameters`, what a token computes with (the model's `active_fraction`: k of E experts)
    active_written_parameters: float | None = None


@attrs.frozen
class RankPlan:
    """The memory plan of one distinct rank (every data- and context-parallel replica of it holds the
    same), in bytes. None: the plugin that would say cannot (see `MemoryPlan.unknown`)."""

    rank: int  # the global rank of its first replica
    pp_rank: int
    tp_rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int | None  # None when the optimizer plugin gives no `states_per_element`
    activations_bytes: int | None  # None when the model gives no `activation_elements_per_token`
    activations_bytes_per_microbatch_sample: int | None
    comm_bytes: int  # buffers of the data-parallel exchange (ZeRO-1/2's updated rows, ZeRO-2's staging)
    optimizer_step_bytes: int  # the optimizer's temporaries while it steps
    backward_phase_bytes: int  # activations and what backward stages beside them
    step_phase_bytes: int  # the exchange and the optimizer's temporaries, once activations are freed
    total_bytes: int  # the peak: params + grads + optimizer + the larger of the two phases


@attrs.frozen
class PlannedLayout:
    dp: int
    cp: int
    tp: int
    pp: int
    ep: int
    zero_stage: int


@attrs.frozen
class MemoryPlan:
    """What an engine's planner (registry extra `plan(config, registries, device) -> MemoryPlan`)
    tells `nanocore plan` and the start-of-run summary. `attrs.asdict` of it is `nanocore plan --json`."""

    world_size: int
    layout: PlannedLayout
    dtype: str  # the parameters' dtype (model.dtype resolved for the planned device)
    ranks: list[RankPlan]
    flops_per_step: float
    flops_per_step_with_recompute: float
    peak_in_flight_microbatches: list[float]  # per pipeline stage, under the configured schedule
    unknown: list[str]  # what could not be counted, in words
    chunks: int  # pipeline chunks (pp x virtual stages)

    def largest(self) -> RankPlan:
        """The rank with the highest peak."""
        return max(self.ranks, key=lambda r: r.total_bytes)


@attrs.frozen
class TimeTerm:
    """One cost term of a predicted step: its exposed seconds (what it adds to the step after overlap)."""

    name: str  # compute, recompute, tensor_parallel, context_parallel, expert_parallel, pipeline_p2p,
    # pipeline_bubble, data_parallel, optimizer
    seconds: float
    detail: str  # the term's inputs, in words


@attrs.frozen
class TimePrediction:
    """What an engine's time model (registry extra `predict(config, registries, hardware, device,
    expert_load_factor) -> TimePrediction`) tells `nanocore plan --hardware`. The terms add up to
    `step_seconds`; each is documented with its formula in docs/planning.md."""

    hardware: str  # the hardware description's name
    dtype: str  # the peak it uses
    step_seconds: float
    tokens_per_sec_per_device: float
    mfu: float  # model FLOPs per step (no recompute) / (step_seconds x devices x peak)
    terms: list[TimeTerm]
    dominant: str  # the largest term's name

    def term(self, name: str) -> float:
        """Seconds of term `name` (0 when the layout has none)."""
        return sum(t.seconds for t in self.terms if t.name == name)


@attrs.frozen
class ReplicaGroup:
    """The data-parallel ranks that hold the same piece of a parameter: a process group (None when
    not distributed), this rank's index in it and its size."""

    group: torch.distributed.ProcessGroup | None
    rank: int
    size: int


@attrs.define(eq=False)
class TrainableParam:
    """One local parameter as the optimizer (and a ZeRO stage plugin) sees it."""

    name: str  # canonical name: the same on every rank and in checkpoints
    param: torch.nn.Parameter  # the model's parameter (possibly bfloat16)
    grad: torch.Tensor | None  # its reduced gradient (fp32 when accumulate_grad_in_fp32); None if frozen
    placement: Placement  # where `param` (when whole) sits in the full tensor
    writer: bool  # True on exactly one rank per replica group of this piece (before ZeRO sharding)
    weight_decay: bool  # False for norms and biases
    # the data-parallel group over which this piece is replicated; None: the engine's `dp` handed to
    # the ZeRO factory. Expert weights under expert parallelism are replicated over the
    # expert-data-parallel group only (ranks holding the same experts).
    dp: ReplicaGroup | None = None
    # (start, length): the rows of the parameter `grad` holds when the engine reduce-scattered the
    # gradients over `dp` (a ZeRO stage registered with `shards_gradients=True`; the rows are
    # `nanocore.sharding.row_share(param.shape, dp.size, dp.rank)`). None: `grad` is the whole parameter's.
    grad_rows: tuple[int, int] | None = None
    # ZeRO-3 (`shards_parameters=True`): the tensor holding this rank's rows (`grad_rows`) of the
    # parameter, which is whole only while a block runs; the stage updates these rows in place.
    param_rows: torch.Tensor | None = None
    # a hidden weight matrix (`nanocore.model_api.is_hidden_matrix`): the ZeRO stage puts it in a param
    # group marked `hidden_matrix: True`, which matrix optimizers (Muon) update as a matrix
    hidden_matrix: bool = False
    # the ranks holding the other pieces of the full parameter in its last two dimensions (the tensor-
    # parallel group of a split linear weight; `placement` says where this piece sits); None: this
    # rank's piece spans them (a replicated weight, an expert stack split over experts only)
    model_parallel: ReplicaGroup | None = None
    # the local parameter's shape when whole (what `placement` places): under ZeRO-3 `param` is
    # empty between uses, so this, not `param.shape`, is the shape to cut rows from.
    shape: tuple[int, ...] = attrs.field()

    @shape.default
    def _whole_shape(self) -> tuple[int, ...]:
        return tuple(self.param.shape)


@attrs.frozen(eq=False)
class ParamPiece:
    """One tensor an optimizer updates, as a ZeRO stage hands it to an optimizer registered with
    `takes_pieces=True` (`factory(..., pieces=...)`, keyed by the tensor): enough to put the whole
    parameter together, or any part of it, from the ranks that hold its pieces.

    The full parameter (`local_placement.full_shape`) is split over `model_parallel` (tensor
    parallelism; each rank's piece is a rectangle of `local_shape` at `local_placement`), and each
    piece is held by the data-parallel `replicas`. With `rows` set, the replicas split the piece's
    rows (dim 0, `nanocore.sharding.row_share(local_shape, replicas.size, r)` on replica r) and this
    tensor is rows `rows` of it; None: this tensor is the whole piece, equal on every replica.
    """

    name: str  # canonical name (as in checkpoints)
    local_placement: Placement  # where this rank's model-parallel piece sits in the full parameter
    local_shape: tuple[int, ...]  # that piece's shape
    rows: tuple[int, int] | None  # (start, length) of the piece's rows this tensor holds
    replicas: ReplicaGroup  # the data-parallel ranks holding the same piece
    model_parallel: ReplicaGroup | None  # see `TrainableParam.model_parallel`
    hidden_matrix: bool  # see `TrainableParam.hidden_matrix`


class ZeroOptimizer(Protocol):
    """What a ZeRO-stage plugin builds: `factory(params, build_optimizer, dp) -> ZeroOptimizer`.

    `build_optimizer(param_groups, pieces)` makes the configured torch optimizer (`pieces`: a
    `ParamPiece` for every tensor in `param_groups`, handed to optimizers that distribute
    themselves); `dp` has `group`, `rank`,
    `size`. A parameter whose `TrainableParam.dp` is set is replicated over that group instead: a
    stage shards and exchanges it there, and its rank 0 there writes its state.

    A stage registered with `shards_gradients=True` (ZeRO-2) asks the engine to reduce-scatter
    gradients during backward: each rank then holds only its rows (`TrainableParam.grad_rows`) of
    every reduced gradient, and the stage updates exactly those rows.
    """

    def step(self, lr: float) -> None:
        """Update the parameters from their reduced gradients (identical on every DP rank afterwards)."""

    def state_shards(self) -> list[ShardedTensor]: ...

    def load_state(self, reader: ShardReader) -> None: ...

    def refresh_master_weights(self) -> None:
        """Re-read fp32 master weights from the (just loaded) model parameters."""

    def state_bytes(self) -> int:
        """Bytes of optimizer state (and master weights) held by this rank."""

    def expected_state_bytes(self, states_per_element: int, matrix_states_per_element: int | None = None) -> int:
        """Bytes this rank will hold once the optimizer keeps `states_per_element` fp32 tensors per
        parameter element it updates (the optimizer registry entry's `states_per_element(args)`), and
        `matrix_states_per_element` per element of hidden matrices when given (`matrix_states_per_element`)."""
