"""Tensor-parallel layers and `parallelize`, which swaps a single-device model's layers for them.

The model declares a TP plan (`nanocore.model_api`); `parallelize` replaces each matched
`nn.Linear` / `nn.Embedding` in place, keeping the attribute names `weight` / `bias` so parameter
names stay those of the single-device model, and marks each new parameter with its `Placement`.
The layers hold weights only; how activations travel (ALL_REDUCE or REDUCE_SCATTER) is the TP
mode's business (`nanocore.tp_api.TPMode`, implemented by TP-mode plugins), so a new mode needs no new layers.

After every backward, `tp_grad_sync(model, group)` adds up the gradients that TP leaves partial.
The loss is computed from vocab-sharded logits by `loss.vocab_parallel_cross_entropy`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanocore.errors import ConfigError, PluginError
from nanocore.sharding import Placement, set_placement
from nanocore.tp_api import Group, LinearFunction, TPMode

from .pruned import PrunedBlock

STYLES = ("colwise", "rowwise", "colwise_kv", "colwise_local", "vocab_embedding", "lm_head", "head_norm")
# `head_norm` modules (qk-norm: one weight applied to every head) stay whole, but each rank's heads
# give only their share of its gradient: `tp_grad_sync` sums them in every TP mode. Recorded here, on
# the module, by `parallelize` and read by `tp_grad_sync` (both of this file).
_HEAD_NORM = "_tp_head_norm"

# A TP layer's forward runs its mode's collectives; inside a compiled block (`model.compile`) it runs
# eagerly and the compiled graph resumes after it, so no compiled graph holds a process group.
_eager_in_compiled_blocks = torch.compiler.disable


class PlannedGroup:
    """Stands for a TP group of `size` ranks seen from `rank` where no process group exists: the memory
    planner parallelises a meta model with it to read each rank's parameter shapes (nothing runs)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


def _size_rank(group: Group) -> tuple[int, int]:
    if isinstance(group, PlannedGroup):
        return group.size, group.rank
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _param(source: torch.Tensor, index: tuple, placement: Placement) -> nn.Parameter:
    """A new parameter holding `source[index]` (works on meta: nothing is allocated there)."""
    param = nn.Parameter(source.detach()[index].clone(), requires_grad=source.requires_grad)
    set_placement(param, placement)
    return param


def _split(size: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if size % tp:
        raise ConfigError(f"parallelism.tp: {what} has size {size}, which tp={tp} does not divide; pick a tp that does")
    return rank * (size // tp), size // tp


class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are split over the TP ranks.

    Used where the following computation is independent per output feature (attention heads, MLP
    hidden units), so no communication is needed until a `RowParallelLinear` joins them. The input
    arrives as the mode keeps activations (replicated, or sequence-sharded for REDUCE_SCATTER) and
    the output is this rank's feature slice for the whole sequence.

    `replicas > 1` means several TP ranks hold this same slice (key/value heads fewer than tp);
    each then sees only its own query heads' share of the gradient, which `tp_grad_sync` sums.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        *,
        full_out_features: int,
        out_start: int,
        group: Group,
        tp_mode: TPMode,
        async_communication: bool = False,
        replicas: int = 1,
    ):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self.full_out_features, self.out_start, self.replicas = full_out_features, out_start, replicas
        self.group, self.tp_mode, self.async_communication = group, tp_mode, async_communication
        self.linear: LinearFunction | None = None  # set by `float8.apply_float8`: FP8 matmuls

    @classmethod
    def from_linear(cls, linear: nn.Linear, out_start: int, out_len: int, *, weight=None, **kwargs):
        """Cut rows [out_start, out_start + out_len) of `linear` (pass `weight` to share a tied one)."""
        full = (linear.out_features, linear.in_features)
        rows = (slice(out_start, out_start + out_len),)
        if weight is None:
            weight = _param(linear.weight, rows, Placement(full, (out_start, 0)))
        bias = None if linear.bias is None else _param(linear.bias, rows, Placement((full[0],), (out_start,)))
        return cls(weight, bias, full_out_features=full[0], out_start=out_start, **kwargs)

    @_eager_in_compiled_blocks
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:  # an FP8 recipe's matmuls (model.float8_recipe)
            return self.tp_mode.column_linear(x, self.weight, self.bias, self.group, linear=self.linear)
        return self.tp_mode.column_linear(x, self.weight, self.bias, self.group, self.async_communication)

    def extra_repr(self) -> str:
        rows = f"{self.out_start}:{self.out_start + self.out_features} of {self.full_out_features}"
        return f"in={self.in_features}, out rows {rows}, replicas={self.replicas}, mode={self.tp_mode!r}"


class VocabParallelLMHead(ColumnParallelLinear):
    """The output projection split over vocabulary rows. Its logits stay vocab-sharded
    ([b, s, vocab/tp]) into `vocab_parallel_cross_entropy`: the full logits are the largest
    activation of a small model and are never gathered in training."""

    @property
    def vocab_start(self) -> int:
        return self.out_start


class LocalColumnLinear(ColumnParallelLinear):
    """`colwise_local`: output features split like `ColumnParallelLinear`, but the input is already
    what every rank needs (the whole sequence, computed on each rank by a replicated column layer, e.g.
    MLA's latent), so nothing moves: each rank multiplies by its rows. The gradient of the input is
    this rank's heads' share, which the replicated layer upstream sums over TP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear if self.linear is not None else F.linear
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split over the TP ranks.

    It consumes a `ColumnParallelLinear`'s sharded output directly; each rank's product is a partial
    sum that the mode combines (all-reduce, or reduce-scatter along the sequence). The bias is
    replicated and added once, after that reduction, so it is not counted tp times.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        *,
        full_in_features: int,
        in_start: int,
        group: Group,
        tp_mode: TPMode,
        async_communication: bool = False,
    ):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self.full_in_features, self.in_start = full_in_features, in_start
        self.group, self.tp_mode, self.async_communication = group, tp_mode, async_communication
        self.linear: LinearFunction | None = None  # set by `float8.apply_float8`: FP8 matmuls

    @classmethod
    def from_linear(cls, linear: nn.Linear, in_start: int, in_len: int, **kwargs):
        full = (linear.out_features, linear.in_features)
        weight = _param(
            linear.weight, (slice(None), slice(in_start, in_start + in_len)), Placement(full, (0, in_start))
        )
        bias = None if linear.bias is None else _param(linear.bias, (slice(None),), Placement.whole((full[0],)))
        return cls(weight, bias, full_in_features=full[1], in_start=in_start, **kwargs)

    @_eager_in_compiled_blocks
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:
            return self.tp_mode.row_linear(x, self.weight, self.bias, self.group, linear=self.linear)
        return self.tp_mode.row_linear(x, self.weight, self.bias, self.group, self.async_communication)

    def extra_repr(self) -> str:
        cols = f"{self.in_start}:{self.in_start + self.in_features} of {self.full_in_features}"
        return f"in cols {cols}, out={self.out_features}, mode={self.tp_mode!r}"


class VocabParallelEmbedding(nn.Module):
    """An embedding table split over vocabulary rows, the largest matrix of a small model.

    Each rank looks up the tokens that fall in its rows and contributes zeros for the rest; the mode
    sums the partial results (all-reduce, or reduce-scatter along the sequence for REDUCE_SCATTER).
    """

    def __init__(
        self,
        weight: nn.Parameter,
        *,
        full_num_embeddings: int,
        vocab_start: int,
        group: Group,
        tp_mode: TPMode,
        padding_idx: int | None = None,
    ):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self.full_num_embeddings, self.vocab_start = full_num_embeddings, vocab_start
        self.group, self.tp_mode = group, tp_mode
        # Only the rank holding the padding row keeps F.embedding's "no gradient for padding".
        local = None if padding_idx is None else padding_idx - vocab_start
        self.padding_idx = local if local is not None and 0 <= local < self.num_embeddings else None

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, start: int, length: int, *, weight=None, **kwargs):
        full = tuple(embedding.weight.shape)
        if weight is None:
            weight = _param(embedding.weight, (slice(start, start + length),), Placement(full, (start, 0)))
        return cls(weight, full_num_embeddings=full[0], vocab_start=start, padding_idx=embedding.padding_idx, **kwargs)

    @_eager_in_compiled_blocks
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.num_embeddings == self.full_num_embeddings:
            return self.tp_mode.after_embedding(F.embedding(input_ids, self.weight, self.padding_idx), self.group)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_start + self.num_embeddings)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp_mode.after_embedding(partial, self.group)

    def extra_repr(self) -> str:
        rows = f"{self.vocab_start}:{self.vocab_start + self.num_embeddings} of {self.full_num_embeddings}"
        return f"rows {rows}, dim={self.embedding_dim}, mode={self.tp_mode!r}"


TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def _style_of(name: str, tp_plan: dict[str, Any]) -> tuple[str, dict] | None:
    for pattern, spec in tp_plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            style, options = (spec, {}) if isinstance(spec, str) else (spec.get("style"), spec)
            if style not in STYLES:
                raise PluginError(f"tp_plan[{pattern!r}]: unknown style {style!r}; styles: {', '.join(STYLES)}")
            return style, options
    return None


def _kv_rows(linear: nn.Linear, options: dict, tp: int, rank: int, name: str) -> tuple[int, int, int]:
    """(start, length, replicas) of the key/value rows this rank needs.

    Query heads are split contiguously, so with kv_heads < tp the ranks r with the same
    r // (tp // kv_heads) hold query heads of one GQA group and share that group's kv head.
    """
    head_dim = options.get("head_dim")
    if not isinstance(head_dim, int) or head_dim < 1 or linear.out_features % head_dim:
        raise PluginError(
            f"tp_plan: colwise_kv for {name!r} needs an integer 'head_dim' dividing {linear.out_features}"
        )
    heads = linear.out_features // head_dim
    if heads >= tp:
        start, length = _split(heads, tp, rank, f"{name} (key/value heads)")
        return start * head_dim, length * head_dim, 1
    if tp % heads:
        raise ConfigError(
            f"parallelism.tp: {name} has {heads} key/value heads; tp={tp} must be a multiple of it (or divide it)"
        )
    replicas = tp // heads
    return (rank // replicas) * head_dim, head_dim, replicas


def _rank_rows(module: nn.Module, style: str, options: dict, tp: int, rank: int, name: str) -> tuple[int, int, int]:
    """(start, length, replicas) of the rows of `module` that TP rank `rank` of `tp` holds under `style`
    (the rows of its weight it keeps: input features for rowwise, vocabulary entries for an
    embedding, output features otherwise), and how many ranks hold the same rows (key/value heads
    fewer than tp are repeated); a ConfigError where tp does not divide them."""
    if style == "vocab_embedding":
        what = f"{name} (vocabulary; pad it with model.make_vocab_size_divisible_by)"
        return (*_split(module.num_embeddings, tp, rank, what), 1)
    if style == "rowwise":
        return (*_split(module.in_features, tp, rank, f"{name} (input features)"), 1)
    if style == "colwise_kv":
        return _kv_rows(module, options, tp, rank, name)
    return (*_split(module.out_features, tp, rank, f"{name} (output features)"), 1)


def split_problem(model: nn.Module, tp_plan: dict[str, Any], tp: int) -> str | None:
    """The first dimension `parallelize` at size `tp` would reject (one `tp` does not divide), read off
    the model without changing it: the config checks ask before any process group exists. The
    vocabulary is left out: it is padded to a multiple of tp (model.make_vocab_size_divisible_by)."""
    for name, module in model.named_modules():
        found = _style_of(name, tp_plan) if name else None
        if found is None or not isinstance(module, nn.Linear) or found[0] in ("lm_head", "head_norm"):
            continue
        try:
            _rank_rows(module, found[0], found[1], tp, 0, name)
        except ConfigError as exc:
            return str(exc)
    return None


def parallelize(
    model: nn.Module, tp_plan: dict[str, Any], group: Group, tp_mode: TPMode, async_communication: bool = False
) -> None:
    """Replace, in place, every module of `model` matched by `tp_plan` with its parallel version.

    `group` is this rank's TP process group (None for no TP); `tp_mode` is the object the `tp_mode`
    registry's factory returned. Patterns are tried in order and the first match wins. Works on
    meta and on real tensors (real weights are sliced, which the tests use). Parameters shared
    between two sharded modules (tied embeddings) stay one parameter.
    """
    tp, rank = _size_rank(group)
    common = {"group": group, "tp_mode": tp_mode}
    replaced: dict[int, nn.Parameter] = {}  # id(original weight) -> its shard, for tied weights
    originals: dict[int, str] = {}
    for name, module in list(model.named_modules()):
        found = _style_of(name, tp_plan) if name else None
        if found is None:
            continue
        style, options = found
        if isinstance(module, PrunedBlock):
            continue  # a block of another pipeline stage, pruned away (the memory planner's rank parts)
        if style == "head_norm":
            setattr(module, _HEAD_NORM, True)
            continue
        wanted = nn.Embedding if style == "vocab_embedding" else nn.Linear
        if type(module) is not wanted:
            raise PluginError(
                f"tp_plan maps {name!r} to {style}, which needs an nn.{wanted.__name__}, but it is a "
                f"{type(module).__name__}"
            )
        tied = replaced.get(id(module.weight))
        start, length, replicas = _rank_rows(module, style, options, tp, rank, name)
        if style == "vocab_embedding":
            new = VocabParallelEmbedding.from_embedding(module, start, length, weight=tied, **common)
        elif style == "rowwise":
            new = RowParallelLinear.from_linear(
                module, start, length, async_communication=async_communication, **common
            )
        else:
            cls = {"lm_head": VocabParallelLMHead, "colwise_local": LocalColumnLinear}.get(style, ColumnParallelLinear)
            new = cls.from_linear(
                module, start, length, weight=tied, replicas=replicas, async_communication=async_communication, **common
            )
        if tied is not None and tied.shape != new.weight.shape:
            raise PluginError(f"{name}.weight is tied to a parameter that the tp_plan splits differently")
        replaced[id(module.weight)] = new.weight
        originals[id(module.weight)] = name
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in replaced:
            raise PluginError(
                f"{name} shares its weight with {originals[id(param)]!r}, which the tp_plan shards, but is not "
                "sharded itself; add it to the model's tp_plan with the same style"
            )


def set_tp_mode(model: nn.Module, tp_mode: TPMode) -> None:
    """Switch every TP layer to another mode (e.g. ALL_REDUCE for generation, where one new token
    cannot be split along the sequence)."""
    for module in model.modules():
        if isinstance(module, TP_LAYERS):
            module.tp_mode = tp_mode


def _partial_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[ColumnParallelLinear]]:
    """(replicated parameters that see only a sequence shard, column layers holding shared kv heads)."""
    layers = [m for m in model.modules() if isinstance(m, TP_LAYERS)]
    sharded = {id(p) for m in layers for p in (m.weight, getattr(m, "bias", None)) if p is not None}
    for m in layers:
        if isinstance(m, RowParallelLinear) and m.bias is not None:
            sharded.discard(id(m.bias))  # replicated and added after the reduce-scatter: partial
    sequence_parallel = any(m.tp_mode.sequence_parallel for m in layers)
    if sequence_parallel:
        partial = [p for p in model.parameters() if id(p) not in sharded]
    else:  # only the head norms: their inputs are this rank's heads
        partial = [p for m in model.modules() if getattr(m, _HEAD_NORM, False) for p in m.parameters()]
    kv = [m for m in layers if isinstance(m, ColumnParallelLinear) and m.replicas > 1]
    return partial, kv


def tp_grad_sync(
    model: nn.Module, group: Group, grad_of: Callable[[nn.Parameter], torch.Tensor | None] | None = None
) -> None:
    """Sum, over the TP group, every gradient that tensor parallelism leaves partial. Call it on every
    TP rank after the last backward of a step, before clipping and the optimizer step.

    - REDUCE_SCATTER: replicated parameters (norms, row-parallel biases) saw only this rank's
      sequence shard.
    - Head norms (`head_norm` in the TP plan, any mode): each rank's heads gave their share.
    - Key/value heads shared by several ranks (`replicas > 1`) got only this rank's query heads'
      share; summed over exactly the ranks sharing them by all-reducing a zero-padded full-size
      buffer over the TP group, which needs no extra process groups.

    `grad_of(param)` returns the gradient tensor to reduce in place (default: `param.grad`; pass
    e.g. `lambda p: p.main_grad` for fp32 accumulation buffers). One all-reduce per dtype. That gradient
    may hold only some rows of the parameter (ZeRO-2): every rank of a TP group holds
    the same rows, so placing them at the head's offset sums them row for row.
    """
    tp, _ = _size_rank(group)
    if tp == 1:
        return
    grad_of = grad_of or (lambda p: p.grad)
    partial, kv_layers = _partial_parameters(model)
    jobs: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]] = {}
    for param in partial:
        grad = grad_of(param)
        if grad is not None:
            jobs.setdefault(grad.dtype, []).append((grad, grad, lambda buf: buf))
    for layer in kv_layers:
        for param in (layer.weight, layer.bias):
            grad = grad_of(param) if param is not None else None
            if grad is None:
                continue
            full = grad.new_zeros((layer.full_out_features, *grad.shape[1:]))
            rows = slice(layer.out_start, layer.out_start + grad.shape[0])  # all rows, or ZeRO-2's share
            full[rows] = grad
            jobs.setdefault(grad.dtype, []).append((grad, full, lambda buf, rows=rows: buf[rows]))
    for items in jobs.values():
        flat = torch.cat([source.reshape(-1) for _, source, _ in items])
        dist.all_reduce(flat, group=group)
        offset = 0
        for grad, source, pick in items:
            grad.copy_(pick(flat[offset : offset + source.numel()].view_as(source)))
            offset += source.numel()


def tp_owned_parameters(model: nn.Module, group: Group) -> Iterable[tuple[str, nn.Parameter]]:
    """The parameters this TP rank answers for: its shards, plus one copy of each replicated tensor
    (TP rank 0 for plain replicated parameters, the first sharing rank for shared kv heads).

    Summing squared gradient norms over these on every TP rank, then all-reducing over TP, counts
    each element once; a checkpoint writer can use it to skip duplicates.
    """
    _, rank = _size_rank(group)
    layers = [m for m in model.modules() if isinstance(m, TP_LAYERS)]
    duplicate: set[int] = set()
    sharded: set[int] = set()
    for m in layers:
        shared = isinstance(m, ColumnParallelLinear) and m.replicas > 1 and rank % m.replicas != 0
        for p in (m.weight, getattr(m, "bias", None)):
            if p is not None and not (isinstance(m, RowParallelLinear) and p is m.bias):
                (duplicate if shared else sharded).add(id(p))
    for name, param in model.named_parameters():
        if id(param) in duplicate or (id(param) not in sharded and rank != 0):
            continue
        yield name, param
