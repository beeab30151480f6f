"""Training throughput and peak memory: nanocore's trainer against the loop a user would write instead.

Side A is the real nanocore path: a config dict structured through the plugin registries, the
`Trainer` with the built-in `nd` engine (dp = tp = pp = 1), random tokens (`dataset: null`), no
loggers, no checkpoints. Side B (`--baseline`) is the loop one would write by hand, over
`transformers`' `LlamaForCausalLM` (the default: SDPA attention, the same shape, nanocore's starting
weights through the Hugging Face conversion) or over nanocore's own LLaMA module (`plain`, which
sees the trainer's overhead but not the model's): the same batch (micro_batch_size x accumulation x
sequence_length), the same AdamW (same `fused` setting, weight decay on matrices only), the same
gradient clipping, `F.cross_entropy`, `loss.backward()` per micro-batch, then `optimizer.step();
optimizer.zero_grad(set_to_none=True)`.

Throughput: both sides run in this process, interleaved step by step (A B A B ...): at the end of
each nanocore step an observer plugin (`on_step_end`) runs one step of the plain loop. A nanocore
step is timed from the end of the plain step before it to its own end, so it covers everything the
trainer does per step (data, LR, engine step, metrics, hooks); a plain step covers its batch, its
micro-batches, clipping and the optimizer step. Each round builds both sides afresh; the first step
of each side per round is a warm-up and is not timed. Each side's figure is the median step time
over all rounds, so machine noise (other processes on the same cores) hits both alike.

Memory: each side runs once more in a fresh subprocess (warm-up + 2 steps). On CPU the figure is
the peak resident set size (VmHWM) of that process, reset (via /proc/self/clear_refs) once torch and
the plugins are imported, so it counts the model, data, activations, gradients and optimizer state
the side allocates and not the libraries. On CUDA it is `torch.cuda.max_memory_allocated`.

    python benchmarks/train_throughput.py                 # defaults: ~1-2 minutes on 2 CPU cores
    python benchmarks/train_throughput.py --hidden 512 --layers 8 --vocab 32000 --seq 512 \
        --accumulation 1 --rounds 5 --threads 2          # 56M parameters
    python benchmarks/train_throughput.py --baseline plain   # nanocore's own module in a hand loop
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nanocore import hookimpl  # light: torch is imported later, after --device is applied

SIDES = ("nanocore", "baseline")
SEED = 1234


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per side per round (after 1 warm-up)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds; each side's figure is the median")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (intermediate = 8/3 x hidden, rounded)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=8, help="query heads (key/value heads = heads / 2)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    p.add_argument("--seq", type=int, default=256, help="sequence length")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 1 by default because multi-threaded kernels degrade badly on shared cores",
    )
    p.add_argument("--no-fused", action="store_true", help="both sides use AdamW without the fused kernel")
    p.add_argument(
        "--baseline",
        choices=("transformers", "plain"),
        default="transformers",
        help="side B's model: transformers' LlamaForCausalLM, or nanocore's LLaMA module in a hand loop",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    p.add_argument("--memory-probe", choices=SIDES, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    intermediate = -(-(args.hidden * 8 // 3) // 64) * 64  # LLaMA's 8/3 ratio, rounded up to 64
    return {
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": args.heads,
        "num_key_value_heads": max(1, args.heads // 2),
        "num_hidden_layers": args.layers,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.seq,
    }


OPTIMIZER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01, "clip_grad": 1.0}


def nanocore_config(args: argparse.Namespace, tmp: Path, steps: int) -> dict[str, Any]:
    return {
        "general": {"seed": SEED, "project": "benchmark", "run": "throughput"},
        "parallelism": {"dp": 1, "tp": 1, "pp": 1},
        "model": {"model_config": model_fields(args), "dtype": args.dtype, "init_method": {"std": 0.02}},
        "tokenizer": {"tokenizer_name_or_path": None},
        "tokens": {
            "sequence_length": args.seq,
            "train_steps": steps,
            "micro_batch_size": args.micro_batch_size,
            "batch_accumulation_per_replica": args.accumulation,
        },
        "optimizer": {
            "learning_rate_scheduler": {
                "learning_rate": OPTIMIZER["lr"],
                "lr_warmup_steps": 0,
                "lr_decay_style": "constant",
            },
            "weight_decay": OPTIMIZER["weight_decay"],
            "clip_grad": OPTIMIZER["clip_grad"],
            "optimizer_factory": {
                "name": "adam_w",
                "adam_beta1": OPTIMIZER["betas"][0],
                "adam_beta2": OPTIMIZER["betas"][1],
                "adam_eps": OPTIMIZER["eps"],
                "torch_adam_is_fused": not args.no_fused,
            },
        },
        "data_stages": [{"name": "stable", "start_training_step": 1, "data": {"dataset": None}}],
        "checkpoints": {"checkpoints_path": str(tmp / "checkpoints"), "save_final_state": False},
        "logging": {"log_dir": str(tmp / "logs"), "loggers": []},
    }


def adamw(model, **options):
    """The baselines' AdamW: `OPTIMIZER`'s settings, weight decay on matrices only (as nanocore's)."""
    import torch

    return torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=OPTIMIZER["lr"],
        betas=OPTIMIZER["betas"],
        eps=OPTIMIZER["eps"],
        weight_decay=OPTIMIZER["weight_decay"],
        **options,
    )


def use_device(args: argparse.Namespace) -> None:
    """Apply `--device` (None: CUDA when there is one) and `--threads` before torch is used."""
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # nanocore's engine takes a GPU whenever it sees one
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)


def probe_memory(script: str, argv: list[str], device: str, flag: str, side: str) -> dict[str, Any]:
    """Run `script argv --device device flag side` in a fresh process and return the JSON it prints
    on its `MEMORY ` line (one process per side: each side's peak is its own)."""
    cmd = [sys.executable, str(Path(script).resolve()), *argv, "--device", device, flag, side]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"memory probe for {side} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("MEMORY ") :])


def transformers_llama(config, reference):
    """transformers' LlamaForCausalLM of the same shape, holding `reference`'s weights (nanocore's
    starting weights through the Hugging Face conversion), SDPA attention."""
    import transformers

    from nanocore_plugins.llama.hf import to_hf

    hf_fields, state = to_hf(config, {name: p.detach() for name, p in reference.named_parameters()})
    hf_fields = {k: v for k, v in hf_fields.items() if k not in ("architectures", "model_type")}
    hf_config = transformers.LlamaConfig(**hf_fields)
    hf_config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(hf_config)
    model.load_state_dict(state, strict=True)
    return model


class PlainLoop:
    """Side B: the hand-written loop, one optimizer step per `step()` call."""

    def __init__(self, args: argparse.Namespace):
        import torch

        from nanocore_plugins.llama.config import LlamaConfig
        from nanocore_plugins.llama.model import LlamaForCausalLM
        from nanocore_plugins.parallel.build import initialise_whole

        self.args = args
        self.device = torch.device(args.device)
        fields = {k: v for k, v in model_fields(args).items() if k != "model_type"}
        config = LlamaConfig(**fields)
        model = LlamaForCausalLM(config, init_std=0.02)
        initialise_whole(model, SEED)  # nanocore's starting weights, as every layout's
        self.transformers = args.baseline == "transformers"
        if self.transformers:
            model = transformers_llama(config, model)
        model.to(device=self.device, dtype=getattr(torch, args.dtype))
        self.model = model.train()
        self.optimizer = adamw(model, fused=None if args.no_fused else True)
        self.generator = torch.Generator().manual_seed(SEED)
        self.params = sum(p.numel() for p in model.parameters())
        self.fused = bool(self.optimizer.defaults.get("fused"))

    def step(self) -> float:
        import torch
        import torch.nn.functional as F

        args = self.args
        batch = torch.randint(
            0, args.vocab, (args.accumulation, args.micro_batch_size, args.seq + 1), generator=self.generator
        )
        total = torch.zeros((), device=self.device)
        for micro in batch:
            micro = micro.to(self.device, non_blocking=True)
            logits = self.model(micro[:, :-1])
            if self.transformers:
                logits = logits.logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), micro[:, 1:].flatten()) / args.accumulation
            loss.backward()
            total += loss.detach()
            del logits, loss  # else the last micro-batch's logits stay alive through the next forward
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), OPTIMIZER["clip_grad"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total)  # waits for the device, as nanocore's float(loss) does


def _clocks() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process): CPU time is what contention from other processes
    on shared cores barely moves, so it is a second, steadier view of the same steps."""
    return time.perf_counter(), time.process_time()


class Interleaver:
    """A nanocore plugin object: at the end of each nanocore step it runs one plain step, timing both.

    nanocore step k is timed from the end of the plain step before it to the end of step k; the first
    step of each side is its warm-up and is not timed.
    """

    def __init__(self) -> None:
        self.plain: PlainLoop | None = None
        self.wall: dict[str, list[float]] = {side: [] for side in SIDES}
        self.cpu: dict[str, list[float]] = {side: [] for side in SIDES}
        self.losses: dict[str, list[float]] = {side: [] for side in SIDES}
        self.mark: tuple[float, float] | None = None

    def start(self, plain: PlainLoop | None) -> None:
        self.plain, self.mark = plain, None
        self.losses = {side: [] for side in SIDES}

    def stop(self) -> None:
        self.plain, self.mark = None, None

    def _record(self, side: str, start: tuple[float, float], end: tuple[float, float]) -> None:
        self.wall[side].append(end[0] - start[0])
        self.cpu[side].append(end[1] - start[1])

    @hookimpl
    def on_step_end(self, step, metrics, trainer) -> None:
        now = _clocks()
        if self.mark is not None:
            self._record("nanocore", self.mark, now)
        self.losses["nanocore"].append(metrics["lm_loss"])
        if self.plain is not None:
            self.losses["baseline"].append(self.plain.step())
            if step > 1:
                self._record("baseline", now, _clocks())
        self.mark = _clocks()


class Bench:
    """Plugins are loaded once (with the interleaver registered) and reused by every round."""

    def __init__(self, args: argparse.Namespace):
        from nanocore.plugins import load_plugins

        self.args = args
        self.plugins = load_plugins()
        self.clock = Interleaver()
        self.plugins.register_object(self.clock, "benchmark-interleaver")
        self._tmp = tempfile.TemporaryDirectory(prefix="nanocore-bench-")  # removed at exit
        self.tmp = Path(self._tmp.name)
        self.params: dict[str, int] = {}
        self.fused: dict[str, bool] = {}

    def round(self, steps: int, sides: tuple[str, ...] = SIDES) -> None:
        """Build the requested sides afresh and run 1 warm-up + `steps` steps of each, interleaved."""
        from nanocore.config.checks import check_config
        from nanocore.config.converter import structure_config
        from nanocore.config.load import LoadedConfig
        from nanocore.trainer import Trainer

        plain = PlainLoop(self.args) if "baseline" in sides else None
        if plain is not None:
            self.params["baseline"], self.fused["baseline"] = plain.params, plain.fused
        if "nanocore" not in sides:
            assert plain is not None
            for _ in range(steps + 1):
                plain.step()
            return
        config = structure_config(nanocore_config(self.args, self.tmp, steps + 1), self.plugins.registries)
        check_config(config, self.plugins.registries, 1)
        trainer = Trainer(LoadedConfig(config, self.plugins, None))
        try:
            self.clock.start(plain)
            trainer.train()
            self.params["nanocore"] = sum(t.param.numel() for t in trainer.engine.trainables)
            self.fused["nanocore"] = bool(trainer.engine.optimizer.optimizer.defaults.get("fused"))
        finally:
            self.clock.stop()
            trainer.close()


# -- memory -------------------------------------------------------------------------------
def _proc_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def memory_probe(args: argparse.Namespace) -> None:
    """Subprocess side: run one side briefly and print its peak memory as one JSON line."""
    import torch

    from nanocore.memory import return_freed_memory

    return_freed_memory()  # what nanocore's trainer does at start-up, for the baseline side too

    bench = Bench(args)
    out: dict[str, Any] = {}
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        bench.round(2, sides=(args.memory_probe,))
        out["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        out["kind"] = "torch.cuda.max_memory_allocated"
    else:
        gc.collect()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            out["kind"] = "peak RSS (VmHWM) above the RSS after imports"
        except OSError:  # without the reset the peak may include import-time transients
            out["kind"] = "peak RSS (VmHWM, not resettable here) above the RSS after imports"
        baseline = _proc_status_kib("VmRSS")
        bench.round(2, sides=(args.memory_probe,))
        out["peak_mib"] = (_proc_status_kib("VmHWM") - baseline) / 1024
        out["baseline_mib"] = baseline / 1024
    print("MEMORY " + json.dumps(out), flush=True)


def measure_memory(args: argparse.Namespace, argv: list[str]) -> dict[str, dict]:
    results = {}
    for side in SIDES:
        results[side] = probe_memory(__file__, argv, args.device, "--memory-probe", side)
    return results


# -- main ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    use_device(args)
    import torch

    if args.memory_probe is not None:
        memory_probe(args)
        return {}

    tokens_per_step = args.micro_batch_size * args.accumulation * args.seq
    bench = Bench(args)
    print(
        f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, {args.dtype}; "
        f"llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch {args.micro_batch_size} x "
        f"{args.accumulation} x {args.seq} = {tokens_per_step} tokens/step; {args.rounds} rounds x "
        f"(1 warm-up + {args.steps} timed steps) per side, steps interleaved",
        flush=True,
    )
    wall, cpu = bench.clock.wall, bench.clock.cpu
    for r in range(args.rounds):
        before = len(wall["nanocore"])
        bench.round(args.steps)
        rates = {side: tokens_per_step / statistics.median(wall[side][before:]) for side in SIDES}
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{s} {rates[s]:7.0f} tok/s" for s in SIDES), flush=True)
        gc.collect()
    if bench.params["nanocore"] != bench.params["baseline"] or bench.fused["nanocore"] != bench.fused["baseline"]:
        raise RuntimeError(f"the sides differ: parameters {bench.params}, fused AdamW {bench.fused}")

    median = {side: tokens_per_step / statistics.median(wall[side]) for side in SIDES}
    ratio = median["nanocore"] / median["baseline"]
    pair_ratio = statistics.median(p / n for n, p in zip(wall["nanocore"], wall["baseline"], strict=True))
    cpu_ratio = statistics.median(cpu["baseline"]) / statistics.median(cpu["nanocore"])
    memory = {} if args.no_memory else measure_memory(args, argv)
    losses = bench.clock.losses
    print(
        f"\nparameters {bench.params['nanocore']:,}, AdamW fused={bench.fused['nanocore']}; "
        f"loss at steps 1 and {args.steps + 1}: nanocore {losses['nanocore'][0]:.4f} -> {losses['nanocore'][-1]:.4f}, "
        f"{args.baseline} {losses['baseline'][0]:.4f} -> {losses['baseline'][-1]:.4f} "
        "(same weights, different random tokens)"
    )
    for side in SIDES:
        rates = sorted(tokens_per_step / t for t in wall[side])
        mem = f", peak memory {memory[side]['peak_mib']:.0f} MiB" if memory else ""
        print(
            f"{(side if side == 'nanocore' else args.baseline):>12}: {median[side]:7.0f} tokens/s, median of "
            f"{len(rates)} steps "
            f"(range {rates[0]:.0f}-{rates[-1]:.0f}){mem}"
        )
    print(f"    ratio: nanocore / {args.baseline} = {ratio:.3f} (goal >= 1.0)")
    print(f"           median of per-step pairs {pair_ratio:.3f}", end="")
    print(f"; by CPU time {cpu_ratio:.3f}" if args.device == "cpu" else "")
    if memory:
        print(f"   memory: {memory['nanocore']['kind']}")
    results = {
        "baseline": args.baseline,
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "memory_probe")},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "parameters": bench.params["nanocore"],
        "tokens_per_step": tokens_per_step,
        "step_wall_seconds": wall,
        "step_cpu_seconds": cpu,
        "median_tokens_per_sec": median,
        "ratio": ratio,
        "pair_ratio_median": pair_ratio,
        "cpu_time_ratio": cpu_ratio,
        "memory": memory,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
