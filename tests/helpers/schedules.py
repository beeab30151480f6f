"""Pipeline schedules on paper: the messages their action lists send and receive between stages."""

from __future__ import annotations

from nanocore.pipeline_api import stage_of, stage_owners


def message_orders(schedule, pp, m, v):
    """(src, dst, direction) -> sequence of (stage, microbatch) as sent, and as received."""
    sent, received = {}, {}
    last = pp * v - 1
    owners = stage_owners(schedule, pp, v)  # stage -> (rank, chunk): the schedule's own placement
    for rank in range(pp):
        for a in schedule.actions(pp, rank, m, v):
            stage = stage_of(schedule, a.chunk, rank, pp, v)
            if a.kind == "F":
                if stage > 0:
                    received.setdefault((owners[stage - 1][0], rank, "F"), []).append((stage, a.microbatch))
                if stage < last:
                    sent.setdefault((rank, owners[stage + 1][0], "F"), []).append((stage + 1, a.microbatch))
            elif a.kind in ("B", "I"):  # W moves nothing between ranks
                if stage < last:
                    received.setdefault((owners[stage + 1][0], rank, "B"), []).append((stage, a.microbatch))
                if stage > 0:
                    sent.setdefault((rank, owners[stage - 1][0], "B"), []).append((stage - 1, a.microbatch))
    return sent, received
