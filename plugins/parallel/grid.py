"""The process grid: TP innermost (ranks of one node), then CP, then PP, then DP; EP carved out of DP x CP.

global rank = dp_rank * (pp * cp * tp) + pp_rank * (cp * tp) + cp_rank * tp + tp_rank
dcp_rank    = dp_rank * cp + cp_rank          (the ranks that hold the same weights: "DP x CP")
dcp_rank    = edp_rank * ep + ep_rank

Context parallelism splits each sequence over `cp` ranks (same dp, pp and tp rank); key/value
blocks travel round them in a ring. They hold the same weights and see different tokens, so for
gradients, ZeRO sharding and the loss they count like data-parallel replicas: gradients are
averaged over DP x CP (the `dcp` group). Data is read per dp rank: the cp ranks of one dp rank read
the same samples and each keeps its chunks.

Expert parallelism splits the experts over `ep` consecutive DP x CP ranks (an expert-parallel
group: same pp and tp rank, dcp ranks edp*ep .. edp*ep + ep-1); tokens travel inside it by
all-to-all. Ranks holding the same experts (same ep_rank, every edp) form the expert-data-parallel
group, over which expert gradients are reduced; everything else is reduced over all of DP x CP.
With cp = 1 all of this is the 3D grid (DP x CP = DP).

A `ProcessGrid` is created once by the engine and passed explicitly; there is no global.
"""

from __future__ import annotations

import datetime
import gc
import logging
import weakref
from itertools import product
from typing import TypeVar

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: this torch module binds the *current*
# default group as the default argument of its functions when it is first imported (which a
# first meta-device initialisation does, through torch._dynamo). Imported after
# init_process_group, it would keep the default group, and its gloo worker threads, alive until
# interpreter shutdown, where they abort the process (see `ProcessGrid.destroy`).
import torch.distributed.nn  # noqa: F401  isort: skip

from nanocore.config.schema import ParallelismArgs
from nanocore.errors import ConfigError
from nanocore.launch_env import launch_env

log = logging.getLogger("nanocore")
T = TypeVar("T")


class ProcessGrid:
    """Ranks, process groups and the device of this process."""

    def __init__(self, par: ParallelismArgs):
        env = launch_env()
        self.world_size, self.rank, self.local_rank = env.world_size, env.rank, env.local_rank
        self.dp, self.tp, self.pp = par.dp, par.tp, par.pp
        self.cp = par.context_parallel_size
        if self.dp * self.tp * self.pp * self.cp != self.world_size:
            raise ConfigError(
                f"parallelism: dp x cp x tp x pp = {self.dp * self.cp * self.tp * self.pp} but {self.world_size} "
                "processes were launched"
            )
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            self.backend = "nccl"
        else:
            self.device = torch.device("cpu")
            self.backend = "gloo"
        self.tp_rank = self.rank % self.tp
        self.cp_rank = (self.rank // self.tp) % self.cp
        self.pp_rank = (self.rank // (self.tp * self.cp)) % self.pp
        self.dp_rank = self.rank // (self.tp * self.cp * self.pp)
        self.dcp, self.dcp_rank = self.dp * self.cp, self.dp_rank * self.cp + self.cp_rank
        self.ep = par.expert_parallel_size
        if self.dcp % self.ep:
            raise ConfigError(f"parallelism.expert_parallel_size: {self.ep} must divide dp x cp = {self.dcp}")
        self.ep_rank, self.edp_rank, self.edp = self.dcp_rank % self.ep, self.dcp_rank // self.ep, self.dcp // self.ep
        self.distributed = self.world_size > 1
        self.tp_group = self.pp_group = self.dp_group = self.mp_group = self.tied_group = None
        self.ep_group = self.edp_group = self.cp_group = self.dcp_group = self.cp_tp_group = None
        self.cp_group_ranks: list[int] = [self.rank]
        self.pp_group_ranks: list[int] = [self.rank]
        self.p2p_groups: tuple = (None, None)
        self._created: list[weakref.ref] = []  # every group this context made, to check they are gone at the end
        self.timeout = datetime.timedelta(seconds=par.collective_timeout_seconds)
        if self.distributed:
            if not dist.is_initialized():
                # env:// rendezvous: torchrun sets MASTER_ADDR/PORT, RANK, WORLD_SIZE
                dist.init_process_group(
                    self.backend,
                    rank=self.rank,
                    world_size=self.world_size,
                    timeout=self.timeout,
                    device_id=self.device if self.backend == "nccl" else None,
                )
            try:
                self._make_groups()
            except BaseException:
                self.destroy()
                raise

    def global_rank(self, dp_rank: int, pp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((dp_rank * self.pp + pp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def dcp_global_rank(self, dcp_rank: int, pp_rank: int, tp_rank: int) -> int:
        """The global rank of DP x CP index `dcp_rank` (= dp_rank * cp + cp_rank)."""
        return self.global_rank(dcp_rank // self.cp, pp_rank, tp_rank, dcp_rank % self.cp)

    def _make_groups(self) -> None:
        # Every rank must create every group in the same order (torch.distributed's rule).
        def group(ranks: list[int]):
            g = dist.new_group(ranks, timeout=self.timeout)
            if isinstance(g, dist.ProcessGroup):  # ranks outside `ranks` get a placeholder
                self._created.append(weakref.ref(g))
            return g

        dp, pp, tp, cp = range(self.dp), range(self.pp), range(self.tp), range(self.cp)
        for d, p, c in product(dp, pp, cp):
            ranks = [self.global_rank(d, p, t, c) for t in tp]
            g = group(ranks)
            if self.rank in ranks:
                self.tp_group = g
        for d, c, t in product(dp, cp, tp):
            ranks = [self.global_rank(d, p, t, c) for p in pp]
            g = group(ranks)
            # one communicator per direction: NCCL matches messages in posting order, and each
            # direction's messages are posted in a consistent order (tested per schedule)
            forward, backward = group(ranks), group(ranks)
            if self.rank in ranks:
                self.pp_group, self.pp_group_ranks = g, ranks
                self.p2p_groups = (forward, backward)
            # tied parameters (embeddings) live on the first and last pipeline stage
            tied = sorted({ranks[0], ranks[-1]})
            tg = group(tied)
            if self.rank in tied:
                self.tied_group = tg
        for p, c, t in product(pp, cp, tp):
            ranks = [self.global_rank(d, p, t, c) for d in dp]
            g = group(ranks)
            if self.rank in ranks:
                self.dp_group = g
        for d, c in product(dp, cp):
            ranks = [self.global_rank(d, p, t, c) for p in pp for t in tp]
            g = group(ranks)
            if self.rank in ranks:
                self.mp_group = g
        if self.cp > 1:
            for d, p, t in product(dp, pp, tp):
                ranks = [self.global_rank(d, p, t, c) for c in cp]
                g = group(ranks)
                if self.rank in ranks:
                    self.cp_group, self.cp_group_ranks = g, ranks
            for p, t in product(pp, tp):
                ranks = [self.dcp_global_rank(i, p, t) for i in range(self.dcp)]
                g = group(ranks)
                if self.rank in ranks:
                    self.dcp_group = g
            for d, p in product(dp, pp):  # every token of a micro-batch: its cp chunks and tp shards
                ranks = [self.global_rank(d, p, t, c) for c in cp for t in tp]
                g = group(ranks)
                if self.rank in ranks:
                    self.cp_tp_group = g
        else:
            self.dcp_group = self.dp_group
            self.cp_tp_group = self.tp_group
        if self.ep > 1:
            for p, t, e in product(pp, tp, range(self.edp)):
                ranks = [self.dcp_global_rank(e * self.ep + r, p, t) for r in range(self.ep)]
                g = group(ranks)
                if self.rank in ranks:
                    self.ep_group = g
            for p, t, r in product(pp, tp, range(self.ep)):
                ranks = [self.dcp_global_rank(e * self.ep + r, p, t) for e in range(self.edp)]
                g = group(ranks)
                if self.rank in ranks:
                    self.edp_group = g
        else:
            self.edp_group = self.dcp_group
        self.world_group = dist.group.WORLD

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of pipeline stage `pp_rank` in this rank's pipeline."""
        return self.pp_group_ranks[pp_rank]

    def loss_on_every_rank(self, local_sum: torch.Tensor) -> float:
        """The loss the last stage (tp rank 0) computed, averaged over DP x CP (each cp rank's is the
        mean over its equal share of the tokens), on every rank. Only the rank holding the last
        virtual stage has a nonzero sum (the last pipeline rank, or rank 0 under a V placement)."""
        if not self.distributed:
            return float(local_sum)
        value = local_sum.detach().float().clone()
        if self.tp_rank != 0:
            value.zero_()
        value /= self.dcp
        dist.all_reduce(value)
        return float(value)

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[T | None] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out  # type: ignore[return-value]  # every slot filled

    def all_ranks_ok(self, ok: bool) -> bool:
        """True on every rank iff `ok` is True on every rank."""
        if not self.distributed:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(flag)
        return float(flag) == 0.0

    def barrier(self) -> None:
        if self.distributed:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.local_rank])
            else:
                dist.barrier()

    def destroy(self) -> None:
        """Destroy every process group and join its threads while the interpreter is fully alive.

        `destroy_process_group` only frees what torch's own tables hold; a gloo group's worker threads
        are joined by its C++ destructor, which runs when the last Python reference goes. Left to
        interpreter shutdown, a worker still releasing the last collective's tensors needs the GIL,
        finds the interpreter finalising and aborts the process ("terminate called without an active
        exception"). So drop every reference held here and collect now; the engine drops its own (the
        model's TP layers, gradient buffers, optimizer) before calling this.
        """
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
        self.tp_group = self.pp_group = self.dp_group = self.mp_group = self.tied_group = None
        self.ep_group = self.edp_group = self.cp_group = self.dcp_group = self.cp_tp_group = None
        self.p2p_groups = (None, None)
        self.world_group = None
        gc.collect()
        alive = sum(1 for ref in self._created if ref() is not None)
        if alive:
            log.warning(
                "%d process group(s) are still referenced after shutdown (by a plugin or an exception's traceback); "
                "their threads end when those references go",
                alive,
            )

    def live_groups(self) -> int:
        """How many groups this context made are still alive (0 after a clean `destroy`)."""
        return sum(1 for ref in self._created if ref() is not None)
