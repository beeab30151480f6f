"""From a single-device model plugin to this rank's part of the model.

Order (fixed, like torchtitan's): build on meta (`meta_model`) -> tensor parallel (the engine
applies the model's TP plan, `tensor_parallel.parallelize`) -> `build_local_model`: expert parallel
(keep this rank's experts of each MoE layer) -> pipeline cut (keep this rank's chunks) ->
materialise (each parameter initialised as the *full* tensor from a generator seeded by (seed,
name), then sliced by its Placement; a large tensor in blocks of rows, only those a rank holds,
where the model allows it) -> re-tie.

The vocabulary is padded for this layout (`vocab_multiple`); the placements of the parameters the
model declares in `vocab_parameters` say which rows are real, so checkpoints hold only those.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from nanocore.model_api import check_model, tie_parameters, valid_rows
from nanocore.moe_api import moe_layers
from nanocore.pipeline_api import stage_of
from nanocore.registry import Entry
from nanocore.sharding import Placement, get_placement, set_placement

from .expert_parallel import shard_experts
from .pruned import PrunedBlock


@attrs.define
class LocalModel:
    """This rank's model: the (pruned) module, its chunks of blocks, and parameter bookkeeping."""

    module: nn.Module
    chunks: list[list[list[str]]]  # local chunk c -> blocks -> module names
    chunk_ids: list[int]  # virtual stage of each local chunk
    num_virtual_stages: int
    true_vocab_size: int
    vocab_size: int
    canonical: dict[str, str]  # local parameter name -> name used for init and checkpoints
    replica_of_tied: set[str]  # local names that are copies of a tied parameter owned by another stage
    moe_layers: list[str] = attrs.field(factory=list)  # every MoE layer of the whole model, local or not
    moe_experts: int = 0  # the most experts of any MoE layer (the width of the routing statistics)


# Parameters larger than this (elements) are initialised in blocks of rows of about this size, where
# the model allows it (`init_by_row_blocks`): see `_initial_values`.
INIT_BLOCK_ELEMENTS = 2**22


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def partition(blocks: list[list[str]], parts: int) -> list[list[list[str]]]:
    """Cut blocks into `parts` contiguous non-empty chunks, minimising the largest chunk's cost.

    Decoder layers cost 1; the first and last blocks (embedding, head) cost 1/2 each.
    """
    return [[blocks[i] for i in chunk] for chunk in partition_indices(len(blocks), parts)]


@functools.lru_cache(maxsize=256)
def partition_indices(num_blocks: int, parts: int) -> list[list[int]]:
    """`partition` of `num_blocks` blocks by index: the block indices of each chunk (the time model
    and the pipeline probe cut as a run does; remembered, the memory planner cuts once per rank)."""
    n = num_blocks
    if n < parts:
        raise ValueError(f"{n} pipeline blocks cannot fill {parts} chunks")
    cost = [1.0] * n
    if n > 2:
        cost[0] = cost[-1] = 0.5
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest possible largest-chunk cost when the first i blocks form k chunks
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-9:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return [list(range(a, b)) for a, b in reversed(bounds)]


_MODEL_KEYS: dict[int, tuple[object, str]] = {}


def model_key(model_args: object) -> str:
    """`repr(model_args)`, remembered per object: a search's layouts share one model section, and its
    repr costs more than the rest of a cache lookup."""
    cached = _MODEL_KEYS.get(id(model_args))
    if cached is not None and cached[0] is model_args:
        return cached[1]
    if len(_MODEL_KEYS) > 256:
        _MODEL_KEYS.clear()
    text = repr(model_args)
    _MODEL_KEYS[id(model_args)] = (model_args, text)
    return text


def meta_model(entry: Entry, model_args: Any, vocab_multiple: int) -> nn.Module:
    """The model plugin's whole single-device model on the meta device (no memory), checked."""
    with torch.device("meta"):
        model = entry.factory(model_args, vocab_multiple=vocab_multiple)
    check_model(model, entry.name)
    return model


def build_local_model(
    model: nn.Module,
    *,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    pp_size: int,
    pp_rank: int,
    virtual_stages: int,
    ep_size: int = 1,
    ep_rank: int = 0,
    rows_of: Callable[[nn.Parameter], tuple[int, int] | None] | None = None,
    placement: object = None,
) -> LocalModel:
    """This rank's part of `model` (a `meta_model`, tensor-parallel layers already swapped in).

    `rows_of(param)` -> (start, length), for ZeRO-3: materialise only those rows of the parameter
    (its shape when whole is kept in `param.zero3_shape`, the rows in `param.zero3_rows`).
    `placement`: the schedule, whose `stage_of` places chunks (`nanocore.pipeline_api.stage_of`)."""
    tied = list(getattr(model, "tied_parameters", []))
    all_moe_layers = moe_layers(model)
    most_experts = max((int(model.get_submodule(n).num_experts) for n in all_moe_layers), default=0)
    chunks, chunk_ids = keep_rank_part(model, pp_size, pp_rank, virtual_stages, ep_size, ep_rank, placement)

    # Canonical names: a tied parameter is initialised and saved under its first name everywhere.
    local = dict(model.named_parameters(remove_duplicate=False))
    canonical = {name: name for name in local}
    replica_of_tied: set[str] = set()
    for first, second in tied:
        if second in local:
            canonical[second] = first
            if first not in local:
                replica_of_tied.add(second)

    placements = {
        name: _mark_vocab_rows(model, name, get_placement(p))
        for name, p in model.named_parameters(remove_duplicate=False)
    }
    extras = {name: {k: v for k, v in vars(p).items()} for name, p in model.named_parameters(remove_duplicate=False)}
    nn.Module.to_empty(model, device=device)  # not a model override: the engine re-ties below
    tie_parameters(model, [(first, second) for first, second in tied if first in local and second in local])
    _materialise(model, model, seed, placements, extras, canonical, dtype, rows_of)
    return LocalModel(
        module=model,
        chunks=chunks,
        chunk_ids=chunk_ids,
        num_virtual_stages=pp_size * virtual_stages,
        true_vocab_size=int(getattr(model, "true_vocab_size", model.vocab_size)),
        vocab_size=int(model.vocab_size),
        canonical=canonical,
        replica_of_tied=replica_of_tied,
        moe_layers=all_moe_layers,
        moe_experts=most_experts,
    )


def keep_rank_part(
    model: nn.Module,
    pp_size: int,
    pp_rank: int,
    virtual_stages: int,
    ep_size: int,
    ep_rank: int,
    placement: object = None,
) -> tuple[list[list[list[str]]], list[int]]:
    """Prune `model` (on meta) in place to this rank's experts and pipeline chunks; returns the local
    chunks (blocks of module names) and their virtual stage numbers. Also used by the memory planner."""
    shard_experts(model, ep_size, ep_rank)
    all_chunks, chunk_ids = rank_chunks(model, pp_size, pp_rank, virtual_stages, placement)
    chunks = [all_chunks[i] for i in chunk_ids]
    for name in pruned_names(all_chunks, chunk_ids):
        model.set_submodule(name, PrunedBlock())
    return chunks, chunk_ids


def rank_chunks(
    model: nn.Module, pp_size: int, pp_rank: int, virtual_stages: int, placement: object = None
) -> tuple[list[list[list[str]]], list[int]]:
    """Every pipeline chunk of `model` (blocks of module names, `pp_size` x `virtual_stages` of them)
    and the numbers of the ones pipeline rank `pp_rank` holds, in its virtual-stage order (the
    schedule `placement` places them: `nanocore.pipeline_api.stage_of`)."""
    all_chunks = partition(model.pipeline_blocks(), pp_size * virtual_stages)
    chunk_ids = [stage_of(placement, c, pp_rank, pp_size, virtual_stages) for c in range(virtual_stages)]
    return all_chunks, chunk_ids


def pruned_names(all_chunks: list[list[list[str]]], chunk_ids: list[int]) -> list[str]:
    """The module names of the blocks in chunks other than `chunk_ids`: what a rank prunes away."""
    keep = {name for i in chunk_ids for block in all_chunks[i] for name in block}
    return [name for chunk in all_chunks for block in chunk for name in block if name not in keep]


def _mark_vocab_rows(model: nn.Module, name: str, placement: Placement) -> Placement:
    """Mark the vocabulary padding of a parameter the model declares in `vocab_parameters`: rows past
    the true vocabulary exist for this layout only and are never saved (see nanocore.sharding)."""
    rows = valid_rows(model, name)
    return placement if rows is None else attrs.evolve(placement, valid_rows=rows)


@torch.no_grad()
def _materialise(
    model: nn.Module,
    root: nn.Module,
    seed: int,
    placements: dict[str, Placement],
    extras: dict[str, dict],
    canonical: dict[str, str],
    dtype: torch.dtype,
    rows_of: Callable[[nn.Parameter], tuple[int, int] | None] | None = None,
) -> None:
    for name, param in model.named_parameters(remove_duplicate=False):
        for key, value in extras.get(name, {}).items():
            setattr(param, key, value)  # attributes set by parallelisation (placements, grad groups)
        set_placement(param, placements[name])
    by_rows = bool(getattr(root, "init_by_row_blocks", False))
    for name, param in model.named_parameters():
        placement, shape = placements[name], tuple(param.shape)
        rows = rows_of(param) if rows_of is not None and shape else None
        if rows is not None:  # ZeRO-3: only this rank's rows of the parameter ever exist here
            param.zero3_shape, param.zero3_rows = shape, rows
            placement, shape = placement.narrow(0, rows[0], rows[1], shape)
        piece = _initial_values(root, canonical[name], placement, shape, seed, by_rows)
        param.data = piece.to(device=param.device, dtype=dtype).contiguous()


def _initial_values(
    root: nn.Module, name: str, placement: Placement, local_shape: tuple[int, ...], seed: int, by_rows: bool
) -> torch.Tensor:
    """This rank's piece of parameter `name`'s initial values, in float32, the same at every layout.

    A tensor of up to INIT_BLOCK_ELEMENTS is filled whole from one generator seeded by (seed, name).
    A larger one, where the model fills any block of rows alike (`init_by_row_blocks`), is filled in
    blocks of rows of that size, block b from a generator seeded by (seed, name, b): a rank fills only
    the blocks its rows overlap and never holds more than one block besides its piece.
    """
    full_shape = placement.full_shape
    per_row = math.prod(full_shape[1:]) if full_shape else 1
    seed_of_name = param_seed(seed, name)
    if not by_rows or not full_shape or full_shape[0] * per_row <= INIT_BLOCK_ELEMENTS:
        full = torch.empty(full_shape, dtype=torch.float32)
        root.init_parameter(name, full, torch.Generator().manual_seed(seed_of_name))
        piece = full[placement.slices(local_shape)]
        # a row slice is a contiguous view of `full`: copy it, or the rank would keep the whole tensor alive
        return piece.clone() if piece.numel() != full.numel() else piece
    index = placement.slices(local_shape)
    first, last = index[0].start, index[0].stop
    block = max(1, INIT_BLOCK_ELEMENTS // per_row)
    out = torch.empty(local_shape, dtype=torch.float32)
    for b in range(first // block, -(-last // block)):
        start, stop = b * block, min(full_shape[0], (b + 1) * block)
        values = torch.empty((stop - start, *full_shape[1:]), dtype=torch.float32)
        root.init_parameter(name, values, torch.Generator().manual_seed(param_seed(seed_of_name, f"rows {b}")))
        lo, hi = max(first, start), min(last, stop)
        out[lo - first : hi - first] = values[(slice(lo - start, hi - start), *index[1:])]
    return out


def initialise_whole(model: nn.Module, seed: int) -> None:
    """Give a whole, unparallelised model (on CPU) the starting weights every layout of a run with
    `seed` starts from: what a baseline outside the engine needs to train the same computation."""
    by_rows = bool(getattr(model, "init_by_row_blocks", False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            param.copy_(_initial_values(model, name, Placement.whole(shape), shape, seed, by_rows))


def chunk_modules(local: LocalModel) -> list[list[list[nn.Module]]]:
    """The modules of each block of each local chunk, in order."""
    module = local.module
    return [[[module.get_submodule(n) for n in block] for block in chunk] for chunk in local.chunks]


def chunk_parameters(local: LocalModel) -> list[list[nn.Parameter]]:
    """The trainable parameters of each local chunk, each in the first chunk that uses it (a
    parameter with requires_grad=False, like a router's balancing bias, is saved, never trained)."""
    params = {n: p for n, p in local.module.named_parameters() if p.requires_grad}
    out: list[list[nn.Parameter]] = []
    seen: set[int] = set()
    for chunk in local.chunks:
        names = {n for block in chunk for n in block}
        ps = []
        for name, p in params.items():
            if id(p) not in seen and any(name == m or name.startswith(m + ".") for m in names):
                ps.append(p)
                seen.add(id(p))
        out.append(ps)
    return out


def tied_across_stages(model: nn.Module, pp_size: int) -> list[nn.Parameter]:
    """Local parameters that are one side of a tied pair split across the first and last stage."""
    out: list[nn.Parameter] = []
    if pp_size == 1:
        return out
    names = dict(model.named_parameters(remove_duplicate=False))
    for first, second in getattr(model, "tied_parameters", []):
        if (first in names) != (second in names):
            out.append(names.get(first, names.get(second)))
    return out
