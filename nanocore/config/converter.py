"""YAML <-> Config through one strict cattrs converter, with errors that name the YAML path."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin

import attrs
import cattrs
import yaml
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)

from nanocore.config.nanotron import accept_nanotron_keys, accepted_keys, warning_text
from nanocore.config.schema import (
    Config,
    DatasetSpec,
    LoggerSpec,
    ModelArgs,
    OptimizerFactory,
)
from nanocore.errors import ConfigError
from nanocore.launch_env import launch_env
from nanocore.registry import Registries, Registry

log = logging.getLogger(__name__)


class _Leaf(Exception):
    """A problem at the current YAML path; the walker prefixes the path."""


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def _strict(kind: type, expected: str) -> Callable[[Any, type], Any]:
    def structure(value: Any, _: type) -> Any:
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is float and isinstance(value, str):
            try:  # YAML 1.1 reads "3e-4" as a string; accept numeric strings for floats only
                return float(value)
            except ValueError:
                pass
        if not ok:
            raise _Leaf(f"expected {expected}, got {_describe(value)}")
        return value

    return structure


def _as_is(value: Any, _: type) -> Any:
    return value


def _attrs_from_mapping(conv: cattrs.Converter, cls: type) -> Any:
    """Hook factory for attrs classes: cattrs' generated hook fails with AttributeError on a list or a
    scalar; say what was expected instead."""
    inner: Callable[[Any, type], Any] = cattrs.gen.make_dict_structure_fn(cls, conv)

    def structure(value: Any, _: type) -> Any:
        if not isinstance(value, dict):
            raise _Leaf(f"expected a mapping, got {_describe(value)}")
        return inner(value, cls)

    return structure


def _is_list(t: Any) -> bool:
    return get_origin(t) is list


def _list_of(conv: cattrs.Converter, value: Any, cls: type) -> list:
    """cattrs would iterate a string character by character, or fail with a TypeError on null."""
    if not isinstance(value, list):
        raise _Leaf(f"expected a list, got {_describe(value)}")
    (item_type,) = get_args(cls) or (Any,)
    out, problems = [], []
    for i, item in enumerate(value):
        try:
            out.append(conv.structure(item, item_type))
        except Exception as exc:
            note = IterableValidationNote(f"@ index {i}", i, item_type)
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]  # 3.11+; cattrs reads it
            problems.append(exc)
    if problems:
        raise cattrs.errors.IterableValidationError("While structuring a list", problems, list)
    return out


def _is_dict(t: Any) -> bool:
    return get_origin(t) is dict


def _mapping_of(conv: cattrs.Converter, cls: type) -> Any:
    inner = conv.gen_structure_mapping(cls)

    def structure(value: Any, _: type) -> Any:
        if not isinstance(value, dict):
            raise _Leaf(f"expected a mapping, got {_describe(value)}")
        return inner(value, cls)

    return structure


def _mapping(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise _Leaf(f"expected {what}, got {_describe(value)}")
    return dict(value)


def _plugin_args(conv: cattrs.Converter, registry: Registry | None, name: str, raw: dict, key: str) -> Any:
    """A plugin-owned section (the keys beside `key`) structured into the plugin's config class."""
    if registry is None:
        return raw or None
    try:
        entry = registry.get(name)
    except ConfigError as exc:
        raise _Leaf(f"{key}: {exc}") from None
    if entry.config_class is None:
        if raw:
            raise _Leaf(f"{registry.kind} {name!r} takes no options, got {', '.join(map(repr, raw))}")
        return None
    return conv.structure(raw, entry.config_class)


def _structure_model(conv: cattrs.Converter, registries: Registries | None, value: Any, _: type) -> ModelArgs:
    """model.model_config: `model_type` (or nanotron's is_llama_config) selects the plugin's class."""
    raw = _mapping(value, "a mapping with model_config")
    model_config = raw.get("model_config", {})
    if not isinstance(model_config, dict):
        raise _Wrapped("model_config", f"expected a mapping (the model's config), got {_describe(model_config)}")
    model_config = dict(model_config)
    model_type = model_config.pop("model_type", None)
    if model_config.pop("is_llama_config", None) and model_type is None:
        model_type = "llama"
    model_type = model_type or "llama"
    if registries is not None and model_type not in registries.model:
        raise _Wrapped("model_config.model_type", registries.model.unknown_message(model_type))
    raw["model_config"] = model_config
    raw["model_type"] = model_type
    entry = registries.model.get(model_type) if registries else None
    return _structure_fields(conv, raw, ModelArgs, {"model_config": entry.config_class if entry else None})


def _structure_optimizer_factory(
    conv: cattrs.Converter, registries: Registries | None, value: Any, _: type
) -> OptimizerFactory:
    raw = _mapping(value, "a mapping with name and the optimizer's arguments")
    name = raw.pop("name", "adam_w")
    if not isinstance(name, str):
        raise _Wrapped("name", f"expected a string, got {_describe(name)}")
    registry = registries.optimizer if registries else None
    if registry is not None and name not in registry:
        raise _Wrapped("name", registry.unknown_message(name))
    canonical = registry.get(name).name if registry else name
    return OptimizerFactory(canonical, _plugin_args(conv, registry, canonical, raw, "name"))


def _structure_dataset(conv: cattrs.Converter, registries: Registries | None, value: Any, _: type) -> DatasetSpec:
    raw = _mapping(value, "a mapping with the dataset's arguments")
    fmt = raw.pop("format", None)
    if fmt is None:  # nanotron's shapes: infer the format from its keys
        fmt = "hf" if "hf_dataset_or_datasets" in raw else "nanoset" if "dataset_folder" in raw else "dummy"
    weight = _structure_at(conv, raw.pop("weight", 1.0), float, "weight")
    registry = registries.dataset_format if registries else None
    if registry is not None and fmt not in registry:
        raise _Wrapped("format", registry.unknown_message(fmt))
    return DatasetSpec(fmt, _plugin_args(conv, registry, fmt, raw, "format"), weight)


def _is_dataset_list(t: Any) -> bool:
    return bool(t == list[DatasetSpec])


def _structure_dataset_list(conv: cattrs.Converter, value: Any, _: type) -> list[DatasetSpec]:
    """`dataset:` is one dataset, a list (a mixture), or null (random tokens)."""
    items = [{"format": "dummy"}] if value is None else value if isinstance(value, list) else [value]
    return _list_of(conv, items, list[DatasetSpec])


def _structure_logger(conv: cattrs.Converter, registries: Registries | None, value: Any, _: type) -> LoggerSpec:
    raw = {"name": value} if isinstance(value, str) else _mapping(value, "a logger name or {name: ..., options}")
    name = raw.pop("name", None)
    if not isinstance(name, str):
        raise _Leaf(f"expected a logger name, got {_describe(name)}")
    registry = registries.logger if registries else None
    if registry is not None and name not in registry:
        raise _Leaf(registry.unknown_message(name))
    return LoggerSpec(name, _plugin_args(conv, registry, name, raw, "name"))


# -- unstructuring: flatten plugin-owned sections back beside their selector key ------------
def _flat(conv: cattrs.Converter, obj: Any) -> dict:
    return {} if obj is None else dict(conv.unstructure(obj))


def _unstructure_model(conv: cattrs.Converter, base: Any, m: ModelArgs) -> dict:
    d: dict = base(m)
    d.pop("model_type")
    d["model_config"] = {"model_type": m.model_type, **_flat(conv, m.model_config)}
    return d


def _unstructure_optimizer_factory(conv: cattrs.Converter, o: OptimizerFactory) -> dict:
    return {"name": o.name, **_flat(conv, o.args)}


def _unstructure_dataset(conv: cattrs.Converter, d: DatasetSpec) -> dict:
    return {"format": d.format, **({"weight": d.weight} if d.weight != 1.0 else {}), **_flat(conv, d.args)}


def _unstructure_logger(conv: cattrs.Converter, s: LoggerSpec) -> dict | str:
    return {"name": s.name, **_flat(conv, s.options)} if s.options else s.name


def make_converter(registries: Registries | None) -> cattrs.Converter:
    """The converter. With `registries`, plugin-owned sections are structured into the plugins' classes."""
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(int, _strict(int, "an integer"))
    conv.register_structure_hook(float, _strict(float, "a number"))
    conv.register_structure_hook(bool, _strict(bool, "true or false"))
    conv.register_structure_hook(str, _strict(str, "a string"))
    conv.register_structure_hook(Any, _as_is)
    conv.register_structure_hook_factory(attrs.has, partial(_attrs_from_mapping, conv))
    conv.register_structure_hook_func(_is_list, partial(_list_of, conv))
    conv.register_structure_hook_factory(_is_dict, partial(_mapping_of, conv))
    conv.register_structure_hook(ModelArgs, partial(_structure_model, conv, registries))
    conv.register_structure_hook(OptimizerFactory, partial(_structure_optimizer_factory, conv, registries))
    conv.register_structure_hook(DatasetSpec, partial(_structure_dataset, conv, registries))
    conv.register_structure_hook_func(_is_dataset_list, partial(_structure_dataset_list, conv))
    conv.register_structure_hook(LoggerSpec, partial(_structure_logger, conv, registries))
    base_model = cattrs.gen.make_dict_unstructure_fn(ModelArgs, conv)
    conv.register_unstructure_hook(ModelArgs, partial(_unstructure_model, conv, base_model))
    conv.register_unstructure_hook(OptimizerFactory, partial(_unstructure_optimizer_factory, conv))
    conv.register_unstructure_hook(DatasetSpec, partial(_unstructure_dataset, conv))
    conv.register_unstructure_hook(LoggerSpec, partial(_unstructure_logger, conv))
    return conv


class _Wrapped(Exception):
    """A problem at a sub-key of the current path."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _structure_at(conv: cattrs.Converter, value: Any, cls: type, key: str) -> Any:
    try:
        return conv.structure(value, cls)
    except _Leaf as exc:
        raise _Wrapped(key, str(exc)) from None


T = TypeVar("T", bound=attrs.AttrsInstance)


def _structure_fields(conv: cattrs.Converter, raw: dict, cls: type[T], override: dict[str, type | None]) -> T:
    """Structure an attrs class field by field, so that `override` can give a field its plugin class."""
    fields = {f.name: f for f in attrs.fields(cls)}
    extra = set(raw) - set(fields)
    problems: list[Exception] = []
    kwargs: dict[str, Any] = {}
    if extra:
        problems.append(ForbiddenExtraKeysError("", cls, extra))
    for name, value in raw.items():
        if name not in fields:
            continue
        target = override.get(name, fields[name].type) if name in override else fields[name].type
        try:
            kwargs[name] = value if target is None else conv.structure(value, target)
        except Exception as exc:
            note = AttributeValidationNote(f"@ {name}", name, target)
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]  # 3.11+; cattrs reads it
            problems.append(exc)
    if problems:
        raise cattrs.errors.ClassValidationError(f"While structuring {cls.__name__}", problems, cls)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        missing = [f.name for f in fields.values() if f.default is attrs.NOTHING and f.name not in kwargs]
        raise _Leaf(f"missing required key(s): {', '.join(missing)}" if missing else str(exc)) from None


def _path_join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def collect_problems(exc: BaseException, path: str = "") -> list[str]:
    """Turn a (nested) cattrs validation error into 'yaml.path: message' lines."""
    out: list[str] = []
    if isinstance(exc, BaseValidationError):
        for sub in exc.exceptions:
            sub_path = path
            for note in getattr(sub, "__notes__", []):
                if isinstance(note, AttributeValidationNote):
                    sub_path = _path_join(path, note.name)
                elif isinstance(note, IterableValidationNote):
                    sub_path = _path_join(path, note.index)
            out.extend(collect_problems(sub, sub_path))
    elif isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        for key in sorted(exc.extra_fields):
            # nanotron keys the compatibility table accepts here count too: a typo of one is suggested its name.
            candidates = known + [k for k in accepted_keys(path) if k != key]
            close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(known)}"
            out.append(f"{path or '<top level>'}: unknown key {key!r}{hint}")
    elif isinstance(exc, _Wrapped):
        out.append(f"{_path_join(path, exc.key)}: {exc}")
    elif isinstance(exc, ConfigError):
        out.extend(f"{path}: {p}" if path else p for p in exc.problems)
    elif isinstance(exc, _Leaf):
        out.append(f"{path or '<top level>'}: {exc}")
    elif isinstance(exc, KeyError):
        out.append(f"{path or '<top level>'}: required key is missing")
    elif isinstance(exc, (TypeError, ValueError)):
        out.append(f"{path or '<top level>'}: {exc}")
    else:
        raise exc
    return out


def structure_config(raw: Any, registries: Registries | None) -> Config:
    """Raw YAML data -> Config; every problem found is reported at once as a ConfigError."""
    if not isinstance(raw, dict):
        raise ConfigError(f"<top level>: expected a mapping of config sections, got {_describe(raw)}")
    # nanotron keys nanocore does not act on are taken out here (listed once, by rank 0); typos stay errors.
    raw, ignored = accept_nanotron_keys(raw)
    conv = make_converter(registries)
    try:
        config = conv.structure(raw, Config)
    except Exception as exc:
        problems = collect_problems(exc)
        raise ConfigError(problems) from None
    if ignored and launch_env().rank == 0:
        log.warning(warning_text(ignored))
    if registries is None:
        return config
    # Omitted sections get attrs defaults, built without the registries (an optimizer's or a logger's
    # options stay None); structuring the dumped form once more gives them the plugins' classes, so
    # that YAML -> config -> YAML -> config is a fixed point.
    return conv.structure(conv.unstructure(config), Config)


def unstructure_config(config: Config) -> dict:
    data: dict = make_converter(None).unstructure(config)
    return data


def read_yaml(path: str | Path) -> Any:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(unstructure_config(config), sort_keys=False)
