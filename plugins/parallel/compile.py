"""`model.compile`: torch.compile per pipeline block, as torchtitan compiles per transformer block.

Each module of each block this rank runs (a decoder layer; the embedding; the final norm and the
head) is compiled in place (`nn.Module.compile`), and so is the loss. torch inlines a module's
parameters as graph inputs, so decoder layers of one shape share one compiled graph: compile time
does not grow with depth. What runs between blocks stays eager and unchanged: pipeline sends and
receives, ZeRO-3's gathers and releases, whole-block recompute (a checkpoint around a compiled
block). Communication inside a block (tensor-parallel collectives, ring attention, the expert
all-to-all) runs eagerly: those functions are marked `torch.compiler.disable` where they are
defined, and the compiled graph resumes after them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger("nanocore")


def compile_blocks(chunk_modules: list[list[list[nn.Module]]], keep_graph: bool = False) -> int:
    """Compile every module of every local block in place; returns how many were compiled.

    `keep_graph`: backwards are split (I, then W from the same graph), so autograd must keep the graph
    after I; compiled backwards then may not donate their saved buffers (torch refuses
    `retain_graph=True` for those), which costs the memory donation would have reused."""
    if keep_graph:
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False
    seen: set[int] = set()
    for chunk in chunk_modules:
        for block in chunk:
            for module in block:
                if isinstance(module, nn.Identity) or id(module) in seen:
                    continue
                seen.add(id(module))
                module.compile()
    return len(seen)


def compile_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """The loss (fused or vocabulary-parallel cross-entropy) as one compiled region."""
    return torch.compile(loss_fn)


def release_compiled() -> None:
    """Drop every compiled graph and its guards in this process: they hold references to what they
    were traced with (process groups among them), which must not outlive the engine's shutdown."""
    torch.compiler.reset()


def cache_dir() -> str:
    """Where inductor keeps compiled kernels and graphs between runs (TORCHINDUCTOR_CACHE_DIR, else a
    folder under the system's temporary directory): a later run of the same shapes starts faster."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return str(inductor_cache_dir())


class FirstStepTimer:
    """Logs how long the first training step took: with `model.compile` that is when every block is
    compiled (later steps reuse the graphs)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.done = False

    def __enter__(self) -> FirstStepTimer:
        if not self.done:
            self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.done or self.start is None or exc[0] is not None:
            return
        self.done = True
        log.info(
            "model.compile: the first step took %.1f s, compiling included (inductor cache: %s)",
            time.perf_counter() - self.start,
            cache_dir(),
        )
