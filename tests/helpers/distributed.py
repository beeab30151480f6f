"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

    def body(rank, world_size, scale):      # module level: spawn pickles it by reference
        ...
        return {"loss": loss.item(), "grad": weight.grad}

    results = run_ranks(2, body, 0.5)       # [rank 0's value, rank 1's value]

Each rank runs with `torch.set_num_threads(1)` (tests share a few cores) and a gloo default process
group over a FileStore in a fresh temporary directory (no ports to collide). Ranks are forked from a
forkserver that has already imported torch, nanocore and every installed plugin (a fresh interpreter
spends about 1.4 s of CPU on those imports, 40 % of a small 8-rank test); each rank then takes the
parent's environment as it is at the call. A test that changes a variable read only when a process
starts (`MALLOC_*`, `OMP_*`, `LD_*`, ...) gets freshly spawned ranks instead. A rank that raises
makes `run_ranks` raise in the parent with that rank's traceback; the other ranks are killed
instead of being left waiting in a collective, and a run that exceeds `timeout` is killed too.
"""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before any group exists: see plugins/parallel/grid.py
import torch.multiprocessing as mp

# Read by the C library, OpenMP or the interpreter when a process starts: applying them in an
# already-running rank would silently do nothing, so a change to any of them means spawn.
_START_ONLY = ("MALLOC_", "GLIBC_", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "PYTHON")
_START_ENV = {k: v for k, v in os.environ.items() if k.startswith(_START_ONLY)}
_PRELOAD = ["tests.helpers.rank_preload"]


def _context(env: dict[str, str]):
    """The forkserver (imports done once) unless a start-only variable differs from this session's start."""
    if {k: v for k, v in env.items() if k.startswith(_START_ONLY)} != _START_ENV:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class RankFailed(RuntimeError):
    """A rank raised, died, or the run timed out; the message carries the rank's traceback."""


def _rank_main(
    rank: int, world_size: int, store_path: str, timeout: float, results, env: dict, fn: Callable, args: tuple
) -> None:
    try:
        os.environ.clear()
        os.environ.update(env)  # the caller's environment now, not the forkserver's from when it started
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args)
        # Pickled here (tensors by value): sharing tensor memory with a process about to exit is fragile.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` fresh gloo rank processes; return their results
    in rank order."""
    env = dict(os.environ)
    ctx = _context(env)
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="nanocore-ranks-")
    store_path = os.path.join(tmp, "store")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, store_path, timeout, results, env, fn, args), daemon=True)
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, world_size, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(procs: list, results, world_size: int, timeout: float) -> list[Any]:
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(values) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(values))
                raise RankFailed(
                    f"ranks {missing} did not finish within {timeout:.0f}s (deadlock or too slow?)"
                ) from None
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
            if dead:
                # A rank can exit right after putting its result: drain once more before blaming it.
                time.sleep(0.5)
                if results.empty():
                    codes = ", ".join(f"rank {r}: exit code {procs[r].exitcode}" for r in dead)
                    raise RankFailed(f"rank(s) died without reporting ({codes})") from None
            continue
        if not ok:
            raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
        values[rank] = pickle.loads(payload)
    return [values[r] for r in range(world_size)]
