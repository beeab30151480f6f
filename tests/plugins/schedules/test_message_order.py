"""NCCL matches point-to-point messages between two ranks in the order they are posted (tags are
ignored), so every schedule must send and receive each direction's messages in the same order."""

from __future__ import annotations

import pytest

from nanocore.plugins import load_plugins
from tests.helpers.schedules import message_orders

LAYOUTS = [
    ("afab", 2, 4, 1),
    ("afab", 4, 6, 1),
    ("1f1b", 2, 4, 1),
    ("1f1b", 4, 8, 1),
    ("1f1b", 4, 2, 1),
    ("interleaved", 2, 4, 2),
    ("interleaved", 4, 8, 2),
    ("interleaved", 2, 6, 3),
    ("zb1p", 2, 4, 1),
    ("zb1p", 4, 8, 1),
    ("zb1p", 4, 3, 1),
    ("zb1p", 8, 16, 1),
    ("zbv", 2, 4, 2),
    ("zbv", 4, 8, 2),
    ("zbv", 4, 3, 2),
    ("zbv", 8, 16, 2),
]


@pytest.mark.parametrize("name,pp,m,v", LAYOUTS)
def test_each_direction_is_received_in_the_order_it_is_sent(name, pp, m, v):
    schedule = load_plugins().registries.pipeline_schedule.get(name).factory(None)
    sent, received = message_orders(schedule, pp, m, v)
    assert sent.keys() == received.keys()
    for key in sent:
        assert sent[key] == received[key], (
            f"{name} pp={pp} m={m} v={v}: {key} sent {sent[key]} received {received[key]}"
        )
