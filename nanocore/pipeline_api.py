"""Pipeline schedules are data: an ordered list of actions per pipeline rank.

A schedule plugin registers `factory(config) -> PipelineSchedule`. The engine runs any such list
with one executor; `nanocore.pipeline_sim` runs the same lists on paper.

Chunks: with `num_chunks = v` virtual stages per rank, rank r holds model chunks c = 0..v-1, and
chunk c on rank r is *virtual stage* `c * pp_size + r` of `pp_size * v` (Megatron's interleaving),
unless the schedule places them otherwise with its own `stage_of` (ZBV's V: rank r holds stages r
and 2p-1-r, so the first and the last stage share rank 0).
Microbatch activations flow virtual stage s -> s + 1; gradients flow back s + 1 -> s.

A backward is one action (`B`) or two (zero-bubble schedules): `I` computes the input gradient
(what the previous stage waits for) and `W`, any time later on the same rank, the weight gradients
from what autograd kept. Activations are held from `F` until `B` (or `W`).
"""

from __future__ import annotations

from typing import Literal, Protocol

import attrs

from nanocore.errors import NanocoreError


@attrs.frozen
class Action:
    """Run the forward (`F`), backward (`B`), input-gradient half (`I`) or weight-gradient half (`W`)
    of a backward, of model chunk `chunk` on microbatch `microbatch`."""

    kind: Literal["F", "B", "I", "W"]
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def splits_backward(actions: list[Action]) -> bool:
    """Whether these actions split backwards into I and W (the engine then keeps recomputed tensors
    and compiled graphs for both halves)."""
    return any(a.kind in ("I", "W") for a in actions)


def stage_of(schedule: object, chunk: int, rank: int, pp_size: int, num_chunks: int) -> int:
    """The virtual stage that chunk `chunk` of pipeline rank `rank` runs: the schedule's own placement
    (an optional `stage_of(chunk, rank, pp_size, num_chunks)` method), else Megatron's loop."""
    own = getattr(schedule, "stage_of", None)
    return int(own(chunk, rank, pp_size, num_chunks)) if own is not None else chunk * pp_size + rank


def stage_owners(schedule: object, pp_size: int, num_chunks: int) -> list[tuple[int, int]]:
    """(rank, chunk) holding each virtual stage, in stage order; a placement that does not give every
    stage to exactly one (rank, chunk) is a `ScheduleError`."""
    owners: dict[int, tuple[int, int]] = {}
    for rank in range(pp_size):
        for chunk in range(num_chunks):
            stage = stage_of(schedule, chunk, rank, pp_size, num_chunks)
            if not 0 <= stage < pp_size * num_chunks or stage in owners:
                raise ScheduleError(
                    f"schedule {getattr(schedule, 'name', schedule)!r} places chunk {chunk} of rank {rank} at "
                    f"virtual stage {stage}: each of the {pp_size * num_chunks} stages must be held exactly once"
                )
            owners[stage] = (rank, chunk)
    return [owners[s] for s in range(pp_size * num_chunks)]


class ScheduleError(NanocoreError):
    """A pipeline schedule cannot run: a bad layout, or an action list that is incomplete or deadlocks."""


class PipelineSchedule(Protocol):
    """Turns a pipeline layout into each rank's ordered action list.

    A schedule may also define `theoretical_bubble(pp_size, num_microbatches, num_chunks) -> float | None`
    and a `bubble_formula: str`; `nanocore pipeline-sim` prints them next to the simulated bubble.
    """

    name: str

    def actions(self, pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int) -> list[Action]:
        """Every F and B (or I and W) this rank runs for one optimizer step, in order."""

    def check(self, pp_size: int, num_microbatches: int, num_chunks: int) -> list[str]:
        """Problems with this layout as 'yaml.path: message' (e.g.
        'tokens.batch_accumulation_per_replica: ...'); [] if fine."""
