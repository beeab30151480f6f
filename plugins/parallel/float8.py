"""`model.float8_recipe`: hand the recipe's FP8 matmuls to every linear layer not kept in high precision.

Applied on the meta device, after tensor parallelism swapped in its layers and before materialising:
a plain `nn.Linear` becomes a `Float8Linear` holding the same parameters (names and placements
unchanged, so checkpoints are those of a high-precision run); a column- or row-parallel layer keeps
its class and gets the recipe's function for its TP split. The output head (the module the model's
TP plan marks `lm_head`) stays in high precision unless `model.float8_skip` says otherwise;
embeddings, routers (not `nn.Linear`) and experts (stacked weights, not `nn.Linear`) are never FP8.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from nanocore.float8_api import Float8Recipe, LinearFunction
from nanocore.tp_api import Group

from .tensor_parallel import ColumnParallelLinear, RowParallelLinear


class Float8Linear(nn.Module):
    """An `nn.Linear`'s parameters, multiplied through an FP8 recipe's function."""

    def __init__(self, linear: nn.Linear, function: LinearFunction):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8"


def high_precision_modules(model: nn.Module, skip: list[str] | None) -> list[str]:
    """The patterns of modules kept out of FP8: `skip`, or by default the output head."""
    if skip is not None:
        return list(skip)
    plan = getattr(model, "tp_plan", {}) or {}
    return [pattern for pattern, style in plan.items() if _style(style) == "lm_head"]


def _style(style) -> str:
    return style.get("style", "") if isinstance(style, dict) else str(style)


def apply_float8(model: nn.Module, recipe: Float8Recipe, skip: list[str] | None, tp_group: Group) -> list[str]:
    """Give every linear layer of `model` not matched by the high-precision patterns the recipe's
    matmuls; returns the names of the layers that run in FP8."""
    keep = high_precision_modules(model, skip)
    converted = []
    for name, module in list(model.named_modules()):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in keep):
            continue
        if isinstance(module, ColumnParallelLinear):  # the head's class too, when it is not kept
            module.linear = recipe.linear(tp_group, "out")
        elif isinstance(module, RowParallelLinear):
            module.linear = recipe.linear(tp_group, "in")
        elif type(module) is nn.Linear:
            model.set_submodule(name, Float8Linear(module, recipe.linear(None, None)))
        else:
            continue
        converted.append(name)
    return converted
