"""Run pipeline schedules on paper: makespan, bubble fraction and peak in-flight activations.

Every rank runs its action list in order. An action starts when its rank is free and what it
depends on has finished (communication takes no time):

- F of virtual stage s on microbatch m needs F(s - 1, m), which runs on the rank holding s - 1;
- B(s, m) needs F(s, m) and, unless s is the last virtual stage, B(s + 1, m).

A chunk is 1/v of a rank's layers, so its F takes `t_forward / v` and its B `t_backward / v`.
Because a rank never waits for anything but a dependency, each action's start time follows from
finish times already known; the simulator visits every action once (O(total actions)).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

import attrs

from nanocore.pipeline_api import Action, ScheduleError


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
    timelines: list[list[TimedAction]]


def describe(action: Action, pp_size: int, rank: int) -> str:
    stage = action.chunk * pp_size + rank
    kind = "forward" if action.kind == "F" else "backward"
    return f"{action} ({kind} of chunk {action.chunk} = virtual stage {stage}, microbatch {action.microbatch})"


def _action_lists(schedule: Any, pp_size: int, num_microbatches: int, num_chunks: int) -> list[list[Action]]:
    if hasattr(schedule, "actions"):
        return [list(schedule.actions(pp_size, r, num_microbatches, num_chunks)) for r in range(pp_size)]
    lists = [list(actions) for actions in schedule]
    if len(lists) != pp_size:
        raise ScheduleError(f"expected one action list per pipeline rank ({pp_size}), got {len(lists)}")
    return lists


def validate(lists: Sequence[Sequence[Action]], num_microbatches: int, num_chunks: int) -> None:
    """Each rank must run F and B of every (chunk, microbatch) exactly once."""
    pp_size = len(lists)
    for rank, actions in enumerate(lists):
        seen: set[tuple[str, int, int]] = set()
        for i, a in enumerate(actions):
            if not isinstance(a, Action) or a.kind not in ("F", "B"):
                raise ScheduleError(f"rank {rank}, action #{i}: expected an Action with kind 'F' or 'B', got {a!r}")
            if not (0 <= a.chunk < num_chunks and 0 <= a.microbatch < num_microbatches):
                raise ScheduleError(
                    f"rank {rank}, action #{i} {a}: chunk must be in [0, {num_chunks}) and microbatch in "
                    f"[0, {num_microbatches}), got chunk {a.chunk}, microbatch {a.microbatch}"
                )
            key = (a.kind, a.chunk, a.microbatch)
            if key in seen:
                raise ScheduleError(f"rank {rank} runs {describe(a, pp_size, rank)} twice (again at action #{i})")
            seen.add(key)
        missing = [
            Action(kind, c, m)
            for c in range(num_chunks)
            for m in range(num_microbatches)
            for kind in ("F", "B")
            if (kind, c, m) not in seen
        ]
        if missing:
            shown = ", ".join(describe(a, pp_size, rank) for a in missing[:3])
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ScheduleError(f"rank {rank} never runs {shown}{more}")


def simulate(
    schedule_or_action_lists: Any,
    pp_size: int,
    num_microbatches: int,
    num_chunks: int = 1,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
) -> SimResult:
    """Simulate one step of a `PipelineSchedule` (or of explicit per-rank action lists).

    `t_forward` / `t_backward` are the time one rank needs for the forward / backward of all its
    layers on one microbatch. Raises `ScheduleError` for an incomplete list or a deadlock.
    """
    lists = _action_lists(schedule_or_action_lists, pp_size, num_microbatches, num_chunks)
    validate(lists, num_microbatches, num_chunks)
    m, last_stage = num_microbatches, pp_size * num_chunks - 1
    duration = {"F": t_forward / num_chunks, "B": t_backward / num_chunks}
    # finish[kind][stage * m + microbatch]; -1.0 = not run yet
    finish = {"F": [-1.0] * ((last_stage + 1) * m), "B": [-1.0] * ((last_stage + 1) * m)}
    pos, free = [0] * pp_size, [0.0] * pp_size
    timelines: list[list[TimedAction]] = [[] for _ in range(pp_size)]
    waiting: dict[tuple[str, int], list[int]] = {}  # (kind, stage * m + mb) -> ranks blocked on it
    ready = list(range(pp_size))
    while ready:
        rank = ready.pop()
        actions, timeline = lists[rank], timelines[rank]
        while pos[rank] < len(actions):
            a = actions[pos[rank]]
            stage = a.chunk * pp_size + rank
            if a.kind == "F":
                deps = [("F", (stage - 1) * m + a.microbatch)] if stage > 0 else []
            else:
                deps = [("F", stage * m + a.microbatch)]
                if stage < last_stage:
                    deps.append(("B", (stage + 1) * m + a.microbatch))
            start = free[rank]
            blocked = None
            for kind, index in deps:
                done = finish[kind][index]
                if done < 0:
                    blocked = (kind, index)
                    break
                start = max(start, done)
            if blocked is not None:
                waiting.setdefault(blocked, []).append(rank)
                break
            end = start + duration[a.kind]
            timeline.append(TimedAction(start, end, a))
            free[rank] = end
            pos[rank] += 1
            key = (a.kind, stage * m + a.microbatch)
            finish[a.kind][key[1]] = end
            ready.extend(waiting.pop(key, ()))
    if any(pos[r] < len(lists[r]) for r in range(pp_size)):
        raise ScheduleError(_deadlock_message(lists, pos, m))

    makespan = max((t[-1].end for t in timelines if t), default=0.0)
    busy = [sum(t.end - t.start for t in timeline) for timeline in timelines]
    bubble = 1.0 - sum(busy) / (pp_size * makespan) if makespan > 0 else 0.0
    peaks = [_peak_in_flight(actions) for actions in lists]
    return SimResult(
        pp_size=pp_size,
        num_microbatches=num_microbatches,
        num_chunks=num_chunks,
        makespan=makespan,
        busy=busy,
        bubble_fraction=bubble,
        peak_in_flight=peaks,
        peak_in_flight_microbatches=[p / num_chunks for p in peaks],
        timelines=timelines,
    )


def _peak_in_flight(actions: Sequence[Action]) -> int:
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak


def _deadlock_message(lists: Sequence[Sequence[Action]], pos: Sequence[int], m: int) -> str:
    pp_size = len(lists)
    lines = ["pipeline schedule deadlocks: these ranks wait for an action that can never finish"]
    for rank, actions in enumerate(lists):
        if pos[rank] >= len(actions):
            continue
        a = actions[pos[rank]]
        stage = a.chunk * pp_size + rank
        if a.kind == "F":
            need = Action("F", (stage - 1) // pp_size, a.microbatch)
            need_rank = (stage - 1) % pp_size
        else:
            # the missing dependency is the own forward if it has not run, else the next stage's backward
            own_forward = Action("F", a.chunk, a.microbatch)
            if own_forward in actions[pos[rank] :]:
                need, need_rank = own_forward, rank
            else:
                need = Action("B", (stage + 1) // pp_size, a.microbatch)
                need_rank = (stage + 1) % pp_size
        if need_rank == rank:
            why = "which comes later in its own list"
        else:
            blocker = lists[need_rank][pos[need_rank]] if pos[need_rank] < len(lists[need_rank]) else None
            why = f"which rank {need_rank} has not run; rank {need_rank} is stuck at {blocker}"
        lines.append(
            f"  rank {rank} is stuck at action #{pos[rank]} {describe(a, pp_size, rank)}: it needs "
            f"{describe(need, pp_size, need_rank)} on rank {need_rank}, {why}"
        )
    return "\n".join(lines)


_MICROBATCH_CHARS = string.ascii_lowercase


def render_timeline(result: SimResult, width: int | None = None) -> str:
    """ASCII picture of a simulated step: one row per rank, time left to right.

    A forward is the microbatch's letter in lower case (a = microbatch 0, ..., z = 25, then again),
    its backward the same letter in upper case; '.' is idle. With `width=None` the shortest action
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
            char = char if t.action.kind == "F" else char.upper()
            lo, hi = round(t.start * scale), round(t.end * scale)
            for col in range(lo, min(max(hi, lo + 1), width)):
                if cells[col] == "." or col < hi:
                    cells[col] = char
        rows.append(f"{f'rank {rank}':>{label}} |{''.join(cells)}|")
    legend = f"{'':>{label}}  a-z: forward of microbatch 0-25 (mod 26), A-Z: its backward, '.': idle"
    return "\n".join([*rows, legend])
