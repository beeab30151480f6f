"""The built-in engine: data, context, tensor, pipeline and expert parallelism over any model plugin.

`setup_model` applies parallelism from outside the single-device model, in a fixed order: tensor
parallel (the model's TP plan), expert split, pipeline cut and materialisation (`build`), selective
recompute, the sequence runtime (context parallelism, document masking), the expert runtime, the
data-parallel strategy's buffers, the pipeline executor. `train_step` runs the schedule, completes
the gradient reductions (data parallel during backward, then tensor-parallel and tied-parameter
sums), clips over the whole model counting every element once, and steps the ZeRO-stage optimizer.
What differs between ZeRO stages lives in the `DataParallel` strategy chosen once in `__init__`.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from nanocore.checkpoint.tensors import ShardedTensor, ShardReader
from nanocore.config import Config
from nanocore.dtypes import resolve_dtype
from nanocore.engine_api import (
    MemoryEstimate,
    ParamPiece,
    ReplicaGroup,
    StepGuard,
    StepOutput,
    TrainableParam,
    ZeroOptimizer,
)
from nanocore.errors import PluginError
from nanocore.float8_api import Float8Recipe
from nanocore.model_api import is_hidden_matrix
from nanocore.moe_api import MoELayer
from nanocore.pipeline_api import splits_backward
from nanocore.registry import Entry, Registries
from nanocore.sharding import get_placement
from nanocore.tp_api import TPMode

from .build import LocalModel, build_local_model, chunk_modules, chunk_parameters, meta_model, tied_across_stages
from .compile import FirstStepTimer, compile_blocks, compile_loss, release_compiled
from .context_parallel import ContextParallel
from .data_parallel import DataParallel, ReplicatedGradients, real_elements
from .data_parallel_zero2 import ShardedGradients
from .data_parallel_zero3 import ShardedParameters
from .expert_parallel import ExpertParallel, is_expert, sync_load
from .expert_statistics import StepRoutingStatistics
from .float8 import apply_float8
from .grad_norm import global_grad_norm
from .grid import ProcessGrid
from .loss import language_model_loss
from .pipeline_parallel import PipelineExecutor
from .prediction import TokenPrediction
from .recompute import recompute_selected
from .tensor_parallel import parallelize as tp_parallelize
from .tensor_parallel import tp_grad_sync, tp_owned_parameters


def data_parallel_for(zero: Entry) -> type[DataParallel]:
    """The strategy a ZeRO stage asks for through its registry entry's extras."""
    if zero.extras.get("shards_parameters"):
        return ShardedParameters
    if zero.extras.get("shards_gradients"):
        return ShardedGradients
    return ReplicatedGradients


T = TypeVar("T")


class ParallelEngine:
    """Registered as parallel engine `nd` (alias `3d`): dp, cp, tp, pp and ep over one process grid."""

    def __init__(self, config: Config, registries: Registries):
        self.config = config
        par = config.parallelism
        self.grid = grid = ProcessGrid(par)
        self.rank, self.world_size, self.device = grid.rank, grid.world_size, grid.device
        self.dp_rank, self.dp_size, self.is_main = grid.dp_rank, grid.dp, grid.rank == 0
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.schedule = registries.pipeline_schedule.get(par.pp_engine).factory(config)
        # a mode that does not implement TPMode is refused when the config is checked (nanocore.config.checks)
        self.tp_mode: TPMode | None = registries.tp_mode.get(par.tp_mode).factory() if par.tp > 1 else None
        recipe = config.model.float8_recipe
        self.float8: Float8Recipe | None = registries.float8_recipe.get(recipe).factory() if recipe else None
        # the ranks holding the same weights: data x context parallel, or expert-data-parallel for experts
        self.dcp = ReplicaGroup(grid.dcp_group, grid.dcp_rank, grid.dcp)
        self.edp = ReplicaGroup(grid.edp_group, grid.edp_rank, grid.edp)
        strategy = data_parallel_for(registries.zero_stage.get(str(config.optimizer.zero_stage)))
        grad_dtype = torch.float32 if config.optimizer.accumulate_grad_in_fp32 else self.dtype
        bucket_bytes = config.model.ddp_bucket_cap_mb * 2**20
        self.data_parallel: DataParallel = strategy(
            self.dcp, self.edp, dtype=grad_dtype, device=self.device, bucket_bytes=bucket_bytes
        )
        # the ranks holding other tokens of a micro-batch: its cp chunks, and its tp shards under sequence parallelism
        sequence_parallel = self.tp_mode is not None and self.tp_mode.sequence_parallel
        token_group = grid.cp_tp_group if sequence_parallel else grid.cp_group  # (tp group, None) at cp = 1
        self.experts = ExpertParallel(grid.ep_group, grid.ep, grid.ep_rank, token_group=token_group)
        self.document_separator: int | None = None
        # set by setup_model / setup_optimizer
        self.local: LocalModel | None = None
        self.model: torch.nn.Module | None = None
        self.true_vocab_size = 0
        self.sequence: ContextParallel | None = None
        self.prediction: TokenPrediction | None = None  # extra prediction heads' runtime (multi-token prediction)
        self.moe_local: dict[int, MoELayer] = {}  # index among the model's MoE layers -> local layer
        self.tied_split: list[torch.nn.Parameter] = []  # one side of a tied pair split over the first and last stage
        self.executor: PipelineExecutor | None = None
        self.flops_model: torch.nn.Module | None = None  # the whole single-device model on meta, for FLOPs
        self.optimizer: ZeroOptimizer | None = None
        self.trainables: list[TrainableParam] = []
        self.frozen: list[TrainableParam] = []  # saved, never trained (a router's balancing bias)
        self.states_per_element: int | None = None  # for the start-of-run memory estimate
        self.matrix_states_per_element: int | None = None  # the same for hidden matrices, where it differs
        # with model.compile, the first step's time (compiling included) is logged
        self.first_step: AbstractContextManager = FirstStepTimer() if config.model.compile else nullcontext()
        torch.manual_seed(config.general.seed + self.rank)
        # The first operation on the meta device imports torch's meta kernels (about 70 MiB of Python
        # modules on CPU): part of start-up, so run it before the trainer measures its memory baseline.
        torch.empty(1, device="meta").mul(2)

    # -- model ----------------------------------------------------------------------------
    def set_document_separator(self, token_id: int | None) -> None:
        """The end-of-document token for `tokens.document_masking` (the trainer passes the tokenizer's)."""
        self.document_separator = token_id

    def setup_model(self, entry: Entry, model_args: Any, seed: int) -> None:
        grid, par = self.grid, self.config.parallelism
        model = meta_model(entry, model_args, vocab_multiple=model_args.make_vocab_size_divisible_by * grid.tp)
        if grid.tp > 1:
            tp_parallelize(model, model.tp_plan, grid.tp_group, self.tp_mode, par.tp_linear_async_communication)
        if self.float8 is not None:
            apply_float8(model, self.float8, self.config.model.float8_skip, grid.tp_group if grid.tp > 1 else None)
        local = self.local = build_local_model(
            model,
            seed=seed,
            device=self.device,
            dtype=self.dtype,
            pp_size=grid.pp,
            pp_rank=grid.pp_rank,
            virtual_stages=par.pp_virtual_stages,
            ep_size=grid.ep,
            ep_rank=grid.ep_rank,
            rows_of=self.data_parallel.rows_at_rest,
            placement=self.schedule,
        )
        self.model, self.true_vocab_size = local.module, local.true_vocab_size
        m, v = self.config.tokens.batch_accumulation_per_replica, par.pp_virtual_stages
        split = splits_backward(self.schedule.actions(grid.pp, grid.pp_rank, m, v))
        if par.recompute == "selective":  # a schedule that splits backwards recomputes once for I and W
            recompute_selected(self.model, kept=split)
        self._setup_sequence()
        metrics = list(getattr(self.model, "prediction_metrics", ()) or ())
        if metrics:
            self.prediction = TokenPrediction(
                grid.tp_group, grid.tp_rank, grid.cp_group, grid.cp, self.true_vocab_size, self.sequence, metrics
            )
            self.model.set_prediction_runtime(self.prediction)
        self.moe_local = self.experts.attach(self.model, local.moe_layers)
        with torch.device("meta"):
            self.flops_model = entry.factory(model_args, vocab_multiple=model_args.make_vocab_size_divisible_by)
        self.tied_split = tied_across_stages(self.model, grid.pp)
        modules = chunk_modules(local)
        self.data_parallel.build(chunk_parameters(local), modules)
        loss = language_model_loss(grid.tp_group, grid.tp_rank, self.true_vocab_size)
        if self.config.model.compile:
            compile_blocks(modules, keep_graph=split)
            if grid.tp == 1:  # the vocabulary-parallel loss's collectives stay eager
                loss = compile_loss(loss)
        self.executor = PipelineExecutor(
            grid,
            local,
            modules,
            self.schedule,
            loss,
            dtype=self.dtype,
            recompute=par.recompute == "full",
            gradients=self.data_parallel,
            block_parameters=self.data_parallel.block_parameters,
            sequence=self.sequence,
            prediction=self.prediction,
        )

    def _setup_sequence(self) -> None:
        """Context parallelism and document masking: hand the model the ring-attention runtime (whether
        the model declares them is checked with the config: `plugin.check_blocks`)."""
        grid, masking = self.grid, self.config.tokens.document_masking
        if grid.cp == 1 and not masking:
            return
        if masking and self.document_separator is None:
            raise PluginError("tokens.document_masking needs the end-of-document token id (set_document_separator)")
        separator = self.document_separator if masking else None
        mode = self.config.parallelism.context_parallel_mode
        self.sequence = ContextParallel(grid.cp_group, grid.cp, grid.cp_rank, grid.cp_group_ranks, separator, mode)
        self._model().set_sequence_runtime(self.sequence)

    def _model(self) -> torch.nn.Module:
        if self.model is None:
            raise PluginError("the engine's model is used before setup_model")
        return self.model

    # -- optimizer ------------------------------------------------------------------------
    def setup_optimizer(self, optimizer: Entry, zero: Entry, optimizer_args: Any) -> None:
        model, local = self._model(), self.local
        assert local is not None
        # exactly one rank of each replica group writes (and counts in the grad norm) each piece: the TP
        # rank that owns it, and the first pipeline stage for a tied pair split across stages
        owned = {name for name, _ in tp_owned_parameters(model, self.grid.tp_group)}
        tp = ReplicaGroup(self.grid.tp_group, self.grid.tp_rank, self.grid.tp)
        for name, p in model.named_parameters():
            writer = name in owned and name not in local.replica_of_tied
            canonical = local.canonical[name]
            if p.requires_grad:
                t = self.data_parallel.trainable(canonical, p, writer, self.edp if is_expert(p) else None)
                t.hidden_matrix = is_hidden_matrix(model, canonical, len(t.shape))
                if tp.size > 1 and len(t.shape) >= 2 and t.shape[-2:] != t.placement.full_shape[-2:]:
                    t.model_parallel = tp  # a split linear weight: the other TP ranks hold the rest
                self.trainables.append(t)
            else:
                self.frozen.append(TrainableParam(canonical, p, None, get_placement(p), writer, False))
        args = optimizer_args
        count = optimizer.extras.get("states_per_element")
        self.states_per_element = count(args.optimizer_factory.args) if count is not None else None
        matrix_count = optimizer.extras.get("matrix_states_per_element")
        self.matrix_states_per_element = matrix_count(args.optimizer_factory.args) if matrix_count is not None else None

        takes_pieces = bool(optimizer.extras.get("takes_pieces"))

        def build_optimizer(param_groups: list[dict], pieces: dict[torch.Tensor, ParamPiece]) -> torch.optim.Optimizer:
            lr = args.learning_rate_scheduler.learning_rate
            extra = {"pieces": pieces} if takes_pieces else {}
            return optimizer.factory(
                param_groups,
                args.optimizer_factory.args,
                lr=lr,
                weight_decay=args.weight_decay,
                device=self.device,
                **extra,
            )

        self.optimizer = zero.factory(self.trainables, build_optimizer, self.dcp)

    # -- steps ----------------------------------------------------------------------------
    def _run(self, micro_batches: list[torch.Tensor], train: bool) -> float:
        assert self.executor is not None
        try:
            local = self.executor.run(micro_batches, train=train)
        finally:
            self.data_parallel.end_pass()
        return self.grid.loss_on_every_rank(local)

    def train_step(self, micro_batches: list[torch.Tensor], lr: float, guard: StepGuard | None = None) -> StepOutput:
        model, optimizer = self._model(), self.optimizer
        assert optimizer is not None
        model.train()
        self.data_parallel.start_step()
        # auxiliary losses: the mean over micro-batches. Each cp rank back-propagates the micro-batch's
        # loss through its own tokens only and DP x CP averages, so each gets cp times the weight.
        self.experts.grad_scale = self.grid.cp / len(micro_batches)
        self.experts.pop_received()  # what an evaluation dispatched since the last step does not count
        if self.prediction is not None:
            self.prediction.start_step(len(micro_batches))
        with self.first_step:
            loss = self._run(micro_batches, train=True)
        self.data_parallel.finish_step()
        if self.grid.tp > 1:  # sequence-parallel replicated params, head norms, kv heads shared by several ranks
            tp_grad_sync(model, self.grid.tp_group, grad_of=lambda p: getattr(p, "main_grad", None))
        for p in self.tied_split:  # tied embeddings on the first and last stage: sum both sides
            dist.all_reduce(p.main_grad, group=self.grid.tied_group)
        assert self.local is not None
        routing = None
        if self.local.moe_layers:
            received = self.experts.pop_received()
            sync = sync_load(received, self.grid.ep_group, self.grid.ep, self.device)
            routing = StepRoutingStatistics.of_step(
                self.moe_local, len(self.local.moe_layers), self.local.moe_experts, self.grid, sync
            )
        metrics = routing.metrics(self.grid.ep) if routing is not None else {}
        if self.prediction is not None:  # every rank takes part: the losses live on the last stage
            for name, value in self.prediction.step_sums().items():
                metrics[name] = self.grid.loss_on_every_rank(value.to(self.device))
        if not math.isfinite(loss):  # the gradients are not either: no norm to take
            if guard is not None:
                guard.accept(loss, math.nan)
            return StepOutput(loss, None, skipped=True, metrics=metrics)
        norm = global_grad_norm(self.trainables, self.data_parallel, self.grid, self.device)
        # loss and norm are reduced, the same on every rank: every rank decides alike
        if not (guard.accept(loss, norm) if guard is not None else math.isfinite(norm)):
            return StepOutput(loss, norm, skipped=True, metrics=metrics)
        clip = self.config.optimizer.clip_grad
        if clip is not None and norm > clip:
            self.data_parallel.grad_buffer.mul_(clip / (norm + 1e-6))
        optimizer.step(lr)
        if routing is not None:  # bias-balanced routers (DeepSeek-V3) follow the step's load
            routing.update_router_biases(self.moe_local)
        return StepOutput(loss, norm, metrics=metrics)

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> float:
        model = self._model()
        model.eval()
        loss = self._run(micro_batches, train=False)
        model.train()
        return loss

    # -- checkpoints ----------------------------------------------------------------------
    def model_shards(self) -> list[ShardedTensor]:
        pieces = (self.data_parallel.saved_piece(t) for t in (*self.trainables, *self.frozen))
        return [piece for piece in pieces if piece is not None]

    def optimizer_shards(self) -> list[ShardedTensor]:
        assert self.optimizer is not None
        return self.optimizer.state_shards()

    @torch.no_grad()
    def load_model(self, reader: ShardReader) -> None:
        for t in (*self.trainables, *self.frozen):
            self.data_parallel.load(t, reader)
        if self.optimizer is not None:
            self.optimizer.refresh_master_weights()

    def load_optimizer(self, reader: ShardReader) -> None:
        assert self.optimizer is not None
        self.optimizer.load_state(reader)

    # -- misc -----------------------------------------------------------------------------
    def flops_per_token(self, sequence_length: int) -> float:
        assert self.flops_model is not None
        return float(self.flops_model.flops_per_token(sequence_length))

    def memory_estimate(self) -> MemoryEstimate:
        """This rank's parameters, gradient buffers and (expected) optimizer state."""
        held = [self.data_parallel.held(p) for p in {id(p): p for p in self._model().parameters()}.values()]
        optimizer = None
        if self.states_per_element is not None and self.optimizer is not None:
            optimizer = int(
                self.optimizer.expected_state_bytes(self.states_per_element, self.matrix_states_per_element)
            )
        grads = self.data_parallel.grad_buffer
        shards = self.model_shards()
        active = getattr(self._model(), "active_fraction", lambda name: 1.0)
        return MemoryEstimate(
            parameters=sum(p.numel() for p in held),
            written_parameters=sum(real_elements(piece.tensor, piece.placement) for piece in shards),
            active_written_parameters=sum(
                real_elements(piece.tensor, piece.placement) * active(piece.name) for piece in shards
            ),
            params_bytes=sum(p.numel() * p.element_size() for p in held),
            grads_bytes=grads.numel() * grads.element_size(),
            optimizer_bytes=optimizer,
        )

    def all_gather_object(self, obj: T) -> list[T]:
        return self.grid.all_gather_object(obj)

    def barrier(self) -> None:
        self.grid.barrier()

    def all_ranks_ok(self, ok: bool) -> bool:
        return self.grid.all_ranks_ok(ok)

    def shutdown(self) -> None:
        """Close what the strategies own, drop every reference to the process groups (TP layers,
        buffers, optimizer, runtimes: all engine state but the grid), then destroy the groups."""
        self.data_parallel.close()
        if self.config.model.compile:  # compiled code holds the groups it was traced with (guards, constants)
            release_compiled()
        grid = self.grid
        for name in list(vars(self)):
            if name != "grid":
                setattr(self, name, None)
        grid.destroy()
