"""What skipping the ring blocks that document masking removes saves, on the long-context example.

The long-context example (examples/config_long_context.yaml: the tiny LLaMA on 2048-byte sequences of
Python files, each sequence split over 4 context-parallel processes, document masking on) is trained
for a few steps twice, with the skip off and on (`SKIP_MASKED_BLOCKS` in
plugins/parallel/context_parallel.py, flipped in the ranks), alternated over rounds, on the same
data. Reported: ring blocks computed and skipped per step (forward passes, all ranks, counted per
sample of a micro-batch: a block is skipped for a sample whose queries and keys share no document), tokens/s of
each side (median step time of rank 0) and their ratio, and the step losses of both (the same
computation: equal within 1e-5).

    python benchmarks/ring_document_skip.py                  # ~5 minutes on 2 CPU cores
    python benchmarks/ring_document_skip.py --steps 6 --rounds 3 --json skip.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from _ranks import init_rank, run_ranks, trainer_for

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "config_long_context.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="timed steps per side and round (after 1 warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each running both sides in turn")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the example's, 2048)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the example's)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def example_config(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The example's config, with its folders in `tmp`, no loggers, no checkpoints, `steps` + 1 steps."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw.pop("plugins")  # its local corpus plugin: loaded by each rank from NANOCORE_PLUGINS (`_rank`)
    raw["checkpoints"].update(checkpoints_path=str(tmp / "checkpoints"), save_final_state=False)
    raw["checkpoints"]["checkpoint_interval"] = 10**6
    raw["logging"].update(log_dir=str(tmp / "logs"), loggers=[])
    raw["tokens"].update(train_steps=args.steps + 1, val_check_interval=-1)
    if args.seq:
        raw["tokens"]["sequence_length"] = args.seq
        raw["model"]["model_config"]["max_position_embeddings"] = args.seq
    if args.layers:
        raw["model"]["model_config"]["num_hidden_layers"] = args.layers
    for stage in raw["data_stages"]:
        stage["data"]["validation_dataset"] = None
    return raw


def _rank(rank: int, world: int, job: dict, store: str, steps: int, results) -> None:
    from nanocore_plugins.parallel import context_parallel

    context_parallel.SKIP_MASKED_BLOCKS = job["skip"]
    os.environ["NANOCORE_PLUGINS"] = ",".join(str(EXAMPLE.parent / spec) for spec in job["plugins"])
    trainer = trainer_for(*init_rank(rank, world, job["config"], store))
    sequence = trainer.engine.sequence
    losses: list[float] = []
    seconds, computed, skipped = [], [], []
    try:
        for step in range(steps + 1):
            before = (sequence.blocks_computed, sequence.blocks_skipped)
            start = time.perf_counter()
            trainer._train_one_step(losses, 1)  # what Trainer.train runs per step
            elapsed = time.perf_counter() - start
            if step > 0:  # the first step also builds the optimizer state
                seconds.append(elapsed)
                computed.append(sequence.blocks_computed - before[0])
                skipped.append(sequence.blocks_skipped - before[1])
    finally:
        sequence = None  # it holds the cp process group, which close() destroys
        trainer.close()
    results.put((rank, {"seconds": seconds, "computed": computed, "skipped": skipped, "losses": losses}))


def run_side(args: argparse.Namespace, skip: bool) -> dict[str, Any]:
    def job(tmp: Path) -> dict[str, Any]:
        plugins = yaml.safe_load(EXAMPLE.read_text())["plugins"]
        return {"config": example_config(args, tmp), "skip": skip, "plugins": plugins}

    world = yaml.safe_load(EXAMPLE.read_text())["parallelism"]["context_parallel_size"]
    got = run_ranks(_rank, world, job, args.steps, f"skip={skip}")
    steps = len(got[0]["seconds"])
    return {
        "step_seconds": statistics.median(got[0]["seconds"]),
        "blocks_computed_per_step": sum(sum(g["computed"]) for g in got) / steps,
        "blocks_skipped_per_step": sum(sum(g["skipped"]) for g in got) / steps,
        "losses": got[0]["losses"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    raw = example_config(args, Path("/nonexistent"))
    tokens = raw["tokens"]["sequence_length"] * raw["tokens"]["micro_batch_size"]
    tokens *= raw["tokens"]["batch_accumulation_per_replica"] * raw["parallelism"]["dp"]
    sides: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for name in ("off", "on"):
            print(f"round {r + 1}: skip {name} ...", flush=True)
            sides[name].append(run_side(args, name == "on"))
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "sides": {}}
    for name, runs in sides.items():
        step_s = statistics.median(run["step_seconds"] for run in runs)
        result["sides"][name] = {
            "tokens_per_second": tokens / step_s,
            "step_seconds": step_s,
            "blocks_computed_per_step": runs[0]["blocks_computed_per_step"],
            "blocks_skipped_per_step": runs[0]["blocks_skipped_per_step"],
            "losses": runs[0]["losses"],
        }
    off, on = result["sides"]["off"], result["sides"]["on"]
    result["speedup"] = on["tokens_per_second"] / off["tokens_per_second"]
    result["max_loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(off["losses"], on["losses"], strict=True))
    print(f"\nlong-context example: sequence {raw['tokens']['sequence_length']}, cp 4, document masking")
    print(f"{'skip':>5} {'blocks computed/step':>21} {'skipped/step':>13} {'tokens/s':>9} {'step s':>7}")
    for name in ("off", "on"):
        side = result["sides"][name]
        print(
            f"{name:>5} {side['blocks_computed_per_step']:>21.1f} {side['blocks_skipped_per_step']:>13.1f} "
            f"{side['tokens_per_second']:>9.0f} {side['step_seconds']:>7.2f}"
        )
    print(f"on / off tokens/s: {result['speedup']:.3f}; largest step-loss difference {result['max_loss_rel_diff']:.1e}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
