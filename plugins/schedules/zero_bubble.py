"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each backward split in
two, the input gradient (I, which the previous stage waits for) and the weight gradient (W, which
nobody waits for), so that W fills the time 1F1B spends waiting.

ZBV (same paper's V schedule) places two chunks per rank in a V and splits backwards the same way.

Both schedules' action lists come from `greedy_lists`: the pipeline run on paper, each rank picking
its next action whenever it is free (input gradients first, forwards within its memory, weight
gradients to fill the waits; `_Rules` says how much memory and how many W kept in reserve), with
F = I = W = 1 except on the first stage, whose I is empty and whose W is its whole backward. A list
that ran once without waiting on anything it does not receive cannot deadlock, whatever the real
times; zb1p reaches the paper's bubble (p-1)/(3m+p-1) at pp 2 and 4. The lists assume those
times: with I 30 % longer than W the gain shrinks (`nanocore pipeline-sim --t-input/--t-weight`).
"""

from __future__ import annotations

import functools
from collections import deque

import attrs

from nanocore.pipeline_api import Action, ScheduleError
from nanocore_plugins.schedules.afab import one_chunk_problems


@attrs.frozen
class _Rules:
    """How a rank picks its next action (see `greedy_lists`)."""

    soft: int  # forwards run freely while the rank holds fewer chunk activations than this
    reserve: int  # weight gradients kept back for the waits of the cooldown
    cap: int  # at most this many chunk activations held (until their W)


def greedy_lists(
    pp_size: int, num_microbatches: int, num_chunks: int, stage_of, rules
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's action list from running the pipeline on paper, each rank greedily picking its next
    action whenever it is free (time-ordered): by priority, the oldest input gradient I whose output
    gradient has arrived (later stages first); else a forward whose input has arrived (later stages
    first) while it holds fewer than `rules(r).soft` chunk activations; else a W beyond
    `rules(r).reserve`; else a forward within `rules(r).cap`; else any pending W; else it waits for
    the next event. Times: F = I = W = 1, except the first stage, whose I is empty (it has no input
    gradient to send) and whose W is its whole backward (2)."""
    p, m, v = pp_size, num_microbatches, num_chunks
    stages = p * v
    owner = {stage_of(c, r): (r, c) for r in range(p) for c in range(v)}
    never = float("inf")
    f_end = [[never] * m for _ in range(stages)]
    i_end = [[never] * m for _ in range(stages)]
    next_f, next_i = [0] * stages, [0] * stages
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    held, free, turn = [0] * p, [0.0] * p, [0] * p  # turn: who goes first among ranks free at once
    lists: list[list[Action]] = [[] for _ in range(p)]
    idle_turns = 0
    total = 3 * m * v
    by_stage = [sorted((stage_of(c, r) for c in range(v)), reverse=True) for r in range(p)]
    while True:
        busy = [r for r in range(p) if len(lists[r]) < total]
        if not busy:
            break
        r = min(busy, key=lambda q: (free[q], turn[q], q))
        t, rule = free[r], rules(r)

        def input_ready(s: int, t: float = t) -> bool:
            k = next_i[s]
            return k < next_f[s] and (f_end[s][k] if s == stages - 1 else i_end[s + 1][k]) <= t

        def forward_ready(s: int, t: float = t) -> bool:
            k = next_f[s]
            return k < m and (s == 0 or f_end[s - 1][k] <= t)

        ready_i = [s for s in by_stage[r] if input_ready(s)]
        ready_f = [s for s in by_stage[r] if forward_ready(s)]
        if ready_i:
            s = ready_i[0]
            k, next_i[s] = next_i[s], next_i[s] + 1
            i_end[s][k] = free[r] = t + (0.0 if s == 0 else 1.0)
            pending_w[r].append((owner[s][1], k))
            lists[r].append(Action("I", owner[s][1], k))
        elif ready_f and held[r] < rule.soft or (ready_f and len(pending_w[r]) <= rule.reserve and held[r] < rule.cap):
            s = ready_f[0]
            k, next_f[s] = next_f[s], next_f[s] + 1
            f_end[s][k] = free[r] = t + 1.0
            held[r] += 1
            lists[r].append(Action("F", owner[s][1], k))
        elif pending_w[r]:
            c, k = pending_w[r].popleft()
            free[r] = t + (2.0 if stage_of(c, r) == 0 else 1.0)
            held[r] -= 1
            lists[r].append(Action("W", c, k))
        else:  # wait: for the ranks free now to act, else for the next thing to finish anywhere
            idle_turns += 1
            if idle_turns > len(busy):
                later = [x for row in (*f_end, *i_end) for x in row if t < x < never] + [f for f in free if f > t]
                if not later:
                    raise ScheduleError(f"zero-bubble list builder is stuck at rank {r} (pp={p}, m={m}, v={v})")
                free[r], idle_turns = min(later), 0
            turn[r] = max(turn) + 1
            continue
        idle_turns = 0
    return tuple(tuple(actions) for actions in lists)


@functools.lru_cache(maxsize=64)
def zb_h1_lists(pp_size: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ZB-H1 action list for one chunk per rank (see the module docstring)."""
    p = pp_size
    return greedy_lists(p, num_microbatches, 1, lambda c, r: r, lambda r: _Rules(soft=p - r, reserve=r, cap=p))


class ZeroBubbleH1Schedule:
    """ZB-H1: 1F1B's peak memory (no rank holds more than p microbatches, counted until their W) with
    a third of its bubble when F, I and W take equal time: (p-1)/(3m+p-1) against 1F1B's
    (p-1)/(m+p-1). Needs a backward that splits (the executor's I and W actions)."""

    name = "zb1p"
    bubble_formula = "(p-1)/(3m+p-1) at F=I=W"

    def check(self, pp_size: int, num_microbatches: int, num_chunks: int) -> list[str]:
        return one_chunk_problems(self.name, num_chunks)

    def actions(self, pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int) -> list[Action]:
        problems = self.check(pp_size, num_microbatches, num_chunks)
        if problems:
            raise ScheduleError("\n".join(problems))
        return list(zb_h1_lists(pp_size, num_microbatches)[pp_rank])

    def theoretical_bubble(self, pp_size: int, num_microbatches: int, num_chunks: int) -> float:
        return (pp_size - 1) / (3 * num_microbatches + pp_size - 1)


@functools.lru_cache(maxsize=64)
def zbv_lists(pp_size: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ZBV action list: two chunks per rank in a V (see `ZeroBubbleVSchedule`)."""
    p = pp_size
    return greedy_lists(
        p, num_microbatches, 2, lambda c, r: _v_stage(c, r, p), lambda r: _Rules(soft=2 * p, reserve=0, cap=2 * p)
    )


def _v_stage(chunk: int, rank: int, pp_size: int) -> int:
    return rank if chunk == 0 else 2 * pp_size - 1 - rank


class ZeroBubbleVSchedule:
    """ZBV: two chunks per rank placed in a V, rank r holding virtual stages r and 2p-1-r, so the
    forward runs down the ranks and back up and rank 0 holds both the first stage and the last (the
    loss): the backward starts on the rank that began the forward, and with split backwards (I, W)
    the bubble nearly vanishes. Memory: at most 2p chunk activations per rank (p whole micro-batches,
    1F1B's peak on its first rank), counted until their W. Needs `pp_virtual_stages: 2`."""

    name = "zbv"

    def stage_of(self, chunk: int, rank: int, pp_size: int, num_chunks: int) -> int:
        return _v_stage(chunk, rank, pp_size)

    def check(self, pp_size: int, num_microbatches: int, num_chunks: int) -> list[str]:
        if num_chunks != 2:
            return [
                f"parallelism.pp_virtual_stages: zbv places exactly 2 chunks per rank in a V, got {num_chunks}; set "
                "pp_virtual_stages: 2"
            ]
        return []

    def actions(self, pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int) -> list[Action]:
        problems = self.check(pp_size, num_microbatches, num_chunks)
        if problems:
            raise ScheduleError("\n".join(problems))
        return list(zbv_lists(pp_size, num_microbatches)[pp_rank])
