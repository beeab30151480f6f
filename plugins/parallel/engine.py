"""The built-in engine: data, context, tensor, pipeline and expert parallelism over any model plugin.

Parallelism is applied from outside the single-device model in a fixed order (TP plan, expert
split, pipeline cut, materialisation), then one pipeline executor runs the configured schedule,
gradients are reduced (DP buckets during backward, expert weights over the ranks holding the same
experts, then TP and tied-parameter reductions), clipped over the whole model counting every
element once, and the ZeRO-stage plugin steps the optimizer.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from nanocore.checkpoint.tensors import ShardedTensor, ShardReader
from nanocore.config import Config
from nanocore.engine_api import StepOutput, TrainableParam
from nanocore.errors import PluginError
from nanocore.moe_api import MoELayer
from nanocore.registry import Entry, Registries
from nanocore.sharding import get_placement, row_share
from nanocore.tp_api import TPMode

from .build import LocalModel, build_local_model, meta_model
from .context_parallel import ContextParallel
from .data_parallel import GradBuffers
from .data_parallel_zero2 import ShardedGradBuffers
from .data_parallel_zero3 import ShardedParams
from .expert_parallel import ExpertParallel, is_expert
from .grid import ParallelContext
from .loss import cross_entropy
from .pipeline_parallel import PipelineExecutor
from .tensor_parallel import parallelize as tp_parallelize
from .tensor_parallel import tp_grad_sync, tp_owned_parameters, vocab_parallel_cross_entropy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class DPInfo:
    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size


class ParallelEngine:
    """Registered as parallel engine `nd` (alias `3d`): dp, cp, tp, pp and ep over one process grid."""

    def __init__(self, config: Config, registries: Registries):
        self.config, self.registries = config, registries
        par = config.parallelism
        self.ctx = ParallelContext(par)
        ctx = self.ctx
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.dp_rank, self.dp_size = ctx.dp_rank, ctx.dp
        self.device = ctx.device
        self.is_main = ctx.rank == 0
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.schedule = registries.pipeline_schedule.get(par.pp_engine).factory(config)
        # a mode that does not implement TPMode is refused when the config is checked (nanocore.config.checks)
        self.tp_mode: TPMode | None = registries.tp_mode.get(par.tp_mode).factory() if par.tp > 1 else None
        # what the ZeRO stage asks of the engine: sharded gradients (2), sharded parameters (3)
        self.zero_extras = registries.zero_stage.get(str(config.optimizer.zero_stage)).extras
        self.local: LocalModel | None = None
        self.optimizer = None
        self.document_separator: int | None = None
        self.sequence: ContextParallel | None = None
        torch.manual_seed(config.general.seed + self.rank)
        # The first operation on the meta device imports torch's meta kernels (about 70 MiB of Python
        # modules on CPU): part of start-up, so run it before the trainer measures its memory baseline.
        torch.empty(1, device="meta").mul(2)

    # -- model ----------------------------------------------------------------------------
    def set_document_separator(self, token_id: int | None) -> None:
        """The end-of-document token for `tokens.document_masking` (the trainer passes the tokenizer's)."""
        self.document_separator = token_id

    def setup_model(self, entry: Entry, model_args: Any, seed: int) -> None:
        ctx, par = self.ctx, self.config.parallelism
        model = meta_model(entry, model_args, vocab_multiple=model_args.make_vocab_size_divisible_by * ctx.tp)
        if ctx.tp > 1:
            tp_parallelize(model, model.tp_plan, ctx.tp_group, self.tp_mode, par.tp_linear_async_communication)
        self.local = build_local_model(
            model,
            seed=seed,
            device=self.device,
            dtype=self.dtype,
            pp_size=ctx.pp,
            pp_rank=ctx.pp_rank,
            virtual_stages=par.pp_virtual_stages,
            ep_size=ctx.ep,
            ep_rank=ctx.ep_rank,
            rows_of=self._zero3_rows if self.zero_extras.get("shards_parameters") else None,
        )
        self.model = self.local.module
        if par.recompute == "selective":
            recompute_selected(self.model)
        self._setup_sequence()
        self._setup_experts()
        self.true_vocab_size = self.local.true_vocab_size
        with torch.device("meta"):  # the whole single-device model, for FLOPs per token
            self._flops_model = entry.factory(model_args, vocab_multiple=model_args.make_vocab_size_divisible_by)
        self._setup_grads()
        self.executor = PipelineExecutor(
            ctx,
            self.local,
            self.schedule,
            self._loss,
            dtype=self.dtype,
            recompute=par.recompute == "full",
            on_final_backward=self.grads.final_backward,
            after_backward=self.grads.after_backward,
            sequence=self.sequence,
        )
        self.sharded_params: ShardedParams | None = None
        if self.zero_extras.get("shards_parameters"):  # ZeRO-3: rows at rest, blocks whole in use
            trainable = list({id(p): p for p in self.model.parameters() if p.requires_grad}.values())
            self.sharded_params = ShardedParams(self.executor.chunk_modules, trainable, self._replicas)
            self.executor.params = self.sharded_params

    def _setup_sequence(self) -> None:
        """Context parallelism and document masking: hand the model the ring-attention runtime (whether
        the model declares them is checked with the config: `plugin.check_blocks`)."""
        ctx, masking = self.ctx, self.config.tokens.document_masking
        if ctx.cp == 1 and not masking:
            return
        if masking and self.document_separator is None:
            raise PluginError("tokens.document_masking needs the end-of-document token id (set_document_separator)")
        separator = self.document_separator if masking else None
        self.sequence = ContextParallel(ctx.cp_group, ctx.cp, ctx.cp_rank, ctx.cp_group_ranks, separator)
        self.model.set_sequence_runtime(self.sequence)

    def _setup_experts(self) -> None:
        """Hand every local MoE layer the expert-parallel runtime (all-to-all over the EP group)."""
        ctx = self.ctx
        # the ranks holding other tokens of a micro-batch: its cp chunks, and its tp shards under sequence parallelism
        sequence_parallel = self.tp_mode is not None and self.tp_mode.sequence_parallel
        token_group = ctx.cp_tp_group if sequence_parallel else ctx.cp_group  # (tp group, None) at cp = 1
        self.runtime = ExpertParallel(ctx.ep_group, ctx.ep, ctx.ep_rank, token_group=token_group)
        self.moe_local: dict[int, MoELayer] = {}  # index among the model's MoE layers -> local layer
        for index, name in enumerate(self.local.moe_layers):
            try:
                layer = self.model.get_submodule(name)
            except AttributeError:  # on another pipeline stage
                continue
            if isinstance(layer, MoELayer):
                layer.set_runtime(self.runtime)
                self.moe_local[index] = layer
        self.edp = DPInfo(ctx.edp_group, ctx.edp_rank, ctx.edp)
        self.dcp = DPInfo(ctx.dcp_group, ctx.dcp_rank, ctx.dcp)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp > 1:
            vocab_start = self.ctx.tp_rank * logits.shape[-1]
            return vocab_parallel_cross_entropy(logits, labels, self.ctx.tp_group, vocab_start, self.true_vocab_size)
        return cross_entropy(logits[..., : self.true_vocab_size], labels)

    def _setup_grads(self) -> None:
        ctx, local = self.ctx, self.local
        # parameters with requires_grad=False (a router's balancing bias) are saved, never trained
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        chunk_params: list[list[torch.nn.Parameter]] = []
        seen: set[int] = set()
        for chunk in local.chunks:
            names = {n for block in chunk for n in block}
            ps = []
            for name, p in params.items():
                if id(p) not in seen and any(name == m or name.startswith(m + ".") for m in names):
                    ps.append(p)
                    seen.add(id(p))
            chunk_params.append(ps)
        accumulate_fp32 = self.config.optimizer.accumulate_grad_in_fp32
        dtype = torch.float32 if accumulate_fp32 else self.dtype
        bucket_bytes = self.config.model.ddp_bucket_cap_mb * 2**20
        # context-parallel ranks hold the same weights: they count as data-parallel replicas
        if self.zero_extras.get("shards_gradients"):  # ZeRO-2: each rank keeps its rows of every gradient
            self.grads = ShardedGradBuffers(
                chunk_params, dtype=dtype, device=self.device, bucket_bytes=bucket_bytes, dp_size=ctx.dcp,
                replica_group=self._replicas,
            )
        else:
            self.grads = GradBuffers(
                chunk_params, dtype=dtype, device=self.device, bucket_bytes=bucket_bytes, dp_group=ctx.dcp_group,
                dp_size=ctx.dcp, replica_group=lambda p: self._replicas(p)[:2],
            )
        self.tied_split = self._tied_local()
        self.writer = self._writers(dict(self.model.named_parameters()))

    def _replicas(self, p: torch.nn.Parameter) -> tuple[Any, int, int]:
        """(group, size, this rank's index) of the ranks holding the same piece of `p`: data x context
        parallel ranks, or the expert-data-parallel ones for an expert's weights."""
        ctx = self.ctx
        return (ctx.edp_group, ctx.edp, ctx.edp_rank) if is_expert(p) else (ctx.dcp_group, ctx.dcp, ctx.dcp_rank)

    def _zero3_rows(self, p: torch.nn.Parameter) -> tuple[int, int] | None:
        """ZeRO-3: the rows of trainable `p` this rank keeps (its replica group's `row_share`)."""
        if not p.requires_grad:
            return None
        _, size, rank = self._replicas(p)
        return row_share(tuple(p.shape), size, rank)

    def _writers(self, params: dict[str, torch.nn.Parameter]) -> dict[str, bool]:
        """Exactly one rank of each replica group writes (and counts in the grad norm) each piece:
        the TP rank that owns it, and the first pipeline stage for a tied pair split across stages
        (among data-parallel replicas, see `_writes_model`)."""
        owned = {name for name, _ in tp_owned_parameters(self.model, self.ctx.tp_group)}
        return {n: n in owned and n not in self.local.replica_of_tied for n in params}

    def _writes_model(self, param: torch.nn.Parameter, writer: bool) -> bool:
        """Whether this rank saves the piece: a writer, on the first rank of its data-parallel replicas."""
        return writer and self._replicas(param)[2] == 0

    # -- optimizer ------------------------------------------------------------------------
    def setup_optimizer(self, optimizer: Entry, zero: Entry, optimizer_args: Any) -> None:
        trainables, frozen = [], []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                frozen.append(
                    TrainableParam(self.local.canonical[name], p, None, get_placement(p), self.writer[name], False)
                )
                continue
            trainables.append(
                TrainableParam(
                    name=self.local.canonical[name],
                    param=p,
                    grad=p.main_grad,
                    placement=get_placement(p),
                    writer=self.writer[name],
                    weight_decay=len(getattr(p, "zero3_shape", p.shape)) >= 2,  # ZeRO-3: empty at rest
                    dp=self.edp if is_expert(p) else None,
                    grad_rows=getattr(p, "main_grad_rows", None) if self.grads.sharded else None,
                    param_rows=getattr(p, "zero3_shard", None) if self.sharded_params is not None else None,
                )
            )
        self.trainables, self.frozen = trainables, frozen
        args = optimizer_args
        count = optimizer.extras.get("states_per_element")  # for the start-of-run memory estimate
        self._states_per_element = count(args.optimizer_factory.args) if count is not None else None

        def build_optimizer(param_groups: list[dict]) -> torch.optim.Optimizer:
            return optimizer.factory(
                param_groups,
                args.optimizer_factory.args,
                lr=args.learning_rate_scheduler.learning_rate,
                weight_decay=args.weight_decay,
                device=self.device,
            )

        self.optimizer = zero.factory(trainables, build_optimizer, self.dcp)

    # -- steps ----------------------------------------------------------------------------
    def _global_mean(self, local_sum: torch.Tensor) -> float:
        """Loss from the last stage (tp rank 0), averaged over DP x CP (each cp rank's is the mean over its
        equal share of the tokens), on every rank."""
        ctx = self.ctx
        if not ctx.distributed:
            return float(local_sum)
        value = local_sum.detach().float().clone()
        if not (ctx.is_last_stage and ctx.tp_rank == 0):
            value.zero_()
        value /= ctx.dcp
        dist.all_reduce(value)
        return float(value)

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepOutput:
        self.model.train()
        self.grads.start_step()
        # auxiliary losses: the mean over micro-batches. Each cp rank back-propagates the micro-batch's
        # loss through its own tokens only and DP x CP averages, so each gets cp times the weight.
        self.runtime.grad_scale = self.ctx.cp / len(micro_batches)
        try:
            local = self.executor.run(micro_batches, train=True)
        finally:
            if self.sharded_params is not None:
                self.sharded_params.release_all()
        self.grads.finish()
        if self.ctx.tp > 1:  # sequence-parallel replicated params, kv heads shared by several ranks
            tp_grad_sync(self.model, self.ctx.tp_group, grad_of=lambda p: getattr(p, "main_grad", None))
        for p in self.tied_split:  # tied embeddings on the first and last stage: sum both sides
            dist.all_reduce(p.main_grad, group=self.ctx.tied_group)
        loss = self._global_mean(local)
        counts, metrics = self._moe_statistics()
        if not math.isfinite(loss):
            return StepOutput(loss, None, skipped=True, metrics=metrics)
        norm = self._grad_norm()
        clip = self.config.optimizer.clip_grad
        if clip is not None and norm > clip:
            scale = clip / (norm + 1e-6)
            self.grads.buffer.mul_(scale)
        self.optimizer.step(lr)
        for index, layer in self.moe_local.items():  # bias-balanced routers (DeepSeek-V3) follow the step's load
            update = getattr(layer, "update_router_bias", None)
            if update is not None:
                update(counts[index])
        return StepOutput(loss, norm, metrics=metrics)

    def _moe_statistics(self) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The step's routing statistics over every rank: tokens per expert of each MoE layer (the
        global counts), and the metrics: auxiliary and z losses (each layer's mean over the global
        batch's micro-batches, summed over layers) and `moe_max_load` (the busiest expert's tokens over
        the mean, worst layer)."""
        layers = self.local.moe_layers
        if not layers:
            return None, {}
        ctx, experts = self.ctx, self.local.moe_experts
        rows: dict[int, torch.Tensor] = {}
        for index, layer in self.moe_local.items():
            stats = layer.pop_statistics()
            if stats is None or ctx.tp_rank != 0 or ctx.cp_rank != 0:  # TP and CP ranks hold the same (summed) statistics
                continue
            row = torch.zeros(experts + 5, dtype=torch.float64)
            row[: int(layer.num_experts)] = stats.tokens_per_expert.detach().to("cpu", torch.float64)
            row[experts] = stats.aux_loss or 0.0
            row[experts + 1] = stats.z_loss or 0.0
            row[experts + 2] = stats.micro_batches
            row[experts + 3] = float(stats.aux_loss is not None)
            row[experts + 4] = float(stats.z_loss is not None)
            rows[index] = row
        table = torch.zeros(len(layers), experts + 5, dtype=torch.float64)
        for index, row in rows.items():
            table[index] = row
        if ctx.distributed:
            table = table.to(self.device)
            dist.all_reduce(table)
            table = table.cpu()
        counts, aux, z, batches = table[:, :experts], table[:, experts], table[:, experts + 1], table[:, experts + 2]
        if not bool((batches > 0).all()):  # e.g. a step without recorded forwards
            return counts, {}
        metrics = {}
        if bool((table[:, experts + 3] > 0).any()):
            metrics["moe_aux_loss"] = float((aux / batches).sum())
        if bool((table[:, experts + 4] > 0).any()):
            metrics["moe_z_loss"] = float((z / batches).sum())
        mean = counts.mean(dim=1).clamp_min(1e-12)
        metrics["moe_max_load"] = float((counts.max(dim=1).values / mean).max())
        return counts, metrics

    def _tied_local(self) -> list[torch.nn.Parameter]:
        """Local parameters that are one side of a tied pair split across the first and last stage."""
        out: list[torch.nn.Parameter] = []
        if self.ctx.pp == 1:
            return out
        names = dict(self.model.named_parameters(remove_duplicate=False))
        for first, second in getattr(self.model, "tied_parameters", []):
            if (first in names) != (second in names):
                out.append(names.get(first, names.get(second)))
        return out

    def _grad_norm(self) -> float:
        # one multi-tensor norm per kind, no squared copies of the gradients
        total = _sum_of_squares([t.grad for t in self.trainables if t.writer and t.dp is None], self.device)
        experts = _sum_of_squares([t.grad for t in self.trainables if t.writer and t.dp is not None], self.device)
        if self.grads.sharded:  # ZeRO-2: each data-parallel rank holds other rows
            if self.ctx.dcp > 1:
                dist.all_reduce(total, group=self.ctx.dcp_group)
            if self.ctx.edp > 1:
                dist.all_reduce(experts, group=self.ctx.edp_group)
        if self.ctx.ep > 1:  # each expert-parallel rank holds other experts
            dist.all_reduce(experts, group=self.ctx.ep_group)
        total += experts
        if self.ctx.distributed and self.ctx.tp * self.ctx.pp > 1:
            dist.all_reduce(total, group=self.ctx.mp_group)
        return float(total.sqrt())

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> float:
        self.model.eval()
        try:
            local = self.executor.run(micro_batches, train=False)
        finally:
            if self.sharded_params is not None:
                self.sharded_params.release_all()
        self.model.train()
        return self._global_mean(local)

    # -- checkpoints ----------------------------------------------------------------------
    def model_shards(self) -> list[ShardedTensor]:
        out = []
        for t in (*self.trainables, *self.frozen):
            if t.param_rows is not None:  # ZeRO-3: every data-parallel rank writes its rows
                rows = _rows_placement(t)
                if t.writer and rows is not None:
                    out.append(ShardedTensor(t.name, rows[1], rows[0], trained=True))
            elif self._writes_model(t.param, t.writer):
                out.append(ShardedTensor(t.name, t.param.detach(), t.placement, trained=t.param.requires_grad))
        return out

    def optimizer_shards(self) -> list[ShardedTensor]:
        return self.optimizer.state_shards()

    @torch.no_grad()
    def load_model(self, reader: ShardReader) -> None:
        for t in (*self.trainables, *self.frozen):
            if t.param_rows is not None:  # ZeRO-3: read this rank's rows only
                rows = _rows_placement(t)
                if rows is not None:
                    rows[1].copy_(reader.read(t.name, rows[0], tuple(rows[1].shape), dtype=t.param_rows.dtype))
                continue
            t.param.copy_(reader.read(t.name, t.placement, tuple(t.param.shape), dtype=t.param.dtype))
        if self.optimizer is not None:
            self.optimizer.refresh_master_weights()

    def load_optimizer(self, reader: ShardReader) -> None:
        self.optimizer.load_state(reader)

    # -- misc -----------------------------------------------------------------------------
    def flops_per_token(self, sequence_length: int) -> float:
        return float(self._flops_model.flops_per_token(sequence_length))

    def memory_estimate(self) -> dict[str, int | None]:
        """This rank's bytes for parameters, gradient buffers and (expected) optimizer state."""
        params = [getattr(p, "zero3_shard", p) for p in {id(p): p for p in self.model.parameters()}.values()]
        states = self._states_per_element
        optimizer = None
        if states is not None and hasattr(self.optimizer, "expected_state_bytes"):
            optimizer = int(self.optimizer.expected_state_bytes(states))
        return {
            "parameters": sum(p.numel() for p in params),  # ZeRO-3: this rank's rows
            "written_parameters": sum(
                _real_numel(piece.tensor, piece.placement) for piece in self.model_shards()
            ),
            "params_bytes": sum(p.numel() * p.element_size() for p in params),
            "grads_bytes": self.grads.buffer.numel() * self.grads.buffer.element_size(),
            "optimizer_bytes": optimizer,
        }

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.ctx.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        self.ctx.barrier()

    def all_ranks_ok(self, ok: bool) -> bool:
        if not self.ctx.distributed:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(flag)
        return float(flag) == 0.0

    def shutdown(self) -> None:
        """Drop everything that holds a process group (TP layers, buffers, optimizer), then destroy them."""
        if getattr(self, "grads", None) is not None:
            self.grads.close()
        if getattr(self, "sharded_params", None) is not None:
            self.sharded_params.close()
        held = (
            "model", "local", "executor", "grads", "optimizer", "trainables", "frozen", "tied_split", "tp_mode",
            "_flops_model", "runtime", "moe_local", "edp", "dcp", "sequence", "sharded_params",
        )
        for name in held:
            if hasattr(self, name):
                setattr(self, name, None)
        self.ctx.destroy()


def recompute_selected(model: torch.nn.Module) -> None:
    """Selective recompute: the modules the model names in `selective_recompute_modules` keep only their
    inputs for backward and run again there (torch's non-reentrant checkpoint), while training."""
    patterns = model.selective_recompute_modules
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            module.forward = functools.partial(_checkpointed, module.forward)


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    if all(t.dtype == torch.float32 for t in tensors):
        norms = torch._foreach_norm(tensors)  # what torch.nn.utils.clip_grad_norm_ uses
    else:  # bfloat16 gradients: each norm accumulated in float32
        norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]
    return torch.stack(norms).pow(2).sum()


def _rows_placement(t: TrainableParam):
    """(placement, tensor) of this rank's ZeRO-3 rows of `t`, or None when it holds none."""
    start, length = t.param.zero3_rows
    if length == 0:
        return None
    if not t.param.zero3_shape:  # a scalar: rank 0's
        return t.placement, t.param_rows.reshape(())
    placement, _ = t.placement.narrow(0, start, length, t.param.zero3_shape)
    return placement, t.param_rows


def _real_numel(tensor: torch.Tensor, placement) -> int:
    """Elements of a parameter piece that are the model's, not vocabulary padding of this layout."""
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return tensor.numel()
    rows = tensor.shape[0]
    return tensor.numel() // rows * placement.real_rows(rows)
