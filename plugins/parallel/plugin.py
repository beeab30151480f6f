"""Registers the built-in engine (`parallelism.engine: nd`, alias `3d`) and its config checks."""

from __future__ import annotations

import torch
from torch import nn

from nanocore import hookimpl
from nanocore.config import Config
from nanocore.moe_api import moe_layers
from nanocore.sequence_api import attention_heads, sequence_features

from .build import model_key
from .context_parallel import CONTEXT_PARALLEL_MODES
from .engine import ParallelEngine
from .planner import plan
from .tensor_parallel import split_problem
from .time_model import predict, predict_bound


def check(config: Config, _args: object, registries=None) -> list[str]:
    par, problems = config.parallelism, []
    ep, cp = par.expert_parallel_size, par.context_parallel_size
    if ep < 1:
        problems.append(f"parallelism.expert_parallel_size: {ep} must be at least 1")
    elif cp >= 1 and (par.dp * cp) % ep:
        where = (
            f"parallelism.dp={par.dp}" if cp == 1 else f"dp x context_parallel_size = {par.dp} x {cp} = {par.dp * cp}"
        )
        problems.append(
            f"parallelism.expert_parallel_size: {ep} must divide {where} (expert-parallel ranks are data-parallel "
            "ranks: each holds 1/ep of the experts and its own share of the batch)"
        )
    if par.context_parallel_mode not in CONTEXT_PARALLEL_MODES:
        problems.append(
            f"parallelism.context_parallel_mode: {par.context_parallel_mode!r} is not one of "
            f"{', '.join(CONTEXT_PARALLEL_MODES)}"
        )
    seq = config.tokens.sequence_length
    if cp > 1 and seq % (2 * cp):
        problems.append(
            f"tokens.sequence_length: context parallelism cuts each sequence into 2 x context_parallel_size = "
            f"{2 * cp} equal chunks (rank r holds chunks r and {2 * cp - 1}-r, which balances causal attention), so "
            f"sequence_length must be divisible by {2 * cp}; got {seq}"
        )
    return problems


_CHECKED_MODELS: dict[tuple[str, str], nn.Module] = {}
_TP_SPLITS: dict[tuple[str, str, int], str | None] = {}  # (model, its config, tp) -> split_problem's answer


def _checked_model(model_entry, config: Config) -> nn.Module:
    """The whole model on meta, read (never changed) by the checks; remembered per model config, since
    `nanocore plan --search` checks thousands of layouts of one model."""
    key = (model_entry.name, model_key(config.model))
    if key not in _CHECKED_MODELS:
        if len(_CHECKED_MODELS) > 8:
            _CHECKED_MODELS.clear()
        with torch.device("meta"):
            _CHECKED_MODELS[key] = model_entry.factory(config.model, vocab_multiple=1)
    return _CHECKED_MODELS[key]


def check_blocks(config: Config, model_entry) -> list[str]:
    """Checks that need the model itself (built on the meta device): pipeline blocks and experts."""
    par = config.parallelism
    chunks = par.pp * par.pp_virtual_stages
    ep, cp, masking = par.expert_parallel_size, par.context_parallel_size, config.tokens.document_masking
    selective = par.recompute == "selective"
    if chunks <= 1 and ep <= 1 and cp <= 1 and par.tp <= 1 and not masking and not selective:
        return []
    try:
        model = _checked_model(model_entry, config)
        blocks = len(model.pipeline_blocks())
    except Exception:  # the model's own check reports a broken model config
        return []
    problems = []
    if par.tp > 1:
        key = (model_entry.name, model_key(config.model), par.tp)
        if key not in _TP_SPLITS:
            if len(_TP_SPLITS) > 1024:
                _TP_SPLITS.clear()
            _TP_SPLITS[key] = split_problem(model, getattr(model, "tp_plan", None) or {}, par.tp)
        if _TP_SPLITS[key] is not None:
            problems.append(str(_TP_SPLITS[key]))
    if blocks < chunks:
        problems.append(
            f"parallelism: pp x pp_virtual_stages = {chunks} pipeline chunks but the model has only {blocks} "
            "pipeline blocks (embedding, each decoder layer, head); add layers or lower pp / pp_virtual_stages"
        )
    if selective and not getattr(model, "selective_recompute_modules", None):
        problems.append(
            f"parallelism.recompute_granularity: selective recomputes the modules a model declares in "
            f"selective_recompute_modules, and model type {config.model.model_type!r} declares none; use full"
        )
    features = sequence_features(model)
    if cp > 1 and "context_parallel" not in features:
        problems.append(
            f"parallelism.context_parallel_size: {cp} needs a model that declares context parallelism, but model "
            f"type {config.model.model_type!r} does not (it lists {sorted(features) or 'nothing'} in "
            "sequence_features; see nanocore.sequence_api); set it to 1"
        )
    if cp > 1 and "context_parallel" in features and par.context_parallel_mode == "all_to_all":
        problems += _all_to_all_heads(config, model)
    if masking and "document_masking" not in features:
        problems.append(
            f"tokens.document_masking: model type {config.model.model_type!r} does not declare document masking "
            "in sequence_features (see nanocore.sequence_api); set it to false"
        )
    if ep > 1:
        layers = moe_layers(model)
        if not layers:
            problems.append(
                f"parallelism.expert_parallel_size: {ep} needs a mixture-of-experts model, but model type "
                f"{config.model.model_type!r} has no experts (use model_type: mixtral, or set it to 1)"
            )
        for name in layers[:1]:
            experts = int(model.get_submodule(name).num_experts)
            if experts % ep:
                problems.append(
                    f"parallelism.expert_parallel_size: {ep} must divide the model's {experts} experts "
                    "(model.model_config.num_local_experts)"
                )
    return problems


def _all_to_all_heads(config: Config, model: torch.nn.Module) -> list[str]:
    """all_to_all context parallelism splits each rank's query heads over the cp ranks."""
    par = config.parallelism
    heads = attention_heads(model)
    if heads is None:
        return [
            f"parallelism.context_parallel_mode: all_to_all splits attention heads over the context-parallel ranks, "
            f"but model type {config.model.model_type!r} does not declare attention_heads (see "
            "nanocore.sequence_api); use ring"
        ]
    if heads % par.tp or (heads // par.tp) % par.context_parallel_size:
        return [
            f"parallelism.context_parallel_mode: all_to_all splits each rank's attention heads over the "
            f"context-parallel ranks, but the model's {heads} query heads / tp={par.tp} do not divide by "
            f"context_parallel_size={par.context_parallel_size}; use ring, or a cp (or tp) that divides them"
        ]
    return []


@hookimpl
def register_parallel_engines(registry):
    registry.register(
        "nd",
        ParallelEngine,
        aliases=("3d",),  # the name before 0.2: configs that say `engine: 3d` keep running
        description=(
            "data, context, tensor, pipeline and expert parallelism (dp, cp, tp, pp, ep; gloo on CPU, NCCL on GPU)"
        ),
        check=check,
        check_model=check_blocks,
        plan=plan,
        predict=predict,
        predict_bound=predict_bound,
    )


@hookimpl
def register_commands(registry):
    from . import pipeline_probe

    registry.register(
        "pipeline-probe",
        pipeline_probe.run,
        add_arguments=pipeline_probe.add_arguments,
        description=pipeline_probe.DESCRIPTION,
    )
