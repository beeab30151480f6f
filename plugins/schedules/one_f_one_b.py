"""One-forward-one-backward (PipeDream-flush) schedule, as Megatron's non-interleaved pipeline."""

from __future__ import annotations

from nanocore.pipeline_api import Action, ScheduleError
from nanocore_plugins.schedules.afab import one_chunk_problems


class OneFOneBSchedule:
    """Warmup forwards, then alternate one forward and one backward, then drain the backwards.

    Rank r runs min(pp - r - 1, m) warmup forwards: just enough that the last rank starts its
    first backward as early as possible. The bubble equals AFAB's, but rank r holds at most
    min(pp - r, m) microbatches of activations instead of m.
    """

    name = "1f1b"
    bubble_formula = "(p-1)/(m+p-1)"

    def check(self, pp_size: int, num_microbatches: int, num_chunks: int) -> list[str]:
        return one_chunk_problems(self.name, num_chunks)

    def actions(self, pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int) -> list[Action]:
        problems = self.check(pp_size, num_microbatches, num_chunks)
        if problems:
            raise ScheduleError("\n".join(problems))
        warmup = min(pp_size - pp_rank - 1, num_microbatches)
        actions = [Action("F", 0, mb) for mb in range(warmup)]
        for backward_mb in range(num_microbatches - warmup):  # steady state
            actions += [Action("F", 0, backward_mb + warmup), Action("B", 0, backward_mb)]
        actions += [Action("B", 0, mb) for mb in range(num_microbatches - warmup, num_microbatches)]  # cooldown
        return actions

    def theoretical_bubble(self, pp_size: int, num_microbatches: int, num_chunks: int) -> float:
        return (pp_size - 1) / (num_microbatches + pp_size - 1)
