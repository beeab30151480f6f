"""The start-of-run summary rank 0 prints: what runs, where, on what, and how big it is.

    nanocore 0.2.0 | run 'tiny_llama' (id 3f2a...) | fresh start
    plugins: llama, parallel, ... (nanocore 0.2.0); stdlib_corpus (local examples/local_plugins/stdlib_corpus.py)
    layout: 8 processes = dp 2 x tp 2 x pp 2 | pp_engine 1f1b, 1 virtual stage(s) | tp_mode REDUCE_SCATTER
      | ZeRO 1 | cpu, float32
    model: llama, 1.06M parameters; per rank 0.19M-0.34M
    ...

Every rank calls `run_summary` (it gathers each rank's sizes); only rank 0 prints the result. The
trainer fills a `RunFacts` record for it: the summary reads that record, never the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import attrs

import nanocore
from nanocore.plan import plan_for

if TYPE_CHECKING:
    from nanocore.config.schema import Config
    from nanocore.data.schedule import DataSchedule
    from nanocore.engine_api import Engine, MemoryEstimate
    from nanocore.mfu import Peak
    from nanocore.plugins import PluginInfo
    from nanocore.registry import Registries
    from nanocore.run_folders import RunFolders


@attrs.frozen
class RunFacts:
    """What the start-of-run summary reports about a run, filled by the trainer once everything is built."""

    config: Config
    registries: Registries
    plugin_infos: list[PluginInfo]  # every loaded plugin (PluginSet.list())
    engine: Engine
    data: DataSchedule  # the training data schedule (its current stage's mixture is built)
    folders: RunFolders
    run_name: str
    run_id: str
    overrides: list[str]  # command-line key.path=value, as given
    step: int  # the step the run starts after (0, or the resumed checkpoint's)
    tokens_per_step: int
    peak: Peak | None = None  # what MFU is measured against (nanocore.mfu.mfu_peak)


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def plugins_in_use(run: RunFacts) -> list[str]:
    """The plugins that provide what this config selects, plus those that observe the run, with versions."""
    cfg, reg = run.config, run.registries
    par = cfg.parallelism
    used = [
        reg.parallel_engine.get(par.engine),
        reg.pipeline_schedule.get(par.pp_engine),
        reg.model.get(cfg.model.model_type),
        reg.optimizer.get(cfg.optimizer.optimizer_factory.name),
        reg.zero_stage.get(str(cfg.optimizer.zero_stage)),
        reg.lr_decay.get(cfg.optimizer.learning_rate_scheduler.lr_decay_style),
    ]
    if par.tp > 1:
        used.append(reg.tp_mode.get(par.tp_mode))
    tok = cfg.tokenizer
    if tok.tokenizer_name_or_path is not None:
        kind = tok.tokenizer_type or (
            tok.tokenizer_name_or_path if tok.tokenizer_name_or_path in reg.tokenizer else "hf"
        )
        used.append(reg.tokenizer.get(kind))
    for stage in cfg.data_stages:
        for spec in [*stage.data.dataset, *(stage.data.validation_dataset or [])]:
            used.append(reg.dataset_format.get(spec.format))
    used += [reg.logger.get(spec.name) for spec in cfg.logging.loggers]
    names = list(dict.fromkeys(entry.plugin for entry in used))
    observers = {"on_train_start", "on_step_end", "on_validation_end", "on_checkpoint_saved", "on_train_end"}
    names += [i.name for i in run.plugin_infos if i.name not in names and observers & set(i.hooks)]
    infos = {i.name: i for i in run.plugin_infos}
    by_origin: dict[str, list[str]] = {}
    for name in names:
        info = infos.get(name)
        if info is None:
            origin = "registered in-process"
        elif info.distribution:
            origin = f"{info.distribution} {info.version}"
        else:
            origin = f"local {info.location}"
        by_origin.setdefault(origin, []).append(name)
    return [f"{', '.join(ns)} ({origin})" for origin, ns in by_origin.items()]


def _stage_lines(run: RunFacts) -> list[str]:
    cfg = run.config
    stages, total = cfg.data_stages, cfg.tokens.train_steps
    current = run.data.stage_index(min(run.step + 1, total))
    lines = []
    for i, stage in enumerate(stages):
        first = stage.start_training_step
        last = stages[i + 1].start_training_step - 1 if i + 1 < len(stages) else total
        if first > total:
            lines.append(f"stage {stage.name!r}: starts at step {first}, after the last step (never used)")
            continue
        steps = last - first + 1
        formats = ", ".join(spec.format for spec in stage.data.dataset)
        line = (
            f"stage {stage.name!r}: steps {first}-{last} ({_count(steps * run.tokens_per_step)} tokens) from {formats}"
        )
        if i == current:
            mixture = run.data.mixture(i)
            samples = sum(source.size for source in mixture.sources)
            epochs = steps * cfg.global_batch_size / samples
            line += f"; {samples:,} samples of {cfg.tokens.sequence_length} tokens ({epochs:.2g} epochs)"
        lines.append(line)
    return lines


def _memory_line(estimates: list[MemoryEstimate]) -> str:
    def total(e: MemoryEstimate) -> int:
        return e.params_bytes + e.grads_bytes + (e.optimizer_bytes or 0)

    largest = max(range(len(estimates)), key=lambda r: total(estimates[r]))
    e = estimates[largest]
    optimizer = (
        _bytes(e.optimizer_bytes) if e.optimizer_bytes is not None else "unknown (optimizer plugin gives no estimate)"
    )
    where = f"rank {largest}, the largest" if len(estimates) > 1 else "one process"
    return (
        f"memory per rank (estimate, {where}): parameters {_bytes(e.params_bytes)}, gradients "
        f"{_bytes(e.grads_bytes)}, optimizer state {optimizer}; {_bytes(total(e))} before activations"
    )


def _plan_line(run: RunFacts) -> str:
    """The planner's figures for the largest rank (what `nanocore plan` prints for this config)."""
    try:
        plan = plan_for(run.config, run.registries, run.engine.device.type)
    except Exception as exc:  # a planner that cannot read this layout must not stop the run
        return f"memory plan: unavailable ({type(exc).__name__}: {exc})"
    if plan is None:
        return "memory plan: the engine offers no planner"
    r = plan.largest()
    act = "unknown" if r.activations_bytes is None else _bytes(r.activations_bytes)
    return (
        f"memory plan (nanocore plan, rank {r.rank}): {_bytes(r.total_bytes)} at peak = parameters "
        f"{_bytes(r.params_bytes)} + gradients {_bytes(r.grads_bytes)} + optimizer "
        f"{_bytes(r.optimizer_bytes or 0)} + the larger of backward (activations {act}) and the optimizer step "
        f"({_bytes(r.step_phase_bytes)}); {plan.flops_per_step:.3g} FLOPs per step"
    )


SLOWER_THAN_BEST = 1.2  # the summary warns when the best searched layout is predicted this much faster
SEARCH_BUDGET_SECONDS = 20.0  # the other ranks wait in their next collective meanwhile


def _search_line(run: RunFacts) -> str | None:
    """With `general.hardware` set, on the main rank: a warning when `nanocore plan --search` predicts a
    layout more than 20 % faster than this run's (None: no warning, or no hardware to predict on)."""
    cfg, engine = run.config, run.engine
    if cfg.general.hardware is None or not engine.is_main:
        return None
    from nanocore.hardware import load_hardware
    from nanocore.plan import predict_for
    from nanocore.plan_search import search

    device = engine.device.type
    try:
        hardware = load_hardware(cfg.general.hardware)
        own = predict_for(cfg, run.registries, hardware, device)
        result = search(
            cfg,
            run.registries,
            engine.world_size,
            hardware,
            hardware.memory_bytes,
            device=device,
            top=1,
            budget_seconds=SEARCH_BUDGET_SECONDS,
        )
    except Exception as exc:  # advice must not stop the run
        return f"layout advice: unavailable ({type(exc).__name__}: {exc})"
    if own is None or not result.best:
        return None
    best = result.best[0].prediction
    if best.tokens_per_sec_per_device <= SLOWER_THAN_BEST * own.tokens_per_sec_per_device:
        return None
    partial = ""
    if not result.complete:
        partial = f" (of the {result.enumerated:,} layouts searched in {SEARCH_BUDGET_SECONDS:g} s)"
    return (
        f"WARNING layout: predicted {own.tokens_per_sec_per_device:,.0f} tokens/s per device on {hardware.name}; "
        f"nanocore plan --search predicts {best.tokens_per_sec_per_device:,.0f} "
        f"({best.tokens_per_sec_per_device / own.tokens_per_sec_per_device:.2f}x) for "
        f"{result.best[0].layout.label()}{partial} (docs/planning.md)"
    )


def _mfu_line(peak: Peak | None) -> str:
    if peak is None:
        return "mfu: not reported (no peak known for this device; set general.hardware)"
    return f"mfu against {peak.flops / 1e12:.4g} TFLOP/s per device: {peak.source}"


def run_summary(run: RunFacts) -> str:
    """The summary text (call on every rank: it gathers each rank's sizes)."""
    cfg, engine = run.config, run.engine
    par, tokens = cfg.parallelism, cfg.tokens
    cp = par.context_parallel_size
    experts_from = "dp x cp" if cp > 1 else "dp"
    estimates = engine.all_gather_object(engine.memory_estimate())
    stage_lines = _stage_lines(run)
    folders = run.folders
    if folders.resume_from is not None:
        start = f"resumed from {folders.resume_from} at step {run.step}"
    elif folders.overwrite:
        start = "fresh start (checkpoints.overwrite: replacing an earlier run's checkpoints and logs)"
    else:
        start = "fresh start"
    per_rank = [e.parameters for e in estimates]
    total_params = sum(e.written_parameters for e in estimates)
    active_params = sum(e.active_written_parameters or 0 for e in estimates)
    active = f" ({_count(active_params)} active per token)" if 0 < active_params < total_params else ""
    spread = (
        _count(per_rank[0]) if min(per_rank) == max(per_rank) else f"{_count(min(per_rank))}-{_count(max(per_rank))}"
    )
    ck = cfg.checkpoints
    every = f"every {ck.checkpoint_interval} steps" if ck.checkpoint_interval > 0 else "no interval"
    keep = f"keep last {ck.keep_last_n}" if ck.keep_last_n else "keep all"
    loggers = ", ".join(spec.name for spec in cfg.logging.loggers) or "none"
    lines = [
        f"nanocore {nanocore.__version__} | run {run.run_name!r} (id {run.run_id}) | {start}",
        *([f"overrides: {', '.join(run.overrides)}"] if run.overrides else []),
        "plugins: " + "; ".join(plugins_in_use(run)),
        f"layout: {engine.world_size} process(es) = dp {par.dp}"
        f"{f' x cp {cp} (each sequence split over {cp} ranks)' if cp > 1 else ''} x tp {par.tp} x pp {par.pp}"
        f"{f' (experts over ep {par.expert_parallel_size} of {experts_from})' if par.expert_parallel_size > 1 else ''}"
        f" | pp_engine {par.pp_engine}, "
        f"{par.pp_virtual_stages} virtual stage(s) | tp_mode {par.tp_mode if par.tp > 1 else '-'} | ZeRO "
        f"{cfg.optimizer.zero_stage} | {engine.device.type}, {str(engine.dtype).removeprefix('torch.')}",
        f"model: {cfg.model.model_type}, {_count(total_params)} parameters{active}; per rank {spread}",
        f"tokens: {tokens.sequence_length * cfg.global_batch_size:,} per step (global batch {cfg.global_batch_size} = "
        f"dp {par.dp} x micro-batch {tokens.micro_batch_size} x accumulation {tokens.batch_accumulation_per_replica}, "
        f"sequence {tokens.sequence_length}{', documents masked' if tokens.document_masking else ''}); "
        f"{tokens.train_steps} steps = {_count(run.tokens_per_step * tokens.train_steps)} tokens",
        *[f"data {line}" for line in stage_lines],
        _memory_line(estimates),
        _plan_line(run),
        _mfu_line(run.peak),
        *[line for line in [_search_line(run)] if line is not None],
        f"checkpoints: {Path(ck.checkpoints_path).resolve()} ({every}, {keep}) | logs: "
        f"{Path(cfg.logging.log_dir).resolve()} ({loggers})",
    ]
    return "start of run\n  " + "\n  ".join(lines)
