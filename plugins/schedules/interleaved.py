"""Interleaved 1F1B (Megatron-LM's virtual pipeline): v model chunks per rank, smaller bubble.

Rank r holds chunks c = 0..v-1, chunk c being virtual stage c * pp + r. Work is issued in groups of
pp microbatches: the forwards of a group pass through chunk 0, then chunk 1, ... (backwards through
the chunks in reverse), so each rank always has the next virtual stage's input in time.
"""

from __future__ import annotations

from nanocore.pipeline_api import Action, ScheduleError


class InterleavedOneFOneBSchedule:
    """Megatron's interleaved 1F1B: warmup, steady one-forward-one-backward, cooldown over (chunk, microbatch) units.

    Rank r runs (pp - r - 1) * 2 + (v - 1) * pp warmup forwards (capped at m * v); the bubble
    shrinks to (p-1)/(v*m + p-1) for v times more point-to-point messages.
    """

    name = "interleaved"
    bubble_formula = "(p-1)/(v*m+p-1)"

    def check(self, pp_size: int, num_microbatches: int, num_chunks: int) -> list[str]:
        problems = []
        if num_chunks < 2:
            problems.append(
                f"parallelism.pp_virtual_stages: the interleaved schedule needs at least 2 virtual stages per rank, "
                f"got {num_chunks}; use pp_engine: 1f1b for one chunk per rank"
            )
        if pp_size >= 1 and num_microbatches % pp_size:
            problems.append(
                f"tokens.batch_accumulation_per_replica: the interleaved schedule needs a multiple of pp ({pp_size}) "
                f"microbatches, got {num_microbatches}"
            )
        return problems

    def actions(self, pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int) -> list[Action]:
        problems = self.check(pp_size, num_microbatches, num_chunks)
        if problems:
            raise ScheduleError("\n".join(problems))
        total = num_microbatches * num_chunks
        group = pp_size * num_chunks

        def unit(k: int, kind: str) -> Action:
            # the k-th forward (or backward) of this rank: which chunk, which microbatch
            chunk = (k % group) // pp_size
            if kind == "B":
                chunk = num_chunks - 1 - chunk
            return Action(kind, chunk, (k // group) * pp_size + k % pp_size)

        warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, total)
        actions = [unit(k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            actions += [unit(warmup + k, "F"), unit(k, "B")]
        actions += [unit(k, "B") for k in range(total - warmup, total)]
        return actions

    def theoretical_bubble(self, pp_size: int, num_microbatches: int, num_chunks: int) -> float:
        return (pp_size - 1) / (num_chunks * num_microbatches + pp_size - 1)
