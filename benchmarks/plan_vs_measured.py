"""The time model against measured runs on this machine: each layout's predicted step time
(`nanocore plan --hardware`, on a description `nanocore calibrate` measured here) beside the step
time nanocore's trainer takes with that layout.

Every layout trains the same float32 LLaMA on random tokens with the same global batch, on 2 gloo
processes (one thread each) unless it says otherwise; the `moe_` layouts train a Mixtral of the same
shape (4 experts of the hidden width, top-2) instead, with and without expert parallelism. The rank
correlation is over the LLaMA layouts (one model); each MoE layout's ratio is printed beside them.
Under expert parallelism the run's logged `moe_sync_load` (each dispatch's busiest expert-parallel
rank's routed rows over its share, the mean over a step's dispatches; median over the timed steps)
is fed back as the expert-load factor, as a user would with `nanocore plan --expert-load-factor`;
`moe_rank_load` (the same over the whole step, what sizes memory) is printed beside it.
Rounds alternate the layouts (the order rotates every round) and each figure is the median over
rounds and timed steps.

Printed per layout: measured and predicted step seconds and their ratio; then the rank correlation
(Spearman) of predicted and measured tokens/s, and how the layout the model ranks first measured
against the fastest measured one. Issue 24's goals: every ratio within 25 %, correlation >= 0.8,
first choice within 5 % of the fastest.

    python benchmarks/plan_vs_measured.py                          # calibrates first; ~10 minutes
    python benchmarks/plan_vs_measured.py --hardware here.yaml --rounds 1 --json out.json
    python benchmarks/plan_vs_measured.py --hardware here.yaml --measured out.json   # predict again only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _ranks import init_rank, llama_config, run_ranks, trainer_for

from nanocore import hookimpl

# name -> (processes, parallelism, optimizer)
LAYOUTS: dict[str, tuple[int, dict, dict]] = {
    "dp2": (2, {"dp": 2}, {}),
    "dp2_zero1": (2, {"dp": 2}, {"zero_stage": 1}),
    "dp2_zero3": (2, {"dp": 2}, {"zero_stage": 3}),
    "tp2_all_reduce": (2, {"tp": 2, "tp_mode": "ALL_REDUCE"}, {}),
    "tp2_reduce_scatter": (2, {"tp": 2, "tp_mode": "REDUCE_SCATTER"}, {}),
    "pp2_1f1b": (2, {"pp": 2, "pp_engine": "1f1b"}, {}),
    "pp2_interleaved": (2, {"pp": 2, "pp_engine": "interleaved", "pp_virtual_stages": 2}, {}),
    "pp2_zb1p": (2, {"pp": 2, "pp_engine": "zb1p"}, {}),
    "pp2_zbv": (2, {"pp": 2, "pp_engine": "zbv", "pp_virtual_stages": 2}, {}),
    "cp2_ring": (2, {"context_parallel_size": 2, "context_parallel_mode": "ring"}, {}),
    "cp2_all_to_all": (2, {"context_parallel_size": 2, "context_parallel_mode": "all_to_all"}, {}),
    "moe_dp2": (2, {"dp": 2}, {}),
    "moe_ep2": (2, {"dp": 2, "expert_parallel_size": 2}, {}),
}
MOE_EXPERTS, MOE_TOP_K = 4, 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of LAYOUTS")
    p.add_argument("--hardware", default=None, help="a hardware description (default: nanocore calibrate first)")
    p.add_argument("--samples", type=int, default=8, help="sequences per step (the global batch)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="query heads (key/value heads = heads / 2)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after 1 warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds; figures are medians over them")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--measured",
        type=Path,
        default=None,
        help="take the measured step times from an earlier --json file (its shapes) and only predict again",
    )
    return p.parse_args(argv)


def raw_config(args: argparse.Namespace, name: str, tmp: Path) -> dict[str, Any]:
    _, parallelism, optimizer = LAYOUTS[name]
    dp = parallelism.get("dp", 1)
    raw = llama_config(args, tmp, name, dict(parallelism), dict(optimizer), accumulation=args.samples // dp)
    if name.startswith("moe_"):  # a Mixtral of the same shape: experts of the hidden width
        raw["model"]["model_config"].update(
            model_type="mixtral",
            intermediate_size=args.hidden,
            num_local_experts=MOE_EXPERTS,
            num_experts_per_tok=MOE_TOP_K,
        )
    return raw


class _Loads:
    """A plugin recording each step's `moe_rank_load` and `moe_sync_load` (logged under expert parallelism)."""

    def __init__(self) -> None:
        self.seen: dict[str, list[float]] = {"moe_rank_load": [], "moe_sync_load": []}

    @hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float], trainer: object) -> None:
        for name, seen in self.seen.items():
            if name in metrics:
                seen.append(metrics[name])


def _rank(rank: int, world: int, raw: dict, store: str, steps: int, results) -> None:
    trainer = trainer_for(*init_rank(rank, world, raw, store))
    loads = _Loads()
    trainer.plugins.pm.register(loads, name="benchmark_loads")
    losses: list[float] = []
    took = []
    try:
        for step in range(steps + 1):
            start = time.perf_counter()
            trainer._train_one_step(losses, 1)  # what Trainer.train runs per step
            if step > 0:
                took.append(time.perf_counter() - start)
    finally:
        trainer.close()
    got = {name: statistics.median(seen) if seen else None for name, seen in loads.seen.items()}
    results.put((rank, {"step_s": statistics.median(took), "losses": losses, **got}))


def predicted_step(args: argparse.Namespace, name: str, hardware_path: str, load: float = 1.0) -> dict[str, Any]:
    """The time model's step for layout `name`; `load`: the expert-load factor (`plan --expert-load-factor`)."""
    from nanocore.config.converter import structure_config
    from nanocore.hardware import load_hardware
    from nanocore.plan import predict_for
    from nanocore.plugins import load_plugins

    registries = load_plugins().registries
    with tempfile.TemporaryDirectory() as tmp:
        config = structure_config(raw_config(args, name, Path(tmp)), registries)
    prediction = predict_for(config, registries, load_hardware(hardware_path), "cpu", load)
    assert prediction is not None
    return {
        "step_seconds": prediction.step_seconds,
        "dominant": prediction.dominant,
        "terms": {t.name: t.seconds for t in prediction.terms},
    }


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else 0.0


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    earlier: dict[str, dict[str, Any]] = {}
    if args.measured is not None:
        saved = json.loads(args.measured.read_text())
        for key in ("samples", "seq", "hidden", "layers", "heads", "vocab", "steps", "rounds", "layouts"):
            setattr(args, key, saved["args"][key])
        earlier = {r["layout"]: r for r in saved["rows"]}
        if args.hardware is None:
            raise SystemExit("--measured: give --hardware too (the calibrate file to predict on)")
    names = args.layouts.split(",")
    for name in names:
        if name not in LAYOUTS:
            raise SystemExit(f"--layouts: {name!r} is not one of {', '.join(LAYOUTS)}")
    hardware = args.hardware
    if hardware is None:
        hardware = str(Path(tempfile.mkdtemp()) / "here.yaml")
        print("calibrating this machine (nanocore calibrate --world-size 2) ...", flush=True)
        calibrate = [sys.executable, "-m", "nanocore", "calibrate", "--world-size", "2", "--threads", "1"]
        subprocess.run([*calibrate, "--output", hardware], check=True)
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.rounds if not earlier else 0):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            world = LAYOUTS[name][0]
            print(f"round {round_ + 1}/{args.rounds}: {name} on {world} processes ...", flush=True)
            got = run_ranks(_rank, world, lambda tmp, name=name: raw_config(args, name, tmp), args.steps, name)
            runs.setdefault(name, []).append(got)
    tokens = args.samples * args.seq
    rows = []
    for name in names:
        if earlier:
            measured, loss = earlier[name]["measured_step_seconds"], earlier[name]["step1_loss"]
            rank_load = earlier[name].get("moe_rank_load")
            load = earlier[name].get("moe_sync_load") or rank_load  # files from before moe_sync_load
        else:
            measured = statistics.median(max(g["step_s"] for g in got) for got in runs[name])
            loss = runs[name][0][0]["losses"][0]
            rank_load, load = (
                statistics.median(seen) if (seen := [g[key] for got in runs[name] for g in got if g.get(key)]) else None
                for key in ("moe_rank_load", "moe_sync_load")
            )
        # the run's measured routing imbalance fed back, as a user would: plan --expert-load-factor
        predicted = predicted_step(args, name, hardware, load or 1.0)
        rows.append(
            {
                "layout": name,
                "processes": LAYOUTS[name][0],
                "measured_step_seconds": measured,
                "predicted_step_seconds": predicted["step_seconds"],
                "predicted_over_measured": predicted["step_seconds"] / measured,
                "measured_tokens_per_second": tokens / measured,
                "predicted_tokens_per_second": tokens / predicted["step_seconds"],
                "dominant": predicted["dominant"],
                "terms": predicted["terms"],
                "step1_loss": loss,
                "moe_rank_load": rank_load,
                "moe_sync_load": load,
            }
        )
    dense = [r for r in rows if not r["layout"].startswith("moe_")] or rows  # one model's layouts
    rho = spearman([r["predicted_tokens_per_second"] for r in dense], [r["measured_tokens_per_second"] for r in dense])
    chosen = max(dense, key=lambda r: r["predicted_tokens_per_second"])
    fastest = max(dense, key=lambda r: r["measured_tokens_per_second"])
    summary = {
        "spearman": rho,
        "within_25_percent": sum(abs(r["predicted_over_measured"] - 1) <= 0.25 for r in rows),
        "layouts": len(rows),
        "first_choice": chosen["layout"],
        "fastest_measured": fastest["layout"],
        "first_choice_over_fastest": chosen["measured_tokens_per_second"] / fastest["measured_tokens_per_second"],
        "hardware": hardware,
    }
    if args.json:  # before printing: a long run's figures are never lost to a formatting slip
        plain = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"args": plain, "rows": rows, "summary": summary}, indent=2))
    print(
        f"\nLLaMA hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, sequence "
        f"{args.seq}, {args.samples} sequences per step, float32, 1 thread per process, {args.rounds} rounds; "
        f"predicted on {hardware}"
    )
    print(f"{'layout':>20} {'measured s':>10} {'predicted s':>11} {'pred/meas':>9} {'tokens/s':>9} {'dominant':>16}")
    for r in rows:
        print(
            f"{r['layout']:>20} {r['measured_step_seconds']:>10.3f} {r['predicted_step_seconds']:>11.3f} "
            f"{r['predicted_over_measured']:>9.2f} {r['measured_tokens_per_second']:>9.0f} {r['dominant']:>16}"
            + (
                f"  (moe_sync_load {r['moe_sync_load']:.2f} fed back; moe_rank_load {r['moe_rank_load']:.2f})"
                if r["moe_sync_load"]
                else ""
            )
        )
    print(
        f"within 25 %: {summary['within_25_percent']} of {len(rows)}; Spearman {rho:.2f}; the model's first "
        f"choice {chosen['layout']} measured {summary['first_choice_over_fastest']:.3f} of the fastest "
        f"({fastest['layout']})"
    )
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
