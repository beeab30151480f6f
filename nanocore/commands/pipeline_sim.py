"""`nanocore pipeline-sim`: run any installed pipeline schedule on paper (nanocore/pipeline_sim.py) and
print its bubble fraction against the schedule's own formula, peak in-flight activations per rank and,
with --timeline, the picture of who computes when."""

from __future__ import annotations

import argparse

from nanocore.errors import ConfigError

HELP = "Simulate a pipeline schedule: bubble fraction, peak in-flight activations, timeline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default="1f1b", help="pp_engine name (any installed schedule plugin)")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    parser.add_argument(
        "--microbatches", type=int, default=8, help="microbatches per step (batch_accumulation_per_replica)"
    )
    parser.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (pp_virtual_stages)")
    parser.add_argument("--t-forward", type=float, default=1.0, help="forward time of one rank's layers per microbatch")
    parser.add_argument(
        "--t-backward", type=float, default=2.0, help="backward time of one rank's layers per microbatch"
    )
    parser.add_argument("--timeline", action="store_true", help="draw the ASCII timeline")
    parser.add_argument("--width", type=int, default=None, help="timeline width in columns (default: automatic)")


def cmd_pipeline_sim(args: argparse.Namespace) -> int:
    from nanocore.config.schema import Config, ModelArgs, ParallelismArgs, TokensArgs
    from nanocore.pipeline_sim import render_timeline, simulate
    from nanocore.plugins import load_plugins

    p, m, v = args.pp, args.microbatches, args.virtual_stages
    if min(p, m, v) < 1:
        raise ConfigError(f"--pp, --microbatches and --virtual-stages must be at least 1, got {p}, {m}, {v}")
    entry = load_plugins().registries.pipeline_schedule.get(args.engine, path="--engine")
    config = Config(
        model=ModelArgs(model_config=None),
        parallelism=ParallelismArgs(pp=p, pp_engine=entry.name, pp_virtual_stages=v),
        tokens=TokensArgs(batch_accumulation_per_replica=m),
    )
    problems = entry.extras["check"](config, None) if "check" in entry.extras else []
    if problems:
        raise ConfigError(problems)
    schedule = entry.factory(config)
    result = simulate(schedule, p, m, v, t_forward=args.t_forward, t_backward=args.t_backward)

    print(f"schedule {entry.name}: pp={p} microbatches={m} virtual_stages={v}")
    ideal = m * (args.t_forward + args.t_backward)
    print(f"makespan {result.makespan:g} (ideal without bubble {ideal:g})")
    line = f"bubble fraction {result.bubble_fraction:.6f}"
    theory = getattr(schedule, "theoretical_bubble", None)
    value = theory(p, m, v) if theory is not None else None
    if value is not None:
        formula = getattr(schedule, "bubble_formula", "theory")
        line += f"  (theory {formula} = {value:.6f})"
    print(line)
    print("peak in-flight activations per rank:")
    for rank, (raw, micro) in enumerate(zip(result.peak_in_flight, result.peak_in_flight_microbatches, strict=True)):
        chunks = f" ({raw} chunk activations)" if v > 1 else ""
        print(f"  rank {rank}: {micro:g} microbatches{chunks}")
    if args.timeline:
        print(render_timeline(result, width=args.width))
    return 0
