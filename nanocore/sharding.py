"""Where a local tensor sits inside the full (unsharded) tensor.

Engines mark every parameter (and every optimizer-state tensor) with a `Placement`; checkpoints
store each saved piece with its placement, so a checkpoint written at one (dp, tp, pp) can be read
at another by cutting out whatever rectangle the reader needs.

A layout may pad a tensor's rows (the vocabulary, to a multiple of `make_vocab_size_divisible_by x
tp`): `valid_rows` says how many leading rows of the full tensor are real. Padding is a property of
the layout, not of the model, so checkpoints keep the real rows only and a reader pads again with
zeros for its own layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Work

_ATTR = "_nanocore_placement"


def _check_valid_rows(placement: Placement, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and not (placement.full_shape and 0 <= value <= placement.full_shape[0]):
        raise ValueError(f"valid_rows {value} must lie within the {list(placement.full_shape)} tensor's rows")


@attrs.frozen
class Placement:
    """The local tensor is `full[offsets[0]:offsets[0]+shape[0], ...]` of a tensor of `full_shape`.

    `valid_rows`: when set, only the first `valid_rows` rows (dim 0) of the full tensor are real and
    the rest is padding the layout added (zeros on load; never saved).
    """

    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    valid_rows: int | None = attrs.field(default=None, validator=_check_valid_rows, kw_only=True)

    @classmethod
    def whole(cls, shape: tuple[int, ...] | torch.Size) -> Placement:
        return cls(tuple(shape), (0,) * len(shape))

    def narrow(
        self, dim: int, start: int, length: int, local_shape: tuple[int, ...]
    ) -> tuple[Placement, tuple[int, ...]]:
        """Placement of `local.narrow(dim, start, length)` (a slice of this local tensor)."""
        offsets = list(self.offsets)
        offsets[dim] += start
        shape = list(local_shape)
        shape[dim] = length
        return attrs.evolve(self, offsets=tuple(offsets)), tuple(shape)

    @property
    def real_shape(self) -> tuple[int, ...]:
        """The full tensor without its padding rows: what a checkpoint stores."""
        if self.valid_rows is None:
            return self.full_shape
        return (self.valid_rows, *self.full_shape[1:])

    def real_rows(self, local_rows: int) -> int:
        """How many leading rows of a local tensor of `local_rows` rows are real (not padding)."""
        if self.valid_rows is None:
            return local_rows
        return max(0, min(local_rows, self.valid_rows - self.offsets[0]))

    def slices(self, local_shape: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, local_shape, strict=True))


def set_placement(tensor: torch.Tensor, placement: Placement) -> None:
    setattr(tensor, _ATTR, placement)


def get_placement(tensor: torch.Tensor) -> Placement:
    """The tensor's placement; an unmarked tensor is whole (replicated)."""
    return getattr(tensor, _ATTR, None) or Placement.whole(tensor.shape)


def shard_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part `index` when `size` is split into `parts` nearly equal contiguous parts."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def row_share(shape: tuple[int, ...] | torch.Size, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of the rows of a tensor of `shape` that data-parallel rank `index` of `parts`
    owns under ZeRO sharding (optimizer state, reduce-scattered gradients, the update it exchanges):
    `shard_range` over dim 0; a 0-dim tensor counts as one row, owned by rank 0. Engines and ZeRO
    stages both cut with this one function, so their pieces agree."""
    rows = shape[0] if len(shape) else 1
    return shard_range(rows, parts, index)


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """`torch.distributed.all_gather_single` (torch >= 2.13), else `all_gather_into_tensor` (its older name)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work: Work | None = fn(output, input, group=group, async_op=async_op)
    return work


def reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """`torch.distributed.reduce_scatter_single` (torch >= 2.13), else `reduce_scatter_tensor` (its older name)."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work: Work | None = fn(output, input, group=group, async_op=async_op)
    return work
