"""The memory plan's expert-load factor: under expert parallelism the busiest rank's routed
activations grow with it and nothing else does; without ep every slot is local and it changes
nothing; `nanocore plan --expert-load-factor` below 1 is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nanocore.config.load import load_config
from nanocore.plan import plan_for
from tests.helpers.launch import REPO

MOE = REPO / "examples" / "config_tiny_moe.yaml"


def planned(ep: int, factor: float):
    loaded = load_config(MOE, world_size=None, overrides=["parallelism.dp=2", f"parallelism.expert_parallel_size={ep}"])
    return plan_for(loaded.config, loaded.plugins.registries, "cpu", factor).largest()


def test_the_factor_sizes_the_busiest_ranks_routed_activations():
    one, two = planned(2, 1.0), planned(2, 2.0)
    assert two.params_bytes == one.params_bytes and two.grads_bytes == one.grads_bytes
    assert two.optimizer_bytes == one.optimizer_bytes
    grown = two.activations_bytes - one.activations_bytes
    assert 0 < grown < one.activations_bytes  # the routed part doubles, not the whole
    three = planned(2, 3.0)
    assert three.activations_bytes - one.activations_bytes == pytest.approx(2 * grown, rel=0.01)  # linear
    assert planned(1, 2.0).activations_bytes == planned(1, 1.0).activations_bytes  # ep 1: every slot local


def test_plan_refuses_a_factor_below_one():
    cmd = [sys.executable, "-m", "nanocore", "plan", str(MOE), "--device", "cpu", "--expert-load-factor", "0.5"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 2 and "--expert-load-factor" in out.stderr
