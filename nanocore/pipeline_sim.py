"""Run pipeline schedules on paper: makespan, bubble fraction and peak in-flight activations.

Every rank runs its action list in order. An action starts when its rank is free and what it
depends on has finished (communication takes no time):

- F of virtual stage s on microbatch m needs F(s - 1, m), which runs on the rank holding s - 1;
- B(s, m) and I(s, m) need F(s, m) and, unless s is the last virtual stage, the input gradient of
  s + 1: B(s + 1, m) or I(s + 1, m);
- W(s, m) needs I(s, m) (its rank's own input-gradient half of the same backward).

A chunk is 1/v of a rank's layers, so its F takes `t_forward / v`, its B `t_backward / v`, its I
`t_input / v` and its W `t_weight / v`. By default I and W split B in halves, except on the first
virtual stage: it has no input gradient to compute or send, so its I is empty and its W is its
whole backward (as the executor runs it).
Because a rank never waits for anything but a dependency, each action's start time follows from
finish times already known; the simulator visits every action once (O(total actions)).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

import attrs

from nanocore.pipeline_api import Action, ScheduleError, stage_owners


@attrs.frozen
class TimedAction:
    """One action of one rank with its simulated start and end time."""

    start: float
    end: float
    action: Action


@attrs.frozen
class SimResult:
    """What one simulated optimizer step looks like. Lists are indexed by pipeline rank."""

    pp_size: int
    num_microbatches: int
    num_chunks: int
    makespan: float
    busy: list[float]
    bubble_fraction: float  # 1 - total busy / (pp_size * makespan)
    peak_in_flight: list[int]  # most (chunk, microbatch) activations held at once
    peak_in_flight_microbatches: list[float]  # the same in whole-rank microbatches: peak_in_flight / num_chunks
    # most activation memory held at once, each stage's micro-batch weighted by `activation` (default:
    # 1 per rank, shared evenly by its chunks: then equal to peak_in_flight_microbatches)
    peak_activation: list[float]
    timelines: list[list[TimedAction]]


_KIND_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


def describe(action: Action, pp_size: int, rank: int, stage: int | None = None) -> str:
    """An action in words, with the virtual stage it runs (`stage`; default: Megatron's loop)."""
    stage = action.chunk * pp_size + rank if stage is None else stage
    kind = _KIND_NAMES.get(action.kind, action.kind)
    return f"{action} ({kind} of chunk {action.chunk} = virtual stage {stage}, microbatch {action.microbatch})"


def _action_lists(schedule: Any, pp_size: int, num_microbatches: int, num_chunks: int) -> list[list[Action]]:
    if hasattr(schedule, "actions"):
        return [list(schedule.actions(pp_size, r, num_microbatches, num_chunks)) for r in range(pp_size)]
    lists = [list(actions) for actions in schedule]
    if len(lists) != pp_size:
        raise ScheduleError(f"expected one action list per pipeline rank ({pp_size}), got {len(lists)}")
    return lists


def validate(
    lists: Sequence[Sequence[Action]],
    num_microbatches: int,
    num_chunks: int,
    stage_at: dict[tuple[int, int], int] | None = None,
) -> None:
    """Each rank must run F and a backward of every (chunk, microbatch) exactly once: B, or I and then W
    (a weight gradient needs what its input-gradient half kept). A backward listed before its own
    forward is a deadlock, which `simulate` reports. `stage_at[(rank, chunk)]` numbers the stages in
    messages (default: Megatron's loop)."""
    pp_size = len(lists)

    def say(a: Action, rank: int) -> str:
        return describe(a, pp_size, rank, None if stage_at is None else stage_at[(rank, a.chunk)])

    for rank, actions in enumerate(lists):
        seen: set[tuple[str, int, int]] = set()
        for i, a in enumerate(actions):
            if not isinstance(a, Action) or a.kind not in _KIND_NAMES:
                raise ScheduleError(
                    f"rank {rank}, action #{i}: expected an Action with kind 'F', 'B', 'I' or 'W', got {a!r}"
                )
            if not (0 <= a.chunk < num_chunks and 0 <= a.microbatch < num_microbatches):
                raise ScheduleError(
                    f"rank {rank}, action #{i} {a}: chunk must be in [0, {num_chunks}) and microbatch in "
                    f"[0, {num_microbatches}), got chunk {a.chunk}, microbatch {a.microbatch}"
                )
            key = (a.kind, a.chunk, a.microbatch)
            if key in seen:
                raise ScheduleError(f"rank {rank} runs {say(a, rank)} twice (again at action #{i})")
            if a.kind == "W" and ("I", a.chunk, a.microbatch) not in seen:
                raise ScheduleError(
                    f"rank {rank}, action #{i}: {say(a, rank)} would use a weight gradient before it "
                    f"exists: {Action('I', a.chunk, a.microbatch)} must run first"
                )
            if (
                a.kind == "B"
                and any((k, a.chunk, a.microbatch) in seen for k in ("I", "W"))
                or (a.kind in ("I", "W") and ("B", a.chunk, a.microbatch) in seen)
            ):
                raise ScheduleError(
                    f"rank {rank}, action #{i}: {say(a, rank)}: a backward runs either whole (B) or "
                    f"split (I then W), not both"
                )
            seen.add(key)
        missing = [
            Action("F", c, m) for c in range(num_chunks) for m in range(num_microbatches) if ("F", c, m) not in seen
        ]
        for c in range(num_chunks):
            for m in range(num_microbatches):
                if ("B", c, m) in seen:
                    continue
                if ("I", c, m) in seen and ("W", c, m) not in seen:
                    missing.append(Action("W", c, m))
                elif ("I", c, m) not in seen:
                    missing.append(Action("B", c, m))
        if missing:
            shown = ", ".join(say(a, rank) for a in missing[:3])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ScheduleError(f"rank {rank} never runs {shown}{more}")


@attrs.frozen(eq=False)
class PreparedSchedule:
    """A schedule's action lists for one layout, checked (`validate`) and compiled for the simulator:
    each action's stage, its slot in the finish table and what it waits for. Preparing once and
    simulating many times (`makespan`) is how `nanocore plan --search` costs thousands of layouts."""

    pp_size: int
    num_microbatches: int
    num_chunks: int
    lists: list[list[Action]]
    owners: list[tuple[int, int]]  # (rank, chunk) of each stage
    # per rank, per action: (kind, stage, finish slot, dependencies as (kind, slot))
    steps: list[list[tuple[str, int, int, tuple[tuple[str, int], ...]]]]


def prepare(
    schedule_or_action_lists: Any, pp_size: int, num_microbatches: int, num_chunks: int = 1, placement: object = None
) -> PreparedSchedule:
    """Check a schedule's (or explicit lists') actions for this layout and compile them (see `simulate`
    for `placement`). Raises `ScheduleError` for an incomplete list."""
    lists = _action_lists(schedule_or_action_lists, pp_size, num_microbatches, num_chunks)
    owners = stage_owners(schedule_or_action_lists if placement is None else placement, pp_size, num_chunks)
    stage_at = {(rank, chunk): stage for stage, (rank, chunk) in enumerate(owners)}
    validate(lists, num_microbatches, num_chunks, stage_at)
    m, last_stage = num_microbatches, pp_size * num_chunks - 1
    steps: list[list[tuple[str, int, int, tuple[tuple[str, int], ...]]]] = []
    for rank, actions in enumerate(lists):
        compiled: list[tuple[str, int, int, tuple[tuple[str, int], ...]]] = []
        for a in actions:
            stage = stage_at[(rank, a.chunk)]
            slot = stage * m + a.microbatch
            if a.kind == "F":
                deps: tuple[tuple[str, int], ...] = (("F", slot - m),) if stage > 0 else ()
            elif a.kind == "W":
                deps = (("I", slot),)
            else:  # B or I: its forward, and the next stage's input gradient ("G": B or I done)
                deps = (("F", slot), ("G", slot + m)) if stage < last_stage else (("F", slot),)
            compiled.append((a.kind, stage, slot, deps))
        steps.append(compiled)
    return PreparedSchedule(pp_size, num_microbatches, num_chunks, lists, owners, steps)


def simulate(
    schedule_or_action_lists: Any,
    pp_size: int,
    num_microbatches: int,
    num_chunks: int = 1,
    t_forward: float | Sequence[float] = 1.0,
    t_backward: float | Sequence[float] = 2.0,
    t_input: float | Sequence[float] | None = None,
    t_weight: float | Sequence[float] | None = None,
    placement: object = None,
    first_stage_whole: bool | None = None,
    activation: float | Sequence[float] = 1.0,
) -> SimResult:
    """Simulate one step of a `PipelineSchedule` (or of explicit per-rank action lists).

    `t_forward` / `t_backward` are the time one rank needs for the forward / backward of all its
    layers on one microbatch; `t_input` / `t_weight` those of a split backward's halves (default
    half of `t_backward` each). Each is one number for every rank, a list with one per rank (shared
    evenly by its chunks), or a list with one per stage (`pp_size * num_chunks`, in stage order:
    where a rank's chunks differ, as under a V whose rank 0 holds both the embedding and the loss).
    Stages differ: the first embeds, the last computes the loss. Raises `ScheduleError` for an
    incomplete list or a deadlock. Chunks sit where the schedule places them
    (`nanocore.pipeline_api.stage_of`); for explicit lists, `placement` is an object with that
    `stage_of` method (default: Megatron's loop). `first_stage_whole`: the first stage's I is empty
    and its W the whole backward, as the executor runs it (None: so only when neither split time is
    given). `activation`: what one micro-batch's activations of a rank (or, a list per stage, of a
    stage) weigh, for `SimResult.peak_activation`.
    """
    prepared = prepare(schedule_or_action_lists, pp_size, num_microbatches, num_chunks, placement)
    timelines: list[list[TimedAction]] = [[] for _ in range(pp_size)]
    makespan, busy = _run(prepared, t_forward, t_backward, t_input, t_weight, first_stage_whole, timelines)
    bubble = 1.0 - sum(busy) / (pp_size * makespan) if makespan > 0 else 0.0
    lists = prepared.lists
    peaks = [_peak_in_flight(actions) for actions in lists]
    if isinstance(activation, (int, float)):  # each chunk weighs activation / num_chunks
        held = [p * float(activation) / num_chunks for p in peaks]
    else:
        weight = _per_stage(activation, [r for r, _ in prepared.owners], pp_size, num_chunks, "activation")
        stage_at = {owner: stage for stage, owner in enumerate(prepared.owners)}
        held = [
            _peak_in_flight(actions, [weight[stage_at[(rank, c)]] for c in range(num_chunks)])
            for rank, actions in enumerate(lists)
        ]
    return SimResult(
        pp_size=pp_size,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        makespan=makespan,
        busy=busy,
        bubble_fraction=bubble,
        peak_in_flight=peaks,
        peak_in_flight_microbatches=[p / num_chunks for p in peaks],
        peak_activation=held,
        timelines=timelines,
    )


def makespan(
    prepared: PreparedSchedule,
    t_forward: float | Sequence[float] = 1.0,
    t_backward: float | Sequence[float] = 2.0,
    t_input: float | Sequence[float] | None = None,
    t_weight: float | Sequence[float] | None = None,
    first_stage_whole: bool | None = None,
) -> float:
    """`simulate(...).makespan` of a prepared schedule, without drawing its timelines."""
    return _run(prepared, t_forward, t_backward, t_input, t_weight, first_stage_whole, None)[0]


def _run(
    prepared: PreparedSchedule,
    t_forward: float | Sequence[float],
    t_backward: float | Sequence[float],
    t_input: float | Sequence[float] | None,
    t_weight: float | Sequence[float] | None,
    first_stage_whole: bool | None,
    timelines: list[list[TimedAction]] | None,
) -> tuple[float, list[float]]:
    """Run the prepared actions (the module docstring); fills `timelines` when given. Returns the
    makespan and each rank's busy time."""
    pp_size, num_chunks, m = prepared.pp_size, prepared.num_chunks, prepared.num_microbatches
    owner_of = [rank for rank, _ in prepared.owners]
    stages = len(owner_of)

    def per_stage(value: float | Sequence[float], name: str) -> list[float]:
        return _per_stage(value, owner_of, pp_size, num_chunks, name)

    backward = per_stage(t_backward, "t_backward")
    times = {
        "F": per_stage(t_forward, "t_forward"),
        "B": backward,
        "I": [b / 2 for b in backward] if t_input is None else per_stage(t_input, "t_input"),
        "W": [b / 2 for b in backward] if t_weight is None else per_stage(t_weight, "t_weight"),
    }
    if first_stage_whole is None:  # its I is empty, its W the whole backward
        first_stage_whole = t_input is None and t_weight is None
    if first_stage_whole:
        times["I"][0], times["W"][0] = 0.0, backward[0]
    # finish[kind][stage * m + microbatch]; -1.0 = not run yet. "G": the input gradient is ready (B or I)
    finish = {kind: [-1.0] * (stages * m) for kind in ("F", "B", "I", "W", "G")}
    steps = prepared.steps
    pos, free, busy = [0] * pp_size, [0.0] * pp_size, [0.0] * pp_size
    waiting: dict[tuple[str, int], list[int]] = {}  # (kind, slot) -> ranks blocked on it
    ready = list(range(pp_size))
    while ready:
        rank = ready.pop()
        compiled = steps[rank]
        n = len(compiled)
        at, start_free = pos[rank], free[rank]
        while at < n:
            kind, stage, slot, deps = compiled[at]
            start = start_free
            blocked = None
            for dep in deps:
                done = finish[dep[0]][dep[1]]
                if done < 0:
                    blocked = dep
                    break
                if done > start:
                    start = done
            if blocked is not None:
                waiting.setdefault(blocked, []).append(rank)
                break
            took = times[kind][stage]
            end = start + took
            if timelines is not None:
                timelines[rank].append(TimedAction(start, end, prepared.lists[rank][at]))
            busy[rank] += took
            start_free = end
            at += 1
            finish[kind][slot] = end
            woken = waiting.pop((kind, slot), None)
            if woken:
                ready.extend(woken)
            if kind == "B" or kind == "I":
                finish["G"][slot] = end
                woken = waiting.pop(("G", slot), None)
                if woken:
                    ready.extend(woken)
        pos[rank], free[rank] = at, start_free
    if any(pos[r] < len(steps[r]) for r in range(pp_size)):
        raise ScheduleError(_deadlock_message(prepared.lists, pos, prepared.owners))
    return max(free, default=0.0), busy


def _per_stage(
    value: float | Sequence[float], owner_of: Sequence[int], pp_size: int, num_chunks: int, name: str
) -> list[float]:
    """One time per stage from one for all ranks, one per rank (its chunks share it evenly) or one
    per stage."""
    stages = len(owner_of)
    if isinstance(value, (int, float)):
        return [float(value) / num_chunks] * stages
    values = [float(v) for v in value]
    if len(values) == pp_size:
        return [values[rank] / num_chunks for rank in owner_of]
    if len(values) == stages:
        return values
    raise ScheduleError(
        f"{name}: expected one time per pipeline rank ({pp_size}) or per stage ({stages}), got {len(values)}"
    )


def _peak_in_flight(actions: Sequence[Action], chunk_weight: Sequence[float] | None = None) -> Any:
    """Most (chunk, microbatch) activations held at once: from F until B, or until W (I keeps them),
    each weighing its chunk's `chunk_weight` (default 1)."""
    held: float = 0
    peak: float = 0
    for a in actions:
        sign = {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)
        held += sign * (1 if chunk_weight is None else chunk_weight[a.chunk])
        peak = max(peak, held)
    return peak


def _deadlock_message(lists: Sequence[Sequence[Action]], pos: Sequence[int], owners: list[tuple[int, int]]) -> str:
    stage_at = {(rank, chunk): stage for stage, (rank, chunk) in enumerate(owners)}
    pp_size = len(lists)

    def say(action: Action, rank: int) -> str:
        return describe(action, pp_size, rank, stage_at[(rank, action.chunk)])

    lines = ["pipeline schedule deadlocks: these ranks wait for an action that can never finish"]
    for rank, actions in enumerate(lists):
        if pos[rank] >= len(actions):
            continue
        a = actions[pos[rank]]
        stage = stage_at[(rank, a.chunk)]
        if a.kind == "F":
            need_rank, need_chunk = owners[stage - 1]
            need = Action("F", need_chunk, a.microbatch)
        elif a.kind == "W":
            need, need_rank = Action("I", a.chunk, a.microbatch), rank
        else:
            # the missing dependency is the own forward if it has not run, else the next stage's backward
            own_forward = Action("F", a.chunk, a.microbatch)
            if own_forward in actions[pos[rank] :]:
                need, need_rank = own_forward, rank
            else:
                need_rank, need_chunk = owners[stage + 1]
                split = Action("I", need_chunk, a.microbatch) in lists[need_rank]
                need = Action("I" if split else "B", need_chunk, a.microbatch)
        if need_rank == rank and need in actions[pos[rank] :]:
            why = "which comes later in its own list"
        else:
            blocker = lists[need_rank][pos[need_rank]] if pos[need_rank] < len(lists[need_rank]) else None
            why = f"which rank {need_rank} has not run; rank {need_rank} is stuck at {blocker}"
        lines.append(
            f"  rank {rank} is stuck at action #{pos[rank]} {say(a, rank)}: it needs {say(need, need_rank)} on rank "
            f"{need_rank}, {why}"
        )
    return "\n".join(lines)


_MICROBATCH_CHARS = string.ascii_lowercase


def render_timeline(result: SimResult, width: int | None = None) -> str:
    """ASCII picture of a simulated step: one row per rank, time left to right.

    A forward is the microbatch's letter in lower case (a = microbatch 0, ..., z = 25, then again),
    its backward (or a split backward's input-gradient half) the same letter in upper case, the
    weight-gradient half a digit (microbatch mod 10); '.' is idle. With `width=None` the shortest action
    gets one column (at most 160 columns); actions shorter than a column may be hidden.
    """
    if result.makespan <= 0:
        return ""
    shortest = min((t.end - t.start for tl in result.timelines for t in tl if t.end > t.start), default=1.0)
    if width is None:
        width = min(160, max(1, round(result.makespan / shortest)))
    scale = width / result.makespan
    label = max(len(f"rank {result.pp_size - 1}"), 6)
    rows = []
    for rank, timeline in enumerate(result.timelines):
        cells = ["."] * width
        for t in timeline:
            char = _MICROBATCH_CHARS[t.action.microbatch % len(_MICROBATCH_CHARS)]
            if t.action.kind == "W":
                char = str(t.action.microbatch % 10)
            elif t.action.kind != "F":
                char = char.upper()
            lo, hi = round(t.start * scale), round(t.end * scale)
            for col in range(lo, min(max(hi, lo + 1), width)):
                if cells[col] == "." or col < hi:
                    cells[col] = char
        rows.append(f"{f'rank {rank}':>{label}} |{''.join(cells)}|")
    legend = f"{'':>{label}}  a-z: forward of microbatch 0-25 (mod 26), A-Z: its backward"
    if any(t.action.kind in ("I", "W") for tl in result.timelines for t in tl):
        legend += " (input-gradient half), 0-9: weight-gradient half (microbatch mod 10)"
    legend += ", '.': idle"
    return "\n".join([*rows, legend])
