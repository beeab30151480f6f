"""The memory planner cuts each rank's part of the model from one whole model built per tp (copying
only the rank's pipeline chunks): every part must hold exactly what the engine's own build holds on
that rank (`meta_model`, then TP, then `keep_rank_part`) — the same parameters, shapes and places."""

from __future__ import annotations

import pytest

from nanocore.config.load import load_config
from nanocore.sharding import get_placement
from plugins.parallel.build import keep_rank_part, meta_model
from plugins.parallel.expert_parallel import shard_experts
from plugins.parallel.planner import _rank_part
from plugins.parallel.pruned import PrunedBlock, under_pruned_block
from plugins.parallel.tensor_parallel import PlannedGroup
from plugins.parallel.tensor_parallel import parallelize as tp_parallelize
from tests.helpers.launch import REPO

CASES = [
    ("config_tiny_moe.yaml", 2, 2, 1, 2, "1f1b"),  # experts split, TP, two stages
    ("config_tiny_llama.yaml", 2, 2, 2, 1, "interleaved"),  # virtual stages: non-contiguous chunks
    ("config_tiny_qwen3.yaml", 1, 4, 1, 1, "1f1b"),
    ("config_tiny_deepseek_v3.yaml", 2, 2, 1, 1, "1f1b"),
]


def _engine_part(config, registries, pp_rank: int, tp_rank: int):
    par = config.parallelism
    entry = registries.model.get(config.model.model_type)
    model = meta_model(entry, config.model, vocab_multiple=config.model.make_vocab_size_divisible_by * par.tp)
    if par.tp > 1:
        mode = registries.tp_mode.get(par.tp_mode).factory()
        tp_parallelize(model, model.tp_plan, PlannedGroup(par.tp, tp_rank), mode, par.tp_linear_async_communication)
    schedule = registries.pipeline_schedule.get(par.pp_engine).factory(config)
    chunks, _ = keep_rank_part(model, par.pp, pp_rank, par.pp_virtual_stages, par.expert_parallel_size, 0, schedule)
    return model, chunks


def _described(model) -> dict[str, tuple]:
    return {
        name: (tuple(p.shape), p.requires_grad, repr(get_placement(p)))
        for name, p in model.named_parameters(remove_duplicate=False)
    }


@pytest.mark.parametrize(("name", "tp", "pp", "virtual", "ep", "schedule"), CASES)
def test_each_rank_part_holds_what_the_engine_builds_on_that_rank(name, tp, pp, virtual, ep, schedule):
    overrides = [
        f"parallelism.tp={tp}",
        f"parallelism.pp={pp}",
        f"parallelism.pp_virtual_stages={virtual}",
        f"parallelism.pp_engine={schedule}",
        f"parallelism.dp={max(ep, 1)}",
        f"parallelism.expert_parallel_size={ep}",
        "parallelism.context_parallel_size=1",
        "tokens.batch_accumulation_per_replica=4",
    ]
    loaded = load_config(REPO / "examples" / name, world_size=None, overrides=overrides)
    config, registries = loaded.config, loaded.plugins.registries
    entry = registries.model.get(config.model.model_type)
    mode = registries.tp_mode.get(config.parallelism.tp_mode).factory() if tp > 1 else None
    schedule_obj = registries.pipeline_schedule.get(schedule).factory(config)
    seen = set()
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            part, _, chunks = _rank_part(config, entry, mode, schedule_obj, pp_rank, tp_rank)
            reference, reference_chunks = _engine_part(config, registries, pp_rank, tp_rank)
            assert chunks == reference_chunks
            described = _described(part)
            assert described == _described(reference)
            seen.add(tuple(sorted(described)))
    assert len(seen) == pp  # each stage holds its own blocks (TP ranks the same names)


def test_other_stages_blocks_are_pruned_blocks_that_tp_and_expert_sharding_skip_by_name():
    """Both builds leave a `PrunedBlock` where another stage's block was; TP and expert sharding skip
    what lies under one, and nothing else: a module the model lacks is still an error."""
    overrides = ["parallelism.pp=2", "parallelism.dp=1", "parallelism.expert_parallel_size=1"]
    loaded = load_config(REPO / "examples" / "config_tiny_moe.yaml", world_size=None, overrides=overrides)
    config, registries = loaded.config, loaded.plugins.registries
    model, chunks = _engine_part(config, registries, 1, 0)
    kept = {name for chunk in chunks for block in chunk for name in block}
    every = [f"model.layers.{i}" for i in range(config.model.model_config.num_hidden_layers)]
    layers, gone = [n for n in every if n in kept], [n for n in every if n not in kept]
    assert layers and gone
    for name in gone:
        assert isinstance(model.get_submodule(name), PrunedBlock)
        assert under_pruned_block(model, name) and under_pruned_block(model, f"{name}.mlp.experts")
    assert not any(under_pruned_block(model, name) for name in layers)
    assert not under_pruned_block(model, "no.such.module")
    shard_experts(model, 1, 0)  # the pruned MoE layers are skipped, the kept ones split
    mode = registries.tp_mode.get("ALL_REDUCE").factory()
    tp_parallelize(model, model.tp_plan, PlannedGroup(2, 0), mode, False)  # plans naming pruned layers: skipped
    with pytest.raises(AttributeError):
        model.get_submodule(f"{gone[0]}.mlp")
