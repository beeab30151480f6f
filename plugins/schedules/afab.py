"""All-forward-all-backward (GPipe-style) schedule, as nanotron's AllForwardAllBackwardPipelineEngine."""

from __future__ import annotations

from nanocore.pipeline_api import Action, ScheduleError


def one_chunk_problems(engine: str, num_chunks: int) -> list[str]:
    """afab and 1f1b keep one contiguous block of layers per rank."""
    if num_chunks == 1:
        return []
    return [
        f"parallelism.pp_virtual_stages: afab/1f1b run one chunk per rank; use pp_engine: interleaved for "
        f"pp_virtual_stages={num_chunks} (or set pp_virtual_stages: 1 for pp_engine: {engine})"
    ]


class AllForwardAllBackwardSchedule:
    """Every microbatch forward, then every backward in the same microbatch order.

    Backwards run first-in first-out (microbatch 0 first) like nanotron's engine, which pops the
    oldest stored activations. Simple, but every rank holds all m microbatches' activations.
    """

    name = "afab"
    bubble_formula = "(p-1)/(m+p-1)"

    def check(self, pp_size: int, num_microbatches: int, num_chunks: int) -> list[str]:
        return one_chunk_problems(self.name, num_chunks)

    def actions(self, pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int) -> list[Action]:
        problems = self.check(pp_size, num_microbatches, num_chunks)
        if problems:
            raise ScheduleError("\n".join(problems))
        microbatches = range(num_microbatches)
        return [Action("F", 0, mb) for mb in microbatches] + [Action("B", 0, mb) for mb in microbatches]

    def theoretical_bubble(self, pp_size: int, num_microbatches: int, num_chunks: int) -> float:
        return (pp_size - 1) / (num_microbatches + pp_size - 1)
