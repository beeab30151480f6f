"""Command-line overrides: `key.path=value` after the options of `run_train.py` and `nanocore config`.

    python run_train.py --config-file c.yaml tokens.train_steps=10 optimizer.clip_grad=null
    nanocore config c.yaml 'logging.loggers=[console, jsonl]' data_stages[0].data.seed=3

Values are YAML (`10` an integer, `null`, `[a, b]` a list, `{x: 1}` a mapping, `'10'` a string).
They are applied to the raw YAML data before it is structured, so a bad override gets the same
message, with its YAML path, as the same mistake in the file.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from nanocore.errors import ConfigError

_PART = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")


def _keys(path: str, item: str) -> list[str | int]:
    keys: list[str | int] = []
    for part in path.split("."):
        match = _PART.fullmatch(part)
        if match is None:
            raise ConfigError(
                f"override {item!r}: {path!r} is not a key path like tokens.train_steps or data_stages[0].name"
            )
        keys.append(match.group(1))
        keys += [int(i) for i in re.findall(r"\[(\d+)\]", match.group(2))]
    return keys


def parse_override(item: str) -> tuple[list[str | int], Any]:
    path, sep, text = item.partition("=")
    if not sep or not path.strip():
        raise ConfigError(f"override {item!r}: expected key.path=value, e.g. tokens.train_steps=10")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: the value is not valid YAML: {exc}") from None
    return _keys(path.strip(), item), value


def apply_overrides(raw: Any, overrides: list[str] | tuple[str, ...]) -> Any:
    """`raw` (the YAML data, changed in place and returned) with each override set, in order."""
    if not overrides:
        return raw
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("<top level>: expected a mapping of config sections; overrides need one")
    for item in overrides:
        keys, value = parse_override(item)
        node: Any = raw
        walked = ""
        for key, following in zip(keys, keys[1:] + [None], strict=True):
            here = f"{walked}[{key}]" if isinstance(key, int) else (f"{walked}.{key}" if walked else key)
            last = following is None
            if isinstance(key, int):
                if not isinstance(node, list) or key >= len(node):
                    size = len(node) if isinstance(node, list) else "no"
                    raise ConfigError(f"override {item!r}: {walked} has {size} entries, so there is no {here}")
            elif not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {walked} is not a mapping, so it has no key {key!r}")
            if last:
                node[key] = value
            else:
                if isinstance(key, str) and node.get(key) is None:
                    node[key] = {}  # a section the file leaves out (or null): create it
                node = node[key]
            walked = here
    return raw
