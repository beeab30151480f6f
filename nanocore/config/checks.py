"""Cross-field checks that run before any process group or tensor exists.

Plugins add their own: a config class may define `check(self, config) -> list[str]` (problems as
'relative.path: message'), and a registry entry may carry `check=fn(config, args) -> list[str]`.
"""

from __future__ import annotations

import inspect
from typing import Any

from nanocore.config.schema import Config
from nanocore.dtypes import DTYPE_NAMES
from nanocore.errors import ConfigError
from nanocore.registry import Entry, Registries
from nanocore.run_lock import LOCK_KINDS
from nanocore.tp_api import TPMode

WARMUP_STYLES = ("linear", "constant")


_TP_MODE_TYPES: dict[type, bool] = {}


def _implements_tp_mode(mode: object) -> bool:
    """`isinstance(mode, TPMode)`, remembered per type: a runtime protocol check reads every member, and
    `nanocore plan --search` checks ~10^5 layouts."""
    kind = type(mode)
    if kind not in _TP_MODE_TYPES:
        _TP_MODE_TYPES[kind] = isinstance(mode, TPMode)
    return _TP_MODE_TYPES[kind]


def _plugin_checks(prefix: str, args: Any, entry: Entry | None, config: Config) -> list[str]:
    problems: list[str] = []
    if args is not None and hasattr(args, "check"):
        problems += [f"{prefix}.{p}" if not p.startswith(prefix) else p for p in args.check(config)]
    if entry is not None and "check" in entry.extras:
        problems += entry.extras["check"](config, args)
    return problems


def check_config(config: Config, registries: Registries, world_size: int | None = None) -> None:
    """Raise one ConfigError listing every cross-field problem. `world_size=None` skips the launch check."""
    p: list[str] = []
    par, tok, opt = config.parallelism, config.tokens, config.optimizer
    for key in ("dp", "tp", "pp", "pp_virtual_stages", "expert_parallel_size", "context_parallel_size"):
        if getattr(par, key) < 1:
            p.append(f"parallelism.{key}: must be at least 1, got {getattr(par, key)}")
    if par.recompute_granularity not in (None, "full", "selective"):
        p.append(f"parallelism.recompute_granularity: expected full or selective, got {par.recompute_granularity!r}")
    if not par.collective_timeout_seconds > 0:
        p.append(f"parallelism.collective_timeout_seconds: must be positive, got {par.collective_timeout_seconds}")
    cp = par.context_parallel_size
    if world_size is not None and par.dp * par.tp * par.pp * cp != world_size:
        if cp == 1:
            layout = f"dp x tp x pp = {par.dp} x {par.tp} x {par.pp} = {par.dp * par.tp * par.pp}"
        else:
            layout = f"dp x cp x tp x pp = {par.dp} x {cp} x {par.tp} x {par.pp} = {par.dp * par.tp * par.pp * cp}"
        p.append(
            f"parallelism: {layout} but the launch has {world_size} process(es); change the layout or torchrun "
            "--nproc_per_node"
        )
    for key in ("sequence_length", "train_steps", "micro_batch_size", "batch_accumulation_per_replica"):
        if getattr(tok, key) < 1:
            p.append(f"tokens.{key}: must be at least 1, got {getattr(tok, key)}")
    if tok.document_masking and config.tokenizer.tokenizer_name_or_path is None:
        p.append(
            "tokens.document_masking: documents end with the tokenizer's eos_token_id, but there is no tokenizer "
            "(tokenizer.tokenizer_name_or_path is null); set one (e.g. byte) or turn document_masking off"
        )
    if config.model.dtype not in DTYPE_NAMES:
        p.append(f"model.dtype: expected one of {', '.join(DTYPE_NAMES)}, got {config.model.dtype!r}")
    if config.general.hardware is not None:
        from nanocore.hardware import load_hardware

        try:
            load_hardware(config.general.hardware)
        except ConfigError as e:
            p += [f"general.hardware: {problem}" for problem in e.problems]
    if config.model.make_vocab_size_divisible_by < 1:
        p.append("model.make_vocab_size_divisible_by: must be at least 1")
    lr = opt.learning_rate_scheduler
    if lr.lr_warmup_style not in WARMUP_STYLES:
        p.append(
            "optimizer.learning_rate_scheduler.lr_warmup_style: expected linear or constant, got "
            f"{lr.lr_warmup_style!r}"
        )
    if lr.lr_decay_style not in registries.lr_decay:
        p.append(
            "optimizer.learning_rate_scheduler.lr_decay_style: "
            f"{registries.lr_decay.unknown_message(lr.lr_decay_style)}"
        )
    if lr.learning_rate < 0 or lr.min_decay_lr < 0 or lr.min_decay_lr > lr.learning_rate:
        p.append("optimizer.learning_rate_scheduler: need 0 <= min_decay_lr <= learning_rate")
    if opt.clip_grad is not None and opt.clip_grad <= 0:
        p.append(f"optimizer.clip_grad: must be positive or null, got {opt.clip_grad}")
    guard = opt.skip_spikes
    if guard.sigmas <= 0:
        p.append(f"optimizer.skip_spikes.sigmas: must be positive, got {guard.sigmas}")
    if guard.window < 2:
        p.append(f"optimizer.skip_spikes.window: must be at least 2, got {guard.window}")
    if not 2 <= guard.min_history <= max(guard.window, 2):
        p.append(
            f"optimizer.skip_spikes.min_history: must be between 2 and window ({guard.window}), got {guard.min_history}"
        )
    if guard.max_consecutive < 1:
        p.append(f"optimizer.skip_spikes.max_consecutive: must be at least 1, got {guard.max_consecutive}")
    if config.checkpoints.folder_lock not in LOCK_KINDS:
        p.append(
            f"checkpoints.folder_lock: must be one of {', '.join(LOCK_KINDS)}; got {config.checkpoints.folder_lock!r}"
        )
    keep = config.checkpoints.keep_last_n
    if keep is not None and keep < 1:
        p.append(f"checkpoints.keep_last_n: must be at least 1, or null to keep every checkpoint; got {keep}")

    def lookup(kind: str, name: str, path: str) -> Entry | None:
        registry = registries[kind]
        if name not in registry:
            p.append(f"{path}: {registry.unknown_message(name)}")
            return None
        return registry.get(name)

    engine = lookup("parallel_engine", par.engine, "parallelism.engine")
    p += _plugin_checks("parallelism", None, engine, config)
    schedule = lookup("pipeline_schedule", par.pp_engine, "parallelism.pp_engine")
    p += _plugin_checks("parallelism", None, schedule, config)
    tp_mode = lookup("tp_mode", par.tp_mode, "parallelism.tp_mode")
    p += _plugin_checks("parallelism", None, tp_mode, config)
    if tp_mode is not None and par.tp > 1:
        mode = tp_mode.factory()
        missing = [
            a
            for a in ("name", "sequence_parallel", "column_linear", "row_linear", "after_embedding")
            if not hasattr(mode, a)
        ]
        if missing or not _implements_tp_mode(mode):
            p.append(
                f"parallelism.tp_mode: {par.tp_mode!r} (plugin {tp_mode.plugin}) builds {mode!r}, which lacks "
                f"{', '.join(missing) or 'the TPMode interface'}; a TP mode implements nanocore.tp_api.TPMode"
            )
    if config.model.float8_recipe is not None:
        recipe = lookup("float8_recipe", config.model.float8_recipe, "model.float8_recipe")
        p += _plugin_checks("model", None, recipe, config)
        if tp_mode is not None and par.tp > 1:
            takes = inspect.signature(tp_mode.factory().column_linear).parameters
            if "linear" not in takes:
                p.append(
                    f"model.float8_recipe: parallelism.tp_mode {par.tp_mode!r} (plugin {tp_mode.plugin}) does not "
                    "take the `linear` argument of nanocore.tp_api.TPMode.column_linear that FP8 needs"
                )
    zero = registries.zero_stage
    if str(opt.zero_stage) not in zero:
        installed = ", ".join(zero.names()) or "none"
        p.append(f"optimizer.zero_stage: no plugin provides ZeRO stage {opt.zero_stage}; installed stages: {installed}")
    model = registries.model.get(config.model.model_type)
    p += _plugin_checks("model.model_config", config.model.model_config, model, config)
    if engine is not None and "check_model" in engine.extras and not p:
        p += engine.extras["check_model"](config, model)
    optimizer = registries.optimizer.get(opt.optimizer_factory.name)
    p += _plugin_checks("optimizer.optimizer_factory", opt.optimizer_factory.args, optimizer, config)

    if config.tokenizer.tokenizer_type is not None:
        lookup("tokenizer", config.tokenizer.tokenizer_type, "tokenizer.tokenizer_type")

    stages = config.data_stages
    if not stages:
        p.append("data_stages: at least one stage is needed (use `dataset: null` for random tokens)")
    starts = [s.start_training_step for s in stages]
    if stages and starts[0] != 1:
        p.append(f"data_stages[0].start_training_step: the first stage must start at step 1, got {starts[0]}")
    for i in range(1, len(starts)):
        if starts[i] <= starts[i - 1]:
            p.append(
                f"data_stages[{i}].start_training_step: stages must be ordered by start_training_step; "
                f"{starts[i]} does not come after {starts[i - 1]} (stage {stages[i - 1].name!r})"
            )
    names = [s.name for s in stages]
    for i, name in enumerate(names):
        if name in names[:i]:
            p.append(f"data_stages[{i}].name: stage name {name!r} is used twice")
    validating = tok.val_check_interval > 0 and tok.limit_val_batches > 0
    for i, stage in enumerate(stages):
        base = f"data_stages[{i}].data"
        for key in ("dataset", "validation_dataset"):
            for j, spec in enumerate(getattr(stage.data, key) or []):
                entry = registries.dataset_format.get(spec.format)
                p += _plugin_checks(f"{base}.{key}[{j}]", spec.args, entry, config)
                if spec.weight <= 0:
                    p.append(f"{base}.{key}[{j}].weight: must be positive, got {spec.weight}")
        if validating and not stage.data.validation_dataset:
            p.append(
                f"{base}.validation_dataset: tokens.val_check_interval is set, so every stage needs a "
                "validation_dataset (or set val_check_interval: -1)"
            )
    for i, spec in enumerate(config.logging.loggers):
        entry = registries.logger.get(spec.name)
        p += _plugin_checks(f"logging.loggers[{i}]", spec.options, entry, config)
    if p:
        raise ConfigError(p)
