"""Context parallelism at a fixed sequence length: activation memory per rank, tokens/s and bytes sent,
cp 1, 2 and 4 side by side, in both modes (ring and all_to_all).

Each cp runs nanocore's trainer on cp gloo processes (dp = tp = pp = 1: one sequence split over cp
ranks; attention as a ring, or all-to-all over heads: `parallelism.context_parallel_mode`), float32,
random tokens. A step is one `Trainer._train_one_step` (what `Trainer.train` runs per step).
Bytes sent: what rank 0's attention sent to the other cp ranks in a step, counted by the runtime
(`ContextParallel.bytes_sent`: every ring hop and all-to-all, forward and backward).

Activation memory: after a warm-up step (so the optimizer state exists), before each timed step a
rank resets its peak resident size (Linux `VmHWM`, through /proc/self/clear_refs) and notes its
resident size; the peak above that during the step is what the step adds on top of weights,
gradients and optimizer state: activations saved for backward, their gradients, the ring's
messages and score tiles, the logits. The trainer's host allocator setting hands every freed
allocation above 64 KiB back to the system (docs/memory.md), so memory freed by one step is not
counted as already resident in the next. Reported per cp and mode: the largest rank's median over steps, its
ratio to cp 1, tokens/s (global tokens per step / median step time of rank 0) and MiB sent per step.

    python benchmarks/context_parallel_memory.py                 # ~2 minutes on 2 CPU cores
    python benchmarks/context_parallel_memory.py --seq 8192 --json cp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _ranks import CLEAR_REFS, init_rank, kb, llama_config, run_ranks, trainer_for


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", default="1,2,4", help="context-parallel sizes to compare (comma-separated)")
    p.add_argument("--modes", default="ring,all_to_all", help="context_parallel_mode values at each cp > 1")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (fixed across cp)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4, help="query heads (key/value heads = heads / 2)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steps per cp (after 1 warm-up)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def config(args: argparse.Namespace, cp: int, tmp: Path, mode: str = "ring") -> dict[str, Any]:
    parallelism = {"dp": 1, "tp": 1, "pp": 1, "context_parallel_size": cp, "context_parallel_mode": mode}
    return llama_config(args, tmp, f"cp{cp}_{mode}", parallelism, {}, accumulation=1)


def _rank(rank: int, world: int, raw: dict, store: str, steps: int, results) -> None:
    trainer = trainer_for(*init_rank(rank, world, raw, store))
    losses: list[float] = []
    activation_kb, seconds, sent = [], [], []
    sequence = trainer.engine.sequence  # the context-parallel runtime (None at cp 1)
    try:
        for step in range(steps + 1):
            CLEAR_REFS.write_text("5")
            base, sent_before = kb("VmRSS"), sequence.bytes_sent if sequence else 0
            start = time.perf_counter()
            trainer._train_one_step(losses, 1)  # what Trainer.train runs per step
            elapsed = time.perf_counter() - start
            if step > 0:  # the first step also allocates the optimizer state
                activation_kb.append(kb("VmHWM") - base)
                seconds.append(elapsed)
                sent.append((sequence.bytes_sent if sequence else 0) - sent_before)
    finally:
        sequence = None  # it holds the cp process group, which close() destroys
        trainer.close()
    results.put((rank, (statistics.median(activation_kb), statistics.median(seconds), losses, statistics.median(sent))))


def run_cp(args: argparse.Namespace, cp: int, mode: str = "ring") -> dict[str, Any]:
    got = run_ranks(_rank, cp, lambda tmp: config(args, cp, tmp, mode), args.steps, f"cp {cp} {mode}")
    activation_mib = max(g[0] for g in got) / 1024
    step_s = got[0][1]
    return {
        "cp": cp,
        "mode": mode,
        "mib_sent_per_step": got[0][3] / 2**20,
        "activation_mib_per_rank": activation_mib,
        "activation_mib_each_rank": [g[0] / 1024 for g in got],
        "step_seconds": step_s,
        "tokens_per_second": args.seq / step_s,
        "losses": got[0][2],
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    sizes = [int(c) for c in args.cp.split(",")]
    modes = args.modes.split(",")
    rows = []
    for cp in sizes:
        for mode in modes if cp > 1 else modes[:1]:  # at cp 1 attention crosses no rank: one row
            print(f"cp {cp} {mode}: {cp} process(es), sequence {args.seq} ...", flush=True)
            rows.append(run_cp(args, cp, mode))
    base = rows[0]["activation_mib_per_rank"]
    print(
        f"\nLLaMA hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, sequence "
        f"{args.seq}, float32, 1 thread per rank"
    )
    print(
        f"{'cp':>3} {'mode':>10} {'activation MiB/rank':>20} {'vs cp ' + str(sizes[0]):>9} {'tokens/s':>9} "
        f"{'step s':>7} {'MiB sent/step':>14}"
    )
    for row in rows:
        # A step of a tiny model can stay within memory already resident (the trainer returns freed
        # buffers to the system, `nanocore.memory`): 0 KiB measured, and no ratio to it.
        row["ratio_to_first"] = row["activation_mib_per_rank"] / base if base > 0 else None
        ratio = f"{row['ratio_to_first']:>9.3f}" if row["ratio_to_first"] is not None else f"{'-':>9}"
        print(
            f"{row['cp']:>3} {row.get('mode', 'ring'):>10} {row['activation_mib_per_rank']:>20.1f} {ratio} "
            f"{row['tokens_per_second']:>9.0f} {row['step_seconds']:>7.2f} {row.get('mib_sent_per_step', 0):>14.2f}"
        )
    first = [r["losses"][0] for r in rows]
    print(f"step-1 loss of each row (the same computation): {', '.join(f'{x:.6f}' for x in first)}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
