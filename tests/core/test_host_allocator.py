"""The trainer's host allocator setting: freed buffers leave the resident set (glibc), unless the user
chose otherwise. Each case runs in a fresh interpreter: glibc's thresholds are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

PROBE = """
import json, torch
from nanocore.memory import return_freed_memory, _status_kb
applied = return_freed_memory()
big = torch.ones(16 * 2**18)            # 16 MiB: mmapped; freeing it raises glibc's dynamic threshold to 16 MiB
del big
before = _status_kb("VmRSS")
held = torch.ones(8 * 2**18)            # 8 MiB, written: resident
del held
print(json.dumps({"applied": applied, "kept_mib": (_status_kb("VmRSS") - before) / 1024}))
"""


def probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "NANOCORE_HOST_ALLOCATOR")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_buffers_leave_the_resident_set():
    fixed = probe()
    assert fixed["applied"] and fixed["kept_mib"] < 2, fixed
    # glibc's own behaviour, which the setting exists for: the freed 8 MiB came from the heap and stays
    default = probe(NANOCORE_HOST_ALLOCATOR="default")
    assert not default["applied"] and default["kept_mib"] > 7, default


def test_a_users_own_threshold_wins():
    assert not probe(MALLOC_MMAP_THRESHOLD_="131072")["applied"]
