"""Built-in FP8 recipes: `tensorwise` and `rowwise` (`model.float8_recipe`)."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore_plugins.float8.recipes import rowwise, tensorwise


def _check(config, args) -> list[str]:
    if config.parallelism.tp > 1 and config.parallelism.tp_linear_async_communication:
        return [
            "parallelism.tp_linear_async_communication: the overlapped TP layers keep their own matmuls, which "
            "model.float8_recipe does not reach; set it to false to train in FP8"
        ]
    return []


@hookimpl
def register_float8_recipes(registry):
    registry.register(
        "tensorwise",
        tensorwise,
        description="FP8 matmuls, one dynamic scale per tensor (e4m3 inputs and weights, e5m2 gradients)",
        check=_check,
    )
    registry.register(
        "rowwise",
        rowwise,
        description="FP8 matmuls, one dynamic scale per row along the reduction dimension (e4m3)",
        check=_check,
    )
