"""`nanocore plan CONFIG`: bytes per rank before anything is launched.

The engine plugin does the counting (nanocore/plan.py asks it); this command prints the result per
distinct rank, FLOPs per step, and with `--device-memory` whether the layout fits and
the largest micro-batch that does. The same totals appear in the start-of-run summary.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import attrs

from nanocore.engine_api import MemoryPlan
from nanocore.errors import ConfigError
from nanocore.hardware import load_hardware, parse_size
from nanocore.plan import plan_for, predict_for
from nanocore.plugins import add_plugin_argument

HELP = "bytes per rank (parameters, gradients, optimizer, activations) before launching"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML training config")
    add_plugin_argument(p)
    p.add_argument("--world-size", type=int, default=None, help="also check the layout against this many processes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--device-memory", default=None, metavar="SIZE", help="e.g. 80GB: say whether every rank fits")
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="resolves model.dtype auto (cuda: bfloat16)"
    )
    p.add_argument(
        "--hardware",
        default=None,
        metavar="NAME|FILE",
        help="predict the step time on this hardware (a100-80gb, h100-sxm, h200, or a calibrate file)",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="rank every layout on --world-size devices that passes the checks and fits, by predicted speed",
    )
    p.add_argument("--top", type=int, default=5, help="with --search: how many layouts to show (default 5)")
    p.add_argument(
        "--only",
        default=None,
        metavar="FIELD=V[|V],...",
        help="with --search: only layouts with these values, e.g. zero=0|1,recompute=full,tp_mode=ALL_REDUCE "
        "(fields: dp tp pp cp ep tp_mode tp_async cp_mode schedule virtual zero micro_batch_size accumulation "
        "recompute)",
    )
    p.add_argument(
        "--expert-load-factor",
        type=float,
        default=1.0,
        help="tokens the busiest expert-parallel rank gets, over the balanced share (default 1.0): "
        "sizes its expert activations and slows its experts (a run logs moe_max_load)",
    )


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '1.5TB', '512MB' or a plain number of bytes (`nanocore.hardware.parse_size`)."""
    return parse_size(text, "--device-memory")


@attrs.frozen
class Fit:
    """`nanocore plan --device-memory`'s verdict (`--json`: its "fit")."""

    device_memory_bytes: int
    fits: bool  # every rank's peak fits
    largest_micro_batch_size: int | None  # None: activations unknown


def fit(plan: MemoryPlan, device_bytes: int, micro_batch_size: int) -> Fit:
    """Whether every rank fits in `device_bytes`, and the largest micro-batch size that does
    (activations grow linearly with it; nothing else does)."""
    fits = plan.largest().total_bytes <= device_bytes
    largest = None
    if all(r.activations_bytes is not None for r in plan.ranks):
        bounds = []
        for r in plan.ranks:
            assert r.activations_bytes is not None
            static = r.params_bytes + r.grads_bytes + (r.optimizer_bytes or 0)
            staging = r.backward_phase_bytes - r.activations_bytes
            per_sample = r.activations_bytes / micro_batch_size
            if static + r.step_phase_bytes > device_bytes:
                bounds.append(0)  # the optimizer step alone does not fit
            elif per_sample > 0:
                bounds.append(max(0, math.floor((device_bytes - static - staging) / per_sample)))
        largest = min(bounds) if bounds else None
    return Fit(device_bytes, fits, largest)


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f}"


def cmd_plan(args: argparse.Namespace) -> int:
    from nanocore.config.load import load_config

    if args.search:
        return cmd_search(args)
    if args.only:
        raise ConfigError("--only: narrows a search; give --search too")
    loaded = load_config(args.config, args.plugin, world_size=args.world_size, overrides=args.overrides)
    config = loaded.config
    if args.expert_load_factor < 1.0:
        raise ConfigError(f"--expert-load-factor: at least 1 (the balanced share), got {args.expert_load_factor}")
    plan = plan_for(config, loaded.plugins.registries, args.device, args.expert_load_factor)
    if plan is None:
        raise ConfigError(f"parallelism.engine: engine {config.parallelism.engine!r} offers no memory planner")
    hardware = load_hardware(args.hardware) if args.hardware is not None else None
    device_memory = args.device_memory
    if device_memory is None and hardware is not None:
        device_memory = str(hardware.memory_bytes)
    f = fit(plan, parse_bytes(device_memory), config.tokens.micro_batch_size) if device_memory else None
    prediction = None
    if hardware is not None:
        prediction = predict_for(config, loaded.plugins.registries, hardware, args.device, args.expert_load_factor)
        if prediction is None:
            raise ConfigError(f"parallelism.engine: engine {config.parallelism.engine!r} offers no time model")
    if args.json:
        result = attrs.asdict(plan) | ({"fit": attrs.asdict(f)} if f is not None else {})
        if prediction is not None:
            result |= {
                "predicted_step_seconds": prediction.step_seconds,
                "predicted_tokens_per_sec_per_device": prediction.tokens_per_sec_per_device,
                "predicted_mfu": prediction.mfu,
                "prediction": attrs.asdict(prediction),
            }
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    lay = plan.layout
    print(
        f"{plan.world_size} process(es): dp {lay.dp} x cp {lay.cp} x tp {lay.tp} x pp {lay.pp}"
        f"{' (ep ' + str(lay.ep) + ')' if lay.ep > 1 else ''}, ZeRO {lay.zero_stage}, {plan.dtype}; "
        "GiB per rank (every data-parallel replica of a rank holds the same)"
    )
    head = ("rank", "pp", "tp", "params", "grads", "optimizer", "activations", "comm", "total")
    print(" ".join(f"{h:>11}" for h in head))
    for r in plan.ranks:
        cells = (r.rank, r.pp_rank, r.tp_rank)
        sizes = (r.params_bytes, r.grads_bytes, r.optimizer_bytes, r.activations_bytes, r.comm_bytes, r.total_bytes)
        print(" ".join(f"{c:>11}" for c in cells) + " " + " ".join(f"{gib(b):>11}" for b in sizes))
    print(f"FLOPs per step: {plan.flops_per_step:.3e} (with recompute {plan.flops_per_step_with_recompute:.3e})")
    for what in plan.unknown:
        print(f"not counted: {what}")
    if prediction is not None:
        print(
            f"predicted on {prediction.hardware} ({prediction.dtype}): {prediction.step_seconds:.4g} s per step, "
            f"{prediction.tokens_per_sec_per_device:,.0f} tokens/s per device, MFU {prediction.mfu:.1%}; "
            f"dominant cost: {prediction.dominant}"
        )
        for t in prediction.terms:
            if t.seconds > 0:
                print(f"  {t.name:>16} {t.seconds:10.4g} s  ({t.detail})")
    if f is not None:
        verdict = "fits" if f.fits else "does NOT fit"
        largest = f.largest_micro_batch_size
        print(
            f"device memory {gib(f.device_memory_bytes)} GiB: {verdict}; largest micro_batch_size that fits: "
            f"{'unknown' if largest is None else largest}"
        )
    return 0


def _hardware_for_search(args: argparse.Namespace, config_hardware: str | None) -> str:
    name = args.hardware or config_hardware
    if name is None:
        raise ConfigError(
            "--hardware: --search predicts step times; name a description (a100-80gb, h100-sxm, h200, "
            "or a nanocore calibrate file) or set general.hardware"
        )
    return name


def cmd_search(args: argparse.Namespace) -> int:
    from nanocore.config.load import load_config
    from nanocore.plan_search import parse_only, search

    only = parse_only(args.only) if args.only else None
    if args.world_size is None or args.world_size < 1:
        raise ConfigError("--world-size: --search needs the number of devices to lay the model out on")
    if args.top < 1:
        raise ConfigError(f"--top: at least 1, got {args.top}")
    if args.expert_load_factor < 1.0:
        raise ConfigError(f"--expert-load-factor: at least 1 (the balanced share), got {args.expert_load_factor}")
    loaded = load_config(args.config, args.plugin, world_size=None, overrides=args.overrides)
    config = loaded.config
    hardware = load_hardware(_hardware_for_search(args, config.general.hardware))
    device_bytes = parse_bytes(args.device_memory) if args.device_memory else hardware.memory_bytes

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = search(
        config,
        loaded.plugins.registries,
        args.world_size,
        hardware,
        device_bytes,
        device=args.device,
        top=args.top,
        expert_load_factor=args.expert_load_factor,
        progress=progress,
        only=only,
    )
    if args.json:
        json.dump(attrs.asdict(result), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0 if result.best else 1
    print(
        f"{result.enumerated} layouts of {args.config} on {result.world_size} x {result.hardware} "
        f"({gib(result.device_memory_bytes)} GiB): {result.passed_checks} pass the config checks and are predicted "
        f"({result.simulated} of them with their pipeline simulated), the {result.planned} fastest planned"
        + (f" ({result.dominated} more skipped: they need at least a misfit's memory)" if result.dominated else "")
        + f"; {result.seconds:.1f} s"
    )
    if result.best:
        print(f"{'':>2} {'tokens/s/dev':>12} {'MFU':>6} {'step s':>8} {'GiB':>6}  {'dominant':<16} layout")
    for i, r in enumerate(result.best, 1):
        p = r.prediction
        print(
            f"{i:>2} {p.tokens_per_sec_per_device:>12,.0f} {p.mfu:>6.1%} {p.step_seconds:>8.3g} "
            f"{gib(r.memory_bytes):>6}  {p.dominant:<16} {r.layout.label()}"
        )
    if not result.best:
        print("no layout fits")
    for r in result.faster_misfits:
        print(
            f"faster but does not fit ({r.prediction.tokens_per_sec_per_device:,.0f} tokens/s/dev): "
            f"{r.layout.label()}: {r.overflow}"
        )
    for message, count in result.rejected[:3]:
        print(f"rejected by the config checks ({count}): {message}")
    return 0 if result.best else 1
