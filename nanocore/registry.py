"""Typed registries: name -> record. Plugins fill them from `register_*` hooks."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Any

import attrs

from nanocore.errors import ConfigError, PluginError


@attrs.frozen
class Entry:
    """One registered name.

    `factory` builds the thing (its signature is documented per registry kind);
    `config_class` is the attrs class of the config section the plugin owns, if any;
    `plugin` is the name of the plugin that registered it.
    """

    name: str
    factory: Any
    config_class: type | None = None
    plugin: str = "?"
    description: str = ""
    extras: dict[str, Any] = attrs.field(factory=dict)


class Registry:
    """Maps names to `Entry` records for one kind of plugin-provided thing (models, loggers, ...)."""

    def __init__(self, kind: str, doc: str = ""):
        self.kind = kind
        self.doc = doc
        self._entries: dict[str, Entry] = {}
        self._aliases: dict[str, str] = {}
        # Set by the plugin manager while a plugin's register hook runs, so that
        # duplicates can name both plugins.
        self.current_plugin: str = "?"

    def register(
        self,
        name: str,
        factory: Any,
        *,
        config_class: type | None = None,
        aliases: tuple[str, ...] | list[str] = (),
        description: str = "",
        **extras: Any,
    ) -> Entry:
        """Register `name`. A name (or alias) already taken is an error naming both plugins."""
        for key in (name, *aliases):
            if key in self._entries or key in self._aliases:
                owner = self.get(key).plugin
                raise PluginError(
                    f"{self.kind} name {key!r} is registered twice: by plugin {owner!r} and by plugin "
                    f"{self.current_plugin!r}. Disable one with NANOCORE_DISABLE_PLUGINS=<name>."
                )
        entry = Entry(name, factory, config_class, self.current_plugin, description, dict(extras))
        self._entries[name] = entry
        for alias in aliases:
            self._aliases[alias] = name
        return entry

    def canonical(self, name: str) -> str | None:
        if name in self._entries:
            return name
        return self._aliases.get(name)

    def __contains__(self, name: str) -> bool:
        return self.canonical(name) is not None

    def get(self, name: str, *, path: str | None = None) -> Entry:
        """The entry for `name`; an unknown name is a ConfigError listing the installed choices."""
        canonical = self.canonical(name)
        if canonical is None:
            raise ConfigError(self.unknown_message(name, path))
        return self._entries[canonical]

    def unknown_message(self, name: Any, path: str | None = None) -> str:
        where = f"{path}: " if path else ""
        if not self._entries:
            return (
                f"{where}no plugin provides {self.kind} {name!r}: no {self.kind} plugin is installed "
                "(pip install the package that provides it, or check NANOCORE_DISABLE_PLUGINS)"
            )
        installed = ", ".join(self.names())
        hint = ""
        close = difflib.get_close_matches(str(name), self.names() + list(self._aliases), n=1, cutoff=0.75)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
        return f"{where}unknown {self.kind} {name!r}{hint}; installed: {installed}"

    def names(self) -> list[str]:
        return sorted(self._entries)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._entries)


# kind -> (hook name, description of the factory's signature)
REGISTRY_KINDS: dict[str, tuple[str, str]] = {
    "model": ("register_models", "factory(model_args: ModelArgs, *, vocab_multiple: int) -> nn.Module (nanocore.model_api)"),
    "parallel_engine": ("register_parallel_engines", "factory(config: Config, registries: Registries) -> Engine"),
    "pp_engine": ("register_pipeline_engines", "factory(config: Config) -> PipelineSchedule"),
    "tp_mode": ("register_tp_modes", "factory() -> TP mode object (column_linear, row_linear, after_embedding)"),
    "optimizer": ("register_optimizers", "factory(param_groups, args, *, lr, weight_decay, device) -> torch.optim.Optimizer"),
    "lr_decay": ("register_lr_schedulers", "factory(progress: float in [0, 1]) -> remaining fraction in [0, 1]"),
    "zero_stage": ("register_zero_stages", "factory(params: list[TrainableParam], build_optimizer, dp) -> ZeroOptimizer"),
    "dataset_format": ("register_dataset_formats", "factory(args, ctx: DatasetContext) -> list[(SampleDataset, weight)]"),
    "tokenizer": ("register_tokenizers", "factory(name_or_path: str) -> Tokenizer"),
    "logger": ("register_loggers", "factory(options, ctx: LoggerContext) -> Logger"),
    "command": ("register_commands", "factory(args: argparse.Namespace) -> int; add_arguments=fn(parser) extra"),
}


class Registries:
    """All registries, one per kind; filled once per process by `PluginSet.registries`."""

    model: Registry
    parallel_engine: Registry
    pp_engine: Registry
    tp_mode: Registry
    optimizer: Registry
    lr_decay: Registry
    zero_stage: Registry
    dataset_format: Registry
    tokenizer: Registry
    logger: Registry
    command: Registry

    def __init__(self) -> None:
        self.by_kind = {kind: Registry(kind.replace("_", " "), doc) for kind, (_, doc) in REGISTRY_KINDS.items()}
        for kind, registry in self.by_kind.items():
            setattr(self, kind, registry)

    def __getitem__(self, kind: str) -> Registry:
        return self.by_kind[kind]
