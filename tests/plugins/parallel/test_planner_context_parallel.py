"""The memory plan counts each context-parallel mode's buffers, and a split-backward schedule's
activations until their W (plans only: the measured peaks are in tests/parallel/test_memory_plan.py
and benchmarks/context_parallel_memory.py, benchmarks/pipeline_schedules.py)."""

from __future__ import annotations

import pytest

from nanocore.config.converter import structure_config
from nanocore.plan import plan_for
from nanocore.plugins import load_plugins
from nanocore_plugins.parallel.planner import context_parallel_buffers
from tests.helpers.training import tiny_config

# tests/helpers/training.py's tiny LLaMA: hidden 32, 4 heads, 2 key/value heads, head size 8
Q, KV = 4 * 8, 2 * 2 * 8


def _plan(tmp_path, **parallelism):
    registries = load_plugins().registries
    raw = tiny_config(tmp_path, parallelism={"dp": 1, "tp": 1, "pp": 1, **parallelism})
    return plan_for(structure_config(raw, registries), registries, "cpu")


def test_each_mode_adds_its_own_buffers_per_local_token():
    declared = {"attention_query": Q, "attention_key_value": KV, "attention_kv_heads": 2}
    assert context_parallel_buffers(declared, "ring", 1, 1) == (0.0, 0.0)
    assert context_parallel_buffers(declared, "ring", 2, 1) == (0.0, 3 * KV)
    # 2 key/value heads over cp 2: no repeat; over cp 4 each is repeated twice (kept in each layer)
    assert context_parallel_buffers(declared, "all_to_all", 2, 1) == (0.0, 2 * (Q + KV + Q))
    assert context_parallel_buffers(declared, "all_to_all", 4, 1) == (KV, 2 * (Q + 2 * KV + Q))
    assert context_parallel_buffers(declared, "all_to_all", 2, 2) == (KV / 2, 2 * (Q / 2 + 2 * KV / 2 + Q / 2))


def test_plans_of_the_two_modes_differ_by_those_buffers(tmp_path):
    ring = _plan(tmp_path / "ring", context_parallel_size=2, context_parallel_mode="ring")
    a2a = _plan(tmp_path / "a2a", context_parallel_size=2, context_parallel_mode="all_to_all")
    tokens = 1 * 16 / 2  # micro_batch_size x sequence / cp, float32
    difference = a2a.ranks[0].activations_bytes - ring.ranks[0].activations_bytes
    assert difference == pytest.approx((2 * (Q + KV + Q) - 3 * KV) * tokens * 4)


def test_split_backward_schedules_plan_activations_until_w(tmp_path):
    one = _plan(tmp_path / "1f1b", pp=2, pp_engine="1f1b")
    zb = _plan(tmp_path / "zb1p", pp=2, pp_engine="zb1p")
    # zb1p lets the last stage hold 2 micro-batches (1F1B: 1), the first stage holds 2 in both
    assert zb.ranks[0].activations_bytes == one.ranks[0].activations_bytes
    assert zb.ranks[-1].activations_bytes > one.ranks[-1].activations_bytes
