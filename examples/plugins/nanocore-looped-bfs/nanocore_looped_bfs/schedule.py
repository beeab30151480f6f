"""Breadth-first looped pipeline schedule (Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2022).

Like interleaved 1F1B, rank r holds v model chunks (chunk c is virtual stage c * pp + r), so a
microbatch loops through the ranks v times. Unlike it, work goes *breadth first*: every microbatch
passes through chunk 0 before any enters chunk 1, and so on; then the backwards run through the
chunks in reverse, again every microbatch per chunk. Each rank holds all m x v chunk activations
(as AFAB does), in exchange for the longest uninterrupted runs of work per chunk, a bubble as small
as interleaved 1F1B's when m >= pp, and no constraint on m: any pp, m and v >= 1 work.

Bubble (t_F, t_B the forward/backward time of a rank's layers per microbatch; a chunk takes 1/v of
them). A microbatch crosses the v * p virtual stages one after the other and each rank must run all
m microbatches of a chunk before the next, so the forward phase lasts
(v * max(m, p) + min(m, p) - 1) * t_F / v on the critical path, and the backward phase is its mirror
image. Every rank is busy m * (t_F + t_B) of that, so

    bubble = 1 - v*m / (v*max(m, p) + min(m, p) - 1)   =  (p-1)/(v*m+p-1)  when m >= p.

Message order: each rank sends and receives along every (src, dst, direction) link in the same
(chunk, microbatch) order, because both ends walk the chunks in the same order and the microbatches
0..m-1 within each; that is what NCCL, which matches point-to-point messages in posting order, needs.
"""

from __future__ import annotations

from nanocore.pipeline_api import Action, ScheduleError


def looped_bfs_bubble(pp_size: int, num_microbatches: int, num_chunks: int) -> float:
    """The bubble fraction derived in the module docstring (independent of t_F / t_B)."""
    p, m, v = pp_size, num_microbatches, num_chunks
    return 1.0 - v * m / (v * max(m, p) + min(m, p) - 1)


class LoopedBFSSchedule:
    """Breadth-first looped schedule: F of chunk 0 for every microbatch, then chunk 1, ...; then B
    of chunk v-1 for every microbatch, then v-2, ... . With v = 1 it is AFAB."""

    name = "looped_bfs"
    bubble_formula = "1 - v*m/(v*max(m,p)+min(m,p)-1)"

    def check(self, pp_size: int, num_microbatches: int, num_chunks: int) -> list[str]:
        """Any layout with pp, microbatches and virtual stages >= 1 runs; only values below 1 are refused."""
        problems = []
        for path, value in (
            ("parallelism.pp", pp_size),
            ("tokens.batch_accumulation_per_replica", num_microbatches),
            ("parallelism.pp_virtual_stages", num_chunks),
        ):
            if value < 1:
                problems.append(f"{path}: pp_engine looped_bfs needs at least 1, got {value}")
        return problems

    def actions(self, pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int) -> list[Action]:
        problems = self.check(pp_size, num_microbatches, num_chunks)
        if problems:
            raise ScheduleError("\n".join(problems))
        microbatches = range(num_microbatches)
        forwards = [Action("F", c, mb) for c in range(num_chunks) for mb in microbatches]
        backwards = [Action("B", c, mb) for c in reversed(range(num_chunks)) for mb in microbatches]
        return forwards + backwards

    def theoretical_bubble(self, pp_size: int, num_microbatches: int, num_chunks: int) -> float:
        return looped_bfs_bubble(pp_size, num_microbatches, num_chunks)
