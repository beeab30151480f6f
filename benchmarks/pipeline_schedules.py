"""Pipeline schedules side by side: tokens/s, each against the simulator's prediction from its own
measured forward/backward times, and activation memory per rank against the simulator's count.

Each schedule runs nanocore's trainer on pp gloo processes (dp = tp = 1), float32, random tokens,
the same model and global batch (`--microbatches` micro-batches of one sequence each). Rounds
alternate the schedules (the order rotates every round) and each figure is the median over rounds,
so machine noise hits every schedule alike.

Prediction: during the timed steps the executor records how long each action computed (its waits
for messages left out: `ActionTimes`). Per stage (a rank's chunks differ: under zbv's V rank 0 holds
the embedding and the loss), the step's F, B, I and W seconds over the micro-batches give the times
`nanocore.pipeline_sim.simulate` needs; its makespan plus what the step
spends outside the pipeline (optimizer, gradient norm, the rest, measured) is the predicted step
time. measured/predicted tokens/s below 1 is time the simulator does not see (messages,
contention for the cores).

Memory: each rank's activation peak in a step (VmHWM above what was resident before it, as in
`context_parallel_memory.py`). The simulator weighs each stage's in-flight micro-batches by what one
holds (`SimResult.peak_activation`), calibrated per stage from 1F1B (run first): a stage holds its
decoder layers' activations (L each) and, the last stage, the logits and loss (H). 1F1B's measured
peak on a rank over its in-flight count is that rank's stage; its first ranks give L (the
embedding's output, one hidden state per token, is counted as nothing), the last gives H. Every
schedule is then predicted stage by stage: under a V, rank 0 holds the first stage and the last.

    python benchmarks/pipeline_schedules.py                          # pp2: ~3 minutes on 2 CPU cores
    python benchmarks/pipeline_schedules.py --pp 2,4 --json pp.json  # and pp4 (4 processes)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _ranks import CLEAR_REFS, init_rank, kb, llama_config, run_ranks, trainer_for

VIRTUAL = {"interleaved": 2, "zbv": 2}  # chunks per rank of the multi-chunk schedules


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", default="2", help="pipeline sizes (comma-separated); pp processes each")
    p.add_argument(
        "--schedules",
        default="1f1b,interleaved,zb1p,zbv",
        help="pp_engine values (1f1b first: it calibrates memory per stage)",
    )
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (the global batch)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8, help="query heads (key/value heads = heads / 2)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after 1 warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds; figures are medians over them")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def config(args: argparse.Namespace, pp: int, schedule: str, tmp: Path) -> dict[str, Any]:
    parallelism = {"dp": 1, "tp": 1, "pp": pp, "pp_engine": schedule, "pp_virtual_stages": VIRTUAL.get(schedule, 1)}
    return llama_config(args, tmp, f"pp{pp}_{schedule}", parallelism, {}, accumulation=args.microbatches)


def _rank(rank: int, world: int, raw: dict, store: str, steps: int, results) -> None:
    from nanocore_plugins.parallel.pipeline_parallel import ActionTimes

    trainer = trainer_for(*init_rank(rank, world, raw, store))
    executor = trainer.engine.executor
    losses: list[float] = []
    pipeline_s: list[float] = []
    run = executor.run

    def timed_run(*a, **k):
        start = time.perf_counter()
        try:
            return run(*a, **k)
        finally:
            pipeline_s.append(time.perf_counter() - start)

    executor.run = timed_run
    step_s, activation_kb, per_step_kind, per_step_stage = [], [], [], []
    try:
        for step in range(steps + 1):
            executor.times = ActionTimes() if step > 0 else None
            CLEAR_REFS.write_text("5")
            base = kb("VmRSS")
            start = time.perf_counter()
            trainer._train_one_step(losses, 1)  # what Trainer.train runs per step
            elapsed = time.perf_counter() - start
            if step > 0:  # the first step also allocates the optimizer state
                step_s.append(elapsed)
                activation_kb.append(kb("VmHWM") - base)
                per_step_kind.append({k: sum(v) for k, v in executor.times.seconds.items()})
                per_step_stage.append({f"{k}{s}": sum(v) for (k, s), v in executor.times.stage_seconds.items()})
    finally:
        executor.run = run
        executor = run = None  # they hold the pipeline's process groups, which close() destroys
        trainer.close()
    kinds = {k: statistics.median(d.get(k, 0.0) for d in per_step_kind) for k in ("F", "B", "I", "W")}
    stages = {k: statistics.median(d.get(k, 0.0) for d in per_step_stage) for k in per_step_stage[0]}
    results.put(
        (
            rank,
            {
                "step_s": statistics.median(step_s),
                "pipeline_s": statistics.median(pipeline_s[1:]),
                "action_s": kinds,
                "stage_action_s": stages,  # "F3": stage 3's forwards
                "activation_kib": statistics.median(activation_kb),
                "losses": losses,
            },
        )
    )


@functools.cache
def _schedules():
    from nanocore.plugins import load_plugins

    return load_plugins().registries.pipeline_schedule


def predict(schedule_name: str, pp: int, m: int, got: list[dict]) -> tuple[float, list[float]]:
    """Predicted pipeline seconds (the simulator's makespan from each rank's measured action times)
    and peak in-flight micro-batches per rank."""
    from nanocore.pipeline_sim import simulate

    v = VIRTUAL.get(schedule_name, 1)
    schedule = _schedules().get(schedule_name).factory(None)
    stages = {s: g["stage_action_s"] for g in got for s in {int(k[1:]) for k in g["stage_action_s"]}}
    # one time per stage: a rank's chunks differ (under a V rank 0 embeds and computes the loss)
    per = {k: [stages[s].get(f"{k}{s}", 0.0) / m for s in range(pp * v)] for k in ("F", "B", "I", "W")}
    split = any(per["I"]) or any(per["W"])
    backward = [i + w for i, w in zip(per["I"], per["W"], strict=True)] if split else per["B"]
    result = simulate(
        schedule,
        pp,
        m,
        v,
        t_forward=per["F"],
        t_backward=backward,
        t_input=per["I"] if split else None,
        t_weight=per["W"] if split else None,
    )
    return result.makespan, list(result.peak_in_flight_microbatches)


def stage_layers(layers: int, stages: int) -> list[int]:
    """Decoder layers in each stage, as the engine cuts the LLaMA's blocks (embedding, layers, head)."""
    from nanocore_plugins.parallel.build import partition

    blocks = [["embed"], *([f"layer{i}"] for i in range(layers)), ["head"]]
    return [sum(b[0].startswith("layer") for b in chunk) for chunk in partition(blocks, stages)]


def stage_memory(args: argparse.Namespace, pp: int, activation_kib: list[float], peaks: list[float]) -> tuple:
    """(KiB per decoder layer L, KiB of the logits and loss H) of one micro-batch, from 1F1B's measured
    activation peak per rank over its in-flight micro-batches."""
    per_mb = [a / p for a, p in zip(activation_kib, peaks, strict=True)]
    layers = stage_layers(args.layers, pp)
    per_layer = statistics.median(per_mb[r] / layers[r] for r in range(max(1, pp - 1)))
    return per_layer, max(0.0, per_mb[-1] - layers[-1] * per_layer)


def predict_memory(args: argparse.Namespace, name: str, pp: int, memory: tuple) -> list[float]:
    """Each rank's predicted activation peak in KiB: the simulator's per-stage weighted peak."""
    from nanocore.pipeline_sim import simulate

    per_layer, head = memory
    v = VIRTUAL.get(name, 1)
    layers = stage_layers(args.layers, pp * v)
    weight = [n * per_layer + (head if s == pp * v - 1 else 0.0) for s, n in enumerate(layers)]
    return list(
        simulate(_schedules().get(name).factory(None), pp, args.microbatches, v, activation=weight).peak_activation
    )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    pps = [int(x) for x in args.pp.split(",")]
    names = args.schedules.split(",")
    runs: dict[tuple[int, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for pp in pps:
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                print(f"round {round_ + 1}/{args.rounds}: pp{pp} {name} ...", flush=True)
                got = run_ranks(_rank, pp, lambda tmp, pp=pp, name=name: config(args, pp, name, tmp), args.steps, name)
                runs.setdefault((pp, name), []).append(got)
    rows = []
    tokens = args.microbatches * args.seq
    for pp in pps:
        memory: tuple | None = None
        for name in names:
            rounds = runs[(pp, name)]
            measured = statistics.median(r[0]["step_s"] for r in rounds)
            predicted_steps, peaks = [], []
            for got in rounds:
                makespan, peaks = predict(name, pp, args.microbatches, got)
                outside = statistics.median(g["step_s"] - g["pipeline_s"] for g in got)
                predicted_steps.append(makespan + outside)
            predicted = statistics.median(predicted_steps)
            activation = [statistics.median(r[rank]["activation_kib"] for r in rounds) for rank in range(pp)]
            if memory is None:  # the first schedule (1f1b) calibrates memory per stage
                memory = stage_memory(args, pp, activation, peaks)
            predicted_kib = predict_memory(args, name, pp, memory)
            # a tiny model's step can stay within memory already resident: 0 KiB measured, no ratio
            memory_ratio = [a / k if k > 0 else None for a, k in zip(activation, predicted_kib, strict=True)]
            action = [
                {k: statistics.median(r[rank]["action_s"][k] for r in rounds) / args.microbatches for k in "FBIW"}
                for rank in range(pp)
            ]
            rows.append(
                {
                    "pp": pp,
                    "schedule": name,
                    "virtual_stages": VIRTUAL.get(name, 1),
                    "tokens_per_second": tokens / measured,
                    "predicted_tokens_per_second": tokens / predicted,
                    "measured_over_predicted": predicted / measured,
                    "step_seconds": measured,
                    "seconds_per_microbatch_each_rank": action,
                    "activation_mib_each_rank": [a / 1024 for a in activation],
                    "peak_in_flight_microbatches": peaks,
                    "predicted_activation_mib_each_rank": [k / 1024 for k in predicted_kib],
                    "memory_measured_over_predicted": memory_ratio,
                    "losses": rounds[0][0]["losses"],  # every rank reports the step loss
                }
            )
    if args.json:  # before printing: a long run's figures are never lost to a formatting slip
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))
    print(
        f"\nLLaMA hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, sequence "
        f"{args.seq}, {args.microbatches} micro-batches of 1, float32, 1 thread per rank, {args.rounds} rounds"
    )
    print(
        f"{'pp':>3} {'schedule':>12} {'tokens/s':>9} {'predicted':>9} {'meas/pred':>9} {'vs first':>8} "
        f"{'F/B or F/I/W ms per micro-batch, each rank':>44} {'act MiB per rank':>18} {'mem meas/pred':>14}"
    )
    for row in rows:
        first = next(r for r in rows if r["pp"] == row["pp"])
        times = " ".join(
            f"{a['F'] * 1e3:.0f}/{a['I'] * 1e3:.0f}/{a['W'] * 1e3:.0f}"
            if a["I"] or a["W"]
            else f"{a['F'] * 1e3:.0f}/{a['B'] * 1e3:.0f}"
            for a in row["seconds_per_microbatch_each_rank"]
        )
        act = "/".join(f"{x:.0f}" for x in row["activation_mib_each_rank"])
        mem = "/".join("-" if x is None else f"{x:.2f}" for x in row["memory_measured_over_predicted"])
        print(
            f"{row['pp']:>3} {row['schedule']:>12} {row['tokens_per_second']:>9.0f} "
            f"{row['predicted_tokens_per_second']:>9.0f} {row['measured_over_predicted']:>9.3f} "
            f"{row['tokens_per_second'] / first['tokens_per_second']:>8.3f} {times:>44} {act:>18} {mem:>14}"
        )
    last = [r["losses"][0] for r in rows]
    print(f"step-1 loss of each row (the same computation): {', '.join(f'{x:.6f}' for x in last)}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
