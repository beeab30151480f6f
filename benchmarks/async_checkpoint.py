"""Asynchronous checkpoints, measured: how long the step that saves stops training, synchronous
(`checkpoints.async_save: false`: write, checksum, fsync, rename) against asynchronous (copy to host
memory, the rest in a background thread).

Each round trains the same LLaMA shape twice, once per mode in an order alternated from round to
round, saving every `--interval` steps into a fresh folder. Timed per save: the `save_checkpoint`
call on the training thread (what the step that saves stalls), and in async mode the steps that run
while the write is in flight (on CPU the writer competes with training for the cores; on a GPU it
would not). Figures are medians over all saves of all rounds.

    python benchmarks/async_checkpoint.py                    # the 56M shape of train_throughput.py
    python benchmarks/async_checkpoint.py --hidden 256 --layers 4 --vocab 8192 --seq 256   # 7M
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_throughput as tt  # noqa: E402  (benchmarks/ is not a package)

from nanocore import hookimpl  # noqa: E402

MODES = ("sync", "async")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--steps", type=int, default=9, help="steps per run")
    p.add_argument("--interval", type=int, default=3, help="save every N steps")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--folder", type=Path, default=None, help="where checkpoints go (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.dtype, args.device, args.no_fused = "float32", "cpu", False
    return args


class Clock:
    """Step times (a nanocore plugin object), and which steps ran while a background write was in flight."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, bool]] = []
        self.mark = 0.0

    @hookimpl
    def on_step_end(self, step, metrics, trainer) -> None:
        now = time.perf_counter()
        in_flight = trainer._pending is not None and not trainer._pending.done()
        self.steps.append((now - self.mark, in_flight))
        self.mark = now


def run(mode: str, args: argparse.Namespace, plugins, clock: Clock, folder: Path) -> tuple[list[float], list]:
    from nanocore.config.checks import check_config
    from nanocore.config.converter import structure_config
    from nanocore.config.load import LoadedConfig
    from nanocore.trainer import Trainer

    raw = tt.nanocore_config(args, folder, args.steps)
    raw["checkpoints"].update(checkpoint_interval=args.interval, async_save=mode == "async", save_final_state=False)
    config = structure_config(raw, plugins.registries)
    check_config(config, plugins.registries, 1)
    trainer = Trainer(LoadedConfig(config, plugins, None))
    saves: list[float] = []
    real = trainer.save_checkpoint

    def timed() -> Path:
        start = time.perf_counter()
        out = real()
        saves.append(time.perf_counter() - start)
        clock.mark += saves[-1]  # the step's time without its save
        return out

    trainer.save_checkpoint = timed  # type: ignore[method-assign]
    try:
        clock.steps, clock.mark = [], time.perf_counter()
        trainer.train()
    finally:
        trainer.close()
    return saves, clock.steps[1:]  # the first step warms up


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    from nanocore.plugins import load_plugins

    torch.set_num_threads(args.threads)
    plugins = load_plugins()
    clock = Clock()
    plugins.register_object(clock, "benchmark-clock")
    saves: dict[str, list[float]] = {m: [] for m in MODES}
    steps: dict[str, list[tuple[float, bool]]] = {m: [] for m in MODES}
    root = args.folder or Path(tempfile.mkdtemp(prefix="nanocore-async-bench-"))
    print(
        f"torch {torch.__version__}, {args.threads} threads; llama hidden {args.hidden}, {args.layers} layers, "
        f"vocab {args.vocab}, seq {args.seq}; {args.steps} steps per run, a save every {args.interval}; "
        f"{args.rounds} rounds, modes alternated; checkpoints in {root}",
        flush=True,
    )
    try:
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                folder = root / f"{mode}-{r}"
                got, timed = run(mode, args, plugins, clock, folder)
                saves[mode] += got
                steps[mode] += timed
                size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
                shutil.rmtree(folder, ignore_errors=True)
                gc.collect()
                print(f"round {r + 1} {mode:>5}: saves {', '.join(f'{s:.2f}' for s in got)} s", flush=True)
    finally:
        if args.folder is None:
            shutil.rmtree(root, ignore_errors=True)
    median = {m: statistics.median(saves[m]) for m in MODES}
    plain = statistics.median(t for t, _ in steps["sync"])
    during = [t for t, busy in steps["async"] if busy]
    results = {
        "checkpoint_mib": size / 2**20,
        "save_call_s": median,
        "stall_ratio": median["async"] / median["sync"],
        "step_s_sync_mode": plain,
        "step_s_while_writing": statistics.median(during) if during else None,
    }
    print(f"\ncheckpoint size {results['checkpoint_mib']:.0f} MiB")
    print(f"the step that saves stops training: sync {median['sync']:.2f} s, async {median['async']:.2f} s")
    print(f"    ratio async / sync = {results['stall_ratio']:.3f} (goal <= 0.20)")
    if during:
        print(
            f"steps while a background write is in flight: {results['step_s_while_writing']:.2f} s "
            f"(median of {len(during)}), against {plain:.2f} s without one"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
