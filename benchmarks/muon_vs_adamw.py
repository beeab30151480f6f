"""Muon against AdamW on the tiny examples: steps to reach AdamW's final validation loss, the
validation loss at equal steps, and tokens/s of each.

Sides, all on one example's model, data, seed, batch, schedule shape (warmup, cosine decay), weight
decay and clipping, float32, one process:

- **adam_w**: the example's own optimizer, as its YAML sets it;
- **muon@LR**: `optimizer_factory.name: muon` (Muon for hidden matrices, AdamW for the rest, the
  update scaled by Moonlight's 0.2 sqrt(max(rows, cols)) so AdamW's learning rate carries over), at
  each learning rate of the sweep (`--muon-lr-factors` times the example's).

How it runs: every side is a `nanocore.trainer.Trainer` built from the example's YAML; the sides are
stepped in turn, one optimizer step each (adam_w, muon@a, muon@b, ..., adam_w, ...), so whatever else
the machine does hits all alike; a step is `Trainer._train_one_step` (data, LR, engine step,
metrics, hooks). Every `--val-every` steps each side's `val_lm_loss` is measured on the example's
held-out batches (`Trainer.validate`, outside the timed steps). tokens/s is the batch's tokens over
each side's median step time.

Reported per side: the final `val_lm_loss`, the first validation step at which it reaches AdamW's
final `val_lm_loss` (and that step over AdamW's steps: the issue's goal is <= 0.8), tokens/s.

    python benchmarks/muon_vs_adamw.py                                 # tiny LLaMA, 600 steps: ~20 min on 2 cores
    python benchmarks/muon_vs_adamw.py --example tiny_moe --muon-lr-factors 1
    python benchmarks/muon_vs_adamw.py --steps 100 --val-every 20      # a quick look
    python benchmarks/muon_vs_adamw.py --json muon.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"tiny_llama": "config_tiny_llama.yaml", "tiny_moe": "config_tiny_moe.yaml"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--example", choices=sorted(EXAMPLES), default="tiny_llama")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps per side (the example's: 600)")
    p.add_argument("--val-every", type=int, default=25, help="steps between validation losses")
    p.add_argument(
        "--muon-lr-factors",
        default="0.5,1,2",
        help="Muon's learning rates, as multiples of the example's (AdamW's) learning rate; comma-separated",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="also write every figure here")
    return p.parse_args(argv)


class Side:
    """One optimizer on the example: a Trainer stepped by hand."""

    def __init__(self, name: str, example: Path, tmp: Path, steps: int, optimizer: dict[str, Any] | None, lr: float):
        import yaml

        from nanocore.config.load import load_config

        raw = yaml.safe_load(example.read_text())
        raw["general"]["run"] = name
        raw["tokens"]["train_steps"] = steps
        raw["tokens"]["val_check_interval"] = steps + 1  # validation built, run here outside the timed steps
        raw["checkpoints"].update(
            checkpoints_path=str(tmp / name / "checkpoints"), checkpoint_interval=0, save_final_state=False
        )
        raw["logging"]["log_dir"] = str(tmp / name / "logs")
        raw["logging"]["loggers"] = []
        if optimizer is not None:
            raw["optimizer"]["optimizer_factory"] = optimizer
        raw["optimizer"]["learning_rate_scheduler"]["learning_rate"] = lr
        raw["optimizer"]["learning_rate_scheduler"]["min_decay_lr"] = lr / 10
        raw["plugins"] = [str(example.parent / p) for p in raw.get("plugins") or []]  # the example's corpus
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        from nanocore.trainer import Trainer

        self.trainer = Trainer(load_config(str(path), world_size=1))
        self.name, self.lr = name, lr
        self.losses: list[float] = []
        self.times: list[float] = []
        self.val: dict[int, float] = {}

    def step(self) -> None:
        start = time.perf_counter()
        self.trainer._train_one_step(self.losses, 10**9)  # what Trainer.train runs per step
        self.times.append(time.perf_counter() - start)

    def validate(self) -> None:
        self.val[self.trainer.step] = self.trainer.validate()

    def close(self) -> None:
        self.trainer.close()


def reached(val: dict[int, float], target: float) -> int | None:
    """The first validation step at which the loss is at or below `target`."""
    return next((step for step, loss in sorted(val.items()) if loss <= target), None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch
    import yaml

    if args.threads:
        torch.set_num_threads(args.threads)
    example = REPO / "examples" / EXAMPLES[args.example]
    base = yaml.safe_load(example.read_text())
    lr = float(base["optimizer"]["learning_rate_scheduler"]["learning_rate"])
    factors = [float(f) for f in args.muon_lr_factors.split(",") if f.strip()]
    tokens = base["tokens"]["micro_batch_size"] * base["tokens"]["batch_accumulation_per_replica"]
    tokens *= base["tokens"]["sequence_length"]
    with tempfile.TemporaryDirectory(prefix="muon_vs_adamw_") as tmp_name:
        tmp = Path(tmp_name)
        sides = [Side("adam_w", example, tmp, args.steps, None, lr)]
        sides += [Side(f"muon@{lr * f:g}", example, tmp, args.steps, {"name": "muon"}, lr * f) for f in factors]
        try:
            started = time.perf_counter()
            for step in range(1, args.steps + 1):
                for side in sides:
                    side.step()
                if step % args.val_every == 0 or step == args.steps:
                    for side in sides:
                        side.validate()
                    row = "  ".join(f"{s.name} {s.val[step]:.4f}" for s in sides)
                    print(f"step {step:>5} ({time.perf_counter() - started:.0f} s)  val_lm_loss  {row}", flush=True)
        finally:
            for side in sides:
                side.close()
    target = sides[0].val[args.steps]
    results: dict[str, Any] = {
        "example": args.example,
        "steps": args.steps,
        "val_every": args.val_every,
        "adam_w_lr": lr,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "sides": {},
    }
    print(
        f"\n{args.example}: {args.steps} steps, validation every {args.val_every}; "
        f"AdamW's final val_lm_loss {target:.4f}"
    )
    print(f"{'side':<14} {'lr':>8} {'final val':>10} {'steps to AdamW final':>21} {'ratio':>6} {'tokens/s':>9}")
    for side in sides:
        at = reached(side.val, target)
        median = statistics.median(side.times[1:] or side.times)
        figures = {
            "lr": side.lr,
            "final_val_lm_loss": side.val[args.steps],
            "steps_to_adam_w_final": at,
            "steps_ratio": at / args.steps if at is not None else None,
            "tokens_per_sec": tokens / median,
            "val_lm_loss": side.val,
            "final_train_loss": side.losses[-1],
        }
        results["sides"][side.name] = figures
        ratio = f"{figures['steps_ratio']:.2f}" if at is not None else "-"
        print(
            f"{side.name:<14} {side.lr:>8.4g} {figures['final_val_lm_loss']:>10.4f} {str(at or 'not reached'):>21} "
            f"{ratio:>6} {figures['tokens_per_sec']:>9.0f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
