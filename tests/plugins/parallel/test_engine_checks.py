"""Layouts the 3d engine cannot run are config errors before any process starts."""

from __future__ import annotations

import pytest

from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.errors import ConfigError
from nanocore.plugins import load_plugins
from tests.helpers.training import tiny_config


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def problems(registries, tmp_path, world_size=None, **sections) -> str:
    config = structure_config(tiny_config(tmp_path, **sections), registries)
    with pytest.raises(ConfigError) as err:
        check_config(config, registries, world_size)
    return str(err.value)


def test_heads_not_divisible_by_tp(registries, tmp_path):
    message = problems(registries, tmp_path, parallelism={"tp": 3})
    assert "num_attention_heads" in message and "tp" in message


def test_a_matrix_tp_does_not_divide_is_a_config_error_not_a_crash_after_launch(registries, tmp_path):
    """Heads split over tp=3 (6 query, 3 key/value), but the MLP's 64 rows do not: that was found only
    when the model was split, after the process groups existed (and it crashed `plan --search` on 1,536
    GPUs, where tp=3 and 6 are divisors). The vocabulary is padded to tp, so it is never the problem."""
    model = {"model_config": {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3}}
    message = problems(registries, tmp_path, model=model, parallelism={"tp": 3})
    assert "gate_proj (output features) has size 64, which tp=3 does not divide" in message
    model["model_config"]["intermediate_size"] = 96  # every matrix now splits three ways
    config = structure_config(tiny_config(tmp_path, model=model, parallelism={"tp": 3}), registries)
    check_config(config, registries, 3)


def test_fewer_layers_than_pipeline_chunks(registries, tmp_path):
    # 4 layers + embedding + head = 6 blocks; pp 4 x 2 virtual stages = 8 chunks
    message = problems(
        registries,
        tmp_path,
        parallelism={"pp": 4, "pp_engine": "interleaved", "pp_virtual_stages": 2},
        tokens={"batch_accumulation_per_replica": 4},
    )
    assert "8 pipeline chunks but the model has only 6 pipeline blocks" in message


MIXTRAL = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}


def mixtral(**options):
    from tests.helpers.training import TINY_MODEL

    return {"model_config": {**TINY_MODEL, **MIXTRAL, **options}}


def test_expert_parallel_with_a_dense_model(registries, tmp_path):
    message = problems(registries, tmp_path, parallelism={"dp": 2, "expert_parallel_size": 2}, world_size=2)
    assert "parallelism.expert_parallel_size: 2 needs a mixture-of-experts model" in message
    assert "'llama' has no experts" in message


def test_expert_parallel_must_divide_dp(registries, tmp_path):
    message = problems(
        registries, tmp_path, model=mixtral(), parallelism={"dp": 2, "expert_parallel_size": 4}, world_size=2
    )
    assert "parallelism.expert_parallel_size: 4 must divide parallelism.dp=2" in message


def test_expert_parallel_must_divide_the_experts(registries, tmp_path):
    message = problems(
        registries,
        tmp_path,
        model=mixtral(num_local_experts=6),
        parallelism={"dp": 4, "expert_parallel_size": 4},
        tokens={"batch_accumulation_per_replica": 1},
        world_size=4,
    )
    assert "6 experts" in message and "expert_parallel_size" in message and "num_local_experts" in message


def test_top_k_above_the_experts(registries, tmp_path):
    message = problems(registries, tmp_path, model=mixtral(num_experts_per_tok=5))
    assert "model.model_config.num_experts_per_tok" in message and "num_local_experts" in message


def test_router_jitter_is_refused(registries, tmp_path):
    message = problems(registries, tmp_path, model=mixtral(router_jitter_noise=0.1))
    assert "model.model_config.router_jitter_noise" in message


def test_expert_parallel_size_below_one(registries, tmp_path):
    message = problems(registries, tmp_path, parallelism={"expert_parallel_size": 0})
    assert "parallelism.expert_parallel_size: 0 must be at least 1" in message


def test_schedule_needing_more_microbatches(registries, tmp_path):
    message = problems(
        registries,
        tmp_path,
        parallelism={"pp": 2, "pp_engine": "interleaved", "pp_virtual_stages": 2},
        tokens={"batch_accumulation_per_replica": 3},
    )
    assert "tokens.batch_accumulation_per_replica" in message and "interleaved" in message


def test_layout_must_match_the_launch(registries, tmp_path):
    message = problems(registries, tmp_path, world_size=8, parallelism={"dp": 2, "tp": 2})
    assert "dp x tp x pp = 2 x 2 x 1 = 4 but the launch has 8 process(es)" in message


def test_zero_stage_nobody_provides(registries, tmp_path):
    message = problems(registries, tmp_path, optimizer={"zero_stage": 4})
    assert "optimizer.zero_stage: no plugin provides ZeRO stage 4; installed stages: 0, 1, 2, 3" in message


def test_unknown_schedule_and_tp_mode_list_installed(registries, tmp_path):
    message = problems(registries, tmp_path, parallelism={"pp_engine": "zb", "tp_mode": "RING"})
    assert "unknown pipeline schedule 'zb'" in message and "1f1b, afab, interleaved" in message
    assert "unknown tp mode 'RING'" in message and "ALL_REDUCE, REDUCE_SCATTER" in message


# -- context parallelism and document masking ------------------------------------------------------


def test_context_parallel_needs_a_sequence_that_splits_into_2cp_chunks(registries, tmp_path):
    message = problems(registries, tmp_path, parallelism={"context_parallel_size": 3}, world_size=3)
    assert (
        "tokens.sequence_length: context parallelism cuts each sequence into 2 x context_parallel_size = 6" in message
    )
    assert "got 16" in message


def test_context_parallel_with_sequence_parallel_needs_cp_times_tp(registries, tmp_path):
    message = problems(
        registries,
        tmp_path,
        parallelism={"context_parallel_size": 2, "tp": 4, "tp_mode": "REDUCE_SCATTER"},
        tokens={"sequence_length": 20},
        world_size=8,
    )
    assert "sequence_length / context_parallel_size = 10 tokens over tp=4" in message
    assert "divisible by cp x tp = 8; got 20" in message


def test_the_launch_counts_context_parallel_ranks(registries, tmp_path):
    message = problems(registries, tmp_path, parallelism={"dp": 2, "context_parallel_size": 2}, world_size=2)
    assert "dp x cp x tp x pp = 2 x 2 x 1 x 1 = 4 but the launch has 2 process(es)" in message


def test_context_parallel_mode_must_be_known(registries, tmp_path):
    message = problems(registries, tmp_path, parallelism={"context_parallel_mode": "ulysses"})
    assert "parallelism.context_parallel_mode: 'ulysses' is not one of ring, all_to_all" in message


def test_all_to_all_context_parallel_needs_heads_that_split_over_cp(registries, tmp_path):
    """The tiny model has 4 query heads: over tp=2 each rank has 2, which cp=4 cannot split (ring can)."""
    par = {"tp": 2, "context_parallel_size": 4}
    message = problems(registries, tmp_path, parallelism={**par, "context_parallel_mode": "all_to_all"}, world_size=8)
    assert (
        "parallelism.context_parallel_mode: all_to_all splits each rank's attention heads over the context-parallel "
        "ranks, but the model's 4 query heads / tp=2 do not divide by context_parallel_size=4" in message
    )
    check_config(structure_config(tiny_config(tmp_path, parallelism=par), registries), registries, 8)  # ring: fine


def test_context_parallel_size_below_one(registries, tmp_path):
    message = problems(registries, tmp_path, parallelism={"context_parallel_size": 0})
    assert "parallelism.context_parallel_size: must be at least 1, got 0" in message


def test_expert_parallel_must_divide_dp_times_cp(registries, tmp_path):
    message = problems(
        registries,
        tmp_path,
        model=mixtral(),
        parallelism={"dp": 1, "context_parallel_size": 2, "expert_parallel_size": 4},
        world_size=2,
    )
    assert "parallelism.expert_parallel_size: 4 must divide dp x context_parallel_size = 1 x 2 = 2" in message


def test_context_parallel_and_document_masking_need_a_model_that_declares_them(registries, tmp_path):
    from tests.helpers.third_party import gpt2_config, require

    require("nanocore-gpt2")
    config = gpt2_config(tmp_path, {}, parallelism={"context_parallel_size": 2})
    config["tokens"]["document_masking"] = True
    config["tokenizer"] = {"tokenizer_name_or_path": "byte"}
    config["model"]["model_config"]["vocab_size"] = 257
    with pytest.raises(ConfigError) as err:
        check_config(structure_config(config, registries), registries, 2)
    message = str(err.value)
    assert "parallelism.context_parallel_size: 2 needs a model that declares context parallelism" in message
    assert "model type 'gpt2' does not" in message
    assert "tokens.document_masking: model type 'gpt2' does not declare document masking" in message


def test_document_masking_needs_a_tokenizer(registries, tmp_path):
    message = problems(registries, tmp_path, tokens={"document_masking": True})
    assert (
        "tokens.document_masking: documents end with the tokenizer's eos_token_id, but there is no tokenizer" in message
    )


def test_a_tp_mode_must_implement_the_core_contract(tmp_path):
    from nanocore import hookimpl

    class Incomplete:  # no row_linear, no after_embedding
        name = "HALF"
        sequence_parallel = False

        def column_linear(self, x, weight, bias, group, async_communication=False):
            return x

    class Plugin:
        @hookimpl
        def register_tp_modes(self, registry):
            registry.register("HALF", Incomplete)

    plugins = load_plugins()
    plugins.register_object(Plugin(), "half_tp_mode")
    registries = plugins.registries
    config = structure_config(tiny_config(tmp_path, parallelism={"tp": 2, "tp_mode": "HALF"}), registries)
    with pytest.raises(ConfigError) as err:
        check_config(config, registries, 2)
    assert "parallelism.tp_mode: 'HALF' (plugin half_tp_mode) builds" in str(err.value)
    assert "lacks row_linear, after_embedding; a TP mode implements nanocore.tp_api.TPMode" in str(err.value)


def test_recompute_granularity_choices_and_a_model_that_declares_selective(registries, tmp_path):
    message = problems(registries, tmp_path, parallelism={"recompute_granularity": "partial"})
    assert "parallelism.recompute_granularity: expected full or selective, got 'partial'" in message

    from tests.helpers.third_party import gpt2_config, require

    require("nanocore-gpt2")
    config = gpt2_config(tmp_path, {}, parallelism={"recompute_granularity": "selective"})
    with pytest.raises(ConfigError) as err:
        check_config(structure_config(config, registries), registries, 1)
    assert "model type 'gpt2' declares none; use full" in str(err.value)
