"""Memory and speed per rank across ZeRO stages and recompute granularities, side by side.

Each layout runs nanocore's trainer (the built-in `nd` engine, gloo processes, 1 thread per rank,
float32, random tokens) on the same model and global batch:

- ZeRO stages 0, 1, 2 and 3 at dp 4: where parameters, gradients and optimizer state live;
- recompute none, selective (the attention core) and full (whole decoder layers) at one process:
  what recomputation saves in activation memory and costs in time.

Per layout: bytes each rank holds for parameters, gradients and optimizer state (the engine's own
account of its buffers, `Engine.memory_estimate`), the measured peak resident memory of the largest
rank above its size before the run was built (Linux `VmHWM` from `peak_memory_mb`'s baseline; file-
backed pages included, which `peak_memory_mb` leaves out)
beside what `nanocore plan` predicts for it,
the largest rank's peak activation memory (what a step adds above its resident size at the step's
start), and tokens/s (global tokens per step over rank 0's median step time). The trainer's host
allocator setting returns every freed allocation above 64 KiB to the system (docs/memory.md), so a
freed buffer is not counted as resident in the next step.

    python benchmarks/memory_layouts.py                 # ~3-5 minutes on 2 CPU cores
    python benchmarks/memory_layouts.py --layouts zero --json zero.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs
from _ranks import CLEAR_REFS, init_rank, kb, llama_config, run_ranks, trainer_for

LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {  # name -> (parallelism + optimizer overrides, ranks)
    "zero0_dp4": ({"dp": 4, "zero_stage": 0}, 4),
    "zero1_dp4": ({"dp": 4, "zero_stage": 1}, 4),
    "zero2_dp4": ({"dp": 4, "zero_stage": 2}, 4),
    "zero3_dp4": ({"dp": 4, "zero_stage": 3}, 4),
    "recompute_none": ({}, 1),
    "recompute_selective": ({"recompute_granularity": "selective"}, 1),
    "recompute_full": ({"recompute_granularity": "full"}, 1),
}
GROUPS = {"zero": [k for k in LAYOUTS if k.startswith("zero")], "recompute": [k for k in LAYOUTS if "recompute" in k]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", choices=("all", *GROUPS), default="all")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="query heads (key/value heads = heads / 2)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=4, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def config(args: argparse.Namespace, name: str, tmp: Path) -> dict[str, Any]:
    options, world = LAYOUTS[name]
    options = dict(options)
    zero = options.pop("zero_stage", 0)
    dp = options.get("dp", 1)
    parallelism = {"dp": dp, "tp": 1, "pp": 1, **options}
    return llama_config(args, tmp, name, parallelism, {"zero_stage": zero}, accumulation=args.global_batch // dp)


def _rank(rank: int, world: int, raw: dict, store: str, steps: int, results) -> None:
    plugins, config = init_rank(rank, world, raw, store)
    from nanocore.plan import plan_for

    planned = plan_for(config, plugins.registries, "cpu")
    CLEAR_REFS.write_text("5")
    trainer = trainer_for(plugins, config)
    before = trainer.memory.baseline_kb  # what peak_memory_mb counts from: start-up done, nothing built
    losses: list[float] = []
    activation_kb, seconds = [], []
    try:
        peak = 0
        for step in range(steps + 1):
            peak = max(peak, kb("VmHWM"))  # building the run, and the steps before: resets below lose it
            CLEAR_REFS.write_text("5")
            base = kb("VmRSS")
            start = time.perf_counter()
            trainer._train_one_step(losses, 1)  # what Trainer.train runs per step
            elapsed = time.perf_counter() - start
            step_peak = kb("VmHWM")
            peak = max(peak, step_peak)
            if step > 0:  # the first step also allocates the optimizer state
                activation_kb.append(step_peak - base)
                seconds.append(elapsed)
        estimate = trainer.engine.memory_estimate()
        ctx = trainer.engine.grid
        mine = attrs.asdict(next(r for r in planned.ranks if (r.pp_rank, r.tp_rank) == (ctx.pp_rank, ctx.tp_rank)))
    finally:
        trainer.close()
    results.put(
        (
            rank,
            {
                "peak_mib": (peak - before) / 1024,
                "activation_mib": statistics.median(activation_kb) / 1024,
                "step_seconds": statistics.median(seconds),
                "params_mib": estimate.params_bytes / 2**20,
                "grads_mib": estimate.grads_bytes / 2**20,
                "optimizer_mib": (estimate.optimizer_bytes or 0) / 2**20,
                "planned_mib": mine["total_bytes"] / 2**20,
                "losses": losses,
            },
        )
    )


def run_layout(args: argparse.Namespace, name: str) -> dict[str, Any]:
    world = LAYOUTS[name][1]
    ranks = run_ranks(_rank, world, lambda tmp: config(args, name, tmp), args.steps, name)
    largest = max(ranks, key=lambda r: r["peak_mib"])
    tokens = args.global_batch * args.seq
    return {
        "layout": name,
        "ranks": world,
        "params_mib": largest["params_mib"],
        "grads_mib": largest["grads_mib"],
        "optimizer_mib": largest["optimizer_mib"],
        "peak_mib": largest["peak_mib"],
        "planned_mib": largest["planned_mib"],
        "activation_mib": max(r["activation_mib"] for r in ranks),
        "step_seconds": ranks[0]["step_seconds"],
        "tokens_per_second": tokens / ranks[0]["step_seconds"],
        "tokens_per_second_per_rank": tokens / ranks[0]["step_seconds"] / world,
        "losses": ranks[0]["losses"],
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    names = list(LAYOUTS) if args.layouts == "all" else GROUPS[args.layouts]
    rows = []
    for name in names:
        print(f"{name}: {LAYOUTS[name][1]} process(es) ...", flush=True)
        rows.append(run_layout(args, name))
    print(
        f"\nLLaMA hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, sequence "
        f"{args.seq}, global batch {args.global_batch}, float32, 1 thread per rank; MiB per rank (largest rank)"
    )
    head = ("layout", "params", "grads", "optimizer", "peak", "planned", "activations", "tokens/s", "tok/s/rank")
    print(f"{head[0]:>20} " + " ".join(f"{h:>11}" for h in head[1:]))
    for row in rows:
        figures = (
            row["params_mib"], row["grads_mib"], row["optimizer_mib"], row["peak_mib"], row["planned_mib"],
            row["activation_mib"],
            row["tokens_per_second"], row["tokens_per_second_per_rank"],
        )  # fmt: skip
        print(f"{row['layout']:>20} " + " ".join(f"{x:>11.1f}" for x in figures))
    for group in GROUPS.values():
        first = [r["losses"][0] for r in rows if r["layout"] in group]
        if first:
            print(f"step-1 loss of {', '.join(group)}: {', '.join(f'{x:.6f}' for x in first)} (the same computation)")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
