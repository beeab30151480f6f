"""torch.compile, measured: nanocore eager and compiled against transformers eager and compiled.

Four sides train the same LLaMA shape on the same batch geometry with the same AdamW and clipping
(`train_throughput.py` describes the two loops): nanocore's trainer with `model.compile: false` and
`true` (regional: one compiled graph per block shape), and the hand loop over transformers'
`LlamaForCausalLM`, eager and `torch.compile(model)` (what a transformers user writes).

Each round runs every side once, in an order rotated from round to round (alternated, so machine
noise hits all sides alike): the side is built afresh, its first step is timed on its own (for a
compiled side that is when it compiles; inductor's cache is reset before it so every round pays the
full compile, as a fresh run with an empty cache would), then `--steps` steps are timed. A side's
figure is the median step over all rounds. Peak memory is measured per side in a fresh subprocess
(warm-up + 2 steps): the peak resident set above the RSS after imports on CPU, or
`torch.cuda.max_memory_allocated` on CUDA.

    python benchmarks/compile_throughput.py                    # 7M shape (train_throughput's default)
    python benchmarks/compile_throughput.py --hidden 512 --layers 8 --vocab 32000 --seq 512 \
        --accumulation 1 --rounds 2 --threads 2               # 56M
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_throughput as tt  # noqa: E402  (benchmarks/ is not a package)

from nanocore import hookimpl  # noqa: E402

SIDES = ("nanocore eager", "nanocore compiled", "transformers eager", "transformers compiled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = tt.parse_args([a for a in (argv or []) if a not in ("--keep-cache",)] + ["--baseline", "transformers"])
    args.keep_cache = "--keep-cache" in (argv or [])
    return args


def _reset_compile_caches(keep_disk: bool) -> None:
    import torch

    torch.compiler.reset()
    if not keep_disk:  # a fresh run: nothing compiled before, in memory or on disk
        import shutil
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="nanocore-inductor-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
        shutil.rmtree(folder, ignore_errors=True)


class StepClock:
    """A nanocore plugin object: the wall time of each nanocore step (the first on its own)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.mark = 0.0

    @hookimpl
    def on_step_end(self, step, metrics, trainer) -> None:
        now = time.perf_counter()
        self.times.append(now - self.mark)
        self.mark = now


def run_side(side: str, args: argparse.Namespace, plugins, clock: StepClock, tmp: Path, steps: int) -> list[float]:
    """Build `side` afresh and run 1 + `steps` steps; returns every step's wall time."""
    import torch

    if side.startswith("nanocore"):
        from nanocore.config.checks import check_config
        from nanocore.config.converter import structure_config
        from nanocore.config.load import LoadedConfig
        from nanocore.trainer import Trainer

        raw = tt.nanocore_config(args, tmp, steps + 1)
        raw["model"]["compile"] = side.endswith("compiled")
        config = structure_config(raw, plugins.registries)
        check_config(config, plugins.registries, 1)
        trainer = Trainer(LoadedConfig(config, plugins, None))
        try:
            clock.times, clock.mark = [], time.perf_counter()
            trainer.train()
        finally:
            trainer.close()
        return list(clock.times)
    loop = tt.PlainLoop(args)
    if side.endswith("compiled"):
        loop.model = torch.compile(loop.model)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loop.step()
        times.append(time.perf_counter() - start)
    return times


def memory_probe(side: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from nanocore.memory import return_freed_memory
    from nanocore.plugins import load_plugins

    return_freed_memory()  # what nanocore's trainer does at start-up, for the baseline sides too

    plugins = load_plugins()
    clock = StepClock()
    plugins.register_object(clock, "benchmark-clock")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="nanocore-bench-") as tmp:
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            run_side(side, args, plugins, clock, Path(tmp), 2)
            return {"peak_mib": torch.cuda.max_memory_allocated() / 2**20}
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        base = tt._proc_status_kib("VmRSS")
        run_side(side, args, plugins, clock, Path(tmp), 2)
        return {"peak_mib": (tt._proc_status_kib("VmHWM") - base) / 1024}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    probe = None
    if "--probe" in argv:
        i = argv.index("--probe")
        probe, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    args = parse_args(argv)
    tt.use_device(args)
    import torch

    if probe is not None:
        print("MEMORY " + json.dumps(memory_probe(probe, args)), flush=True)
        return {}

    import tempfile

    from nanocore.plugins import load_plugins

    plugins = load_plugins()
    clock = StepClock()
    plugins.register_object(clock, "benchmark-clock")
    tokens = args.micro_batch_size * args.accumulation * args.seq
    print(
        f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, {args.dtype}; llama "
        f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {tokens} tokens/step; {args.rounds} rounds "
        f"x (first step + {args.steps} timed steps) per side, sides alternated",
        flush=True,
    )
    first: dict[str, list[float]] = {s: [] for s in SIDES}
    steady: dict[str, list[float]] = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory(prefix="nanocore-bench-") as tmp:
        for r in range(args.rounds):
            order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]
            for side in order:
                _reset_compile_caches(args.keep_cache)
                times = run_side(side, args, plugins, clock, Path(tmp) / f"{r}", args.steps)
                first[side].append(times[0])
                steady[side] += times[1:]
                gc.collect()
            print(
                f"round {r + 1}: "
                + ", ".join(f"{s} {tokens / statistics.median(steady[s][-args.steps :]):.0f} tok/s" for s in SIDES),
                flush=True,
            )
    memory: dict[str, float] = {}
    if not args.no_memory:
        for side in SIDES:
            memory[side] = tt.probe_memory(__file__, argv, args.device, "--probe", side)["peak_mib"]
    rate = {s: tokens / statistics.median(steady[s]) for s in SIDES}
    print(f"\n{'side':>22} {'tokens/s':>9} {'first step s':>13} {'peak MiB':>9}")
    for s in SIDES:
        mem = f"{memory[s]:9.0f}" if memory else f"{'-':>9}"
        print(f"{s:>22} {rate[s]:9.0f} {statistics.median(first[s]):13.1f} {mem}")
    results = {
        "compiled_over_eager": rate["nanocore compiled"] / rate["nanocore eager"],
        "compiled_over_transformers_compiled": rate["nanocore compiled"] / rate["transformers compiled"],
        "tokens_per_s": rate,
        "first_step_s": {s: statistics.median(first[s]) for s in SIDES},
        "peak_mib": memory,
    }
    print(
        f"ratios: nanocore compiled / eager = {results['compiled_over_eager']:.3f} (goal >= 1.15); "
        f"nanocore compiled / transformers compiled = {results['compiled_over_transformers_compiled']:.3f} "
        "(goal >= 1.0)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
