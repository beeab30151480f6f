"""`meta.json`: what a step folder says about itself. Written, read and checked here only.

    {"format_version": 2, "step": 20, "consumed_tokens": 40960,
     "topology": {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "world_size": 4},
     "data": {"consumed_samples": {"stable": 2560}}, "lr_scheduler": {"step": 20},
     "model_type": "llama", "run_id": "3f2a..."}

The trainer writes it at every save, `nanocore convert --from-hf` for the step-0 checkpoint it makes
(`converted_from` instead of `run_id`); a resume, `nanocore generate` and `nanocore checkpoint verify`
read it through `read_meta`. Checkpoints of earlier versions lack keys added since (`cp`,
`model_type`, `run_id`): they read with the defaults below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from nanocore.checkpoint.folder import CheckpointError, way_on, write_json

META = "meta.json"
FORMAT_VERSION = 2  # 2: vocabulary parameters hold the true rows only (no layout padding)
REQUIRED = ("step", "consumed_tokens", "topology", "data", "lr_scheduler")


class MetaError(ValueError):
    """meta.json is not what nanocore writes; the message says what is wrong, after "meta.json "."""


@attrs.frozen
class Topology:
    """The layout that wrote a checkpoint. A checkpoint loads at any layout; RNG states are restored
    only at the same world size."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    world_size: int = 1

    @classmethod
    def from_json(cls, data: Any) -> Topology:
        if not isinstance(data, dict):
            raise MetaError("has no valid 'topology'")
        sizes = {}
        for field in ("dp", "tp", "pp", "cp"):
            sizes[field] = _count(data.get(field, 1), f"topology.{field}")
        product = sizes["dp"] * sizes["tp"] * sizes["pp"] * sizes["cp"]
        world_size = _count(data.get("world_size", product), "topology.world_size")
        return cls(**sizes, world_size=world_size)


@attrs.frozen
class CheckpointMeta:
    """The contents of meta.json."""

    step: int
    consumed_tokens: int
    topology: Topology
    data: dict[str, Any]  # the data schedule's state_dict (samples consumed per stage)
    lr_scheduler: dict[str, Any]  # the LR schedule's state_dict
    model_type: str | None = None
    run_id: str | None = None  # the run this checkpoint belongs to (loggers such as W&B continue it)
    converted_from: str | None = None  # the Hugging Face folder `nanocore convert --from-hf` read
    spike_guard: dict[str, Any] | None = None  # optimizer.skip_spikes: the recent steps it judges by
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        """The JSON object; optional fields that are unset are left out."""
        data = attrs.asdict(self)
        return {k: v for k, v in data.items() if v is not None}

    @classmethod
    def from_json(cls, data: Any) -> CheckpointMeta:
        """Parse and check meta.json's object; a MetaError says what is wrong."""
        if not isinstance(data, dict):
            raise MetaError("is not a JSON object")
        for key in REQUIRED:
            if key not in data:
                raise MetaError(f"lacks {key!r}")
        for key in ("data", "lr_scheduler"):
            if not isinstance(data[key], dict):
                raise MetaError(f"has no valid {key!r}")
        optional: dict[str, Any] = {}
        for key in ("model_type", "run_id", "converted_from"):
            if data.get(key) is not None:
                optional[key] = str(data[key])
        if isinstance(data.get("spike_guard"), dict):
            optional["spike_guard"] = data["spike_guard"]
        return cls(
            step=_count(data["step"], "step", minimum=0),
            consumed_tokens=_count(data["consumed_tokens"], "consumed_tokens", minimum=0),
            topology=Topology.from_json(data["topology"]),
            data=data["data"],
            lr_scheduler=data["lr_scheduler"],
            format_version=_count(data.get("format_version", 1), "format_version"),  # 1 before the key existed
            **optional,
        )


def _count(value: Any, key: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MetaError(f"has {key} {value!r}, expected an integer >= {minimum}")
    return value


def parse_meta(text: str) -> CheckpointMeta:
    """meta.json's text -> the record; MetaError when it is not valid JSON or not a valid record."""
    try:
        data = json.loads(text)
    except ValueError as exc:  # JSONDecodeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MetaError(f"is not valid JSON ({first})") from None
    return CheckpointMeta.from_json(data)


def read_meta(folder: Path) -> CheckpointMeta:
    """A step folder's meta.json; a CheckpointError that names the file and the way on if it is
    missing or damaged."""
    path = Path(folder) / META
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing (incomplete checkpoint?); {way_on(Path(folder))}")
    try:
        return parse_meta(path.read_text())
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON ({exc}); {way_on(Path(folder))}") from None
    except MetaError as exc:
        raise CheckpointError(f"checkpoint file {path} {exc}; {way_on(Path(folder))}") from None


def write_meta(folder: Path, meta: CheckpointMeta) -> None:
    """Write meta.json into a (temporary) step folder."""
    write_json(Path(folder) / META, meta.to_json())
