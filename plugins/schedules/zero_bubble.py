"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each backward split in
two, the input gradient (I, which the previous stage waits for) and the weight gradient (W, which
nobody waits for), so that W fills the time 1F1B spends waiting.

The action lists come from a greedy run of the pipeline on paper with unit times (F = I = W = 1):
at every time step rank r runs, by priority, the oldest input gradient whose output gradient has
arrived (the critical path); else the next forward if its input has arrived and it holds fewer than
p - r microbatches (1F1B's rhythm); else a weight gradient, keeping r of them in reserve for the
waits of the cooldown; else a forward up to p microbatches held (1F1B's peak, on rank 0); else any
pending W. A list that ran once without waiting on anything it does not receive cannot deadlock,
whatever the real times; with F, I and W of equal length it reaches the paper's bubble
(p-1)/(3m+p-1). It assumes those equal times: with I 30 % longer than W the same lists lose
their gain at pp=2 and large m (measured on paper: `nanocore pipeline-sim --t-input/--t-weight`).
"""

from __future__ import annotations

import functools
from collections import deque

from nanocore.pipeline_api import Action, ScheduleError
from nanocore_plugins.schedules.afab import one_chunk_problems


@functools.lru_cache(maxsize=64)
def zb_h1_lists(pp_size: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ZB-H1 action list for one chunk per rank (see the module docstring)."""
    p, m = pp_size, num_microbatches
    never = float("inf")
    f_end = [[never] * m for _ in range(p)]  # when rank r's forward of microbatch k ends
    i_end = [[never] * m for _ in range(p)]  # ... its input gradient
    next_f, next_i = [0] * p, [0] * p
    pending_w: list[deque[int]] = [deque() for _ in range(p)]
    held = [0] * p  # microbatches forwarded and not yet through W
    lists: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(len(actions) < 3 * m for actions in lists):
        for r in range(p):
            k = next_i[r]
            arrived = never if k >= m else f_end[r][k] if r == p - 1 else i_end[r + 1][k]
            if k < next_f[r] and arrived <= t:  # the critical path first
                lists[r].append(Action("I", 0, k))
                i_end[r][k] = t + 1
                next_i[r] += 1
                pending_w[r].append(k)
                continue
            k = next_f[r]
            forward = k < m and (r == 0 or f_end[r - 1][k] <= t)
            if forward and held[r] < p - r:  # 1F1B's rhythm and memory
                kind = "F"
            elif len(pending_w[r]) > r:  # keep r weight gradients for the cooldown's waits
                kind = "W"
            elif forward and held[r] < p:  # nothing else to do: run ahead, within p microbatches
                kind = "F"
            elif pending_w[r]:
                kind = "W"
            else:
                continue
            if kind == "F":
                lists[r].append(Action("F", 0, k))
                f_end[r][k] = t + 1
                next_f[r] += 1
                held[r] += 1
            else:
                lists[r].append(Action("W", 0, pending_w[r].popleft()))
                held[r] -= 1
        t += 1
    return tuple(tuple(actions) for actions in lists)


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
