"""Typed registries: name -> record. Plugins fill them from `register_*` hooks."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

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

    def __init__(self, kind: str, spec: RegistryKind | None = None):
        self.spec = spec if spec is not None else RegistryKind(f"register_{kind}s", "")
        self.kind = kind.replace("_", " ")
        self.doc = self.spec.signature
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
        self._check_extras(name, extras)
        entry = Entry(name, factory, config_class, self.current_plugin, description, dict(extras))
        self._entries[name] = entry
        for alias in aliases:
            self._aliases[alias] = name
        return entry

    def _check_extras(self, name: str, extras: dict[str, Any]) -> None:
        """A misspelt or unknown extra is an error naming the plugin, as a misspelt hook name is."""
        accepted = self.spec.extras
        for key, value in extras.items():
            if key not in accepted:
                close = difflib.get_close_matches(key, list(accepted), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                takes = ", ".join(sorted(accepted)) or "none"
                raise PluginError(
                    f"plugin {self.current_plugin!r} registers {self.kind} {name!r} with unknown extra {key!r}{hint}; "
                    f"a {self.kind} accepts: {takes} (nanocore.registry.REGISTRY_KINDS)"
                )
            expected = accepted[key].type
            if not isinstance(value, expected if isinstance(expected, tuple) else (expected,)):
                wanted = " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,)))
                raise PluginError(
                    f"plugin {self.current_plugin!r} registers {self.kind} {name!r} with {key}={value!r}: expected "
                    f"{wanted} ({accepted[key].doc})"
                )

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


@attrs.frozen
class Extra:
    """A keyword a registry kind accepts in `register(...)` besides the fixed ones: its type and meaning."""

    type: type | tuple[type, ...]
    doc: str


# `Callable` is a typing special form; isinstance accepts it, the annotation of `Extra.type` does not
_FUNCTION = cast(type, Callable)
_CHECK = Extra(_FUNCTION, "fn(config, args) -> list[str]: problems with this entry's config, run before launch")


@attrs.frozen
class RegistryKind:
    """One kind of plugin-provided thing: the hook that fills it, the factory's signature, the extras it takes.

    `deprecated_hooks` are earlier names of `hook`, still called (with a warning) for one release."""

    hook: str
    signature: str
    extras: dict[str, Extra] = attrs.field(factory=dict)
    deprecated_hooks: tuple[str, ...] = ()


REGISTRY_KINDS: dict[str, RegistryKind] = {
    "model": RegistryKind(
        "register_models",
        "factory(model_args: ModelArgs, *, vocab_multiple: int) -> CausalLM (nanocore.model_api)",
        {
            "check": _CHECK,
            "hf_architectures": Extra((tuple, list), "transformers architecture names this model reads and writes"),
            "from_hf": Extra(
                _FUNCTION, "fn(hf_config: dict, state) -> (model_config, state): weights from transformers"
            ),
            "to_hf": Extra(_FUNCTION, "fn(model_config, state) -> (hf_config: dict, state): weights to transformers"),
            "from_hf_selects_only": Extra(bool, "from_hf only renames and drops tensors, so they can be read lazily"),
        },
    ),
    "parallel_engine": RegistryKind(
        "register_parallel_engines",
        "factory(config: Config, registries: Registries) -> Engine (nanocore.engine_api)",
        {
            "check": _CHECK,
            "check_model": Extra(_FUNCTION, "fn(config, model_entry) -> list[str]: checks that need the model"),
            "plan": Extra(
                _FUNCTION,
                "fn(config, registries, device[, expert_load_factor]) -> MemoryPlan (nanocore.engine_api): "
                "bytes per rank",
            ),
            "predict": Extra(
                _FUNCTION,
                "fn(config, registries, hardware, device, expert_load_factor) -> TimePrediction "
                "(nanocore.engine_api): seconds per step",
            ),
            "predict_bound": Extra(
                _FUNCTION,
                "fn(config, registries, hardware, device, expert_load_factor) -> TimePrediction: a cheaper "
                "prediction whose step_seconds never exceeds predict's (plan --search simulates only layouts "
                "whose bound could still make its top)",
            ),
        },
    ),
    "pipeline_schedule": RegistryKind(
        "register_pipeline_schedules",
        "factory(config: Config) -> PipelineSchedule (nanocore.pipeline_api)",
        {"check": _CHECK},
        deprecated_hooks=("register_pipeline_engines",),
    ),
    "tp_mode": RegistryKind("register_tp_modes", "factory() -> TPMode (nanocore.tp_api)", {"check": _CHECK}),
    "float8_recipe": RegistryKind(
        "register_float8_recipes", "factory() -> Float8Recipe (nanocore.float8_api)", {"check": _CHECK}
    ),
    "optimizer": RegistryKind(
        "register_optimizers",
        "factory(param_groups, args, *, lr, weight_decay, device) -> torch.optim.Optimizer",
        {
            "check": _CHECK,
            "states_per_element": Extra(_FUNCTION, "fn(args) -> int: optimizer state tensors per parameter element"),
            "step_temporaries_per_element": Extra(
                _FUNCTION, "fn(args) -> int: temporary copies per element while the optimizer steps (planner)"
            ),
            "matrix_states_per_element": Extra(
                _FUNCTION, "fn(args) -> int: state tensors per element of hidden matrices (default states_per_element)"
            ),
            "matrix_step_buffers": Extra(
                _FUNCTION,
                "fn(args) -> int: float32 buffers the size of one whole hidden matrix held while it steps (planner)",
            ),
            "takes_pieces": Extra(
                bool,
                "factory also takes pieces: dict[Tensor, ParamPiece] (nanocore.engine_api), to distribute itself",
            ),
        },
    ),
    "lr_decay": RegistryKind(
        "register_lr_decays",
        "factory(progress: float in [0, 1]) -> remaining fraction in [0, 1]",
        deprecated_hooks=("register_lr_schedulers",),
    ),
    "zero_stage": RegistryKind(
        "register_zero_stages",
        "factory(params: list[TrainableParam], build_optimizer, dp) -> ZeroOptimizer (nanocore.engine_api)",
        {
            "shards_optimizer_state": Extra(
                bool, "optimizer state and master weights kept as rows per data-parallel rank"
            ),
            "shards_gradients": Extra(bool, "gradients reduce-scattered during backward, each rank keeps its rows"),
            "shards_parameters": Extra(bool, "parameters kept as rows at rest, each block gathered around its use"),
            "exchange_buffer_bytes": Extra(int, "bytes of the piece in which updated rows are exchanged (planner)"),
        },
    ),
    "dataset_format": RegistryKind(
        "register_dataset_formats",
        "factory(args, ctx: DatasetContext) -> list[(SampleDataset, weight)] (nanocore.data.api)",
        {"check": _CHECK},
    ),
    "tokenizer": RegistryKind("register_tokenizers", "factory(name_or_path: str) -> Tokenizer (nanocore.data.api)"),
    "logger": RegistryKind(
        "register_loggers", "factory(options, ctx: LoggerContext) -> Logger (nanocore.logging_api)", {"check": _CHECK}
    ),
    "command": RegistryKind(
        "register_commands",
        "factory(args: argparse.Namespace) -> int (the exit code)",
        {"add_arguments": Extra(_FUNCTION, "fn(parser): adds the command's argparse arguments")},
    ),
}

# Hook names renamed in 0.2 -> their new names (both are called, the old with a DeprecationWarning).
RENAMED_HOOKS = {old: spec.hook for spec in REGISTRY_KINDS.values() for old in spec.deprecated_hooks}

# Registry kinds renamed in 0.2; `registries.<old name>` keeps working for one release.
RENAMED_KINDS = {"pp_engine": "pipeline_schedule"}


class Registries:
    """All registries, one per kind; filled once per process by `PluginSet.registries`."""

    model: Registry
    parallel_engine: Registry
    pipeline_schedule: Registry
    tp_mode: Registry
    float8_recipe: Registry
    optimizer: Registry
    lr_decay: Registry
    zero_stage: Registry
    dataset_format: Registry
    tokenizer: Registry
    logger: Registry
    command: Registry

    def __init__(self) -> None:
        self.by_kind = {kind: Registry(kind, spec) for kind, spec in REGISTRY_KINDS.items()}
        for kind, registry in self.by_kind.items():
            setattr(self, kind, registry)

    def __getitem__(self, kind: str) -> Registry:
        return self.by_kind[RENAMED_KINDS.get(kind, kind)]

    def __getattr__(self, name: str) -> Registry:
        if name in RENAMED_KINDS:
            warnings.warn(
                f"registries.{name} is now registries.{RENAMED_KINDS[name]}", DeprecationWarning, stacklevel=2
            )
            return self.by_kind[RENAMED_KINDS[name]]
        raise AttributeError(name)
