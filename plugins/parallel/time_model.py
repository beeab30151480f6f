"""The `nd` engine's time model: seconds per training step of a config on a hardware description
(`nanocore plan --hardware`). One function per cost term; docs/planning.md gives each formula.

Per pipeline rank and micro-batch of T = micro_batch_size x sequence / cp tokens on the rank, from the
model built on the meta device with the layout's TP (the same parameters the engine builds):

- compute (`matmul_seconds`, `attention_seconds`): every weight matrix outside the embedding is one
  matmul of 2 T x (its local elements) FLOPs forward, two of that size backward (input and weight
  gradients), each at the hardware's efficiency for its size; an expert matrix gets the tokens its
  router sends it (T / sp x k / E x ep per expert, x the expert-load factor on the busiest rank);
  attention is 4 x (query width / tp) x sequence x T x 1/2 (causal) FLOPs forward per layer, twice
  that backward, at the description's `attention_efficiency` where it has one (a fused kernel is
  not a matmul: on a 2-core CPU it runs at about a third of the matmul peak, FlashAttention-2 on an
  H100 at 35 %), else at the matmul curve;
- memory_bound (`memory_bound_seconds`): every other op the block's forward launches (norms,
  activations, rotary, residual adds, casts, copies; the loss on the last block), counted by running
  the block on the meta device under a dispatch mode (`trace_memory_bound`): each op costs the
  hardware's `op_overhead` plus its input and output bytes at the memory bandwidth, forward once and
  backward twice; bytes at the residual width are replicated under TP without sequence parallelism,
  the rest split tp ways; views, matmuls and the attention core (counted above) are not;
- recompute (`recompute_seconds`): full: each decoder layer's forward again in backward;
  selective: the attention core's;
- tensor_parallel (`tensor_parallel_seconds`): per decoder layer two all-reduces of T x hidden
  activations forward and two backward (REDUCE_SCATTER: an all-gather and a reduce-scatter for
  each); with tp_linear_async_communication the backward's all-gathers hide behind the weight
  gradients; the embedding's output forward, the head's input backward, and the vocabulary-parallel
  loss's two small all-reduces forward;
- context_parallel (`context_parallel_seconds`): ring: (cp - 1) key/value blocks sent per layer
  forward, again backward with their float32 gradients one hop more, overlapped with attention (only
  what exceeds it shows), each ring step's float32 score block written out and read back
  (`RING_SCORE_PASSES`) at the memory bandwidth, and its attention as matmuls per block (beyond the
  compute term's fused causal attention); all_to_all: queries, keys, values and the output
  swapped forward and backward (not overlapped), each copied three times around its swap;
- expert_parallel (`expert_parallel_seconds`): per MoE layer a dispatch and a combine all-to-all of
  T / sp x k tokens' hidden vectors forward and backward, x the expert-load factor, the token counts'
  all-to-all before the forward's dispatch, and the arrived rows regrouped by expert and back;
- pipeline_p2p (`pipeline_p2p_seconds`): one activation message per forward and one gradient per
  backward between stages;
- pipeline_bubble: the pipeline simulator runs the schedule with each rank's forward, backward and
  split-backward times; the bubble is the step's makespan less the busiest rank's work;
- data_parallel (`data_parallel_seconds`): the gradient all-reduce (ZeRO-2/3: reduce-scatter) over
  dp x cp, overlapped with the last micro-batch's backward (at least one bucket shows); ZeRO-1/2's
  all-gather of updated parameters after the step; ZeRO-3's gathers, one per parameter tensor, in
  every forward and backward, overlapped with that compute but for each pass's first block;
- optimizer (`optimizer_seconds`): the step reads and writes each updated element's parameter,
  gradient and states once at the memory bandwidth.

Collectives follow the ring alpha-beta model of `nanocore.hardware.Hardware.collective_seconds`,
at the intra-node link while a group's ranks fit in one node (tp innermost, then cp, pp, dp), each
kind at its own figures where the description measured them (`nanocore calibrate`). Where a
term says "overlapped with" or "hides behind" some compute, only the hardware's `compute_overlap`
share of that compute hides it (1 on a GPU, whose collectives have their own engine; what calibrate
measures on CPU, where gloo shares the cores: near 0 on a busy 2-core machine).
"""

from __future__ import annotations

import fnmatch
import math

import attrs
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nanocore.config import Config
from nanocore.dtypes import resolve_dtype_name
from nanocore.engine_api import TimePrediction, TimeTerm
from nanocore.hardware import Hardware
from nanocore.moe_api import moe_layers
from nanocore.pipeline_api import stage_of
from nanocore.pipeline_sim import PreparedSchedule, prepare
from nanocore.pipeline_sim import makespan as simulated_makespan
from nanocore.registry import Registries

from .build import meta_model, model_key, partition_indices
from .expert_parallel import is_expert, shard_experts
from .tensor_parallel import PlannedGroup
from .tensor_parallel import parallelize as tp_parallelize

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CAUSAL = 0.5  # causal attention computes about half of the score matrix
# times each ring step's score block is read or written, forward and backward (count: `_block_forward`
# writes the scores, scales them (read, write), masks them on the diagonal (read, write), takes the
# log-sum-exp (read), subtracts it and exponentiates (2 x read, write) and reads them into the
# output's matmul; `_block_backward` does the same up to the probabilities, then writes the
# probabilities' gradient, subtracts delta and multiplies (3 x read, write) and reads the result
# twice into the matmuls)
RING_SCORE_PASSES = (10, 18)


@attrs.frozen
class Matmul:
    """One weight matrix of a block, as this TP rank holds it (every expert: ep applies later)."""

    elements: int
    experts: int  # 1 for a dense matrix; E for a stacked expert tensor
    active: float  # the share of tokens that use it (k / E for an expert)


@attrs.frozen
class MemoryBound:
    """A block's non-matmul work in one forward (see `trace_memory_bound`)."""

    ops: int  # ops launched per micro-batch (views, matmuls and the attention core excluded)
    stream: float  # elements read and written per token by ops at the residual width
    inner: float  # elements per token by the others (heads, MLP width, vocabulary: split under TP)


NO_MEMORY_BOUND = MemoryBound(0, 0.0, 0.0)


@attrs.frozen(cache_hash=True)
class Block:
    """A pipeline block's costs per token: its matmuls, whether it holds an attention core, its
    trainable elements (dense and expert), its non-matmul work."""

    matmuls: tuple[Matmul, ...]
    attention: bool
    moe: bool
    params: int
    expert_params: int
    memory: MemoryBound = NO_MEMORY_BOUND
    role: str = "layer"  # "embedding" (the first block), "head" (the last: it computes the loss) or "layer"
    tensors: int = 0  # trainable parameter tensors (ZeRO-3 gathers each one by one)


@attrs.frozen
class Inventory:
    """The model at one TP size: blocks in order, and the widths the collectives move."""

    blocks: tuple[Block, ...]
    hidden: int
    attention_query: float  # query elements per token per layer (before TP)
    attention_key_value: float
    kv_heads: int
    top_k: float  # tokens' expert choices per MoE layer (0 for a dense model)
    heads: int = 0  # query heads per layer before TP (0: not declared)


_INVENTORIES: dict[tuple[str, ...], Inventory] = {}  # a search asks for the same few thousands of times


def inventory(config: Config, registries: Registries, tp: int) -> Inventory:
    """Read the model's blocks at tensor-parallel size `tp` off a meta model (see the module docstring);
    remembered per model config, tp and TP mode (`nanocore plan --search` asks again for every layout)."""
    par = config.parallelism
    key = (model_key(config.model), str(tp), par.tp_mode, str(par.tp_linear_async_communication))
    if key not in _INVENTORIES:
        if len(_INVENTORIES) > 64:
            _INVENTORIES.clear()
        _INVENTORIES[key] = _read_inventory(config, registries, tp)
    return _INVENTORIES[key]


def _is_lookup(module: nn.Module) -> bool:
    """An embedding: its weight is read by rows (a lookup, no matmul); its last dimension is the hidden size."""
    return isinstance(module, nn.Embedding) or "Embedding" in type(module).__name__


def _read_inventory(config: Config, registries: Registries, tp: int) -> Inventory:
    entry = registries.model.get(config.model.model_type)
    model = meta_model(entry, config.model, vocab_multiple=config.model.make_vocab_size_divisible_by * tp)
    declared = model.activation_elements_per_token() if hasattr(model, "activation_elements_per_token") else None
    declared = declared or {}
    if tp > 1:
        mode = registries.tp_mode.get(config.parallelism.tp_mode).factory()
        async_comm = config.parallelism.tp_linear_async_communication
        tp_parallelize(model, model.tp_plan, PlannedGroup(tp, 0), mode, async_comm)
    shard_experts(model, 1, 0)  # marks the expert tensors
    active = getattr(model, "active_fraction", None)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    moe = set(moe_layers(model))
    traced = trace_memory_bound(config, registries)
    blocks_out = []
    alike: dict[Block, Block] = {}
    hidden = 0
    top_k = 0.0
    pipeline_blocks = list(model.pipeline_blocks())
    for block in pipeline_blocks:
        matmuls, params, expert_params, tensors, seen = [], 0, 0, 0, set()
        is_moe = any(name == layer or layer.startswith(name + ".") for name in block for layer in moe)
        for name in block:
            for module in model.get_submodule(name).modules():
                lookup = _is_lookup(module)
                for p in module.parameters(recurse=False):
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    if lookup:
                        hidden = hidden or int(p.shape[-1])
                    if p.requires_grad:
                        tensors += 1
                        if is_expert(p):
                            expert_params += p.numel()
                        else:
                            params += p.numel()
                    if p.dim() < 2 or lookup:
                        continue
                    fraction = float(active(names[id(p)])) if active is not None else 1.0
                    experts = int(p.shape[0]) if is_expert(p) else 1
                    if is_expert(p):
                        top_k = max(top_k, fraction * experts)
                    matmuls.append(Matmul(p.numel(), experts, fraction))
        attention = any(".layers." in name or name.startswith("layers.") for name in block)
        memory = traced[len(blocks_out)] if len(blocks_out) < len(traced) else NO_MEMORY_BOUND
        at = len(blocks_out)
        role = "embedding" if at == 0 else "head" if at == len(pipeline_blocks) - 1 else "layer"
        made = Block(tuple(matmuls), attention, is_moe, params, expert_params, memory, role, tensors)
        blocks_out.append(alike.setdefault(made, made))  # alike layers: one object, costed once by `predict`
    return Inventory(
        blocks=tuple(blocks_out),
        hidden=hidden,
        attention_query=float(declared.get("attention_query", 0.0)),
        attention_key_value=float(declared.get("attention_key_value", 0.0)),
        kv_heads=int(declared.get("attention_kv_heads", 0)),
        top_k=top_k,
        heads=int(getattr(model, "attention_heads", 0) or 0),
    )


TRACE_TOKENS = 16  # the traced micro-batch: 1 x 16 tokens (its elements are scaled per token)
_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "matmul", "linear")
_NO_COPY = ("_unsafe_view", "detach", "alias", "lift_fresh")  # not flagged as views, but move no bytes
_TRACES: dict[str, tuple[MemoryBound, ...]] = {}


class _Counter(TorchDispatchMode):
    """Counts the ops that reach it and the elements they read and write, split by the output's last
    dimension (the residual width or not); parameters (read in part, e.g. an embedding's rows) are skipped."""

    def __init__(self, hidden: int, params: set[int]) -> None:
        super().__init__()
        self.hidden, self.params = hidden, params
        # parameters `_trace_on_cpu` replaced, kept alive to the trace's end: `params` holds their ids, and
        # a freed one's id, reused by a new activation, would hide that activation from the count
        self.retired: list[torch.Tensor] = []
        self.paused = 0  # inside an attention core
        self.ops, self.stream, self.inner = 0, 0.0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.paused or func.is_view or name in _MATMULS or name in _NO_COPY:
            return out
        flat_in = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        flat_out = [a for a in torch.utils._pytree.tree_leaves(out) if isinstance(a, torch.Tensor)]
        elements = sum(a.numel() for a in flat_in if id(a) not in self.params) + sum(a.numel() for a in flat_out)
        self.ops += 1
        width = flat_out[0].shape[-1] if flat_out and flat_out[0].dim() else 0
        if width == self.hidden:
            self.stream += elements
        else:
            self.inner += elements
        return out


CPU_TRACE_BYTES = 256 * 2**20  # a block the meta device cannot run is run on the CPU up to this size


def _trace_on_cpu(model: nn.Module, block: list[str], x: torch.Tensor, counter: _Counter) -> MemoryBound | None:
    """Count a block the meta device cannot run (a mixture-of-experts layer sorts its tokens by the
    experts their values choose) by running it on the CPU, its parameters made real and random: the
    ops and elements per token do not depend on which experts win. None where its parameters exceed
    CPU_TRACE_BYTES (then the caller estimates)."""
    modules = [model.get_submodule(name) for name in block]
    size = sum(t.numel() * t.element_size() for m in modules for t in [*m.parameters(), *m.buffers()])
    if size > CPU_TRACE_BYTES:
        return None
    counter.paused += 1  # making the block real is not its work
    try:
        generator = torch.Generator().manual_seed(0)
        for m in modules:
            counter.retired += [*m.parameters(), *m.buffers()]
            m.to_empty(device="cpu")
            for t in [*m.parameters(), *m.buffers()]:
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=generator) * 0.02)
            counter.params |= {id(t) for t in m.parameters()}
        y = torch.randn(x.shape, generator=generator) if x.is_floating_point() else torch.zeros_like(x, device="cpu")
    finally:
        counter.paused -= 1
    counter.ops, counter.stream, counter.inner = 0, 0.0, 0.0
    try:
        for m in modules:
            y = m(y)
    except Exception:  # noqa: BLE001 - estimate, do not fail
        return None
    return MemoryBound(counter.ops, counter.stream / TRACE_TOKENS, counter.inner / TRACE_TOKENS)


def trace_memory_bound(config: Config, registries: Registries) -> tuple[MemoryBound, ...]:
    """Each pipeline block's non-matmul work per forward, counted by running the whole model's blocks in
    turn on the meta device (1 x TRACE_TOKENS tokens, no grad) under `_Counter`; the attention core (the
    model's `selective_recompute_modules`) is one op whose work the attention term costs, and the last
    block adds the loss's cross-entropy. A block the meta device cannot run (data-dependent routing)
    runs on the CPU where it is small enough (`_trace_on_cpu`), else takes the previous decoder
    layer's counts. Remembered per model config."""
    key = model_key(config.model)
    if key in _TRACES:
        return _TRACES[key]
    entry = registries.model.get(config.model.model_type)
    model = meta_model(entry, config.model, vocab_multiple=config.model.make_vocab_size_divisible_by)
    params = {id(p) for p in model.parameters()}
    lookups = [p for m in model.modules() if _is_lookup(m) for p in m.parameters(recurse=False) if p.dim() == 2]
    counter = _Counter(int(lookups[0].shape[-1]) if lookups else 0, params)
    patterns = list(getattr(model, "selective_recompute_modules", None) or [])
    handles = []
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):

            def enter(*_: object) -> None:
                counter.paused += 1
                counter.ops += 1

            def leave(*_: object) -> None:
                counter.paused -= 1

            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    out: list[MemoryBound] = []
    x = torch.zeros(1, TRACE_TOKENS, dtype=torch.long, device="meta")
    blocks = model.pipeline_blocks()
    try:
        with torch.no_grad(), counter:
            for i, block in enumerate(blocks):
                counter.ops, counter.stream, counter.inner, counter.paused = 0, 0.0, 0.0, 0
                try:
                    y = x
                    for name in block:
                        y = model.get_submodule(name)(y)
                    if i == len(blocks) - 1:
                        target = torch.zeros(TRACE_TOKENS, dtype=torch.long, device="meta")
                        nn.functional.cross_entropy(y.flatten(0, -2).float(), target)
                    x = y
                    out.append(MemoryBound(counter.ops, counter.stream / TRACE_TOKENS, counter.inner / TRACE_TOKENS))
                except Exception:  # noqa: BLE001 - e.g. routing that reads token counts; estimate, do not fail
                    traced = _trace_on_cpu(model, block, x, counter)
                    if traced is None:
                        pairs = zip(out, blocks, strict=False)
                        layers = [m for m, b in pairs if len(b) == 1 and ".layers." in f".{b[0]}"]
                        traced = layers[-1] if layers else NO_MEMORY_BOUND
                    out.append(traced)
    finally:
        for h in handles:
            h.remove()
    _TRACES[key] = tuple(out)
    return _TRACES[key]


@attrs.frozen
class Layout:
    """What the terms read of a config: sizes, modes and the batch geometry."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    virtual: int
    zero: int
    microbatches: int
    tokens: float  # per micro-batch on one rank: micro_batch_size x sequence / cp
    sequence: int
    sequence_parallel: bool
    tp_async: bool
    cp_mode: str
    recompute: str | None
    dtype: str
    dtype_bytes: int
    grad_bytes: int
    states: int  # optimizer states per element
    load: float  # expert-load factor of the busiest rank


def layout_of(config: Config, registries: Registries, dtype: str, expert_load_factor: float) -> Layout:
    par, tok, opt = config.parallelism, config.tokens, config.optimizer
    sequence_parallel = False
    if par.tp > 1:
        sequence_parallel = bool(registries.tp_mode.get(par.tp_mode).factory().sequence_parallel)
    entry = registries.optimizer.get(opt.optimizer_factory.name)
    count = entry.extras.get("states_per_element")
    states = int(count(opt.optimizer_factory.args)) if count is not None else 2
    dtype_bytes = DTYPE_BYTES[dtype] if dtype in DTYPE_BYTES else 2
    return Layout(
        dp=par.dp,
        tp=par.tp,
        pp=par.pp,
        cp=par.context_parallel_size,
        ep=par.expert_parallel_size,
        virtual=par.pp_virtual_stages,
        zero=opt.zero_stage,
        microbatches=tok.batch_accumulation_per_replica,
        tokens=tok.micro_batch_size * tok.sequence_length / par.context_parallel_size,
        sequence=tok.sequence_length,
        sequence_parallel=sequence_parallel,
        tp_async=par.tp_linear_async_communication,
        cp_mode=par.context_parallel_mode,
        recompute=par.recompute,
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        grad_bytes=4 if opt.accumulate_grad_in_fp32 else dtype_bytes,
        states=states,
        # the busiest rank gets every routed token at most: a factor above ep (a busiest expert's
        # moe_max_load can reach E / top_k) means ep
        load=min(expert_load_factor, par.expert_parallel_size) if par.expert_parallel_size > 1 else expert_load_factor,
    )


# -- the terms -----------------------------------------------------------------------------------


def matmul_seconds(block: Block, lay: Layout, hw: Hardware) -> float:
    """Forward seconds of a block's matmuls on one micro-batch (backward: twice, half per split half)."""
    total = 0.0
    moe_tokens = lay.tokens / (lay.tp if lay.sequence_parallel else 1)
    for mm in block.matmuls:
        if mm.experts == 1:
            total += hw.matmul_seconds(2 * lay.tokens * mm.elements, lay.dtype)
            continue
        per_expert_tokens = moe_tokens * mm.active * lay.ep * lay.load  # what the busiest rank's experts get
        per_expert = 2 * per_expert_tokens * mm.elements / mm.experts
        total += (mm.experts / lay.ep) * hw.matmul_seconds(per_expert, lay.dtype)
    return total


def attention_seconds(block: Block, inv: Inventory, lay: Layout, hw: Hardware, backward: bool = False) -> float:
    """Seconds of a layer's attention core (4 x query width / tp x sequence x T FLOPs forward, causal
    half; backward twice that), at the description's attention efficiency (`Hardware.attention_seconds`)."""
    if not block.attention:
        return 0.0
    flops = 4 * inv.attention_query / lay.tp * lay.sequence * lay.tokens * CAUSAL
    return hw.attention_seconds(flops, lay.dtype, backward)


def memory_bound_seconds(block: Block, lay: Layout, hw: Hardware) -> float:
    """Forward seconds of a block's non-matmul ops on one micro-batch (backward: twice): each op's
    overhead, and T x (stream elements / (tp under sequence parallelism) + inner elements / tp) x
    dtype bytes at the memory bandwidth."""
    mb = block.memory
    elements = mb.stream / (lay.tp if lay.sequence_parallel else 1) + mb.inner / lay.tp
    return hw.memory_bound_seconds(mb.ops, lay.tokens * elements * lay.dtype_bytes)


def recompute_seconds(block: Block, inv: Inventory, lay: Layout, hw: Hardware) -> float:
    """What recompute adds to a block's backward: its forward (full) or its attention core's (selective)."""
    if lay.recompute == "full" and block.attention:
        return (
            matmul_seconds(block, lay, hw)
            + attention_seconds(block, inv, lay, hw)
            + memory_bound_seconds(block, lay, hw)
        )
    if lay.recompute == "selective":
        return attention_seconds(block, inv, lay, hw)
    return 0.0


def tensor_parallel_seconds(block: Block, inv: Inventory, lay: Layout, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) seconds of a block's TP collectives on one micro-batch: a decoder layer's
    attention and MLP each enter and leave the TP region once each way; the embedding leaves it
    forward (its backward enters: nothing under ALL_REDUCE), the head enters it (nothing forward under
    ALL_REDUCE) and its vocabulary-parallel loss all-reduces each token's largest logit, then its sum
    of exponentials and target logit (float32)."""
    if lay.tp <= 1:
        return 0.0, 0.0
    size = lay.tokens * inv.hidden * lay.dtype_bytes
    if lay.sequence_parallel:  # enter: all-gather forward, reduce-scatter backward; leave: the reverse
        gather = hw.collective_seconds("all_gather", size, lay.tp)
        scatter = hw.collective_seconds("reduce_scatter", size, lay.tp)
        enter, leave = (gather, scatter), (scatter, gather)
    else:  # enter: nothing forward, all-reduce backward; leave: the reverse
        reduce = hw.collective_seconds("all_reduce", size, lay.tp)
        enter, leave = (0.0, reduce), (reduce, 0.0)
    if block.role == "embedding":
        return leave
    if block.role == "head":
        loss = hw.collective_seconds("all_reduce", lay.tokens * 4, lay.tp) + hw.collective_seconds(
            "all_reduce", 2 * lay.tokens * 4, lay.tp
        )
        return enter[0] + loss, enter[1]
    count = 2 if block.attention else 1  # attention and MLP
    forward, backward = count * (enter[0] + leave[0]), count * (enter[1] + leave[1])
    if lay.tp_async and lay.sequence_parallel:  # the backward's all-gathers run beside the weight gradients
        backward -= count * gather * hw.compute_overlap
    return forward, backward


def context_parallel_seconds(block: Block, inv: Inventory, lay: Layout, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) exposed seconds of a layer's context-parallel exchange on one micro-batch."""
    if lay.cp <= 1 or not block.attention:
        return 0.0, 0.0
    b = lay.dtype_bytes
    q = lay.tokens * inv.attention_query / lay.tp * b
    kv = lay.tokens * inv.attention_key_value / lay.tp * b
    stride = lay.tp
    if lay.cp_mode == "all_to_all":
        kv_heads = max(1, round(inv.kv_heads / lay.tp)) if inv.kv_heads else lay.cp
        repeat = lay.cp // math.gcd(kv_heads, lay.cp)
        # queries, keys, values (each by itself) to heads-split, the output back; the same backward
        swapped = (q, repeat * kv / 2, repeat * kv / 2, q)
        swap = sum(hw.collective_seconds("all_to_all", x, lay.cp, stride) for x in swapped)
        # each swapped tensor is copied three times on the device: laid out for the swap, back from
        # it, and into sequence order (or out of it), each a read and a write
        copies = hw.memory_bound_seconds(0, 3 * 2 * sum(swapped))
        return swap + copies, swap + copies
    attention = attention_seconds(block, inv, lay, hw)
    attention_backward = attention_seconds(block, inv, lay, hw, backward=True)
    kv_grad = lay.tokens * inv.attention_key_value / lay.tp * 4  # float32 key/value gradients
    forward = (lay.cp - 1) * hw.collective_seconds("send", kv, 1, stride)
    # backward: the key/value blocks go round again, and each block's gradients travel with them, one
    # hop more (the last reaches the blocks' owner)
    backward = forward + lay.cp * hw.collective_seconds("send", kv_grad, 1, stride)
    hiding = hw.compute_overlap * attention  # the exchange runs beside this block pair's attention
    # each ring step's scores are written out (float32): the score matmul's output, scaling, the
    # mask, log-sum-exp and exponentials, merged into the output; backward recomputes them and forms
    # the score gradients. The diagonal block is T x T, each other one half of it.
    scores = inv.heads / lay.tp * lay.tokens**2 * (1 + (lay.cp - 1) / 2) * 4
    passes = (
        hw.memory_bound_seconds(0, RING_SCORE_PASSES[0] * scores),
        hw.memory_bound_seconds(0, RING_SCORE_PASSES[1] * scores),
    )
    # and its attention is plain matmuls block by block, not a fused kernel: two per block forward
    # (scores, output), five backward (scores again, the value, score, query and key gradients), at
    # a block's size (the diagonal block whole, masked; each other one half of it); what exceeds
    # the compute term's causal attention (its forward and backward at the attention efficiency) is the ring's
    diagonal = 2 * inv.attention_query / lay.tp * lay.tokens**2  # FLOPs of one matmul of the diagonal block
    blocks = hw.matmul_seconds(diagonal, lay.dtype) + (lay.cp - 1) * hw.matmul_seconds(diagonal / 2, lay.dtype)
    extra = max(0.0, 2 * blocks - attention), max(0.0, 5 * blocks - attention_backward)
    exchange = max(0.0, forward - hiding), max(0.0, backward - hw.compute_overlap * attention_backward)
    return passes[0] + extra[0] + exchange[0], passes[1] + extra[1] + exchange[1]


def expert_parallel_seconds(block: Block, inv: Inventory, lay: Layout, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) seconds of a MoE layer's dispatch and combine all-to-alls on one micro-batch."""
    if lay.ep <= 1 or not block.moe:
        return 0.0, 0.0
    tokens = lay.tokens / (lay.tp if lay.sequence_parallel else 1) * inv.top_k * lay.load
    size = tokens * inv.hidden * lay.dtype_bytes
    two = 2 * hw.collective_seconds("all_to_all", size, lay.ep, lay.tp)
    # the dispatch first swaps each expert's token count (int64), and the rows that arrive are
    # regrouped by expert and back (a read and a write each way)
    experts = max((mm.experts for mm in block.matmuls), default=1)
    counts = hw.collective_seconds("all_to_all", experts * 8, lay.ep, lay.tp)
    reorder = hw.memory_bound_seconds(0, 2 * 2 * size)
    return two + counts + reorder, two + reorder


def pipeline_p2p_seconds(inv: Inventory, lay: Layout, hw: Hardware) -> float:
    """Seconds of one activation (or gradient) message between neighbouring stages."""
    if lay.pp <= 1:
        return 0.0
    return hw.collective_seconds("send", lay.tokens * inv.hidden * lay.dtype_bytes, 1, lay.tp * lay.cp)


def _dp_stride(lay: Layout) -> int:
    """A stride that spans the dp x cp group's ranks (cp ranks tp apart, dp ranks tp x cp x pp apart)."""
    n = lay.dp * lay.cp
    span = (lay.cp - 1) * lay.tp + (lay.dp - 1) * lay.tp * lay.cp * lay.pp + 1
    return max(1, math.ceil((span - 1) / max(n - 1, 1)))


def data_parallel_seconds(
    params: int,
    expert_params: int,
    lay: Layout,
    hw: Hardware,
    last_backward: float,
    compute: float,
    bucket: float,
    blocks: int = 1,
    tensors: int = 1,
) -> tuple[float, str]:
    """Exposed seconds of the data-parallel traffic of a rank holding `params` dense and `expert_params`
    expert elements (before ep), and the detail."""
    dcp = lay.dp * lay.cp
    edp = max(1, dcp // lay.ep)
    stride = _dp_stride(lay)
    dense_grads = params * lay.grad_bytes
    expert_grads = expert_params / lay.ep * lay.grad_bytes
    reduce = "reduce_scatter" if lay.zero >= 2 else "all_reduce"
    grads = hw.collective_seconds(reduce, dense_grads, dcp, stride) + hw.collective_seconds(
        reduce, expert_grads, edp, stride
    )
    one_bucket = hw.collective_seconds(reduce, min(bucket, dense_grads), dcp, stride)
    exposed = max(one_bucket, grads - hw.compute_overlap * last_backward) if grads else 0.0
    param_bytes = (params + expert_params / lay.ep) * lay.dtype_bytes
    gather = hw.collective_seconds("all_gather", param_bytes, dcp, stride)
    if lay.zero in (1, 2):
        exposed += gather  # updated rows back to every replica, after the step
    if lay.zero == 3:
        # one all-gather per parameter tensor before each forward and each backward of its block,
        # prefetched beside the previous block's compute; each pass's first block waits for its own
        tensors = max(tensors, 1)
        one = hw.collective_seconds("all_gather", param_bytes / tensors, dcp, stride)
        first = math.ceil(tensors / max(blocks, 1)) * one
        whole = tensors * one
        exposed += max(2 * lay.microbatches * first, 2 * lay.microbatches * whole - hw.compute_overlap * compute)
    detail = f"{reduce} of {(dense_grads + expert_grads) / 2**20:.1f} MiB over {dcp} ranks; ZeRO {lay.zero}"
    return exposed, detail


def optimizer_seconds(params: int, expert_params: int, lay: Layout, hw: Hardware) -> float:
    """The optimizer step: parameter, gradient and states read and written once per updated element."""
    if hw.memory_bandwidth is None:
        return 0.0
    dcp = lay.dp * lay.cp
    edp = max(1, dcp // lay.ep)
    sharded = lay.zero >= 1
    updated = params / (dcp if sharded else 1) + expert_params / lay.ep / (edp if sharded else 1)
    per_element = 2 * lay.dtype_bytes + lay.grad_bytes + 2 * 4 * lay.states + (8 if lay.dtype_bytes != 4 else 0)
    return updated * per_element / hw.memory_bandwidth


_FLOPS: dict[tuple[str, int], float] = {}


_MAKESPANS: dict[tuple[object, ...], float] = {}
_PREPARED: dict[tuple[str, int, int, int], PreparedSchedule] = {}  # (pp_engine, pp, microbatches, chunks)


def _flops_per_token(config: Config, registries: Registries, sequence: int) -> float:
    """The model's own FLOPs per token (no recompute), remembered per model config and sequence."""
    key = (model_key(config.model), sequence)
    if key not in _FLOPS:
        with torch.device("meta"):
            whole = registries.model.get(config.model.model_type).factory(
                config.model, vocab_multiple=config.model.make_vocab_size_divisible_by
            )
        _FLOPS[key] = float(whole.flops_per_token(sequence))
    return _FLOPS[key]


_BLOCK_COSTS: dict[tuple[object, ...], tuple[Inventory, Hardware, dict[str, float]]] = {}


def _block_costs(blk: Block, inv: Inventory, lay: Layout, hw: Hardware) -> dict[str, float]:
    """One block's per-micro-batch terms. They depend on the layout only through the fields in the
    key (not dp, pp, ZeRO, the schedule or the micro-batch count), so a search's layouts share them."""
    key = (blk, id(inv), id(hw), *_costs_key(lay))
    cached = _BLOCK_COSTS.get(key)
    if cached is not None and cached[0] is inv and cached[1] is hw:
        return cached[2]
    tpf, tpb = tensor_parallel_seconds(blk, inv, lay, hw)
    cpf, cpb = context_parallel_seconds(blk, inv, lay, hw)
    epf, epb = expert_parallel_seconds(blk, inv, lay, hw)
    costs = {
        "mm": matmul_seconds(blk, lay, hw),
        "att": attention_seconds(blk, inv, lay, hw),
        "attb": attention_seconds(blk, inv, lay, hw, backward=True),
        "mem": memory_bound_seconds(blk, lay, hw),
        "rec": recompute_seconds(blk, inv, lay, hw),
        **{"tpf": tpf, "tpb": tpb, "cpf": cpf, "cpb": cpb, "epf": epf, "epb": epb},
    }
    if len(_BLOCK_COSTS) > 65536:
        _BLOCK_COSTS.clear()
    _BLOCK_COSTS[key] = (inv, hw, costs)
    return costs


_STAGES: dict[tuple[object, ...], tuple[Inventory, Hardware, list[dict[str, float]], tuple]] = {}


def _costs_key(lay: Layout) -> tuple[object, ...]:
    """The layout fields a block's terms depend on (`_block_costs`)."""
    return (lay.tp, lay.cp, lay.ep, lay.load, lay.tokens, lay.sequence, lay.sequence_parallel, lay.tp_async) + (
        lay.cp_mode,
        lay.recompute,
        lay.dtype,
        lay.dtype_bytes,
    )


def _split_terms(c: dict[str, float], messages: float = 0.0) -> dict[str, float]:
    """F, B, I and W from a block's (or a stage's summed) terms: F is the matmuls, attention core,
    non-matmul work and forward collectives; I the input gradient (the matmuls again, twice the
    rest, recompute, backward collectives); W the weight gradients (the matmuls once more); B = I + W.
    `messages`: a stage's pipeline message each way."""
    forward = c["mm"] + c["att"] + c["mem"] + c["tpf"] + c["cpf"] + c["epf"] + messages
    inputs = c["mm"] + c["attb"] + 2 * c["mem"] + c["rec"] + c["tpb"] + c["cpb"] + c["epb"] + messages
    return {"F": forward, "B": inputs + c["mm"], "I": inputs, "W": c["mm"]}


def _dtype(config: Config, hardware: Hardware, device: str) -> str:
    """The dtype the prediction computes in (float32 as tf32 where the hardware lists only that);
    a clear error when the description lacks it."""
    dtype = resolve_dtype_name(config.model.dtype, device)
    if dtype == "float32" and "float32" not in hardware.peak_flops and "tf32" in hardware.peak_flops:
        dtype = "tf32"
    hardware.peak(dtype)
    return dtype


def _stage_terms(inv: Inventory, lay: Layout, hw: Hardware, p2p: float) -> list[dict[str, float]]:
    """Each stage's terms per micro-batch (a rank's chunks differ: the first stage embeds, the last
    computes the loss): the blocks' sums, and F, B and its split halves I and W."""
    costs: dict[Block, dict[str, float]] = {}
    per_stage = []
    for chunk in partition_indices(len(inv.blocks), lay.pp * lay.virtual):
        blocks = [inv.blocks[b] for b in chunk]
        sums = dict.fromkeys(("mm", "att", "attb", "mem", "rec", "tpf", "tpb", "cpf", "cpb", "epf", "epb"), 0.0)
        params = expert_params = tensors = 0
        for blk in blocks:
            if blk not in costs:  # decoder layers are alike: each distinct block costed once
                costs[blk] = _block_costs(blk, inv, lay, hw)
            for key, value in costs[blk].items():
                sums[key] += value
            params += blk.params
            expert_params += blk.expert_params
            tensors += blk.tensors
        per_stage.append(
            {
                **sums,
                **_split_terms(sums, p2p),
                "params": params,
                "expert_params": expert_params,
                "blocks": len(blocks),
                "tensors": tensors,
                "ops": sum(b.memory.ops for b in blocks),
                "p2p": 2 * p2p,
            }
        )
    return per_stage


def block_seconds(
    config: Config, registries: Registries, hardware: Hardware, device: str = "cuda"
) -> list[dict[str, float]]:
    """Each pipeline block's predicted F, B, I and W seconds on one micro-batch (`_split_terms`), at
    the config's tp, cp and ep (what `nanocore pipeline-probe --hardware` prints beside its
    measurements), with the terms they sum."""
    lay = layout_of(config, registries, _dtype(config, hardware, device), 1.0)
    inv = inventory(config, registries, lay.tp)
    out = []
    for blk in inv.blocks:
        c = _block_costs(blk, inv, lay, hardware)
        out.append({**_split_terms(c), **c})
    return out


# -- the step ------------------------------------------------------------------------------------


def predict(
    config: Config,
    registries: Registries,
    hardware: Hardware,
    device: str = "cuda",
    expert_load_factor: float = 1.0,
) -> TimePrediction:
    """The predicted step of `config` on `hardware` (see the module docstring)."""
    return _predict(config, registries, hardware, device, expert_load_factor, pipeline=True)


def predict_bound(
    config: Config,
    registries: Registries,
    hardware: Hardware,
    device: str = "cuda",
    expert_load_factor: float = 1.0,
) -> TimePrediction:
    """`predict` without simulating the pipeline: its bubble term is 0, every other term the same, so
    its step is never longer than `predict`'s (equal where pp is 1). `plan --search` ranks layouts by
    it and simulates only those that could still make the top."""
    return _predict(config, registries, hardware, device, expert_load_factor, pipeline=False)


def _predict(
    config: Config,
    registries: Registries,
    hardware: Hardware,
    device: str,
    expert_load_factor: float,
    pipeline: bool,
) -> TimePrediction:
    dtype = _dtype(config, hardware, device)
    lay = layout_of(config, registries, dtype, expert_load_factor)
    inv = inventory(config, registries, lay.tp)
    schedule = registries.pipeline_schedule.get(config.parallelism.pp_engine).factory(config)
    p2p = pipeline_p2p_seconds(inv, lay, hw := hardware)
    # what the stages and ranks compute depends on the blocks' terms, the cut and the placement only:
    # layouts differing in dp, ZeRO or the micro-batch count share them
    stage_key = (_costs_key(lay), id(inv), id(hw), lay.pp, lay.virtual, p2p, config.parallelism.pp_engine)
    cached = _STAGES.get(stage_key)
    if cached is None or cached[0] is not inv or cached[1] is not hw:
        if len(_STAGES) > 16384:
            _STAGES.clear()
        per_stage = _stage_terms(inv, lay, hw, p2p)
        per_rank = []
        for rank in range(lay.pp):
            ids = [stage_of(schedule, c, rank, lay.pp, lay.virtual) for c in range(lay.virtual)]
            per_rank.append({k: sum(per_stage[i][k] for i in ids) for k in per_stage[0]})
        times = tuple(tuple(st[k] for st in per_stage) for k in ("F", "B", "I", "W"))  # one per stage
        cached = _STAGES[stage_key] = (inv, hw, per_rank, times)
    per_rank, times = cached[2], cached[3]
    m = lay.microbatches
    key = (config.parallelism.pp_engine, lay.pp, m, lay.virtual, times)
    # layouts differing in what the pipeline does not see (ZeRO, cp mode) share a makespan
    if pipeline and key not in _MAKESPANS:
        if len(_MAKESPANS) > 4096:
            _MAKESPANS.clear()
        shape = (config.parallelism.pp_engine, lay.pp, m, lay.virtual)
        if shape not in _PREPARED:  # checked and compiled once per schedule and shape
            if len(_PREPARED) > 1024:
                _PREPARED.clear()
            _PREPARED[shape] = prepare(schedule, lay.pp, m, lay.virtual)
        _MAKESPANS[key] = simulated_makespan(
            _PREPARED[shape],
            t_forward=times[0],
            t_backward=times[1],
            t_input=times[2],
            t_weight=times[3],
            first_stage_whole=True,  # the executor runs the first stage's backward whole, in W
        )
    busy = [m * (r["F"] + r["B"]) for r in per_rank]
    critical = max(range(lay.pp), key=lambda i: busy[i])
    r = per_rank[critical]
    bucket = config.model.ddp_bucket_cap_mb * 2**20
    dp_times: dict[tuple[float, ...], tuple[float, str]] = {}  # ranks alike (middle stages) costed once
    opts: dict[tuple[float, float], float] = {}
    for i, x in enumerate(per_rank):
        args = (x["params"], x["expert_params"], x["B"], busy[i], x["blocks"], x["tensors"])
        if args not in dp_times:
            dp_times[args] = data_parallel_seconds(
                int(x["params"]),
                int(x["expert_params"]),
                lay,
                hw,
                x["B"],
                busy[i],
                bucket,
                int(x["blocks"]),
                int(x["tensors"]),
            )
        if args[:2] not in opts:
            opts[args[:2]] = optimizer_seconds(int(x["params"]), int(x["expert_params"]), lay, hw)
    dp_exposed, dp_detail = max(dp_times.values(), key=lambda t: t[0])
    opt = max(opts.values())
    bubble = max(0.0, _MAKESPANS[key] - busy[critical]) if pipeline else 0.0
    where = f"{m} micro-batches of {lay.tokens:g} tokens on stage rank {critical}"
    schedule_name = f"{config.parallelism.pp_engine}, {m} micro-batches, {lay.virtual} virtual stage(s)"
    terms = [
        TimeTerm("compute", m * (3 * r["mm"] + r["att"] + r["attb"]), where),
        TimeTerm("memory_bound", m * 3 * r["mem"], f"{int(r['ops'])} non-matmul ops per micro-batch forward"),
        TimeTerm("recompute", m * r["rec"], f"recompute {lay.recompute or 'off'}"),
        TimeTerm("tensor_parallel", m * (r["tpf"] + r["tpb"]), f"tp {lay.tp}, {config.parallelism.tp_mode}"),
        TimeTerm("context_parallel", m * (r["cpf"] + r["cpb"]), f"cp {lay.cp} {lay.cp_mode} (exposed)"),
        TimeTerm("expert_parallel", m * (r["epf"] + r["epb"]), f"ep {lay.ep}, load factor {lay.load:g}"),
        TimeTerm("pipeline_p2p", m * r["p2p"], f"pp {lay.pp}"),
        TimeTerm("pipeline_bubble", bubble, schedule_name),
        TimeTerm("data_parallel", dp_exposed, dp_detail + " (exposed)"),
        TimeTerm("optimizer", opt, f"{lay.states} states per element"),
    ]
    step = sum(t.seconds for t in terms)
    world = lay.dp * lay.tp * lay.pp * lay.cp
    global_tokens = lay.dp * config.tokens.micro_batch_size * m * lay.sequence
    flops = _flops_per_token(config, registries, lay.sequence) * global_tokens
    return TimePrediction(
        hardware=hardware.name,
        dtype=dtype,
        step_seconds=step,
        tokens_per_sec_per_device=global_tokens / step / world if step > 0 else 0.0,
        mfu=flops / (step * world * hardware.peak(dtype)) if step > 0 else 0.0,
        terms=terms,
        dominant=max(terms, key=lambda t: t.seconds).name,
    )
