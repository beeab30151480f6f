"""Selective recompute: the modules a model names keep only their inputs for backward.

Whole-block recompute (`recompute_granularity: full`) is the pipeline executor's (one checkpoint per
block); this is the finer one, Megatron-LM's selective recompute of the attention core.
"""

from __future__ import annotations

import fnmatch
import functools

import torch
from torch.utils.checkpoint import checkpoint


def recompute_selected(model: torch.nn.Module) -> None:
    """The modules the model names in `selective_recompute_modules` keep only their inputs for backward
    and run again there (torch's non-reentrant checkpoint), while training."""
    patterns = model.selective_recompute_modules
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            module.forward = functools.partial(_checkpointed, module.forward)


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
