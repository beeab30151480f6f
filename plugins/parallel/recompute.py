"""Selective recompute: the modules a model names keep only their inputs for backward.

Whole-block recompute (`recompute_granularity: full`) is the pipeline executor's (one checkpoint per
block); this is the finer one, Megatron-LM's selective recompute of the attention core.

Under a schedule that splits backwards (I, then W later) both use `recompute_kept`, which recomputes
once for both halves: torch's checkpoint recomputes in every backward call over the graph, so W
would run the forward again (and under ZeRO-3 with parameters already handed back).
"""

from __future__ import annotations

import fnmatch
import functools

import torch
from torch.utils.checkpoint import checkpoint


def recompute_selected(model: torch.nn.Module, kept: bool = False) -> None:
    """The modules the model names in `selective_recompute_modules` keep only their inputs for backward
    and run again there (torch's non-reentrant checkpoint; `recompute_kept` when `kept`), while training."""
    patterns = model.selective_recompute_modules
    wrap = _kept if kept else _checkpointed
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            module.forward = functools.partial(wrap, module.forward)


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _kept(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return recompute_kept(forward, *args, **kwargs)


class _Frame:
    """One recomputed call: its inputs and RNG state; the tensors its backward saves, once recomputed."""

    def __init__(self, fn, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = (
            torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self.count = 0
        self.values: list[torch.Tensor] | None = None

    def pack(self, tensor: torch.Tensor) -> int:
        self.count += 1
        return self.count - 1

    def unpack(self, index: int) -> torch.Tensor:
        if self.values is None:
            self._recompute()
        assert self.values is not None
        return self.values[index]

    def _recompute(self) -> None:
        values: list[torch.Tensor] = []
        args = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in self.args]
        devices = [torch.cuda.current_device()] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng)
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: values.append(t) or len(values) - 1, values.__getitem__
            ):
                self.fn(*args, **self.kwargs)
        if len(values) != self.count:
            raise RuntimeError(
                f"recompute saved {len(values)} tensors for backward where the forward saved {self.count}: the "
                f"recomputed forward took another path"
            )
        self.values = values


def recompute_kept(fn, *args, **kwargs):
    """`fn(*args)` keeping only its inputs for backward, like torch's non-reentrant checkpoint, except
    that the forward runs again at most once: the recomputed tensors serve every backward call over
    this graph (a split backward's I and W) and are freed with the graph."""
    frame = _Frame(fn, args, kwargs)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args, **kwargs)
