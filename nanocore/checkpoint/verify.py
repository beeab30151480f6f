"""Checking a checkpoint before it is used: every file its manifest lists is there with the same size
and checksum, meta.json and config.yaml parse, and every tensor is fully covered by its pieces.

On resume every rank checks, the checksums shared out (rank r hashes every world_size-th file, so
a large checkpoint is read once, in parallel, well within the collective timeout), and every rank
raises the lowest rank's verdict; `nanocore checkpoint verify` (nanocore/commands/checkpoint.py) runs the
same checks without training. A problem is one CheckpointError that names the file, what is wrong
with it and the way on (the previous complete checkpoint in the same folder, if any). meta.json is
parsed and checked by nanocore/checkpoint/meta.py, the one reader of that file.
Checkpoints written before manifests existed are parsed but cannot be checked byte for byte.
"""

from __future__ import annotations

import json
import logging
from bisect import bisect_left
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np
import torch
import yaml
from safetensors import safe_open

from nanocore.checkpoint.folder import CheckpointError, way_on
from nanocore.checkpoint.manifest import ALGORITHM, MANIFEST, describe, read_manifest
from nanocore.checkpoint.meta import META, CheckpointMeta, MetaError, parse_meta
from nanocore.checkpoint.tensors import META_KEY
from nanocore.errors import NanocoreError

log = logging.getLogger("nanocore")
T = TypeVar("T")
FRESH_OPTIMIZER = (
    "; or, to go on from this checkpoint with fresh optimizer state (AdamW's moments restart from zero), "
    "set checkpoints.load_optimizer: false"
)


class _Damage(Exception):
    def __init__(self, file: str, what: str):
        super().__init__(f"{file} {what}")
        self.file = file


@attrs.frozen
class Report:
    """What was checked in a step folder that passed."""

    folder: Path
    meta: CheckpointMeta
    has_manifest: bool
    checked: list[str]  # one line per kind of file


def verify_checkpoint(folder: Path, *, optimizer: bool = True, share: tuple[int, int] = (0, 1)) -> Report:
    """Check a step folder; raise CheckpointError naming the first problem and the way on.

    `optimizer=False` leaves optimizer/ alone (a resume with checkpoints.load_optimizer: false).
    `share=(r, n)` hashes only the files r, r + n, r + 2n, ... of the manifest (sizes, parsing and
    coverage are checked whole): n ranks together read every byte once.
    """
    folder = Path(folder)
    try:
        return _verify(folder, optimizer, share)
    except _Damage as damage:
        fresh = FRESH_OPTIMIZER if damage.file.startswith("optimizer/") else ""
        raise CheckpointError(f"checkpoint {folder} is damaged: {damage}; {way_on(folder)}{fresh}") from None
    except OSError as exc:  # not damage: a folder this user may not read, a file system gone away
        raise CheckpointError(f"could not read checkpoint {folder}: {exc}") from None


def verify_for_resume(
    folder: Path, *, rank: int, world_size: int, gather: Callable[[Any], list[Any]], load_optimizer: bool
) -> CheckpointMeta:
    """Every rank checks its share of the checkpoint a run resumes from (`gather`: the engine's
    all_gather_object); every rank raises the same error (the lowest rank's verdict), or all go on.
    Returns the checkpoint's meta.json."""
    verdict: str | None = None
    failure: BaseException | None = None
    report: Report | None = None
    try:
        report = verify_checkpoint(folder, optimizer=load_optimizer, share=(rank, world_size))
        if rank == 0 and not report.has_manifest:
            log.info("%s was written before checkpoints had a manifest: its files were parsed, not checksummed", folder)
    except BaseException as exc:  # the other ranks must hear of it, whatever it is
        failure = exc
        verdict = str(exc) if isinstance(exc, NanocoreError) else f"rank {rank} could not check {folder} ({exc!r})"
    first = next((v for v in gather(verdict) if v is not None), None)
    if failure is not None and not isinstance(failure, NanocoreError):
        raise failure  # a bug, with its traceback
    if first is not None:
        raise CheckpointError(first)
    assert report is not None
    return report.meta


def _verify(folder: Path, optimizer: bool, share: tuple[int, int]) -> Report:
    checked = []
    try:
        manifest = read_manifest(folder)
    except ValueError as exc:
        raise _Damage(MANIFEST, str(exc)) from None
    if manifest is not None:
        checked.append(_check_files(folder, manifest["files"], optimizer, share))
    else:
        checked.append(f"{MANIFEST}: none (written before checkpoints had one): files parsed, not checksummed")
    meta = _read_meta(folder)
    checked.append(f"{META}: step {meta.step}, written by {meta.topology.world_size} rank(s)")
    _parse(folder, "config.yaml", lambda path: yaml.safe_load(path.read_text()), "YAML")
    checked.append("config.yaml: parses")
    model = _index(folder, "model")
    if not model.tensors:
        raise _Damage("model/", "holds no weights")
    checked.append(f"model: {len(model.tensors)} tensors, each fully covered by the pieces in {model.files} file(s)")
    if optimizer:
        checked.append(_check_optimizer(folder, model, meta, manifest is not None))
    else:
        checked.append("optimizer: not checked (checkpoints.load_optimizer: false)")
    checked.append(_check_rng(folder, meta.topology.world_size, parse=manifest is None))
    return Report(folder, meta, manifest is not None, checked)


def _check_files(folder: Path, files: dict[str, Any], optimizer: bool, share: tuple[int, int]) -> str:
    rank, ranks = share
    count = size = 0
    for index, (name, entry) in enumerate(sorted(files.items())):
        if not optimizer and name.startswith("optimizer/"):
            continue
        path = folder / name
        if not path.is_file():
            raise _Damage(name, f"is missing (the manifest lists it, {entry['size']} bytes)")
        actual = path.stat().st_size
        if actual != entry["size"]:
            raise _Damage(name, f"has {actual} bytes but had {entry['size']} when saved (truncated or overwritten)")
        count, size = count + 1, size + actual
        if index % ranks != rank:
            continue  # another rank hashes this one
        digest = describe(path)[ALGORITHM]
        if digest != entry.get(ALGORITHM):
            raise _Damage(
                name,
                f"does not match its checksum ({ALGORITHM} {digest}, saved as {entry.get(ALGORITHM)}): it is damaged",
            )
    return f"{MANIFEST}: {count} files ({size} bytes), the size and {ALGORITHM} of each as saved"


def _parse(folder: Path, name: str, parse: Callable[[Path], T], kind: str) -> T:
    path = folder / name
    if not path.is_file():
        raise _Damage(name, "is missing")
    try:
        return parse(path)
    except (UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:  # JSONDecodeError is a ValueError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _Damage(name, f"is not valid {kind} ({first})") from None


def _read_meta(folder: Path) -> CheckpointMeta:
    def parse(path: Path) -> CheckpointMeta:
        try:
            return parse_meta(path.read_text())
        except MetaError as exc:
            raise _Damage(META, str(exc)) from None

    return _parse(folder, META, parse, "JSON")


@attrs.define
class _Index:
    """The pieces of every full tensor in a folder of shard files (headers only)."""

    files: int = 0
    tensors: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], str]]] = attrs.Factory(dict)
    untrained: set[str] = attrs.Factory(set)  # weights without optimizer state (ShardedTensor.trained False)


def _index(folder: Path, sub: str) -> _Index:
    index = _Index()
    for file in sorted((folder / sub).glob("*.safetensors")):
        name = f"{sub}/{file.name}"
        try:
            with safe_open(str(file), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get(META_KEY, "{}"))
                for key, info in meta.items():
                    shape = tuple(f.get_slice(key).get_shape())
                    piece = (tuple(info["full_shape"]), tuple(info["offsets"]), shape, name)
                    index.tensors.setdefault(info["name"], []).append(piece)
                    if info.get("trained") is False:
                        index.untrained.add(info["name"])
        except Exception as exc:  # safetensors raises its own error type for a damaged file
            raise _Damage(name, f"is not a readable safetensors file ({type(exc).__name__}: {exc})") from None
        index.files += 1
    for tensor, pieces in index.tensors.items():
        gap = _uncovered(tensor, pieces)
        if gap:
            raise _Damage(f"{sub}/", gap)
    return index


def _uncovered(tensor: str, pieces: list) -> str | None:
    """Why the pieces do not cover the full tensor, or None when they do (overlaps are allowed)."""
    full = pieces[0][0]
    for shape, offsets, size, file in pieces:
        if shape != full:
            return f"disagrees about the shape of {tensor!r}: {file} says {list(shape)}, another file {list(full)}"
        if len(offsets) != len(full) or any(o < 0 or o + n > m for o, n, m in zip(offsets, size, full, strict=True)):
            return f"has a piece of {tensor!r} outside its shape {list(full)} in {file}"
    # cut every dimension at every piece's edges; each cell of that grid must lie in some piece
    boxes = [(offsets, size) for _, offsets, size, _ in pieces]
    cuts = [sorted({0, m} | {o[d] for o, _ in boxes} | {o[d] + n[d] for o, n in boxes}) for d, m in enumerate(full)]
    covered = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
    for offsets, size in boxes:
        cells = (slice(bisect_left(c, o), bisect_left(c, o + n)) for c, o, n in zip(cuts, offsets, size, strict=True))
        covered[tuple(cells)] = True
    if covered.all():
        return None
    first = tuple(int(i) for i in np.argwhere(~covered)[0])
    start = [c[i] for c, i in zip(cuts, first, strict=True)]
    return f"does not cover all of tensor {tensor!r} (nothing holds the block at {start}): a piece is missing"


def _check_optimizer(folder: Path, model: _Index, meta: CheckpointMeta, has_manifest: bool) -> str:
    state = _index(folder, "optimizer")
    if not state.tensors:
        if not has_manifest and meta.step > 0:
            raise _Damage("optimizer/", f"holds no optimizer state, but the checkpoint is of step {meta.step}")
        return "optimizer: none saved"  # a manifest says so: nothing was written (step 0, or a stateless optimizer)
    owners = {name.split("::")[0] for name in state.tensors}
    missing = sorted(set(model.tensors) - model.untrained - owners)
    if missing:
        raise _Damage(
            "optimizer/",
            f"has no state for {len(missing)} of the model's {len(model.tensors)} tensors (e.g. {missing[0]!r}): "
            "a rank's file is missing",
        )
    return f"optimizer: {len(state.tensors)} tensors, state for every weight, fully covered by {state.files} file(s)"


def _check_rng(folder: Path, world_size: int, parse: bool) -> str:
    files = sorted((folder / "rng").glob("*.pt"))
    if not files:
        return "rng: none saved"
    for rank in range(world_size):
        name = f"rng/rank-{rank:05d}.pt"
        if not (folder / name).is_file():
            raise _Damage(name, f"is missing (the checkpoint was written by {world_size} ranks)")
        if parse:
            try:
                torch.load(folder / name, weights_only=True)
            except Exception as exc:
                raise _Damage(name, f"cannot be read ({type(exc).__name__}: {exc})") from None
    return f"rng: {world_size} file(s)" + ("" if parse else " (checked by checksum)")
