"""What an FP8 recipe is (`model.float8_recipe`): the contract between an engine's linear layers and a
float8 plugin.

A float8 plugin registers a factory that returns a `Float8Recipe`. For each linear layer it trains
in FP8, the engine asks the recipe for a `LinearFunction` that computes `x @ weight.T + bias` with
its matmuls (forward and both gradients) on float8 operands. `group` and `sharded` say how the layer
is split over tensor parallelism, so that the recipe scales every piece as the whole tensor would
be scaled: `sharded="out"` (column-parallel: this rank holds some output rows of the weight; the
output gradient is split the same way), `sharded="in"` (row-parallel: some input columns; the input
is split the same way), None (the layer is whole on this rank). Outputs, gradients and the weights
themselves stay in the model's dtype; only the matmul operands are float8.

Built-in implementations: `nanocore_plugins.float8` (`tensorwise`, `rowwise`).
"""

from __future__ import annotations

from typing import Literal, Protocol, TypeAlias

from nanocore.tp_api import Group, LinearFunction

Sharded: TypeAlias = Literal["out", "in"] | None


class Float8Recipe(Protocol):
    """How a linear layer's matmuls run in float8."""

    name: str

    def linear(self, group: Group, sharded: Sharded) -> LinearFunction:
        """The function one layer uses; `group` is its tensor-parallel group (None: no TP)."""
        ...


__all__ = ["Float8Recipe", "LinearFunction", "Sharded"]
