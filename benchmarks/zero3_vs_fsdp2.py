"""nanocore's ZeRO-3 against torch's own FSDP2 (`fully_shard`), side by side, per data-parallel size.

Side A is nanocore's trainer (the built-in `nd` engine, `zero_stage: 3`, gloo ranks, one thread
per rank, float32, random tokens). Side B is the loop a user would write with FSDP2 instead:
transformers' `LlamaForCausalLM` (SDPA attention; `--baseline-model nanocore`: nanocore's own LLaMA
module and its fused loss, which isolates the sharding machinery) with one `fully_shard` per decoder
layer plus one at the root, AdamW over the sharded parameters (weight decay on matrices only),
`clip_grad_norm_`, `F.cross_entropy` (which keeps a logits-sized log-softmax for backward),
`loss.backward()` per micro-batch. Both start from the same
weights (nanocore's initialisation, through the Hugging Face conversion for transformers) and read
the same samples in the same order (nanocore's data schedule over `dataset: null`), so their losses
are the same computation: the figure reported is the largest difference over the steps.

Per side: the peak memory of the largest rank over the steps (`peak_memory_mb`'s measure: resident
memory above the rank's size before the model was built, less file-backed pages; building the run
is not counted) and tokens/s (global tokens per step over rank 0's median step time, the first step
not timed). Rounds alternate the sides (A B, then B A, ...); each figure is the median over rounds.
Both sides run with nanocore's host allocator setting (`nanocore.memory.return_freed_memory`), so
freed buffers do not count as held on either side.

    python benchmarks/zero3_vs_fsdp2.py                   # 56M shape, dp 2 and 4: ~10 minutes on 2 cores
    python benchmarks/zero3_vs_fsdp2.py --hidden 128 --layers 2 --vocab 4096 --seq 64 --dp 2 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _ranks import init_rank, run_ranks
from train_throughput import OPTIMIZER, SEED, adamw, model_fields, transformers_llama

SIDES = ("nanocore_zero3", "fsdp2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="data-parallel sizes to compare")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8, help="query heads (key/value heads = heads / 2)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps per side per round, after one untimed")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--baseline-model", choices=("transformers", "nanocore"), default="transformers")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def config(args: argparse.Namespace, dp: int, tmp: Path) -> dict[str, Any]:
    per_replica = args.global_batch // dp
    return {
        "general": {"seed": SEED, "project": "benchmark", "run": f"zero3_dp{dp}"},
        "parallelism": {"dp": dp, "tp": 1, "pp": 1},
        "model": {"model_config": model_fields(args), "dtype": "float32", "init_method": {"std": 0.02}},
        "tokenizer": {"tokenizer_name_or_path": None},
        "tokens": {
            "sequence_length": args.seq,
            "train_steps": args.steps + 1,
            "micro_batch_size": args.micro_batch_size,
            "batch_accumulation_per_replica": per_replica // args.micro_batch_size,
        },
        "optimizer": {
            "zero_stage": 3,
            "weight_decay": OPTIMIZER["weight_decay"],
            "clip_grad": OPTIMIZER["clip_grad"],
            "learning_rate_scheduler": {
                "learning_rate": OPTIMIZER["lr"],
                "lr_warmup_steps": 0,
                "lr_decay_style": "constant",
            },
            "optimizer_factory": {
                "name": "adam_w",
                "adam_beta1": OPTIMIZER["betas"][0],
                "adam_beta2": OPTIMIZER["betas"][1],
                "adam_eps": OPTIMIZER["eps"],
                "torch_adam_is_fused": False,
            },
        },
        "data_stages": [{"name": "stable", "start_training_step": 1, "data": {"dataset": None}}],
        "checkpoints": {"checkpoints_path": str(tmp / "checkpoints"), "save_final_state": False},
        "logging": {"log_dir": str(tmp / "logs"), "loggers": []},
        "baseline_model": args.baseline_model,  # read by the FSDP2 side, dropped before structuring
    }


def _nanocore_rank(rank: int, world: int, raw: dict, store: str, steps: int, results) -> None:
    raw = {k: v for k, v in raw.items() if k != "baseline_model"}
    plugins, config = init_rank(rank, world, raw, store)
    from nanocore.config.load import LoadedConfig
    from nanocore.trainer import Trainer

    trainer = Trainer(LoadedConfig(config, plugins, None))
    meter = trainer.memory  # made before anything of the run was built
    reset, meter.reset = meter.reset, lambda: None  # the trainer resets it after logging each step
    losses: list[float] = []
    seconds, peak = [], 0.0
    try:
        for step in range(steps + 1):
            reset()
            start = time.perf_counter()
            trainer._train_one_step(losses, 1)  # what Trainer.train runs per step
            if step > 0:
                seconds.append(time.perf_counter() - start)
            peak = max(peak, meter.peak_mb())
    finally:
        trainer.close()
    results.put((rank, {"peak_mib": peak, "step_seconds": statistics.median(seconds), "losses": losses}))


def _fsdp2_rank(rank: int, world: int, raw: dict, store: str, steps: int, results) -> None:
    baseline_model = raw["baseline_model"]
    raw = {k: v for k, v in raw.items() if k != "baseline_model"}
    plugins, config = init_rank(rank, world, raw, store)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import transformers  # noqa: F401  imported before the meter's baseline, as nanocore's plugins are
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nanocore.data.build import stage_mixture
    from nanocore.data.schedule import DataSchedule
    from nanocore.memory import MemoryMeter, return_freed_memory
    from nanocore_plugins.llama.config import LlamaConfig
    from nanocore_plugins.llama.model import LlamaForCausalLM
    from nanocore_plugins.parallel.build import initialise_whole

    return_freed_memory()  # what nanocore's trainer does at start-up
    meter = MemoryMeter(torch.device("cpu"))
    fields = {k: v for k, v in raw["model"]["model_config"].items() if k != "model_type"}
    model_config = LlamaConfig(**fields)
    model = LlamaForCausalLM(model_config, init_std=0.02)
    initialise_whole(model, SEED)  # nanocore's starting weights, as every layout's
    cross_entropy = F.cross_entropy
    if baseline_model == "transformers":
        model = transformers_llama(model_config, model)
    else:
        from nanocore_plugins.parallel.loss import cross_entropy  # nanocore's fused loss
    model.train()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = adamw(model, foreach=False, fused=False)  # nanocore's `torch_adam_is_fused: false`
    data = DataSchedule(
        [s.name for s in config.data_stages],
        [s.start_training_step for s in config.data_stages],
        lambda i: stage_mixture(
            config, i, "dataset", None, model_config.vocab_size, plugins.registries, is_main=True, barrier=lambda: None
        ),
        global_batch_size=config.global_batch_size,
        micro_batch_size=config.tokens.micro_batch_size,
        dp_rank=rank,
        dp_size=world,
    )
    losses: list[float] = []
    seconds, peak = [], 0.0
    for step in range(1, steps + 2):
        meter.reset()
        start = time.perf_counter()
        micro_batches = data.next_batch(step)
        total = torch.zeros(())
        for micro in micro_batches:
            logits = model(micro[:, :-1])
            if baseline_model == "transformers":
                logits = logits.logits
            loss = cross_entropy(logits.flatten(0, 1).float(), micro[:, 1:].flatten()) / len(micro_batches)
            loss.backward()
            total += loss.detach()
            del logits, loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIMIZER["clip_grad"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)  # the loss over the global batch, as nanocore reports it
        losses.append(float(total) / world)
        if step > 1:
            seconds.append(time.perf_counter() - start)
        peak = max(peak, meter.peak_mb())
    dist.destroy_process_group()
    results.put((rank, {"peak_mib": peak, "step_seconds": statistics.median(seconds), "losses": losses}))


def run_side(args: argparse.Namespace, side: str, dp: int) -> dict[str, Any]:
    target = _nanocore_rank if side == "nanocore_zero3" else _fsdp2_rank
    ranks = run_ranks(target, dp, lambda tmp: config(args, dp, tmp), args.steps, f"{side} dp{dp}")
    return {
        "peak_mib": max(r["peak_mib"] for r in ranks),
        "tokens_per_second": args.global_batch * args.seq / ranks[0]["step_seconds"],
        "losses": ranks[0]["losses"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {dp: {side: [] for side in SIDES} for dp in args.dp}
    for r in range(args.rounds):
        for dp in args.dp:
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                print(f"round {r + 1}/{args.rounds}: {side} dp{dp} ...", flush=True)
                runs[dp][side].append(run_side(args, side, dp))
    print(
        f"\nLLaMA hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, sequence {args.seq}, global "
        f"batch {args.global_batch} (micro-batch {args.micro_batch_size}), float32, 1 thread per rank, "
        f"FSDP2 over {args.baseline_model}'s model; medians of {args.rounds} alternated rounds"
    )
    head = ("dp", "side", "peak MiB/rank", "tokens/s", "peak ratio", "tok/s ratio", "max |loss diff|")
    print(f"{head[0]:>3} {head[1]:>15} " + " ".join(f"{h:>15}" for h in head[2:]))
    rows = []
    for dp in args.dp:
        sides = {
            side: {
                "peak_mib": statistics.median(x["peak_mib"] for x in runs[dp][side]),
                "tokens_per_second": statistics.median(x["tokens_per_second"] for x in runs[dp][side]),
                "losses": runs[dp][side][0]["losses"],
            }
            for side in SIDES
        }
        ours, theirs = sides["nanocore_zero3"], sides["fsdp2"]
        diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
        row = {
            "dp": dp,
            **{f"{side}_{k}": v for side, figures in sides.items() for k, v in figures.items()},
            "peak_ratio": ours["peak_mib"] / theirs["peak_mib"],
            "tokens_per_second_ratio": ours["tokens_per_second"] / theirs["tokens_per_second"],
            "max_loss_difference": diff,
        }
        rows.append(row)
        for side in SIDES:
            figures = sides[side]
            ratios = (
                f"{row['peak_ratio']:>15.3f} {row['tokens_per_second_ratio']:>15.3f} {diff:>15.2e}"
                if side == "nanocore_zero3"
                else ""
            )
            print(f"{dp:>3} {side:>15} {figures['peak_mib']:>15.1f} {figures['tokens_per_second']:>15.1f} {ratios}")
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
