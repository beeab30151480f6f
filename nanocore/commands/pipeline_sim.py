"""`nanocore pipeline-sim`: run any installed pipeline schedule on paper (nanocore/pipeline_sim.py) and
print its bubble fraction against the schedule's own formula, peak in-flight activations per rank and,
with --timeline, the picture of who computes when. With --table, comma-separated --engine, --pp and
--microbatches give one row per combination (schedules compared side by side)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from nanocore.errors import ConfigError

if TYPE_CHECKING:
    from nanocore.config.schema import Config
    from nanocore.pipeline_api import PipelineSchedule
    from nanocore.pipeline_sim import SimResult
    from nanocore.registry import Entry

HELP = "Simulate a pipeline schedule: bubble fraction, peak in-flight activations, timeline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default="1f1b", help="pp_engine name (any installed schedule plugin)")
    parser.add_argument("--pp", default="4", help="pipeline ranks")
    parser.add_argument("--microbatches", default="8", help="microbatches per step (batch_accumulation_per_replica)")
    parser.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (pp_virtual_stages)")
    times = "one number for every rank, or comma-separated: one per rank, or one per stage (pp x virtual stages)"
    parser.add_argument("--t-forward", default="1.0", help=f"forward time of one rank's layers per microbatch: {times}")
    parser.add_argument("--t-backward", default="2.0", help="backward time of one rank's layers per microbatch")
    parser.add_argument(
        "--t-input", default=None, help="a split backward's input-gradient half (default: half of the backward)"
    )
    parser.add_argument(
        "--t-weight", default=None, help="a split backward's weight-gradient half (default: half of the backward)"
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help="one row per --engine x --pp x --microbatches (comma-separated lists); interleaved and other "
        "multi-chunk schedules use --virtual-stages (at least 2)",
    )
    parser.add_argument("--timeline", action="store_true", help="draw the ASCII timeline")
    parser.add_argument("--width", type=int, default=None, help="timeline width in columns (default: automatic)")


def cmd_pipeline_sim(args: argparse.Namespace) -> int:
    from nanocore.pipeline_sim import render_timeline
    from nanocore.plugins import load_plugins

    pps, ms = _numbers(args.pp, "--pp"), _numbers(args.microbatches, "--microbatches")
    engines = [e.strip() for e in str(args.engine).split(",") if e.strip()]
    v = args.virtual_stages
    if min(*pps, *ms, v) < 1:
        raise ConfigError(
            f"--pp, --microbatches and --virtual-stages must be at least 1, got {args.pp}, {args.microbatches}, {v}"
        )
    registry = load_plugins().registries.pipeline_schedule
    entries = [registry.get(e, path="--engine") for e in engines]
    if args.table or len(entries) > 1 or len(pps) > 1 or len(ms) > 1:
        return _table(entries, pps, ms, v, args)
    entry, p, m = entries[0], pps[0], ms[0]
    problems = _problems(entry, p, m, v)
    if problems:
        raise ConfigError(problems)
    schedule = entry.factory(_config(entry.name, p, m, v))
    result = _simulate(schedule, p, m, v, args)

    print(f"schedule {entry.name}: pp={p} microbatches={m} virtual_stages={v}")
    print(f"makespan {result.makespan:g} (ideal without bubble {max(result.busy):g})")
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


def _numbers(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected a number or comma-separated numbers, got {text!r}") from None


def _config(engine: str, p: int, m: int, v: int) -> Config:
    from nanocore.config.schema import Config, ModelArgs, ParallelismArgs, TokensArgs

    return Config(
        model=ModelArgs(model_config=None),
        parallelism=ParallelismArgs(pp=p, pp_engine=engine, pp_virtual_stages=v),
        tokens=TokensArgs(batch_accumulation_per_replica=m),
    )


def _problems(entry: Entry, p: int, m: int, v: int) -> list[str]:
    return entry.extras["check"](_config(entry.name, p, m, v), None) if "check" in entry.extras else []


def _simulate(schedule: PipelineSchedule, p: int, m: int, v: int, args: argparse.Namespace) -> SimResult:
    from nanocore.pipeline_api import ScheduleError
    from nanocore.pipeline_sim import simulate

    try:
        return simulate(
            schedule,
            p,
            m,
            v,
            t_forward=_times(args.t_forward, "--t-forward"),
            t_backward=_times(args.t_backward, "--t-backward"),
            t_input=_times(args.t_input, "--t-input"),
            t_weight=_times(args.t_weight, "--t-weight"),
        )
    except ScheduleError as exc:
        if str(exc).startswith("t_"):  # a list of the wrong length: say which flag
            raise ConfigError("--" + str(exc).replace("_", "-", 1)) from None
        raise


def _times(text: str | float | None, flag: str) -> Any:
    """One time, or a list of them (per rank or per stage)."""
    if text is None:
        return None
    try:
        values = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected a number or comma-separated numbers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ConfigError(f"{flag}: expected non-negative times, got {text!r}")
    return values[0] if len(values) == 1 and "," not in str(text) else values


def _table(entries: list[Entry], pps: list[int], ms: list[int], v: int, args: argparse.Namespace) -> int:
    """One row per schedule x pp x microbatches: bubble, the schedule's formula, peak in-flight."""
    peak_title = "peak in-flight (microbatches)"
    print(f"{'schedule':<12} {'pp':>3} {'m':>4} {'v':>2} {'bubble':>8} {'theory':>8} {peak_title:>30}")
    for entry in entries:
        for p in pps:
            for m in ms:
                chunks = v if v > 1 else 1
                if chunks == 1 and any("pp_virtual_stages" in x for x in _problems(entry, p, m, 1)):
                    chunks = 2  # a multi-chunk schedule (interleaved) without --virtual-stages
                problems = _problems(entry, p, m, chunks)
                if problems:
                    print(f"{entry.name:<12} {p:>3} {m:>4} {chunks:>2} {'-':>8} {'-':>8}   n/a: {problems[0]}")
                    continue
                schedule = entry.factory(_config(entry.name, p, m, chunks))
                result = _simulate(schedule, p, m, chunks, args)
                theory = getattr(schedule, "theoretical_bubble", None)
                value = theory(p, m, chunks) if theory is not None else None
                shown = f"{value:.4f}" if value is not None else "-"
                peak = max(result.peak_in_flight_microbatches)
                print(
                    f"{entry.name:<12} {p:>3} {m:>4} {chunks:>2} {result.bubble_fraction:>8.4f} {shown:>8} {peak:>30g}"
                )
    return 0
