"""Finding and loading plugins: entry points first, then local files or modules.

Local plugins come from `--plugin` (CLI), the YAML `plugins:` list (relative to the YAML) and the
`NANOCORE_PLUGINS` environment variable (comma-separated). `NANOCORE_DISABLE_PLUGINS` blocks names.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import pluggy

from nanocore.errors import PluginError
from nanocore.hookspecs import PROJECT, NanocoreSpecs
from nanocore.registry import REGISTRY_KINDS, Registries

ENTRY_POINT_GROUP = "nanocore"
ENV_PLUGINS = "NANOCORE_PLUGINS"
ENV_DISABLE = "NANOCORE_DISABLE_PLUGINS"
log = logging.getLogger("nanocore")


@attrs.define
class PluginInfo:
    """What `nanocore plugins` shows for one plugin."""

    name: str
    source: str  # "entry point" or "local"
    distribution: str | None
    version: str | None
    location: str
    hooks: list[str] = attrs.field(factory=list)


def is_plugin_file(spec: str) -> bool:
    """Whether a local plugin spec names a `.py` file (else an importable module name): it ends in
    `.py` or holds a path separator. Decided here only: loading and the checkpoint's config agree."""
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def add_plugin_argument(parser: argparse.ArgumentParser, help: str = "load a local plugin (repeatable)") -> None:
    """The `--plugin FILE_OR_MODULE` option every command that loads plugins takes (`args.plugin`: a list)."""
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE", help=help)


def _split_env(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def disabled_names() -> set[str]:
    return set(_split_env(os.environ.get(ENV_DISABLE)))


class PluginSet:
    """A pluggy manager plus the registries filled from it. Build with `load_plugins()`."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(NanocoreSpecs)
        self.infos: dict[str, PluginInfo] = {}
        self.blocked: set[str] = set()  # NANOCORE_DISABLE_PLUGINS names that matched a plugin
        self._registries: Registries | None = None

    # -- loading ----------------------------------------------------------------------
    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        disabled = disabled_names()
        for ep in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
            if ep.name in self.infos:
                continue  # the same distribution seen twice on sys.path
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else None
            version = dist.version if dist is not None else None
            if ep.name in disabled:
                self.pm.set_blocked(ep.name)
                self.blocked.add(ep.name)
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # one broken plugin is reported by name, not as a traceback
                raise PluginError(
                    f"plugin {ep.name!r} (distribution {dist_name} {version}, entry point {ep.value}) failed to "
                    f"import: {type(exc).__name__}: {exc}\n{_last_frame(exc)}"
                    f"Fix or uninstall it, or disable it with {ENV_DISABLE}={ep.name}"
                ) from exc
            self._register(plugin, ep.name, PluginInfo(ep.name, "entry point", dist_name, version, ep.value))

    def load_local(self, spec: str, base_dir: Path | None = None) -> None:
        """Load a plugin from a `.py` file (relative to `base_dir` or the cwd) or an importable module name."""
        if spec in disabled_names():
            self.blocked.add(spec)
            return
        path = Path(spec)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        is_file = is_plugin_file(spec)
        name = path.stem if is_file else spec
        if name in disabled_names():
            self.blocked.add(name)
            return
        if any(info.location == str(path.resolve() if is_file else spec) for info in self.infos.values()):
            return  # the same local plugin named twice (CLI and YAML, say) is loaded once
        try:
            if is_file:
                if not path.exists():
                    raise PluginError(f"local plugin file {str(path)!r} does not exist")
                module = _import_file(path)
                location = str(path.resolve())
            else:
                module = importlib.import_module(spec)
                location = spec
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(
                f"local plugin {spec!r} failed to import: {type(exc).__name__}: {exc}\n{_last_frame(exc)}"
                f"Fix the file, or remove it from --plugin / the YAML 'plugins:' list / {ENV_PLUGINS}"
            ) from exc
        self._register(module, name, PluginInfo(name, "local", None, None, location))

    def register_object(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin object (tests, notebooks)."""
        self._register(plugin, name, PluginInfo(name, "object", None, None, repr(plugin)))

    def _register(self, plugin: Any, name: str, info: PluginInfo) -> None:
        if self.pm.has_plugin(name) or name in self.infos:
            raise PluginError(
                f"two plugins are named {name!r} ({self.infos[name].location} and {info.location}); rename one"
            )
        self.pm.register(plugin, name=name)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(name=name)
            raise PluginError(
                f"plugin {name!r} ({info.location}): {exc}. Known hooks: {', '.join(hook_names())}"
            ) from exc
        info.hooks = sorted(impl.name for impl in self.pm.get_hookcallers(plugin) or [])
        self.infos[name] = info
        self._registries = None

    # -- registries -------------------------------------------------------------------
    @property
    def registries(self) -> Registries:
        """Fill every registry by calling each plugin's register hook, one plugin at a time."""
        if self._registries is None:
            registries = Registries()
            for kind, spec in REGISTRY_KINDS.items():
                registry = registries[kind]
                impls = [
                    (hook_name, impl)
                    for hook_name in (spec.hook, *spec.deprecated_hooks)
                    for impl in getattr(self.pm.hook, hook_name).get_hookimpls()
                ]
                order = list(self.infos)  # registration order: entry points, then local plugins
                impls.sort(key=lambda pair: order.index(pair[1].plugin_name) if pair[1].plugin_name in order else 0)
                for hook_name, impl in impls:
                    registry.current_plugin = impl.plugin_name
                    try:
                        impl.function(**{a: registry for a in impl.argnames})
                    except PluginError:
                        raise
                    except Exception as exc:
                        raise PluginError(
                            f"plugin {impl.plugin_name!r} failed in {hook_name}: {type(exc).__name__}: {exc}"
                        ) from exc
                registry.current_plugin = "?"
            self._registries = registries
        return self._registries

    @property
    def hook(self) -> pluggy.HookRelay:
        return self.pm.hook

    def list(self) -> list[PluginInfo]:
        return [self.infos[n] for n in sorted(self.infos)]


def hook_names() -> list[str]:
    return sorted(n for n in dir(NanocoreSpecs) if not n.startswith("_"))


def _last_frame(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"  at {exc.filename}:{exc.lineno}\n"
    frames = traceback.extract_tb(exc.__traceback__)
    return f"  at {frames[-1].filename}:{frames[-1].lineno}\n" if frames else ""


def _import_file(path: Path) -> ModuleType:
    module_name = f"nanocore_local_plugins.{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"cannot import local plugin file {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def load_plugins(
    local: Iterable[str] = (),
    yaml_plugins: Iterable[str] = (),
    yaml_dir: Path | None = None,
    *,
    entry_points: bool = True,
) -> PluginSet:
    """Entry points, then `local` (CLI --plugin), the YAML list (relative to `yaml_dir`), then NANOCORE_PLUGINS."""
    plugins = PluginSet()
    if entry_points:
        plugins.load_entry_points()
    for spec in local:
        plugins.load_local(spec)
    for spec in yaml_plugins:
        plugins.load_local(spec, base_dir=yaml_dir)
    for spec in _split_env(os.environ.get(ENV_PLUGINS)):
        plugins.load_local(spec)
    unmatched = sorted(disabled_names() - plugins.blocked)
    if unmatched and entry_points:  # a typo would leave the plugin it meant enabled
        log.warning(
            "%s names %s, which no plugin found here is called (plugins: %s)",
            ENV_DISABLE,
            ", ".join(repr(n) for n in unmatched),
            ", ".join(sorted(plugins.infos)),
        )
    return plugins
