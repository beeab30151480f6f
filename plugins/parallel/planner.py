"""The `nd` engine's memory plan: bytes per rank before anything is launched (`nanocore plan`).

Parameters are counted exactly: for each distinct rank (pipeline stage x tensor-parallel rank; data-
and context-parallel replicas hold the same, ZeRO shards within one row) the rank's part of the model
is on the meta device, parallelised with that rank's TP coordinates and pruned to its experts and
pipeline chunks, as the engine builds it (the whole model is built once per tp; each rank's pipeline
chunks are copied from it). Then, in bytes:

- params: the rank's parameters x dtype size (tied pairs once per rank); ZeRO-3: its rows of every
  trainable parameter, plus, while blocks run, two neighbouring blocks whole (the running one and the
  prefetched next, each parameter gathered straight into its own storage);
- grads: trainable elements x gradient dtype size (float32 under accumulate_grad_in_fp32); ZeRO-2
  keeps its rows only (`row_share` over the data-parallel group);
- optimizer: `states_per_element` float32 tensors per element the rank updates (all of them at
  ZeRO-0, its rows at ZeRO-1/2), `matrix_states_per_element` for hidden matrices where the
  optimizer declares it (Muon: 1), plus float32 master weights for lower-precision parameters;
- activations: what autograd keeps per micro-batch (the model's `activation_elements_per_token`) x
  tokens per micro-batch on this rank (micro_batch_size x sequence / cp), summed over the chunks'
  forwards the rank's schedule holds at once (its action list from the pipeline simulator: each
  forward adds its chunk's activations, each backward frees them; at its largest); TP divides what
  it shards, sequence parallelism the norms too; full recompute keeps each recomputed block's input,
  selective drops the attention core's outputs. Under expert parallelism a sparse layer's routed
  activations (`moe_mlp`) are sized for the busiest rank: x the expert-load factor (`nanocore plan
  --expert-load-factor`; 1 is balanced routing, ep the most: one rank gets every routed token; without ep
  every slot is local and the factor is moot).
  Plus the backward's working set: the loss's float32
  softmax over the logits and one decoder layer's activations; on a stage without the loss,
  autograd's fresh gradient of its largest parameter (the embedding's, before it is added to the
  gradient buffer); under context parallelism (where the model declares `attention_query` and
  `attention_key_value`, per token and TP rank) one attention layer's exchange buffers: the ring
  holds the key/value block arriving while one is computed and, in backward, the key/value gradients
  travelling with them (3 x k + v per local token); all_to_all holds the whole-sequence queries,
  keys and values of heads / cp (as many elements as the local ones; key/value heads fewer than cp
  are repeated, `r` = cp / gcd(kv heads, cp) times) and the output, sent and received
  (2 x (q + r (k + v) + q)), and keeps the repeated keys and values for backward in each layer
  ((r - 1) (k + v) more per layer);
- comm: ZeRO-1/2's exchange of updated rows (this rank's rows and everyone's, one piece of about
  `exchange_buffer_bytes` at a time, at the optimizer step) and ZeRO-2's staging during backward:
  one bucket reducing and one filling (a parameter larger than `ddp_bucket_cap_mb` is a bucket of
  its own, reduced from autograd's gradient itself) and their reduced shares, which fill as backward
  frees activations, after the loss's working set is gone;
- optimizer step: the optimizer's float32 temporaries (`step_temporaries_per_element`: AdamW's
  multi-tensor kernel builds one per element, the fused kernel none), and `matrix_step_buffers`
  float32 buffers of the largest whole hidden matrix (its TP pieces together; Muon's gathered
  pieces and Newton-Schulz products on the matrix's owner).

total = params + grads + optimizer + max(backward, exchange + optimizer step), where backward =
max(activations, activations - the loss's working set + ZeRO-2 staging):
backward's peak and the optimizer step's do not overlap (activations are freed before the step).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from nanocore.config import Config
from nanocore.dtypes import resolve_dtype_name
from nanocore.engine_api import MemoryPlan, PlannedLayout, RankPlan
from nanocore.model_api import is_hidden_matrix
from nanocore.pipeline_api import Action
from nanocore.pipeline_sim import SimResult, simulate
from nanocore.registry import Entry, Registries
from nanocore.sharding import get_placement, row_share
from nanocore.tp_api import TPMode

from .build import meta_model, model_key, pruned_names, rank_chunks
from .expert_parallel import is_expert, shard_experts
from .pruned import PrunedBlock
from .tensor_parallel import PlannedGroup
from .tensor_parallel import parallelize as tp_parallelize

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


_RANK_PARTS: dict[tuple[object, ...], tuple[nn.Module, dict[str, float] | None, list[list[list[str]]]]] = {}
# model key -> the whole model on meta and its declared activation elements
_WHOLE: dict[tuple[object, ...], tuple[nn.Module, dict[str, float] | None]] = {}
_PRUNED = PrunedBlock()  # what a rank part holds in place of another stage's blocks (one, shared)
_SIMULATED: dict[tuple[str, int, int, int], SimResult] = {}  # (schedule, pp, micro-batches, virtual)


def _whole_model(config: Config, model_entry: Entry, tp: int) -> tuple[nn.Module, dict[str, float] | None]:
    """The whole single-device model on meta (its vocabulary padded for `tp`) and its declared
    activation elements; built once per model and tp: every rank part is cut from it."""
    multiple = config.model.make_vocab_size_divisible_by * tp
    key = (model_key(config.model), model_entry.name, multiple)
    if key not in _WHOLE:
        if len(_WHOLE) > 16:
            _WHOLE.clear()
        model = meta_model(model_entry, config.model, vocab_multiple=multiple)
        _WHOLE[key] = (model, _activation_elements(model))
    return _WHOLE[key]


def _tree_copy(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """A copy of the module tree under `module`: new module objects with the same attributes, sharing
    their parameters and buffers; `memo` maps a module's id to what stands for it (a module met
    twice is copied once; a pruned one is `_PRUNED`)."""
    if id(module) in memo:
        return memo[id(module)]
    new = copy.copy(module)
    memo[id(module)] = new
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    new._modules = {name: None if child is None else _tree_copy(child, memo) for name, child in module._modules.items()}
    return new


def _pipeline_part(
    model: nn.Module, pp: int, pp_rank: int, virtual: int, schedule: object, changes: bool
) -> tuple[nn.Module, list[list[list[str]]]]:
    """A copy of `model` holding only this pipeline rank's chunks (every other pipeline block an
    `PrunedBlock`, as `keep_rank_part` leaves them) and those chunks. The copy's modules are new and
    share the parameters and buffers of the blocks it keeps: `plan` reads them and never changes
    them, and parallelising a part or sharding its experts swaps modules and parameters, never
    alters one. Copying the kept blocks' module tree costs a fraction of building and parallelising
    the whole model once per rank (a 1T model's 64 stages x 8 TP ranks). Where the rank holds every
    block and nothing will swap its modules (`changes` False: no TP, experts not split), the whole
    model itself."""
    all_chunks, ids = rank_chunks(model, pp, pp_rank, virtual, schedule)
    if len(ids) == len(all_chunks) and not changes:  # the whole model, and nothing will change it
        return model, all_chunks
    memo: dict[int, nn.Module] = {id(model.get_submodule(name)): _PRUNED for name in pruned_names(all_chunks, ids)}
    return _tree_copy(model, memo), [all_chunks[i] for i in ids]


def _rank_part(
    config: Config, model_entry: Entry, tp_mode: TPMode | None, schedule: object, pp_rank: int, tp_rank: int
) -> tuple[nn.Module, dict[str, float] | None, list[list[list[str]]]]:
    """A pipeline and TP rank's part of the model on meta (read, never changed, by `plan`): the model,
    its declared activation elements and its local chunks, as the engine builds it (`build_local_model`:
    parallelised with that rank's TP coordinates, pruned to its chunks and its experts). Remembered:
    `nanocore plan --search` plans layouts that differ only in what the model part does not depend
    on (ZeRO, batch, recompute, dp)."""
    par = config.parallelism
    tp, pp, ep = par.tp, par.pp, par.expert_parallel_size
    key = (model_key(config.model), tp, tp_rank, par.tp_mode, par.tp_linear_async_communication, pp, pp_rank)
    key += (par.pp_virtual_stages, ep, par.pp_engine)
    if key not in _RANK_PARTS:
        if len(_RANK_PARTS) > 1024:
            _RANK_PARTS.clear()
        whole, declared = _whole_model(config, model_entry, tp)
        model, local_chunks = _pipeline_part(whole, pp, pp_rank, par.pp_virtual_stages, schedule, tp > 1 or ep > 1)
        if tp > 1:
            assert tp_mode is not None
            tp_parallelize(model, model.tp_plan, PlannedGroup(tp, tp_rank), tp_mode, par.tp_linear_async_communication)
        shard_experts(model, ep, 0)
        _RANK_PARTS[key] = (model, declared, local_chunks)
    return _RANK_PARTS[key]


def plan(config: Config, registries: Registries, device: str = "cuda", expert_load_factor: float = 1.0) -> MemoryPlan:
    """The memory plan of `config` (see the module docstring). `device` resolves `model.dtype: auto`;
    `expert_load_factor` is the busiest expert-parallel rank's routed tokens over the balanced share."""
    par, tokens, opt = config.parallelism, config.tokens, config.optimizer
    dtype_name = resolve_dtype_name(config.model.dtype, device)
    dtype_bytes = DTYPE_BYTES[dtype_name]
    grad_bytes = 4 if opt.accumulate_grad_in_fp32 else dtype_bytes
    cp, tp, pp, dp = par.context_parallel_size, par.tp, par.pp, par.dp
    dcp = dp * cp
    ep = par.expert_parallel_size
    edp = dcp // ep
    zero = registries.zero_stage.get(str(opt.zero_stage))
    shards_grads = bool(zero.extras.get("shards_gradients"))
    shards_params = bool(zero.extras.get("shards_parameters"))
    sharded_state = bool(zero.extras.get("shards_optimizer_state"))
    optimizer_entry = registries.optimizer.get(opt.optimizer_factory.name)
    count = optimizer_entry.extras.get("states_per_element")
    states = count(opt.optimizer_factory.args) if count is not None else None
    matrix_count = optimizer_entry.extras.get("matrix_states_per_element")
    matrix_states = matrix_count(opt.optimizer_factory.args) if matrix_count is not None else states
    buffers = optimizer_entry.extras.get("matrix_step_buffers")
    matrix_buffers = buffers(opt.optimizer_factory.args) if buffers is not None else 0
    temporaries = optimizer_entry.extras.get("step_temporaries_per_element")
    step_temporaries = temporaries(opt.optimizer_factory.args) if temporaries is not None else 0
    exchange_piece = zero.extras.get("exchange_buffer_bytes")
    model_entry = registries.model.get(config.model.model_type)
    tp_mode = registries.tp_mode.get(par.tp_mode).factory() if tp > 1 else None
    sequence_parallel = bool(tp_mode is not None and tp_mode.sequence_parallel)
    chunks = pp * par.pp_virtual_stages
    microbatches = tokens.batch_accumulation_per_replica
    schedule = registries.pipeline_schedule.get(par.pp_engine).factory(config)
    shape = (par.pp_engine, pp, microbatches, par.pp_virtual_stages)
    if shape not in _SIMULATED:
        if len(_SIMULATED) > 256:
            _SIMULATED.clear()
        _SIMULATED[shape] = simulate(schedule, pp, microbatches, par.pp_virtual_stages)
    simulated = _SIMULATED[shape]
    in_flight = simulated.peak_in_flight
    orders = [[timed.action for timed in timeline] for timeline in simulated.timelines]  # each rank's actions
    mb_tokens = tokens.micro_batch_size * tokens.sequence_length / cp
    bucket_bytes = config.model.ddp_bucket_cap_mb * 2**20

    ranks = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            model, declared, local_chunks = _rank_part(config, model_entry, tp_mode, schedule, pp_rank, tp_rank)
            params = {id(p): p for p in model.parameters()}.values()
            param_bytes = sum(p.numel() for p in params) * dtype_bytes
            gathered = 0.0
            if shards_params:  # ZeRO-3: rows at rest; up to two blocks whole, and one block's gather buffers
                param_bytes = sum(
                    (_row_elements(p, edp if is_expert(p) else dcp) if p.requires_grad else p.numel()) * dtype_bytes
                    for p in params
                )
                # a block is whole while it runs, and the next one (prefetched) besides it
                gathered = max(
                    sum(_block_bytes(model, blk, dtype_bytes) for blk in chunk[i : i + 2])
                    for chunk in local_chunks
                    for i in range(len(chunk))
                )
            grads = optimizer = updated = exchange = largest = largest_grad = whole_matrix = 0
            matrices = {id(p) for name, p in model.named_parameters() if is_hidden_matrix(model, name, p.dim())}
            for p in params:
                if not p.requires_grad:
                    continue
                if id(p) in matrices:  # the whole matrix (its TP pieces together) an owner steps
                    whole_matrix = max(
                        whole_matrix, math.prod(p.shape[:-2]) * math.prod(get_placement(p).full_shape[-2:])
                    )
                largest_grad = max(largest_grad, p.numel() * grad_bytes)
                group = edp if is_expert(p) else dcp
                share = _row_elements(p, group) if sharded_state else p.numel()
                grads += (_row_elements(p, group) if shards_grads else p.numel()) * grad_bytes
                updated += share
                if states is not None:
                    kept = matrix_states if id(p) in matrices and matrix_states is not None else states
                    optimizer += share * 4 * kept + (share * 4 if dtype_bytes != 4 else 0)
                if sharded_state and group > 1 and not shards_params:  # own rows out, every rank's in
                    exchange += p.numel() * dtype_bytes * (group + 1) / group
                    largest = max(largest, p.numel() * dtype_bytes * (group + 1) / group)
            if exchange_piece is not None and exchange:  # exchanged in pieces of about exchange_piece bytes
                exchange = min(exchange, exchange_piece * (dcp + 1) / dcp + largest)
            activations, loss_working = None, 0.0
            if declared is not None:
                activations, loss_working = _activations(
                    declared,
                    local_chunks,
                    model,
                    par,
                    tp,
                    sequence_parallel,
                    orders[pp_rank],
                    mb_tokens,
                    dtype_bytes,
                    cp,
                    min(expert_load_factor, ep) if ep > 1 else 1.0,  # a rank gets every token at most
                )
            # ZeRO-2: two buckets of staging (one reducing, one filling; a parameter larger than a bucket is
            # a bucket of its own) and the reduced share of one. They fill as backward frees activations,
            # after the loss's working set is gone.
            staging = 0.0
            if shards_grads and dcp > 1:
                # a parameter larger than a bucket is reduced from autograd's gradient itself
                staging = min(max(bucket_bytes, largest_grad) + bucket_bytes, grads * dcp) * (1 + 1 / dcp)
            # the optimizer step, activations gone: its temporaries, and a matrix optimizer's buffers of one
            # whole matrix (Muon's gathered pieces and Newton-Schulz products)
            step_temps = updated * 4 * step_temporaries + whole_matrix * 4 * matrix_buffers
            step_phase = exchange + step_temps
            backward_phase = max(activations or 0, (activations or 0) - loss_working + staging) + gathered
            if not loss_working and activations is not None:
                # a stage without the loss peaks later in backward, when autograd's fresh gradient of its
                # largest parameter (the first stage's embedding) exists before it joins the buffer
                backward_phase += max((p.numel() for p in params if p.requires_grad), default=0) * dtype_bytes
            total = param_bytes + grads + (optimizer or 0) + max(backward_phase, step_phase)
            ranks.append(
                RankPlan(
                    rank=_global_rank(pp_rank, tp_rank, tp, cp, pp),
                    pp_rank=pp_rank,
                    tp_rank=tp_rank,
                    params_bytes=int(param_bytes),
                    grads_bytes=int(grads),
                    optimizer_bytes=int(optimizer) if states is not None else None,
                    activations_bytes=int(activations) if activations is not None else None,
                    activations_bytes_per_microbatch_sample=(
                        int(activations / tokens.micro_batch_size) if activations is not None else None
                    ),
                    comm_bytes=int(max(exchange, staging)),
                    optimizer_step_bytes=int(step_temps),
                    backward_phase_bytes=int(backward_phase),  # activations + ZeRO-2 staging
                    step_phase_bytes=int(step_phase),  # exchange + optimizer temporaries
                    total_bytes=int(total),
                )
            )
    whole = _whole_model(config, model_entry, 1)[0]  # the vocabulary padded as for one device
    per_token = float(whole.flops_per_token(tokens.sequence_length))
    global_tokens = dp * tokens.micro_batch_size * microbatches * tokens.sequence_length
    recompute_factor = {"full": 4 / 3, "selective": 1.0, None: 1.0}[par.recompute]
    unknown = []
    if ranks[0].activations_bytes is None:
        unknown.append("activations (the model declares no activation_elements_per_token)")
    if states is None:
        unknown.append("optimizer state (the optimizer plugin declares no states_per_element)")
    return MemoryPlan(
        world_size=dp * cp * tp * pp,
        layout=PlannedLayout(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep, zero_stage=opt.zero_stage),
        dtype=dtype_name,
        ranks=ranks,
        flops_per_step=per_token * global_tokens,
        flops_per_step_with_recompute=per_token * global_tokens * recompute_factor,
        peak_in_flight_microbatches=[p / max(1, par.pp_virtual_stages) for p in in_flight],
        unknown=unknown,
        chunks=chunks,
    )


def _row_elements(p: torch.Tensor, group: int) -> int:
    """Elements of `p` the largest ZeRO share (rank 0's rows) holds."""
    _, rows = row_share(tuple(p.shape), group, 0)
    per_row = p.numel() // p.shape[0] if p.dim() and p.shape[0] else 1
    return rows * per_row


def _block_bytes(model, block: list[str], dtype_bytes: int) -> int:
    """Bytes of a pipeline block's trainable parameters when whole."""
    seen = {}
    for name in block:
        for p in model.get_submodule(name).parameters():
            if p.requires_grad:
                seen[id(p)] = p.numel()
    return sum(seen.values()) * dtype_bytes


def _activation_elements(model) -> dict[str, float] | None:
    declare = getattr(model, "activation_elements_per_token", None)
    return declare() if declare is not None else None


def _activations(
    declared: dict[str, float],
    local_chunks: list[list[list[str]]],
    model,
    par,
    tp: int,
    sequence_parallel: bool,
    actions: list[Action],
    mb_tokens: float,
    dtype_bytes: int,
    cp: int = 1,
    expert_load: float = 1.0,
) -> tuple[float, float]:
    """Bytes of activations this rank holds at its peak (see the module docstring), and of those the
    loss's working set, which exists only at the start of backward."""
    sp = tp if sequence_parallel else 1
    norms = declared["layer_norms"] / sp
    if sequence_parallel:
        gathered = declared["layer_column_inputs"] / (tp if par.tp_linear_async_communication else 1)
    else:
        gathered = 0.0  # the column layers' inputs are the norms' outputs, counted there
    sharded = declared["layer_sharded"] / tp
    if par.recompute == "selective":
        sharded -= declared["layer_attention_core_outputs"] / tp
    held_cp, working_cp = context_parallel_buffers(declared, par.context_parallel_mode, cp, tp)
    layer = norms + gathered + sharded + declared.get("layer_replicated", 0.0) + held_cp
    # a sparse layer: the dense MLP's share replaced by the sparse block's (its tokens: this rank's sequence)
    sparse_layer = (
        layer
        - declared.get("dense_mlp_sharded", 0.0) / tp
        + declared.get("moe_mlp", 0.0) * expert_load / sp
        + declared.get("moe_mlp_sharded", 0.0) / tp
    )
    moe_layers = {name.removesuffix(".mlp") for name in getattr(model, "moe_layers", ())}
    head = declared["head_norm"] / sp + (declared["layer_column_inputs"] / 2 if sequence_parallel else 0.0)
    logits = declared["head_logits"] / tp
    hidden = declared["layer_norms"] / 4  # one hidden vector per token
    blocks = model.pipeline_blocks()
    is_last = local_chunks[-1][-1] == blocks[-1]
    per_chunk = []
    for chunk in local_chunks:
        elements = 0.0
        for block in chunk:
            if block == blocks[0]:
                continue  # the embedding keeps only the token ids
            if block == blocks[-1]:
                elements += head + logits
                if "model.mtp" in block:  # each multi-token prediction module: a layer, its head, its loss's softmax
                    depth = len(model.get_submodule("model.mtp"))
                    mtp_layer = sparse_layer if moe_layers else layer
                    elements += depth * (mtp_layer + 5 * hidden + head + logits * (1 + 4 / dtype_bytes))
                continue
            if par.recompute == "full":
                elements += hidden / sp  # a recomputed block keeps its input only
            else:
                elements += sparse_layer if block[0] in moe_layers else layer
        per_chunk.append(elements)
    held = peak = 0.0  # what the forwards not yet undone by their backward (B, or a split one's W) hold
    for action in actions:
        held += {"F": 1, "B": -1, "W": -1}.get(action.kind, 0) * per_chunk[action.chunk]
        peak = max(peak, held)
    held = peak
    # backward of one layer: its activations, their gradients; and the context-parallel exchange's buffers
    working = max(layer, sparse_layer if moe_layers else 0.0) + working_cp
    loss = 2 * logits * 4 / dtype_bytes if is_last else 0.0  # the float32 softmax of the logits and its gradient
    return (held + working + loss) * mb_tokens * dtype_bytes, loss * mb_tokens * dtype_bytes


def context_parallel_buffers(declared: dict[str, float], mode: str, cp: int, tp: int) -> tuple[float, float]:
    """Per local token: what context parallelism adds to what each attention layer keeps for backward,
    and to one layer's working set while it runs (see the module docstring)."""
    q, kv = declared.get("attention_query"), declared.get("attention_key_value")
    if cp <= 1 or q is None or kv is None:
        return 0.0, 0.0
    q, kv = q / tp, kv / tp
    if mode != "all_to_all":
        return 0.0, 3 * kv
    kv_heads = max(1, round(declared.get("attention_kv_heads", 0) / tp))  # per TP rank (replicated below 1)
    repeat = cp // math.gcd(kv_heads, cp)
    return (repeat - 1) * kv, 2 * (q + repeat * kv + q)


def _global_rank(pp_rank: int, tp_rank: int, tp: int, cp: int, pp: int) -> int:
    """Global rank of (dp 0, cp 0, this pp and tp rank): the grid is tp innermost, then cp, then pp, then dp."""
    return (pp_rank * cp + 0) * tp + tp_rank
