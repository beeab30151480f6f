"""The memory plan's expert-load factor: under expert parallelism the busiest rank's routed
activations grow with it and nothing else does; without ep every slot is local and it changes
nothing; `nanocore plan --expert-load-factor` below 1 is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nanocore.config.load import load_config
from nanocore.plan import plan_for
from tests.helpers.launch import REPO

MOE = REPO / "examples" / "config_tiny_moe.yaml"


def planned(ep: int, factor: float):
    dp = max(2, ep)
    loaded = load_config(
        MOE, world_size=None, overrides=[f"parallelism.dp={dp}", f"parallelism.expert_parallel_size={ep}"]
    )
    return plan_for(loaded.config, loaded.plugins.registries, "cpu", factor).largest()


def test_the_factor_sizes_the_busiest_ranks_routed_activations():
    one, two = planned(2, 1.0), planned(2, 2.0)
    assert two.params_bytes == one.params_bytes and two.grads_bytes == one.grads_bytes
    assert two.optimizer_bytes == one.optimizer_bytes
    grown = two.activations_bytes - one.activations_bytes
    assert 0 < grown < one.activations_bytes  # the routed part doubles, not the whole
    one4, two4, three4 = planned(4, 1.0), planned(4, 2.0), planned(4, 3.0)
    grown4 = two4.activations_bytes - one4.activations_bytes
    assert grown4 > 0
    assert three4.activations_bytes - one4.activations_bytes == pytest.approx(2 * grown4, rel=0.01)  # linear
    # a rank gets every routed token at most: at ep 2, a factor of 3 (a busiest expert's moe_max_load
    # can reach experts / top_k) plans what 2 does
    assert planned(2, 3.0).activations_bytes == two.activations_bytes
    assert planned(1, 2.0).activations_bytes == planned(1, 1.0).activations_bytes  # ep 1: every slot local


def test_plan_refuses_a_factor_below_one():
    cmd = [sys.executable, "-m", "nanocore", "plan", str(MOE), "--device", "cpu", "--expert-load-factor", "0.5"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 2 and "--expert-load-factor" in out.stderr


def test_a_run_logs_the_busiest_ep_ranks_load_the_factor_means():
    """moe_rank_load: the busiest ep rank's routed tokens over every sparse layer, over the balanced
    share (experts in contiguous runs per rank); moe_max_load is per expert and can say 4 where each
    rank gets its share."""
    import torch

    from plugins.parallel.expert_statistics import StepRoutingStatistics

    stats = StepRoutingStatistics.zeros(2, 4)
    stats.micro_batches += 1
    stats.tokens_per_expert = torch.tensor([[8.0, 0, 0, 0], [0, 0, 8, 0]], dtype=torch.float64)
    metrics = stats.metrics(ep=2)
    assert metrics["moe_max_load"] == 4.0  # one expert of four takes every token, in each layer
    assert metrics["moe_rank_load"] == 1.0  # but layer 1's expert is on the other rank: 8 tokens each
    stats.tokens_per_expert = torch.tensor([[8.0, 0, 0, 0], [0, 8, 0, 0]], dtype=torch.float64)
    assert stats.metrics(ep=2)["moe_rank_load"] == 2.0  # both on rank 0: every token, twice the share
    assert stats.metrics(ep=4)["moe_rank_load"] == 2.0  # one expert per rank: rank 0 holds layer 0's
    stats.tokens_per_expert = torch.tensor([[8.0, 0, 0, 0], [8.0, 0, 0, 0]], dtype=torch.float64)
    assert stats.metrics(ep=4)["moe_rank_load"] == 4.0  # expert 0 takes everything, twice: ep is the most
    assert "moe_rank_load" not in stats.metrics()  # no expert parallelism


def test_a_run_logs_the_mean_busiest_share_of_its_dispatches():
    """moe_sync_load: each dispatch's busiest ep rank's rows over the balanced share, the mean over the
    step's dispatches of every ep group (`sync_load` gives each group's sum and count); only under
    expert parallelism."""
    from plugins.parallel.expert_statistics import StepRoutingStatistics

    stats = StepRoutingStatistics.zeros(2, 4)
    stats.micro_batches += 1
    stats.tokens_per_expert = torch.tensor([[4.0, 4, 4, 4], [4, 4, 4, 4]], dtype=torch.float64)
    stats.sync_shares[0], stats.sync_dispatches[0] = 2.0 + 1.0 + 1.5, 3  # three dispatches
    metrics = stats.metrics(ep=2)
    assert metrics["moe_rank_load"] == pytest.approx(1.0)  # balanced over the step
    assert metrics["moe_sync_load"] == pytest.approx(1.5)  # but not within each dispatch
    assert "moe_sync_load" not in stats.metrics(ep=1)
