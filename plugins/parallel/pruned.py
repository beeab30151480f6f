"""What a rank's model holds in place of a pipeline block another stage owns.

The engine's build (`build.keep_rank_part`) and the memory planner's rank parts (`planner`) both
replace the blocks of other pipeline stages with a `PrunedBlock`. Tensor parallelism and expert
sharding meet those names in the model's plans and skip them by this one test, so a real mismatch
(a plan naming a module that is not there) is still an error.
"""

from __future__ import annotations

from torch import nn


class PrunedBlock(nn.Identity):
    """A pipeline block of another stage, pruned away from this rank's model."""


def under_pruned_block(model: nn.Module, name: str) -> bool:
    """Whether the module `name` of `model` is a pruned block or lies inside one."""
    module = model
    for part in name.split("."):
        if isinstance(module, PrunedBlock):
            return True
        child = module._modules.get(part)
        if child is None:
            return False
        module = child
    return isinstance(module, PrunedBlock)
