"""The config a checkpoint stores (`config.yaml`), read by the commands that use a checkpoint's model
without training it: `nanocore generate` and `nanocore convert --to-hf`.

Loading a checkpoint never runs code it names. The `plugins:` of a checkpoint's config (local plugin
files, or modules) are reported, never imported: a checkpoint folder from elsewhere could carry a
file and name it there. Plugins come from what is installed (entry points) and what the user names
on the command line (`--plugin`) or in NANOCORE_PLUGINS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanocore.config.converter import collect_problems, make_converter, read_yaml
from nanocore.errors import ConfigError, NanocoreError
from nanocore.registry import Registries


def read_checkpoint_config(folder: Path) -> dict[str, Any]:
    """The raw config.yaml of a step folder."""
    raw = read_yaml(folder / "config.yaml")
    if not isinstance(raw, dict):
        raise NanocoreError(f"{folder / 'config.yaml'} is not a nanocore config")
    return raw


def named_plugins(raw: dict[str, Any]) -> list[str]:
    """The plugins the training run loaded from its YAML (files or modules), as the checkpoint lists them."""
    return [str(p) for p in raw.get("plugins") or []]


def untrusted_note(names: list[str]) -> str:
    """What to tell a user whose checkpoint needs a plugin it names."""
    shown = ", ".join(names)
    flags = " ".join(f"--plugin {n}" for n in names)
    return (
        f"this checkpoint was trained with local plugin(s) {shown} (listed in its config.yaml); plugins a "
        f"checkpoint names are never imported from it: pass {flags} if you trust them"
    )


def structure_section(raw: dict[str, Any], key: str, cls: type, registries: Registries) -> Any:
    """One section of a checkpoint's config structured with the plugins loaded now; a problem is a
    ConfigError that, when the checkpoint names plugins, says how to load them."""
    try:
        return make_converter(registries).structure(raw.get(key, {}), cls)
    except Exception as exc:
        top = "<top level>: "
        problems = [f"{key}: {p[len(top) :]}" if p.startswith(top) else f"{key}.{p}" for p in collect_problems(exc)]
        names = named_plugins(raw)
        if names:
            problems.append(untrusted_note(names))
        raise ConfigError(problems) from None
