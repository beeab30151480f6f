"""What the memory benchmarks share: a small LLaMA config, the trainer built in a gloo rank, resident
memory read from /proc, and their ranks started and collected.

Used by `memory_layouts.py` and `context_parallel_memory.py` (run as scripts: this folder is on
`sys.path`). Linux only, as `peak_memory_mb`'s resettable peak is.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def kb(field: str) -> int:
    """A `/proc/self/status` figure in KiB (VmRSS, VmHWM, RssFile, ...)."""
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in {STATUS} (Linux only)")


def llama_config(
    args: argparse.Namespace, tmp: Path, run: str, parallelism: dict, optimizer: dict, accumulation: int
) -> dict[str, Any]:
    """A float32 LLaMA of `args`' shape (hidden, layers, heads, vocab, seq) on random tokens, micro-batch
    1, `args.steps` + 1 steps (one warm-up), AdamW at a constant rate, no checkpoints, no loggers."""
    return {
        "general": {"seed": 1, "project": "benchmark", "run": run},
        "parallelism": parallelism,
        "model": {
            "model_config": {
                "model_type": "llama",
                "hidden_size": args.hidden,
                "intermediate_size": 4 * args.hidden,
                "num_attention_heads": args.heads,
                "num_key_value_heads": max(1, args.heads // 2),
                "num_hidden_layers": args.layers,
                "vocab_size": args.vocab,
                "max_position_embeddings": args.seq,
            },
            "dtype": "float32",
        },
        "tokenizer": {"tokenizer_name_or_path": None},
        "tokens": {
            "sequence_length": args.seq,
            "train_steps": args.steps + 1,
            "micro_batch_size": 1,
            "batch_accumulation_per_replica": accumulation,
        },
        "optimizer": {
            **optimizer,
            "learning_rate_scheduler": {"learning_rate": 1e-3, "lr_warmup_steps": 0, "lr_decay_style": "constant"},
            "optimizer_factory": {"name": "adam_w", "torch_adam_is_fused": False},
        },
        "data_stages": [{"name": "stable", "start_training_step": 1, "data": {"dataset": None}}],
        "checkpoints": {"checkpoints_path": str(tmp / "checkpoints"), "save_final_state": False},
        "logging": {"log_dir": str(tmp / "logs"), "loggers": []},
    }


def init_rank(rank: int, world: int, raw: dict, store: str):
    """In a fresh rank process: one thread, the gloo group, plugins and the checked config.
    Returns (plugins, config); build the `Trainer` after any measurement baseline."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  before any group exists (see plugins/parallel/grid.py)

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from nanocore.config.checks import check_config
    from nanocore.config.converter import structure_config
    from nanocore.plugins import load_plugins

    plugins = load_plugins()
    config = structure_config(raw, plugins.registries)
    check_config(config, plugins.registries, world)
    return plugins, config


def trainer_for(plugins, config):
    from nanocore.config.load import LoadedConfig
    from nanocore.trainer import Trainer

    trainer = Trainer(LoadedConfig(config, plugins, None))
    trainer.memory.reset = lambda: None  # the trainer's own meter would reset the peak inside a step
    return trainer


def _collect(results, procs, what: str, timeout: float = 1800) -> list:
    """Each rank's `(rank, value)`; a rank that dies first ends the wait at once (its peers would wait
    on it forever) with its exit code, as does a silence of `timeout` seconds."""
    import queue
    import time

    got, deadline = [], time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            got.append(results.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            why = f"rank {dead[0][0]} exited with {dead[0][1]}" if dead else f"no result in {timeout:.0f} s"
            raise RuntimeError(f"{what}: {why}")
    return got


def run_ranks(target: Callable, world: int, make_config: Callable[[Path], dict], steps: int, what: str) -> list:
    """Start `target(rank, world, raw, store, steps, results)` on `world` spawned processes (MALLOC_*
    settings need a fresh process) and return what each put on `results`, in rank order: each
    puts `(rank, value)`."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        raw = make_config(Path(tmp))
        procs = [
            ctx.Process(target=target, args=(r, world, raw, str(Path(tmp) / "store"), steps, results))
            for r in range(world)
        ]
        for proc in procs:
            proc.start()
        got = dict(_collect(results, procs, what))
        for proc in procs:
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"{what}: a rank exited with {proc.exitcode}")
    return [got[r] for r in range(world)]
