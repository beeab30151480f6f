"""Pipeline schedules are data: an ordered list of actions per pipeline rank.

A schedule plugin registers `factory(config) -> PipelineSchedule`. The engine runs any such list
with one executor; `nanocore.pipeline_sim` runs the same lists on paper.

Chunks: with `num_chunks = v` virtual stages per rank, rank r holds model chunks c = 0..v-1, and
chunk c on rank r is *virtual stage* `c * pp_size + r` of `pp_size * v` (Megatron's interleaving).
Microbatch activations flow virtual stage s -> s + 1; gradients flow back s + 1 -> s.
"""

from __future__ import annotations

from typing import Literal, Protocol

import attrs

from nanocore.errors import NanocoreError


@attrs.frozen
class Action:
    """Run the forward (`F`) or backward (`B`) of model chunk `chunk` on microbatch `microbatch`."""

    kind: Literal["F", "B"]
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(NanocoreError):
    """A pipeline schedule cannot run: a bad layout, or an action list that is incomplete or deadlocks."""


class PipelineSchedule(Protocol):
    """Turns a pipeline layout into each rank's ordered action list.

    A schedule may also define `theoretical_bubble(pp_size, num_microbatches, num_chunks) -> float | None`
    and a `bubble_formula: str`; `nanocore pipeline-sim` prints them next to the simulated bubble.
    """

    name: str

    def actions(self, pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int) -> list[Action]:
        """Every F and B this rank runs for one optimizer step, in order."""

    def check(self, pp_size: int, num_microbatches: int, num_chunks: int) -> list[str]:
        """Problems with this layout as 'yaml.path: message' (e.g.
        'tokens.batch_accumulation_per_replica: ...'); [] if fine."""
