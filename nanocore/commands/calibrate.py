"""`nanocore calibrate --world-size N --output FILE`: measure the machine at hand and write a hardware
description (nanocore/hardware.py) that `nanocore plan --hardware FILE` and `general.hardware` read.

It starts N processes on this machine (gloo on CPU, NCCL on GPUs: one per device) and, all ranks at
once as in training, measures:

- matmul throughput over square and training-shaped matmuls in each dtype (float32; bfloat16 too on
  GPU, or with --dtypes): the peak is the best rate, the efficiency curve each size's rate over it,
  the slowest rank's (synchronous training waits for it);
- the attention core (causal scaled_dot_product_attention) forward and backward over sequences of
  128-1024 (1,024-8,192 on GPU, in bfloat16), each pass's rate over the matmul peak
  (`attention_efficiency`): a fused kernel is not a matmul, and on a 2-core CPU it runs at about a
  third of the matmul peak;
- all-reduce time over message sizes *as a step pays it*: each all-reduce follows a matmul of about
  a layer's size, and its cost is the mean time of (matmul + all-reduce) less the mean time of the
  matmul alone, the median of 3 alternated rounds. Latency and bus bandwidth are fitted to the ring
  formula, t(S) = 2 (n-1) (latency + S / n / bandwidth), over all sizes (least relative error). Not
  the best of a tight loop: on a CPU
  with gloo, a 4 KiB all-reduce's best is 0.5 ms, its mean in a tight loop 1.5-3 ms and after a
  matmul 3-4 ms (its threads wake after the compute, and the ranks drift apart), and a step of a
  tensor-parallel layout pays that on each of its hundreds of collectives;
- the same for reduce-scatter, all-gather, all-to-all and a ring exchange of point-to-point messages
  (send to the next rank, receive from the previous: context parallelism's and the pipeline's
  pattern), each fitted on its own (`intra_node.collectives`): gloo's all-gather and reduce-scatter
  move a byte at about a third of its all-reduce's rate;
- a large elementwise op into a fresh buffer for the memory bandwidth, and the device memory (on CPU:
  the RAM over N);
- how much compute hides a collective running beside it (`compute_overlap`): a 4 MiB all-reduce and
  matmuls of about as long, alone and together;
- the overhead of one small non-matmul op (`op_overhead`): a chain of 200 elementwise ops on a few
  hundred elements, forward and backward, over 3 x 200 (the time model counts each forward op as three
  launches' worth: one forward, two backward).

A single machine has no inter-node link: inter_node repeats intra_node's figures (edit it for a
cluster, or use a shipped description). Run it on a quiet machine: what another job takes, the
figures lose. On CPU each rank uses `--threads` threads (default: the cores over N), as a run of N
processes on this machine would.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanocore.errors import ConfigError
from nanocore.hardware import RING_STEPS
from nanocore.memory import return_freed_memory

if TYPE_CHECKING:
    import torch

    from nanocore.hardware import Hardware

HELP = "measure this machine (matmuls, collectives, memory) and write a hardware description for plan --hardware"

SQUARE = (64, 128, 256, 512, 1024, 2048)
GPU_SQUARE = (256, 512, 1024, 2048, 4096, 8192)
MESSAGE_BYTES = tuple(2**k for k in range(12, 25, 2))  # 4 KiB .. 16 MiB
GPU_MESSAGE_BYTES = tuple(2**k for k in range(14, 29, 2))  # 16 KiB .. 256 MiB
CHAIN = 200  # elementwise ops in the op-overhead probe
IN_STEP_ROUNDS = 3  # rounds of each collective's in-step timing (`_in_step`): their median counts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, required=True, help="processes to start (devices on a GPU node)")
    p.add_argument("--output", required=True, help="the hardware YAML to write")
    p.add_argument("--name", default=None, help="the description's name (default: this host's name)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per process (default: cores / N)")
    p.add_argument("--dtypes", default=None, help="comma-separated matmul dtypes (default: float32; GPU adds bf16)")
    p.add_argument("--seconds", type=float, default=0.05, help="least time spent on each measured size")


def _time(fn: Callable[[], object], seconds: float, sync: Callable[[], None]) -> float:
    """Best time of one call of `fn`, repeating for at least `seconds` (and at least 3 times)."""
    fn()
    sync()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 3 or spent < seconds:
        start = time.perf_counter()
        fn()
        sync()
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
        if calls >= 200:
            break
    return best


def _in_step(
    fn: Callable[[], object],
    compute: Callable[[], object],
    seconds: float,
    sync: Callable[[], None],
    device: torch.device,
) -> float:
    """Mean seconds `fn` (a collective) adds when it follows `compute`, as a training step runs them:
    (compute + fn) over an agreed number of calls, then compute alone as often, less it. A mean,
    not a best: a step pays every call's wait. Three such rounds, and their median: a burst of
    something else on the machine during one round (a 4 KiB all-to-all measured 0.2 ms in one round
    and 1.5-2 ms in the others) does not set the figure. Every rank must make the same number of calls
    (a rank that stopped early would wait in its next collective while the others wait in this one),
    so the count is agreed first: the largest any rank needs for `seconds` (30 to 400)."""
    import torch
    import torch.distributed as dist

    for _ in range(2):
        compute()
        fn()
    sync()
    start = time.perf_counter()
    compute()
    fn()
    sync()
    one = max(time.perf_counter() - start, 1e-9)
    calls = torch.tensor([min(max(math.ceil(seconds / one), 30), 400)], dtype=torch.int64, device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    n = int(calls.item())

    def mean(body: Callable[[], object]) -> float:
        dist.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(n):
            body()
        sync()
        return (time.perf_counter() - start) / n

    def both() -> None:
        compute()
        fn()

    rounds = sorted(mean(both) - mean(compute) for _ in range(IN_STEP_ROUNDS))
    return max(rounds[len(rounds) // 2], 1e-7)


def _best_of(fn: Callable[[], object], calls: int, sync: Callable[[], None], barrier: bool = False) -> float:
    """Best time of one call of `fn` over exactly `calls` calls (each after a barrier, with `barrier`)."""
    import torch.distributed as dist

    best = float("inf")
    for _ in range(calls):
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _overlap(world: int, device: torch.device, sync: Callable[[], None]) -> float:
    """The share of compute running beside an all-reduce that hides it: a 4 MiB all-reduce (C s)
    and matmuls of about as long (M s) alone and together (T s): (C + M - T) / min(C, M), within 0..1.
    Every rank makes the same calls (fixed counts, no clock decides how many)."""
    import torch
    import torch.distributed as dist

    x = torch.ones(2**20, device=device)
    a = torch.randn(512, 512, device=device)

    def best(fn: Callable[[], object]) -> float:
        return _best_of(fn, 5, sync, barrier=True)

    comm = best(lambda: dist.all_reduce(x))
    one = best(lambda: torch.mm(a, a))
    count = max(1, round(comm / max(one, 1e-9)))

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, a)

    def both() -> None:
        work = dist.all_reduce(x, async_op=True)
        compute()
        assert work is not None
        work.wait()

    alone = best(compute)
    together = best(both)
    shorter = max(min(comm, alone), 1e-9)
    return min(1.0, max(0.0, (comm + alone - together) / shorter))


def _collective(kind: str, size: int, rank: int, world: int, device: torch.device) -> Callable[[], object]:
    """One call of collective `kind` on `size` bytes as `Hardware.collective_seconds` counts them
    (reduce-scatter's input, all-gather's output, all-to-all's send buffer, one message)."""
    import torch
    import torch.distributed as dist

    n = size // 4
    part = torch.ones(n // world, device=device)
    whole = torch.ones(n // world * world, device=device)
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return functools.partial(scatter, part, whole)
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return functools.partial(gather, whole, part)
    if kind == "all_to_all":
        received = torch.empty_like(whole)
        return functools.partial(dist.all_to_all_single, received, whole)
    message, received = torch.ones(n, device=device), torch.empty(n, device=device)

    def exchange() -> None:  # to the next rank, from the previous one
        ops = [
            dist.P2POp(dist.isend, message, (rank + 1) % world),
            dist.P2POp(dist.irecv, received, (rank - 1) % world),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return exchange


def _forward_backward(forward: Callable[[], torch.Tensor], grad: torch.Tensor) -> None:
    forward().backward(grad)


def _attention(
    dtypes: list[str], cuda: bool, device: torch.device, seconds: float, sync: Callable[[], None]
) -> dict[str, Any]:
    """Causal scaled_dot_product_attention, the model's attention core, over training shapes (the
    sequence grows, the tokens of a call stay about the same): [forward FLOPs of a call, forward
    FLOP/s, backward FLOP/s counting twice the forward's FLOPs]. In bfloat16 on GPU where it is
    measured (the flash kernels' dtype), else in the first dtype."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    name = "bfloat16" if cuda and "bfloat16" in dtypes else dtypes[0]
    dtype = getattr(torch, name)
    # (sequences, heads, sequence, head width): about the same tokens per call as the sequence grows
    tokens, heads, width, sequences = (
        (8192, 32, 128, (1024, 2048, 4096, 8192)) if cuda else (1024, 8, 32, (128, 256, 512, 1024))
    )
    shapes = [(max(1, tokens // s), heads, s, width) for s in sequences]
    points = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device=device, dtype=dtype)
        forward = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)
        both = functools.partial(_forward_backward, forward, grad)
        dist.barrier()
        once = _time(forward, seconds, sync)
        dist.barrier()
        twice = _time(both, seconds, sync)
        flops = 4.0 * b * h * s * s * d * 0.5  # causal: half the score matrix
        points.append([flops, flops / once, 2 * flops / max(twice - once, 1e-9)])
    return {"dtype": name, "points": points}


def _rank(rank: int, world: int, store: str, args: dict[str, Any], results: Any) -> None:
    import torch
    import torch.distributed as dist

    try:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(args["threads"])
            # measured as the trainer runs: it fixes glibc's mmap threshold (nanocore/memory.py), so
            # each large buffer it allocates is fresh pages, faulted in on first touch
            return_freed_memory()
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(device)

        out: dict[str, Any] = {"matmul": {}, "all_reduce": [], "collectives": {}, "copy": 0.0}
        sizes = GPU_SQUARE if cuda else SQUARE
        rows = (1024, 4096, 16384) if cuda else (256, 1024)  # tokens of a micro-batch
        shapes = [(n, n, n) for n in sizes] + [(m, k, f * k) for m in rows for k in sizes[:-1] for f in (1, 4)]
        for dtype_name in args["dtypes"]:
            dtype = getattr(torch, dtype_name)
            points = []
            for m, k, n in shapes:
                if not cuda and dtype != torch.float32 and m * k * n > 256**3:
                    continue  # low-precision matmuls on a CPU are slow: small shapes tell enough
                a = torch.randn(m, k, device=device).to(dtype)
                b = torch.randn(k, n, device=device).to(dtype)
                dist.barrier()
                took = _time(functools.partial(torch.mm, a, b), args["seconds"], sync)
                points.append([2.0 * m * k * n, 2.0 * m * k * n / took])
            out["matmul"][dtype_name] = points
            if rank == 0:
                print(f"calibrate: matmuls in {dtype_name} measured ({len(points)} shapes)", file=sys.stderr)
        out["attention"] = _attention(args["dtypes"], cuda, device, 10 * args["seconds"], sync)
        if rank == 0:
            print(f"calibrate: attention in {out['attention']['dtype']} measured", file=sys.stderr)
        # a layer's matmul before each collective: about 1.5 ms in float32 on one CPU thread, 0.6 ms in
        # bfloat16 on an H100
        k, layer_dtype = (4096, torch.bfloat16) if cuda else (256, torch.float32)
        layer_a = torch.randn(k, k, device=device, dtype=layer_dtype)
        layer_b = torch.randn(k, 3 * k, device=device, dtype=layer_dtype)
        layer = functools.partial(torch.mm, layer_a, layer_b)
        for size in GPU_MESSAGE_BYTES if cuda else MESSAGE_BYTES:
            x = torch.ones(size // 4, device=device)
            dist.barrier()
            reduce = functools.partial(dist.all_reduce, x)
            took = _in_step(reduce, layer, 10 * args["seconds"], sync, device)
            out["all_reduce"].append([float(size), took])
        if rank == 0:
            print(f"calibrate: all-reduce over {world} process(es) measured", file=sys.stderr)
        if world > 1:
            for kind in ("reduce_scatter", "all_gather", "all_to_all", "send"):
                points = []
                for size in (GPU_MESSAGE_BYTES if cuda else MESSAGE_BYTES)[::2]:
                    call = _collective(kind, size, rank, world, device)
                    dist.barrier()
                    took = _in_step(call, layer, 10 * args["seconds"], sync, device)
                    points.append([float(size), took])
                out["collectives"][kind] = points
            if rank == 0:
                print("calibrate: reduce-scatter, all-gather, all-to-all and messages measured", file=sys.stderr)
        out["overlap"] = _overlap(world, device, sync) if world > 1 else 1.0
        big = torch.empty(2**26 if cuda else 2**24, device=device)  # 256 MiB / 64 MiB of float32
        dist.barrier()
        # an op as training runs one: read a buffer, write a freshly allocated one
        out["copy"] = 2 * big.numel() * 4 / _time(lambda: big.mul(1.0001), args["seconds"], sync)
        tiny = torch.randn(256, device=device, requires_grad=True)

        def chain() -> None:
            y = tiny
            for _ in range(CHAIN // 2):
                y = y * 1.0001 + 0.0001
            y.sum().backward()

        dist.barrier()
        out["op"] = _time(chain, args["seconds"], sync) / (3 * CHAIN)
        out["memory"] = torch.cuda.get_device_properties(device).total_memory if cuda else None
        out["device"] = torch.cuda.get_device_name(device) if cuda else (platform.processor() or platform.machine())
        out["backend"] = "nccl" if cuda else "gloo"
        results.put((rank, out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it; a silent death would hang it
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        raise


def _fit_all_reduce(points: list[list[float]], world: int) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency s) of t(S) = 2 (n-1) (latency + S / n / bandwidth)."""
    return _fit(points, 2 * max(world - 1, 1), max(world, 2))


def _fit_kind(kind: str, points: list[list[float]], world: int) -> tuple[float, float]:
    """`_fit` in `kind`'s formula (`Hardware.collective_seconds`): a message is latency + S / bandwidth."""
    if kind == "send":
        return _fit(points, 1, 1)
    return _fit(points, RING_STEPS[kind](max(world, 2)), max(world, 2))


def _fit(points: list[list[float]], steps: int, per: int) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of t(S) = steps (latency + S / per / bandwidth): the line
    t = a + c S with the least relative error over the measured (S, t) points (each point's error
    over its own t, so the small messages set the latency and the large ones the bandwidth), a and c
    at least 0."""
    # minimise sum ((a + c S) / t - 1)^2: weights 1 / t^2 on the residuals a + c S - t
    w = [1.0 / max(t, 1e-12) ** 2 for _, t in points]
    sw = sum(w)
    ss = sum(wi * s for wi, (s, _) in zip(w, points, strict=True))
    sss = sum(wi * s * s for wi, (s, _) in zip(w, points, strict=True))
    st = sum(wi * t for wi, (_, t) in zip(w, points, strict=True))
    sst = sum(wi * s * t for wi, (s, t) in zip(w, points, strict=True))
    det = sw * sss - ss * ss
    slope = (sw * sst - ss * st) / det if det > 0 else 0.0
    intercept = (st - slope * ss) / sw
    if slope <= 0:  # no growth with size measured: all latency, bandwidth from the largest message
        slope, intercept = 1e-15, st / sw
    elif intercept < 0:  # the best line through the origin
        slope, intercept = sst / sss, 0.0
    bandwidth = steps / per / max(slope, 1e-15)
    latency = max(intercept, 0.0) / steps
    return bandwidth, latency


def _total_ram() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def measure(world: int, threads: int, dtypes: list[str], seconds: float) -> list[dict[str, Any]]:
    """Each rank's raw measurements (see the module docstring), in rank order."""
    import queue

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        args = {"threads": threads, "dtypes": dtypes, "seconds": seconds}
        procs = [
            ctx.Process(target=_rank, args=(r, world, str(Path(tmp) / "store"), args, results)) for r in range(world)
        ]
        for p in procs:
            p.start()
        got: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + 1800
        while len(got) < world:
            try:
                rank, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    why = f"exit code {dead[0]}" if dead else "no answer in 30 minutes"
                    raise ConfigError(f"calibrate: a process failed ({why})") from None
                continue
            if "error" in value:
                for p in procs:
                    p.kill()
                raise ConfigError(f"calibrate: rank {rank} failed: {value['error']}")
            got[rank] = value
        for p in procs:
            p.join(60)
    return [got[r] for r in range(world)]


def _mean_point(points: list[tuple[float, float]]) -> tuple[float, float]:
    return sum(f for f, _ in points) / len(points), sum(e for _, e in points) / len(points)


def describe(ranks: list[dict[str, Any]], world: int, threads: int, name: str) -> Hardware:
    """The hardware description of the measurements (the slowest rank's figure for each)."""
    from nanocore.hardware import AttentionEfficiency, Hardware, Link

    peaks: dict[str, float] = {}
    curve: list[tuple[float, float]] = []
    for dtype in ranks[0]["matmul"]:
        rates = [min(r["matmul"][dtype][i][1] for r in ranks) for i in range(len(ranks[0]["matmul"][dtype]))]
        flops = [p[0] for p in ranks[0]["matmul"][dtype]]
        peaks[dtype] = max(rates)
        if dtype == "float32" or not curve:  # one curve: float32's where measured
            bins: dict[int, list[tuple[float, float]]] = {}  # shapes within a factor of 2 of FLOPs: their mean
            for f, rate in zip(flops, rates, strict=True):
                bins.setdefault(round(math.log2(f)), []).append((f, rate / peaks[dtype]))
            curve = [_mean_point(pts) for _, pts in sorted(bins.items())]
    measured = ranks[0]["attention"]
    peak = peaks[measured["dtype"]]
    sizes = [p[0] for p in measured["points"]]
    # the slowest rank's rate of each pass, over the dtype's matmul peak (at most 1)
    passes = [
        tuple((f, min(1.0, min(r["attention"]["points"][i][j] for r in ranks) / peak)) for i, f in enumerate(sizes))
        for j in (1, 2)
    ]
    reduce_points = [[p[0], max(r["all_reduce"][i][1] for r in ranks)] for i, p in enumerate(ranks[0]["all_reduce"])]
    bandwidth, latency = _fit_all_reduce(reduce_points, world)
    kinds = {}
    for kind in ranks[0].get("collectives", {}):
        sizes = [p[0] for p in ranks[0]["collectives"][kind]]
        points = [[size, max(r["collectives"][kind][i][1] for r in ranks)] for i, size in enumerate(sizes)]
        kinds[kind] = Link(*_fit_kind(kind, points, world))
    link = Link(bandwidth, latency, kinds)
    cuda = ranks[0]["memory"] is not None
    memory = int(ranks[0]["memory"]) if cuda else _total_ram() // max(world, 1)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    import torch

    per = "" if cuda else f", {threads} thread(s) each"
    source = (
        f"nanocore calibrate on {socket.gethostname()} ({ranks[0]['device']}), {when}, torch {torch.__version__}, "
        f"{world} process(es) over {ranks[0]['backend']}{per}. inter_node repeats intra_node: one machine has no "
        "inter-node link."
    )
    return Hardware(
        name=name,
        source=source,
        peak_flops=peaks,
        memory_bytes=memory,
        devices_per_node=world,
        intra_node=link,
        inter_node=link,
        memory_bandwidth=min(r["copy"] for r in ranks),
        matmul_efficiency=tuple((float(f), float(e)) for f, e in curve),
        op_overhead=max(r["op"] for r in ranks),
        compute_overlap=min(r["overlap"] for r in ranks),
        attention_efficiency=AttentionEfficiency(*passes),
    )


def cmd_calibrate(args: argparse.Namespace) -> int:
    from nanocore.hardware import hardware_to_yaml, load_hardware

    if args.world_size < 1:
        raise ConfigError(f"--world-size: at least 1, got {args.world_size}")
    import torch

    cuda = torch.cuda.is_available()
    if cuda and args.world_size > torch.cuda.device_count():
        raise ConfigError(f"--world-size: {args.world_size} processes but {torch.cuda.device_count()} GPU(s) here")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world_size)
    dtypes = args.dtypes.split(",") if args.dtypes else (["float32", "bfloat16"] if cuda else ["float32"])
    for d in dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtypes: {d!r} is not one of float32, bfloat16, float16")
    output = Path(args.output)
    if not output.parent.exists():
        raise ConfigError(f"--output: the folder {output.parent} does not exist")
    print(f"calibrate: {args.world_size} process(es), measuring (about a minute)", file=sys.stderr)
    ranks = measure(args.world_size, threads, dtypes, args.seconds)
    hw = describe(ranks, args.world_size, threads, args.name or socket.gethostname())
    raw = {
        "matmul_flops_per_s": ranks[0]["matmul"],
        "all_reduce_seconds": [r["all_reduce"] for r in ranks],
        "collective_seconds": [r["collectives"] for r in ranks],
        "attention_flops_per_s": ranks[0]["attention"],
    }
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(hardware_to_yaml(hw, measured=raw))
    load_hardware(str(tmp))  # what it wrote reads back
    tmp.replace(output)
    print(
        f"calibrate: wrote {output}: peak {', '.join(f'{k} {v / 1e9:.1f} GFLOP/s' for k, v in hw.peak_flops.items())}; "
        f"all-reduce bus bandwidth {hw.intra_node.bandwidth / 1e9:.2f} GB/s, "
        f"latency {hw.intra_node.latency * 1e6:.1f} us; "
        f"memory bandwidth {(hw.memory_bandwidth or 0) / 1e9:.1f} GB/s; op overhead {hw.op_overhead * 1e6:.1f} us; "
        f"compute overlap {hw.compute_overlap:.2f}",
        file=sys.stderr,
    )
    if hw.attention_efficiency is not None:
        fwd, bwd = hw.attention_efficiency.forward, hw.attention_efficiency.backward
        print(
            f"calibrate:   attention: forward {min(e for _, e in fwd):.0%}-{max(e for _, e in fwd):.0%} of the peak, "
            f"backward {min(e for _, e in bwd):.0%}-{max(e for _, e in bwd):.0%}",
            file=sys.stderr,
        )
    for kind, link in hw.intra_node.collectives.items():
        print(
            f"calibrate:   {kind}: bandwidth {link.bandwidth / 1e9:.2f} GB/s, latency {link.latency * 1e6:.1f} us",
            file=sys.stderr,
        )
    return 0
