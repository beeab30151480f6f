"""Load a YAML file into a checked Config, loading the plugins it (and the command line) names."""

from __future__ import annotations

from pathlib import Path

import attrs

from nanocore.config.checks import check_config
from nanocore.config.converter import read_yaml, structure_config
from nanocore.config.overrides import apply_overrides
from nanocore.config.schema import Config
from nanocore.errors import ConfigError
from nanocore.launch_env import launch_env
from nanocore.plugins import PluginSet, load_plugins


@attrs.define
class LoadedConfig:
    config: Config
    plugins: PluginSet
    path: Path | None
    overrides: list[str] = attrs.field(factory=list)  # command-line key.path=value, as given


def yaml_plugin_list(raw: object, path: Path) -> list[str]:
    if not isinstance(raw, dict) or raw.get("plugins") is None:
        return []
    items = raw["plugins"]
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ConfigError("plugins: expected a list of plugin file paths or module names")
    return items


def launch_world_size() -> int:
    return launch_env().world_size


def load_config(
    path: str | Path,
    cli_plugins: list[str] | tuple[str, ...] = (),
    *,
    world_size: int | None = -1,
    overrides: list[str] | tuple[str, ...] = (),
) -> LoadedConfig:
    """Read `path`, apply command-line `overrides`, load every plugin it needs, structure and check it.

    `world_size=-1` (default) takes it from the launcher's WORLD_SIZE; `None` skips that check.
    """
    path = Path(path)
    raw = apply_overrides(read_yaml(path), overrides)
    plugins = load_plugins(cli_plugins, yaml_plugin_list(raw, path), path.resolve().parent)
    config = structure_config(raw, plugins.registries)
    check_config(config, plugins.registries, launch_world_size() if world_size == -1 else world_size)
    return LoadedConfig(config, plugins, path, list(overrides))
