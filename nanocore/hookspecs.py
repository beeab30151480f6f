"""The hooks a nanocore plugin may implement.

Registration hooks receive a typed `Registry` and call `registry.register(...)`; they return nothing.
Event hooks let a plugin observe a run without owning any registry name.
All hooks are called with keyword arguments, so an implementation may accept any subset of them.
`trainer` is the running `nanocore.trainer.Trainer` (typed `object` here: the trainer imports this module).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from nanocore.config.schema import Config
    from nanocore.registry import Registry

PROJECT = "nanocore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class NanocoreSpecs:
    # -- registration ---------------------------------------------------------------
    @hookspec
    def register_models(self, registry: Registry) -> None:
        """Register model types: `registry.register(name, build, config_class=...)`.

        `build(model_args, *, vocab_multiple)` returns an `nn.Module` (built on the current default
        device, usually meta) that follows `nanocore.model_api.CausalLM`.
        """

    @hookspec
    def register_parallel_engines(self, registry: Registry) -> None:
        """Register parallel engines (`parallelism.engine`): `factory(config, registries) -> Engine`."""

    @hookspec
    def register_pipeline_schedules(self, registry: Registry) -> None:
        """Register pipeline schedules (`parallelism.pp_engine`): `factory(config) -> PipelineSchedule`."""

    @hookspec(
        warn_on_impl=DeprecationWarning("register_pipeline_engines is now register_pipeline_schedules (nanocore 0.2)")
    )
    def register_pipeline_engines(self, registry: Registry) -> None:
        """Deprecated name of `register_pipeline_schedules`; still called, for one release."""

    @hookspec
    def register_tp_modes(self, registry: Registry) -> None:
        """Register tensor-parallel communication modes (`parallelism.tp_mode`)."""

    @hookspec
    def register_float8_recipes(self, registry: Registry) -> None:
        """Register FP8 training recipes (`model.float8_recipe`): `factory() -> Float8Recipe` (nanocore.float8_api)."""

    @hookspec
    def register_optimizers(self, registry: Registry) -> None:
        """Register optimizers (`optimizer.optimizer_factory.name`):
        `factory(param_groups, args, *, lr, weight_decay, device) -> torch.optim.Optimizer`.
        Extras: `takes_pieces=True` adds `pieces: dict[Tensor, ParamPiece]` (nanocore.engine_api): where
        every tensor sits in its full parameter and which ranks hold the rest (docs/plugins.md)."""

    @hookspec
    def register_lr_decays(self, registry: Registry) -> None:
        """Register LR decay shapes (`lr_decay_style`): `factory(progress) -> factor`, both in [0, 1]."""

    @hookspec(warn_on_impl=DeprecationWarning("register_lr_schedulers is now register_lr_decays (nanocore 0.2)"))
    def register_lr_schedulers(self, registry: Registry) -> None:
        """Deprecated name of `register_lr_decays`; still called, for one release."""

    @hookspec
    def register_zero_stages(self, registry: Registry) -> None:
        """Register ZeRO stages by number as a string (`optimizer.zero_stage`): '0', '1', ...

        `factory(params: list[TrainableParam], build_optimizer, dp) -> ZeroOptimizer` (nanocore.engine_api).
        Extras: `shards_gradients=True` asks the engine to reduce-scatter gradients (ZeRO-2).
        """

    @hookspec
    def register_dataset_formats(self, registry: Registry) -> None:
        """Register dataset formats (`data_stages[].data.dataset.format`)."""

    @hookspec
    def register_tokenizers(self, registry: Registry) -> None:
        """Register tokenizer kinds (`tokenizer.tokenizer_type`, or a name in `tokenizer_name_or_path`)."""

    @hookspec
    def register_loggers(self, registry: Registry) -> None:
        """Register metric loggers (`logging.loggers`)."""

    @hookspec
    def register_commands(self, registry: Registry) -> None:
        """Register `nanocore <command>` subcommands: `registry.register(name, run, add_arguments=fn)`.

        `add_arguments(parser)` adds argparse arguments; `run(args) -> int` is the exit code.
        """

    # -- events ---------------------------------------------------------------------
    @hookspec
    def on_train_start(self, config: Config, trainer: object) -> None:
        """Called on every rank once the model, optimizer and data are ready, before step 1."""

    @hookspec
    def on_step_end(self, step: int, metrics: dict[str, float], trainer: object) -> None:
        """Called on every rank after each optimizer step with that step's metrics dict."""

    @hookspec
    def on_validation_end(self, step: int, metrics: dict[str, float], trainer: object) -> None:
        """Called on every rank after a validation pass."""

    @hookspec
    def on_checkpoint_saved(self, step: int, path: Path, trainer: object) -> None:
        """Called on every rank after a checkpoint is complete on disk."""

    @hookspec
    def on_train_end(self, step: int, trainer: object) -> None:
        """Called on every rank when training finishes (normally or not)."""
