"""`nanocore pipeline-probe CONFIG`: the forward, backward, input-gradient and weight-gradient times of
each pipeline block of the config's model, measured on this machine, and what they predict for the
pipeline schedules.

One process, no process group: the model is built whole (tp = cp = 1, the config's dtype, micro-batch
and sequence), and each block (the embedding, each decoder layer, the head with the loss) runs on a
random micro-batch: its forward (F), its whole backward (B), and its backward split as the executor
splits it for the zero-bubble schedules (`split_backward`): the input gradient (I) and, later, the
weight gradients (W). A block's input is the previous block's output, and the gradient it receives
the next block's input gradient, so each block sees the shapes and values of training. Each figure
is the median over `--repeats` rounds after one warm-up round. On CPU the host allocator returns freed
buffers as a run's does (`nanocore.memory.return_freed_memory`), so each block pays the same fresh
pages a run pays.

A stage's times are the sums over the blocks the engine places on it (`build.partition`, the cut a
run of the config makes); as in the executor, the first stage has no input gradient: its I is empty
and its W its whole backward. Under `parallelism.recompute: full` a stage's backward (and I) also
runs the forward again of the blocks recomputed (all but the first and last of the pipeline).

The times go to the simulator (`nanocore.pipeline_sim.simulate`, the same as `nanocore
pipeline-sim` with per-stage `--t-*`) for the config's schedule and, with `--engines`, for others:
the predicted pipeline time of one step on one pipeline rank set, its bubble and peak in-flight
micro-batches. What the probe leaves out: tensor- and context-parallel splitting (a rank computes
about 1 / (tp cp) of these) and their collectives, the messages between stages, data-parallel
reductions and the optimizer step; `nanocore plan --hardware` models those.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import attrs
import torch

from nanocore.errors import ConfigError

DESCRIPTION = (
    "measure each pipeline block's forward, backward, input- and weight-gradient time on this machine "
    "(one process) and predict the pipeline schedules from them"
)
KINDS = ("F", "B", "I", "W")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML training config")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up (default 3)")
    p.add_argument(
        "--engines",
        default=None,
        help="comma-separated schedules to predict (default: the config's pp_engine); multi-chunk ones use "
        "the config's pp_virtual_stages, or 2",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: torch's; a run of N processes on this machine gives each cores / N)",
    )
    p.add_argument(
        "--hardware",
        default=None,
        metavar="NAME|FILE",
        help="also print the time model's F/B per block on this hardware (a calibrate file of this machine): "
        "where the model and the measurement part",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


@attrs.frozen
class BlockTimes:
    """Seconds one micro-batch's forward (F), backward (B), input gradient (I) and weight gradients (W)
    of one pipeline block take; I is 0 for the first block (its input is token ids)."""

    name: str
    F: float
    B: float
    I: float  # noqa: E741 (the schedules' own letter)
    W: float


def probe_blocks(
    blocks: list[list[torch.nn.Module]],
    names: list[str],
    inputs: torch.Tensor,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    repeats: int,
    sync: Callable[[], None] = lambda: None,
) -> list[BlockTimes]:
    """Median F/B/I/W seconds of each block over `repeats` rounds (after one warm-up); `blocks` run
    in order on `inputs`, the last block's output goes through `loss_fn`."""
    from .split_backward import backward_input

    def clock() -> float:
        sync()
        return time.perf_counter()

    def forward(keep: list) -> torch.Tensor:
        x = inputs
        for b, modules in enumerate(blocks):
            x_in = x.detach().requires_grad_(True) if b > 0 else x
            start = clock()
            y = x_in
            for module in modules:
                y = module(y)
            if b == len(blocks) - 1:
                y = loss_fn(y)
            keep.append((x_in, y, clock() - start))
            x = y
        return x

    rounds: list[list[tuple[float, float, float, float]]] = []
    for _ in range(repeats + 1):
        for modules in blocks:
            for m in modules:
                m.zero_grad(set_to_none=True)
        whole: list = []
        forward(whole)
        grad = None
        backward_s = [0.0] * len(blocks)
        for b in reversed(range(len(blocks))):
            x_in, y, _ = whole[b]
            start = clock()
            torch.autograd.backward(y, grad)
            backward_s[b] = clock() - start
            grad = x_in.grad if b > 0 else None
        del whole
        split: list = []
        forward(split)
        grad = None
        measured = [(0.0, 0.0, 0.0, 0.0)] * len(blocks)
        for b in reversed(range(len(blocks))):
            x_in, y, f = split[b]
            weights = [p for m in blocks[b] for p in m.parameters() if p.requires_grad]
            start = clock()
            input_grad, work = backward_input(y, grad, x_in if b > 0 else None, weights)
            took_i = clock() - start if b > 0 else 0.0  # the first block: nothing for I, W is its backward
            start = clock()
            work.run()
            took_w = clock() - start
            measured[b] = (f, backward_s[b], took_i, took_w)
            grad = input_grad
            split[b] = None
        rounds.append(measured)
    rounds = rounds[1:]  # the first round warms up (allocations, lazy initialisation)
    return [
        BlockTimes(name, *(statistics.median(r[b][k] for r in rounds) for k in range(4)))
        for b, name in enumerate(names)
    ]


def stage_times(times: list[BlockTimes], cut: list[list[int]], recompute: bool) -> dict[str, list[float]]:
    """Per-stage F/B/I/W seconds from per-block ones (`cut`: the block indices of each stage)."""
    last = cut[-1][-1]
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    for s, blocks in enumerate(cut):
        got = {k: sum(getattr(times[b], k) for b in blocks) for k in KINDS}
        if recompute:  # every block but the pipeline's first and last runs its forward again
            again = sum(times[b].F for b in blocks if b not in (0, last))
            got["B"] += again
            got["I"] += again
        if s == 0:  # no input gradient: W is the whole backward (as the executor runs it)
            got["I"], got["W"] = 0.0, got["B"]
        for k in KINDS:
            out[k].append(got[k])
    return out


def run(args: argparse.Namespace) -> int:
    from nanocore.config.load import load_config
    from nanocore.dtypes import resolve_dtype
    from nanocore.memory import return_freed_memory
    from nanocore.pipeline_sim import simulate

    from .build import build_local_model, chunk_modules, meta_model, partition_indices
    from .loss import language_model_loss

    if args.repeats < 1:
        raise ConfigError(f"--repeats: at least 1, got {args.repeats}")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads: at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    loaded = load_config(args.config, world_size=None)
    config, registries = loaded.config, loaded.plugins.registries
    par, tokens = config.parallelism, config.tokens
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(config.model.dtype, device)
    if device.type == "cpu":
        return_freed_memory()  # host buffers come and go as in a run (nanocore/memory.py)
    engines = [e.strip() for e in (args.engines or par.pp_engine).split(",") if e.strip()]
    schedules = {name: registries.pipeline_schedule.get(name, path="--engines") for name in engines}

    entry = registries.model.get(config.model.model_type)
    model = meta_model(entry, config.model, vocab_multiple=config.model.make_vocab_size_divisible_by)
    local = build_local_model(
        model, seed=config.general.seed, device=device, dtype=dtype, pp_size=1, pp_rank=0, virtual_stages=1
    )
    blocks = chunk_modules(local)[0]
    names = [",".join(block) for block in local.chunks[0]]
    generator = torch.Generator().manual_seed(config.general.seed)
    shape = (tokens.micro_batch_size, tokens.sequence_length + 1)
    ids = torch.randint(0, local.true_vocab_size, shape, generator=generator).to(device)
    loss = language_model_loss(None, 0, local.true_vocab_size)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if not args.json:
        print(
            f"probing {len(blocks)} blocks of {config.model.model_type} on {device.type} ({str(dtype).split('.')[-1]}, "
            f"micro-batch {tokens.micro_batch_size} x {tokens.sequence_length}, {args.repeats} rounds) ...",
            file=sys.stderr,
            flush=True,
        )
    times = probe_blocks(blocks, names, ids[:, :-1], lambda logits: loss(logits, ids[:, 1:]), args.repeats, sync)

    predicted = None
    if args.hardware is not None:
        from nanocore.hardware import load_hardware

        from .time_model import block_seconds

        whole = attrs.evolve(  # the probe runs whole blocks in one process
            config,
            parallelism=attrs.evolve(par, dp=1, tp=1, pp=1, context_parallel_size=1, expert_parallel_size=1),
        )
        predicted = block_seconds(whole, registries, load_hardware(args.hardware), device.type)
        if len(predicted) != len(times):
            raise ConfigError(f"--hardware: the time model sees {len(predicted)} blocks, the probe {len(times)}")

    m, pp = tokens.batch_accumulation_per_replica, par.pp
    predictions = []
    for name, schedule_entry in schedules.items():
        v = par.pp_virtual_stages if name == par.pp_engine else 1
        check = schedule_entry.extras.get("check")
        probe_config = attrs.evolve(config, parallelism=attrs.evolve(par, pp_engine=name, pp_virtual_stages=v))
        problems = check(probe_config, None) if check is not None else []
        if v == 1 and any("pp_virtual_stages" in x for x in problems):
            v = 2  # a multi-chunk schedule
            probe_config = attrs.evolve(config, parallelism=attrs.evolve(par, pp_engine=name, pp_virtual_stages=v))
            problems = check(probe_config, None) if check is not None else []
        if problems:
            raise ConfigError(f"--engines: {name} at pp {pp}, {m} micro-batches: {problems[0]}")
        if pp * v > len(blocks):
            raise ConfigError(f"--engines: {name}: {len(blocks)} pipeline blocks cannot fill {pp * v} stages")
        per = stage_times(times, partition_indices(len(blocks), pp * v), par.recompute == "full")
        schedule = schedule_entry.factory(probe_config)
        result = simulate(
            schedule,
            pp,
            m,
            v,
            t_forward=per["F"],
            t_backward=per["B"],
            t_input=per["I"],
            t_weight=per["W"],
        )
        predictions.append(
            {
                "engine": name,
                "virtual_stages": v,
                "stage_seconds": per,
                "pipeline_seconds": result.makespan,
                "bubble_fraction": result.bubble_fraction,
                "peak_in_flight_microbatches": list(result.peak_in_flight_microbatches),
                "tokens_per_second_per_pipeline": m
                * tokens.micro_batch_size
                * tokens.sequence_length
                / result.makespan,
            }
        )
    if args.json:
        out = {"blocks": [attrs.asdict(t) for t in times], "pp": pp, "microbatches": m, "predictions": predictions}
        if predicted is not None:
            out["time_model_blocks"] = predicted
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    model_head = f" {'model F':>8} {'model B':>8} {'meas/model':>10}" if predicted is not None else ""
    print(f"{'block':<40} {'F ms':>8} {'B ms':>8} {'I ms':>8} {'W ms':>8} {'(I+W)/B':>8}{model_head}")
    for b, t in enumerate(times):
        ratio = f"{(t.I + t.W) / t.B:.2f}" if t.B > 0 else "-"
        line = f"{t.name[:40]:<40} {t.F * 1e3:>8.2f} {t.B * 1e3:>8.2f} {t.I * 1e3:>8.2f} {t.W * 1e3:>8.2f} {ratio:>8}"
        if predicted is not None:
            f, bwd = predicted[b]["F"], predicted[b]["B"]
            share = f"{(t.F + t.B) / (f + bwd):.2f}" if f + bwd > 0 else "-"
            line += f" {f * 1e3:>8.2f} {bwd * 1e3:>8.2f} {share:>10}"
        print(line)
    left_out = "" if par.tp * par.context_parallel_size == 1 else " (whole blocks: this layout's tp x cp splits them)"
    print(f"\npp {pp}, {m} micro-batches; pipeline only{left_out}, messages and the optimizer step left out")
    for p in predictions:
        print(
            f"{p['engine']:<12} v={p['virtual_stages']}  {p['pipeline_seconds']:.4f} s per step  "
            f"bubble {p['bubble_fraction']:.3f}  peak in-flight {max(p['peak_in_flight_microbatches']):g} "
            f"micro-batches  {p['tokens_per_second_per_pipeline']:.0f} tokens/s per pipeline"
        )
        per = p["stage_seconds"]
        flags = " ".join(
            f"--t-{k} {','.join(f'{x:.6g}' for x in per[key])}"
            for k, key in (("forward", "F"), ("backward", "B"), ("input", "I"), ("weight", "W"))
        )
        print(
            f"  nanocore pipeline-sim --engine {p['engine']} --pp {pp} --microbatches {m} "
            f"--virtual-stages {p['virtual_stages']} {flags}"
        )
    return 0
