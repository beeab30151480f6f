"""`nanocore plan CONFIG --search --world-size N`: every layout of a config on N devices that passes the
config checks and fits in memory, ranked by predicted tokens/s per device.

The config fixes the model, the sequence length and the global batch (dp x micro-batch x accumulation
samples); the search varies everything else the engine offers: tp, pp and its schedule and virtual
stages, cp and its mode, dp, ep, the ZeRO stage, the micro-batch size (accumulation follows from the
global batch) and recompute. The registries say which schedules, TP modes and ZeRO stages exist; each
schedule's own check says which virtual-stage counts it runs.

How: each layout is checked (`check_config`, microseconds) and its step bounded (the engine's
`predict_bound`: its prediction without the pipeline simulation, well under a millisecond once the
model's inventory at that tp is read); then, fastest first, layouts are predicted in full (the
pipeline simulated) while their bound could still beat the next one to take, and taken layouts are
planned (the engine's `plan`, tens of milliseconds) until `top` fit. A faster layout that
does not fit is reported with the rank and the term that overflows it. Layouts the checks reject are
counted by their first message.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING

import attrs

from nanocore.config.checks import check_config
from nanocore.engine_api import MemoryPlan, RankPlan, TimePrediction
from nanocore.errors import ConfigError
from nanocore.moe_api import moe_layers
from nanocore.plan import plan_for, predict_for

if TYPE_CHECKING:
    from nanocore.config.schema import Config
    from nanocore.hardware import Hardware
    from nanocore.registry import Registries

VIRTUAL_STAGES = (1, 2, 4)  # tried with every schedule: its own check says which it runs
RECOMPUTE: tuple[str | None, ...] = (None, "selective", "full")
LARGEST_MICRO_BATCH = 16
BOUND = "predict_bound"  # the engine's extra giving a lower bound of a step (`predict_for`)


@attrs.frozen
class Layout:
    """One point of the search: the config fields it sets."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    tp_mode: str
    tp_async: bool
    cp_mode: str
    schedule: str
    virtual: int
    zero: int
    micro_batch_size: int
    accumulation: int
    recompute: str | None

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"cp{self.cp}"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        words = [" ".join(parts)]
        if self.tp > 1:
            words.append(("RS" if self.tp_mode == "REDUCE_SCATTER" else "AR") + (" async" if self.tp_async else ""))
        if self.pp > 1:
            words.append(self.schedule + (f" v{self.virtual}" if self.virtual > 1 else ""))
        if self.cp > 1:
            words.append(self.cp_mode)
        words.append(f"ZeRO-{self.zero}")
        words.append(f"mbs {self.micro_batch_size} x {self.accumulation}")
        words.append(f"recompute {self.recompute or 'off'}")
        return ", ".join(words)

    def apply(self, config: Config) -> Config:
        par = attrs.evolve(
            config.parallelism,
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            context_parallel_size=self.cp,
            expert_parallel_size=self.ep,
            tp_mode=self.tp_mode,
            tp_linear_async_communication=self.tp_async,
            context_parallel_mode=self.cp_mode,
            pp_engine=self.schedule,
            pp_virtual_stages=self.virtual,
            recompute_layer=False,
            recompute_granularity=self.recompute,
        )
        tok = attrs.evolve(
            config.tokens, micro_batch_size=self.micro_batch_size, batch_accumulation_per_replica=self.accumulation
        )
        opt = attrs.evolve(config.optimizer, zero_stage=self.zero)
        return attrs.evolve(config, parallelism=par, tokens=tok, optimizer=opt)


@attrs.frozen
class Ranked:
    """A layout with its predicted step and, once planned, its memory."""

    layout: Layout
    prediction: TimePrediction
    memory_bytes: int | None = None  # the largest rank's peak (None: not planned)
    fits: bool | None = None
    overflow: str | None = None  # for a misfit: which rank and term, in words


@attrs.frozen
class SearchResult:
    world_size: int
    hardware: str
    device_memory_bytes: int
    enumerated: int
    passed_checks: int
    planned: int
    seconds: float
    best: list[Ranked]  # the fastest `top` that fit, fastest first
    faster_misfits: list[Ranked]  # predicted faster than the first that fits, but over the memory
    rejected: list[tuple[str, int]]  # the config checks' first messages and how many layouts each rejected
    config_layout: Ranked | None  # the config's own layout, as predicted (and planned)
    complete: bool = True  # False: the time budget ran out before every layout was enumerated
    dominated: int = 0  # layouts not planned: one needing no more memory did not fit (`_needs_more`)
    simulated: int = 0  # layouts predicted in full after their bound (the rest never could make the top)


def parse_only(text: str) -> dict[str, tuple[object, ...]]:
    """`--only`'s `FIELD=V[|V...],...` (e.g. `zero=0,recompute=full,schedule=1f1b|interleaved`) as
    Layout field -> allowed values, each read as its field's type (recompute: off for none)."""
    fields = {f.name: f.type for f in attrs.fields(Layout)}
    out: dict[str, tuple[object, ...]] = {}
    for item in [x for x in text.split(",") if x.strip()]:
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            raise ConfigError(f"--only: {item!r} is not FIELD=VALUE with FIELD one of {', '.join(fields)}")
        kind = str(fields[name])
        allowed: list[object] = []
        for value in values.split("|"):
            value = value.strip()
            try:
                if name == "recompute":
                    if value not in ("off", "selective", "full"):
                        raise ValueError(value)
                    allowed.append(None if value == "off" else value)
                elif kind in ("int", "<class 'int'>"):
                    allowed.append(int(value))
                elif kind in ("bool", "<class 'bool'>"):
                    if value.lower() not in ("true", "false"):
                        raise ValueError(value)
                    allowed.append(value.lower() == "true")
                else:
                    allowed.append(value)
            except ValueError:
                want = "off, selective or full" if name == "recompute" else kind.replace("<class '", "").rstrip("'>")
                raise ConfigError(f"--only: {name}={value!r}: expected {want}") from None
        out[name] = tuple(allowed)
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _experts(config: Config, registries: Registries) -> int:
    """The fewest experts of the model's MoE layers (1 for a dense model: ep stays 1)."""
    import torch

    with torch.device("meta"):
        model = registries.model.get(config.model.model_type).factory(
            config.model, vocab_multiple=config.model.make_vocab_size_divisible_by
        )
    counts = [int(getattr(model.get_submodule(name), "num_experts", 1)) for name in moe_layers(model)]
    return min(counts, default=1)


def layouts(config: Config, registries: Registries, world_size: int, devices_per_node: int) -> Iterator[Layout]:
    """Every layout of `config` on `world_size` devices (the checks have not looked at them yet); tensor
    parallelism stays within a node (its collectives run per layer, twice each way: across nodes no peer
    runs it)."""
    samples = config.parallelism.dp * config.tokens.micro_batch_size * config.tokens.batch_accumulation_per_replica
    schedules = sorted(registries.pipeline_schedule.names())
    tp_modes = [(m, False) for m in sorted(registries.tp_mode.names())]
    if "REDUCE_SCATTER" in registries.tp_mode.names():
        tp_modes.append(("REDUCE_SCATTER", True))
    zeros = sorted(int(z) for z in registries.zero_stage.names())
    layers = config.model.num_hidden_layers if hasattr(config.model, "num_hidden_layers") else None
    experts = _experts(config, registries)
    for tp in [t for t in _divisors(world_size) if t <= devices_per_node]:
        for pp in _divisors(world_size // tp):
            if layers is not None and pp > layers:
                continue
            for cp in _divisors(world_size // tp // pp):
                dp = world_size // tp // pp // cp
                if samples % dp:
                    continue
                per_replica = samples // dp
                for ep in [e for e in _divisors(dp * cp) if experts % e == 0]:
                    for mode, tp_async in tp_modes if tp > 1 else [(config.parallelism.tp_mode, False)]:
                        for cp_mode in (
                            ("ring", "all_to_all") if cp > 1 else (config.parallelism.context_parallel_mode,)
                        ):
                            for schedule in schedules if pp > 1 else [config.parallelism.pp_engine]:
                                for virtual in VIRTUAL_STAGES if pp > 1 else (1,):
                                    for zero in zeros:
                                        for mbs in _divisors(per_replica):
                                            if mbs > LARGEST_MICRO_BATCH:
                                                break
                                            if mbs & (mbs - 1):
                                                continue  # powers of two
                                            for recompute in RECOMPUTE:
                                                yield Layout(
                                                    dp,
                                                    tp,
                                                    pp,
                                                    cp,
                                                    ep,
                                                    mode,
                                                    tp_async,
                                                    cp_mode,
                                                    schedule,
                                                    virtual,
                                                    zero,
                                                    mbs,
                                                    per_replica // mbs,
                                                    recompute,
                                                )


def overflow(rank: RankPlan, device_bytes: int) -> str:
    """Which term of a rank that does not fit is the largest, in words."""
    terms = {
        "parameters": rank.params_bytes,
        "gradients": rank.grads_bytes,
        "optimizer states": rank.optimizer_bytes or 0,
        "activations": rank.activations_bytes or 0,
        "communication buffers": rank.comm_bytes,
        "optimizer-step temporaries": rank.optimizer_step_bytes,
    }
    name, size = max(terms.items(), key=lambda kv: kv[1])
    return (
        f"rank {rank.rank} needs {rank.total_bytes / 2**30:.1f} GiB of {device_bytes / 2**30:.1f}; "
        f"{name} the largest term ({size / 2**30:.1f} GiB)"
    )


def _plan(config: Config, registries: Registries, device: str, expert_load_factor: float) -> MemoryPlan:
    plan = plan_for(config, registries, device, expert_load_factor)
    if plan is None:
        raise ConfigError(f"parallelism.engine: engine {config.parallelism.engine!r} offers no memory planner")
    return plan


def _memory_family(lay: Layout) -> Layout:
    """`lay` but for what `_needs_more` orders: micro-batch, accumulation and recompute."""
    return attrs.evolve(lay, micro_batch_size=0, accumulation=0, recompute=None)


def _needs_more(lay: Layout, misfit: Layout) -> bool:
    """Whether `lay` needs at least the memory of `misfit`, a layout of its `_memory_family` that did
    not fit: a micro-batch at least as large and recompute that keeps at least as much (off >
    selective > full). Activations grow with the micro-batch (a pipeline keeps min(in-flight,
    accumulation) of them: micro_batch x that never shrinks as the micro-batch grows) and shrink with
    recompute. Not the ZeRO stage: a higher one adds gather and reduce buffers, which on a small model
    outweigh what it shards (the planner puts a tiny LLaMA's ZeRO-3 above its ZeRO-1)."""
    return lay.micro_batch_size >= misfit.micro_batch_size and RECOMPUTE.index(lay.recompute) <= RECOMPUTE.index(
        misfit.recompute
    )


def _rank_key(r: Ranked) -> tuple[float, int, int, int, int, int, int, int]:
    """Fastest first; among equally fast layouts, the simpler one (less sharding, fewer axes, no
    recompute, fewer micro-batches)."""
    lay = r.layout
    return (
        -r.prediction.tokens_per_sec_per_device,
        lay.zero,
        lay.cp,
        lay.pp,
        lay.ep,
        lay.tp,
        RECOMPUTE.index(lay.recompute),
        lay.accumulation,
    )


def search(
    config: Config,
    registries: Registries,
    world_size: int,
    hardware: Hardware,
    device_bytes: int,
    *,
    device: str = "cuda",
    top: int = 5,
    expert_load_factor: float = 1.0,
    progress: Callable[[str], None] | None = None,
    budget_seconds: float | None = None,
    exhaustive: bool = False,
    only: Mapping[str, Collection[object]] | None = None,
) -> SearchResult:
    """Search the layouts of `config` on `world_size` devices of `hardware` (see the module docstring).
    With `budget_seconds`, enumeration stops when it is spent and the layouts predicted so far are
    ranked (`complete` is then False): the start-of-run summary's advice must not hold a run up.
    `exhaustive`: predict every layout in full (no bound), to check the bound changes no answer.
    `only`: Layout field -> the values allowed (`parse_only`); other layouts are not enumerated."""
    start = time.monotonic()
    last = start
    rejected: Counter[str] = Counter()
    # every layout that passes the checks, with its bound (`exact`: or its full prediction, where the
    # engine offers no bound or `exhaustive` asks for every one)
    candidates: list[tuple[Ranked, bool]] = []
    enumerated = 0
    complete = True
    for layout in layouts(config, registries, world_size, hardware.devices_per_node):
        if budget_seconds is not None and time.monotonic() - start > budget_seconds:
            complete = False
            break
        if only and any(getattr(layout, name) not in allowed for name, allowed in only.items()):
            continue
        enumerated += 1
        candidate = layout.apply(config)
        try:
            check_config(candidate, registries, world_size)
        except ConfigError as exc:
            rejected[str(exc).splitlines()[0]] += 1
            continue
        args = (candidate, registries, hardware, device, expert_load_factor)
        bound = None if exhaustive else predict_for(*args, BOUND)
        prediction = bound if bound is not None else predict_for(*args)
        if prediction is None:
            raise ConfigError(f"parallelism.engine: engine {config.parallelism.engine!r} offers no time model")
        candidates.append((Ranked(layout, prediction), bound is None))
        if progress is not None and time.monotonic() - last > 5:
            last = time.monotonic()
            progress(f"search: {enumerated} layouts enumerated, {len(candidates)} pass the checks and are predicted")
    # Fastest first by the bound; a layout is predicted in full (its pipeline simulated) only while its
    # bound could still beat the fastest fully predicted one not yet taken. A bound's step is never
    # longer than the full prediction's, so layouts are taken in the order of their full predictions,
    # ties broken by enumeration (as a stable sort of every full prediction would take them).
    order = sorted(range(len(candidates)), key=lambda i: (_rank_key(candidates[i][0]), i))
    # a heap of fully predicted layouts: (their rank key and enumeration index, the layout)
    ready: list[tuple[tuple[tuple[float, int, int, int, int, int, int, int], int], Ranked]] = []
    at = simulated = 0
    best: list[Ranked] = []
    misfits: list[Ranked] = []
    planned = dominated = 0
    too_big: dict[Layout, list[Layout]] = {}  # the misfits of each `_memory_family`
    while len(best) < top:
        nxt = order[at] if at < len(order) else -1
        if nxt >= 0 and (not ready or (_rank_key(candidates[nxt][0]), nxt) < ready[0][0]):
            at += 1
            ranked, exact = candidates[nxt]
            if not exact:
                simulated += 1
                full = predict_for(ranked.layout.apply(config), registries, hardware, device, expert_load_factor)
                assert full is not None
                ranked = Ranked(ranked.layout, full)
            heapq.heappush(ready, ((_rank_key(ranked), nxt), ranked))
            continue
        if not ready:
            break
        ranked = heapq.heappop(ready)[1]
        lay = ranked.layout
        family = _memory_family(lay)
        if any(_needs_more(lay, m) for m in too_big.get(family, ())):
            dominated += 1  # needs at least what a layout that did not fit needs
            continue
        plan = _plan(lay.apply(config), registries, device, expert_load_factor)
        planned += 1
        largest = plan.largest()
        fits = largest.total_bytes <= device_bytes
        done = attrs.evolve(
            ranked,
            memory_bytes=largest.total_bytes,
            fits=fits,
            overflow=None if fits else overflow(largest, device_bytes),
        )
        if fits:
            best.append(done)
        else:
            too_big.setdefault(family, []).append(lay)
            if not best and len(misfits) < 3:
                misfits.append(done)
        if progress is not None and time.monotonic() - last > 5:
            last = time.monotonic()
            progress(f"search: {planned} of the fastest layouts planned, {len(best)} fit")
    return SearchResult(
        world_size=world_size,
        hardware=hardware.name,
        device_memory_bytes=device_bytes,
        enumerated=enumerated,
        passed_checks=len(candidates),
        planned=planned,
        seconds=time.monotonic() - start,
        best=best,
        faster_misfits=misfits,
        rejected=rejected.most_common(),
        config_layout=None,
        complete=complete,
        dominated=dominated,
        simulated=simulated,
    )
