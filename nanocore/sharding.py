"""Where a local tensor sits inside the full (unsharded) tensor.

Engines mark every parameter (and every optimizer-state tensor) with a `Placement`; checkpoints
store each saved piece with its placement, so a checkpoint written at one (dp, tp, pp) can be read
at another by cutting out whatever rectangle the reader needs.
"""

from __future__ import annotations

import attrs
import torch

_ATTR = "_nanocore_placement"


@attrs.frozen
class Placement:
    """The local tensor is `full[offsets[0]:offsets[0]+shape[0], ...]` of a tensor of `full_shape`."""

    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...] | torch.Size) -> Placement:
        return cls(tuple(shape), (0,) * len(shape))

    def narrow(self, dim: int, start: int, length: int, local_shape: tuple[int, ...]) -> tuple[Placement, tuple[int, ...]]:
        """Placement of `local.narrow(dim, start, length)` (a slice of this local tensor)."""
        offsets = list(self.offsets)
        offsets[dim] += start
        shape = list(local_shape)
        shape[dim] = length
        return Placement(self.full_shape, tuple(offsets)), tuple(shape)

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
