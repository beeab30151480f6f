"""One executor for every pipeline schedule: it runs a rank's list of actions (schedules are data).

Forward of chunk c on microbatch m receives its input from the rank holding the previous virtual
stage (or takes the token ids), sends its output on (or computes the loss); backward receives the
output gradient, runs autograd and sends the input gradient back. A schedule may split a backward:
I receives the output gradient, computes and sends only the input gradient, and W computes the
weight gradients later from the same graph (`split_backward`). Sends are asynchronous and never
block, receives block until needed, so a rank stalls exactly when the simulator says it does.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Protocol

import attrs
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from nanocore.pipeline_api import Action, PipelineSchedule, splits_backward, stage_owners

from .build import LocalModel
from .context_parallel import ContextParallel
from .data_parallel import BlockParameters
from .grid import ProcessGrid
from .prediction import TokenPrediction
from .recompute import recompute_kept
from .split_backward import WeightGradients, backward_input

_HEADER = 8  # ndim + up to 7 dims


class P2P:
    """Point-to-point messages between pipeline ranks, with a shape header so receivers can allocate."""

    def __init__(self, grid: ProcessGrid, dtype: torch.dtype):
        self.grid, self.dtype = grid, dtype
        self.pending: list = []
        self.local: dict[tuple, torch.Tensor] = {}
        self.waited = 0.0  # seconds spent blocked in receives (for ActionTimes)
        self.tagged = grid.backend == "gloo"  # NCCL matches messages in order and ignores tags

    def send(self, tensor: torch.Tensor, dst_pp_rank: int, key: tuple[int, int, int]) -> None:
        if dst_pp_rank == self.grid.pp_rank:  # interleaving with pp=1: hand over in-process
            self.local[key] = tensor
            return
        dst = self.grid.pp_peer(dst_pp_rank)
        header = torch.zeros(_HEADER, dtype=torch.long, device=tensor.device)
        header[0] = tensor.dim()
        header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape)
        tag, group = self._tag(key), self.grid.p2p_groups[key[0]]
        self.pending.append(dist.isend(header, dst, group=group, tag=2 * tag))
        self.pending.append(dist.isend(tensor.contiguous(), dst, group=group, tag=2 * tag + 1))

    def recv(self, src_pp_rank: int, key: tuple[int, int, int]) -> torch.Tensor:
        if src_pp_rank == self.grid.pp_rank:
            return self.local.pop(key)
        src = self.grid.pp_peer(src_pp_rank)
        tag, group = self._tag(key), self.grid.p2p_groups[key[0]]
        header = torch.empty(_HEADER, dtype=torch.long, device=self.grid.device)
        start = time.perf_counter()
        dist.irecv(header, src, group=group, tag=2 * tag).wait()
        shape = header[1 : 1 + int(header[0])].tolist()
        out = torch.empty(shape, dtype=self.dtype, device=self.grid.device)
        dist.irecv(out, src, group=group, tag=2 * tag + 1).wait()
        self.waited += time.perf_counter() - start
        return out

    def _tag(self, key: tuple[int, int, int]) -> int:
        # key = (direction, virtual stage, microbatch); tags only need to be unique per step
        direction, stage, micro = key
        return ((micro * 4096 + stage) * 2 + direction) % (1 << 30) if self.tagged else 0

    def wait_all(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()


class GradientHooks(Protocol):
    """What the executor tells the data-parallel gradients around each backward (B, or the W that
    produces a split backward's weight gradients)."""

    def final_backward(self, chunk: int | None) -> None:
        """The next backward is `chunk`'s last of this step (None: the step's backwards are over)."""

    def after_backward(self, chunk: int) -> None:
        """A backward of `chunk` has run (and its input gradient was sent)."""


class ActionTimes:
    """Seconds each kind of action (F, B, I, W) computed on this rank, its waits for messages left
    out: what the simulator needs to predict a schedule (`benchmarks/pipeline_schedules.py`). On a
    GPU the times are host times: synchronize in `clock` to measure kernels."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds: dict[str, list[float]] = {}
        self.stage_seconds: dict[tuple[str, int], list[float]] = {}  # (kind, stage): a rank's chunks differ

    def add(self, kind: str, seconds: float, stage: int) -> None:
        self.seconds.setdefault(kind, []).append(seconds)
        self.stage_seconds.setdefault((kind, stage), []).append(seconds)


class PipelineExecutor:
    """Runs any schedule's action list for this rank: forwards, backwards and the p2p between stages."""

    def __init__(
        self,
        grid: ProcessGrid,
        local: LocalModel,
        chunk_modules: list[list[list[torch.nn.Module]]],
        schedule: PipelineSchedule,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        dtype: torch.dtype,
        recompute: bool,
        gradients: GradientHooks | None = None,
        block_parameters: BlockParameters | None = None,
        sequence: ContextParallel | None = None,
        prediction: TokenPrediction | None = None,
    ):
        """`block_parameters`: gathered before each block runs and released after (ZeRO-3); None when
        parameters are always whole. `gradients` hears of each backward (None: evaluation only)."""
        self.grid, self.local, self.schedule, self.loss_fn = grid, local, schedule, loss_fn
        self.chunk_modules = chunk_modules
        self.sequence = sequence  # context parallelism / document masking: this rank's tokens and their layout
        self.prediction = prediction  # extra prediction heads: they read the micro-batch's whole labels
        self.recompute = recompute
        self.gradients = gradients
        self.params = block_parameters
        self.p2p = P2P(grid, dtype)
        self.last_stage = local.num_virtual_stages - 1
        self.owners = stage_owners(schedule, grid.pp, len(local.chunks))  # stage -> (pp rank, chunk)
        self._actions: dict[int, list[Action]] = {}
        self.split = False  # this step's schedule splits backwards (I and W): recompute must keep its tensors
        self.times: ActionTimes | None = None  # set to measure each action's compute time
        # every trainable parameter each chunk uses (W's targets); unlike `build.chunk_parameters`, a
        # parameter two chunks share (ZBV's tied embedding and head on rank 0) is listed in both
        self.chunk_weights = [
            list(
                {
                    id(p): p for block in chunk for module in block for p in module.parameters() if p.requires_grad
                }.values()
            )
            for chunk in chunk_modules
        ]

    def actions(self, num_microbatches: int) -> list[Action]:
        if num_microbatches not in self._actions:
            v = len(self.local.chunks)
            self._actions[num_microbatches] = self.schedule.actions(
                self.grid.pp, self.grid.pp_rank, num_microbatches, v
            )
        return self._actions[num_microbatches]

    def _run_chunk(self, c: int, x: torch.Tensor, grad: bool) -> torch.Tensor:
        stage = self.local.chunk_ids[c]
        params = self.params
        for b, block in enumerate(self.chunk_modules[c]):
            if params is not None:  # ZeRO-3: this block whole now, the next one on its way
                params.gather(c, b)
                params.prefetch(c, b + 1)
            first_or_last = (stage == 0 and b == 0) or (
                stage == self.last_stage and b == len(self.chunk_modules[c]) - 1
            )
            if grad and self.recompute and not first_or_last:
                if self.split:  # recomputed once for I and W together
                    x = recompute_kept(_apply_block, block, x)
                else:
                    x = checkpoint(_apply_block, block, x, use_reentrant=False)
            else:
                x = _apply_block(block, x)
            if params is not None:
                params.release(c, b)
                if grad and x.requires_grad:  # whole again just before this block's backward
                    x.register_hook(functools.partial(_before_backward, params, c, b))
        return x

    def _owner(self, stage: int) -> int:
        return self.owners[stage][0]

    def run(self, micro_batches: list[torch.Tensor], train: bool) -> torch.Tensor:
        """Run one step's actions; returns the sum of this rank's microbatch losses / M (0 off the last stage)."""
        device = self.grid.device
        inputs = [mb[:, :-1].to(device, non_blocking=True) for mb in micro_batches]
        labels = [mb[:, 1:].to(device, non_blocking=True) for mb in micro_batches]
        whole_labels = labels  # multi-token prediction reads every position's labels, unsharded
        sequence, layouts = self.sequence, []
        if sequence is not None:  # every cp rank read the whole samples; each keeps its chunks
            layouts = [sequence.prepare(x) for x in inputs]
            inputs = [sequence.shard(x) for x in inputs]
            labels = [sequence.shard(y) for y in labels]
        try:
            return self._run(inputs, labels, whole_labels, layouts, train)
        finally:
            if sequence is not None:
                sequence.layout = None

    def _run(self, inputs: list, labels: list, whole_labels: list, layouts: list, train: bool) -> torch.Tensor:
        m_count = len(inputs)
        step = _Step(
            inputs, labels, whole_labels, layouts, train, torch.zeros((), dtype=torch.float32, device=self.grid.device)
        )
        actions = self.actions(m_count)
        if not train:
            actions = [Action("F", c, m) for m in range(m_count) for c in range(len(self.local.chunks))]
        self.split = splits_backward(actions)
        for i, a in enumerate(actions):
            if a.kind in ("B", "W"):  # what produces weight gradients
                step.last_backward[a.chunk] = i
        run = {"F": self._forward, "B": self._backward, "I": self._backward_input, "W": self._backward_weight}
        times = self.times if train else None
        for i, action in enumerate(actions):
            if layouts:  # read by attention in forward, and in backward where recomputation runs it again
                self.sequence.layout = layouts[action.microbatch]
            if times is None:
                run[action.kind](step, i, action.chunk, action.microbatch)
                continue
            start, waited = times.clock(), self.p2p.waited
            run[action.kind](step, i, action.chunk, action.microbatch)
            took = times.clock() - start - (self.p2p.waited - waited)
            times.add(action.kind, took, self.local.chunk_ids[action.chunk])
        if self.gradients is not None:
            self.gradients.final_backward(None)
        self.p2p.wait_all()
        return step.total

    def _forward(self, step: _Step, i: int, c: int, m: int) -> None:
        stage = self.local.chunk_ids[c]
        if stage == 0:
            x = step.inputs[m]
        else:
            x = self.p2p.recv(self._owner(stage - 1), (0, stage, m))
            x.requires_grad_(step.train)
        if self.prediction is not None and stage == self.last_stage:
            self.prediction.labels = step.whole_labels[m]
        with torch.set_grad_enabled(step.train):
            y = self._run_chunk(c, x, step.train)
            if stage == self.last_stage:
                y = self.loss_fn(y, step.labels[m]) / len(step.inputs)
                step.total += y.detach().float()
            else:
                self.p2p.send(y.detach(), self._owner(stage + 1), (0, stage + 1, m))
        if step.train:
            step.saved[(c, m)] = (x if stage > 0 else None, y)

    def _backward(self, step: _Step, i: int, c: int, m: int) -> None:
        stage = self.local.chunk_ids[c]
        x, y = step.saved.pop((c, m))
        if self.gradients is not None:
            self.gradients.final_backward(c if step.last_backward[c] == i else None)
        if stage == self.last_stage:
            y.backward()
        else:
            grad = self.p2p.recv(self._owner(stage + 1), (1, stage, m))
            torch.autograd.backward(y, grad)
        if x is not None:
            self.p2p.send(x.grad, self._owner(stage - 1), (1, stage - 1, m))
        if self.gradients is not None:  # after the send: the previous stage need not wait for our reduction
            self.gradients.after_backward(c)

    def _backward_input(self, step: _Step, i: int, c: int, m: int) -> None:
        """Input gradient now (sent at once), weight gradients at this chunk's W."""
        stage = self.local.chunk_ids[c]
        x, y = step.saved.pop((c, m))
        grad = None if stage == self.last_stage else self.p2p.recv(self._owner(stage + 1), (1, stage, m))
        input_grad, step.weight_work[(c, m)] = backward_input(y, grad, x, self.chunk_weights[c])
        if x is not None:
            self.p2p.send(input_grad, self._owner(stage - 1), (1, stage - 1, m))

    def _backward_weight(self, step: _Step, i: int, c: int, m: int) -> None:
        work = step.weight_work.pop((c, m))
        if self.gradients is not None:
            self.gradients.final_backward(c if step.last_backward[c] == i else None)
        work.run()
        if self.gradients is not None:
            self.gradients.after_backward(c)


@attrs.define
class _Step:
    """One step's micro-batches and what its actions hand each other."""

    inputs: list[torch.Tensor]
    labels: list[torch.Tensor]
    whole_labels: list[torch.Tensor]
    layouts: list
    train: bool
    total: torch.Tensor  # the sum of this rank's micro-batch losses / M
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = attrs.Factory(dict)  # F -> B/I
    weight_work: dict[tuple[int, int], WeightGradients] = attrs.Factory(dict)  # I -> W
    last_backward: dict[int, int] = attrs.Factory(dict)  # chunk -> index of its last B or W


def _before_backward(params, c: int, b: int, grad: torch.Tensor) -> None:
    params.gather(c, b)
    params.prefetch(c, b - 1)


def _apply_block(modules: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    for module in modules:
        x = module(x)
    return x
