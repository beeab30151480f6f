"""Pipeline schedules on paper: the messages their action lists send and receive between stages."""

from __future__ import annotations


def message_orders(schedule, pp, m, v):
    """(src, dst, direction) -> sequence of (stage, microbatch) as sent, and as received."""
    sent, received = {}, {}
    last = pp * v - 1
    for rank in range(pp):
        for a in schedule.actions(pp, rank, m, v):
            stage = a.chunk * pp + rank
            if a.kind == "F":
                if stage > 0:
                    received.setdefault(((stage - 1) % pp, rank, "F"), []).append((stage, a.microbatch))
                if stage < last:
                    sent.setdefault((rank, (stage + 1) % pp, "F"), []).append((stage + 1, a.microbatch))
            elif a.kind in ("B", "I"):  # W moves nothing between ranks
                if stage < last:
                    received.setdefault(((stage + 1) % pp, rank, "B"), []).append((stage, a.microbatch))
                if stage > 0:
                    sent.setdefault((rank, (stage - 1) % pp, "B"), []).append((stage - 1, a.microbatch))
    return sent, received
