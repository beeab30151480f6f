"""Hugging Face transformers interop, generic over model plugins (the library half of `nanocore convert`).

`nanocore convert --to-hf CHECKPOINT OUT_DIR` (`to_hf`) writes `config.json` + `model.safetensors` that
`transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads; `nanocore convert --from-hf
HF_DIR OUT` (`from_hf`) writes a step-0 nanocore checkpoint with the meta.json a trained one has;
and `model.init_method.path` may name an HF folder, whose weights then start a run at any (dp, tp, pp).

The core only moves files and full tensors. A model plugin that speaks transformers declares, in
the extras of its model registry entry:

- `hf_architectures`: the `architectures` names of config.json it converts (["LlamaForCausalLM"]);
- `to_hf(model_config, state) -> (hf_config: dict, hf_state: dict)`: from full tensors as a
  checkpoint holds them (the true vocabulary of the parameters the model declares in
  `vocab_parameters`, a tied pair once);
- `from_hf(hf_config: dict, hf_state: dict) -> (model_config, state)`: to the tensors the model's
  `named_parameters()` lists, unpadded.

Weights are read from safetensors only: pickled `.bin` files are refused, never unpickled.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from nanocore.checkpoint.folder import begin_save, finish_save, resolve_checkpoint
from nanocore.checkpoint.meta import META, CheckpointMeta, Topology, write_meta
from nanocore.checkpoint.tensors import ShardedTensor, ShardReader, write_shards
from nanocore.config import Config, GeneralArgs, ModelArgs, TokenizerArgs, unstructure_config
from nanocore.dtypes import torch_dtype
from nanocore.errors import ConfigError, NanocoreError, PluginError
from nanocore.model_api import valid_rows
from nanocore.registry import Entry, Registries
from nanocore.sharding import Placement

log = logging.getLogger("nanocore")

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@attrs.define
class HFModel:
    """An HF folder converted for nanocore: the model plugin's entry, its config and full tensors."""

    entry: Entry
    model_config: Any
    state: dict[str, torch.Tensor]
    folder: Path


# -- reading HF folders -------------------------------------------------------------------------
def is_hf_folder(path: str | Path) -> bool:
    """A transformers model folder: config.json naming its `architectures`, and not a nanocore step folder."""
    path = Path(path)
    if not (path / HF_CONFIG).is_file() or (path / META).exists():
        return False
    try:
        return "architectures" in json.loads((path / HF_CONFIG).read_text())
    except (json.JSONDecodeError, TypeError):
        return False


def hf_entry(registries: Registries, hf_config: dict[str, Any], folder: Path) -> Entry:
    """The model plugin whose `hf_architectures` include one of config.json's `architectures`."""
    wanted = hf_config.get("architectures") or []
    supported: dict[str, str] = {}
    for entry in registries.model:
        for arch in entry.extras.get("hf_architectures", ()):
            supported[arch] = entry.name
    for arch in wanted:
        if arch in supported:
            return registries.model.get(supported[arch])
    known = ", ".join(f"{a} (model type {n})" for a, n in sorted(supported.items())) or "none"
    raise PluginError(
        f"{folder / HF_CONFIG}: architectures {wanted}: no installed model plugin converts them; "
        f"supported: {known}. A model plugin adds one with hf_architectures/from_hf/to_hf in its registry entry."
    )


class LazyTensor:
    """One tensor of a safetensors file, read only where indexed: `lazy[rows, cols]` reads that
    rectangle (safetensors slices), `lazy.shape` reads nothing. What a rank needs of a Hugging Face
    folder's weights, without every rank holding every tensor."""

    def __init__(self, file: Path, key: str):
        self.file, self.key = file, key
        with safe_open(str(file), framework="pt") as f:
            self.shape = torch.Size(f.get_slice(key).get_shape())

    def __getitem__(self, index: tuple[slice, ...] | slice | int) -> torch.Tensor:
        with safe_open(str(self.file), framework="pt") as f:
            if index == () or not self.shape:
                whole: torch.Tensor = f.get_tensor(self.key)[index]
                return whole
            part: torch.Tensor = f.get_slice(self.key)[index]
            return part


def read_hf_state(folder: Path, lazy: bool = False) -> dict[str, torch.Tensor | LazyTensor]:
    """Every tensor of the folder's safetensors files (one file, or shards listed by the index);
    `lazy`: `LazyTensor`s, read where indexed."""
    index = folder / HF_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise NanocoreError(
                f"{folder} has only pickled weights ({', '.join(pickles)}); nanocore reads safetensors only and never "
                "unpickles files (loading a pickle can run arbitrary code). If you trust the files, convert them once "
                "with transformers: AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out, "
                "safe_serialization=True)"
            )
        raise NanocoreError(f"{folder} has no *.safetensors weights")
    state: dict[str, torch.Tensor | LazyTensor] = {}
    for file in files:
        if not file.is_file():
            raise NanocoreError(f"{index} lists {file.name}, which is missing")
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                state[key] = LazyTensor(file, key) if lazy else f.get_tensor(key)
    return state


def load_hf(folder: str | Path, registries: Registries, lazy: bool = False) -> HFModel:
    """Read an HF folder and convert it with the model plugin's `from_hf`; checks every tensor's shape.

    `lazy`: where the model plugin's `from_hf` only selects tensors (registry extra
    `from_hf_selects_only=True`, as LLaMA's), the state holds `LazyTensor`s that read only the
    rectangles asked for; otherwise (Mixtral stacks its experts) whole tensors."""
    folder = Path(folder)
    if not (folder / HF_CONFIG).is_file():
        raise NanocoreError(f"{folder} is not a Hugging Face model folder (no {HF_CONFIG})")
    hf_config = json.loads((folder / HF_CONFIG).read_text())
    entry = hf_entry(registries, hf_config, folder)
    lazy = lazy and bool(entry.extras.get("from_hf_selects_only"))
    model_config, state = entry.extras["from_hf"](hf_config, read_hf_state(folder, lazy=lazy))
    _check_tensors(entry, model_config, state, folder)
    return HFModel(entry, model_config, state, folder)


def _check_tensors(entry: Entry, model_config: Any, state: dict[str, torch.Tensor], source: Path) -> None:
    """The converted tensors are exactly the model's parameters, with their shapes."""
    with torch.device("meta"):
        model = entry.factory(ModelArgs(model_config=model_config, model_type=entry.name))
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    problems = [f"missing tensor {n}" for n in expected if n not in state]
    problems += [f"unexpected tensor {n}" for n in state if n not in expected]
    problems += [
        f"{n}: shape {list(state[n].shape)}, the model needs {list(s)}"
        for n, s in expected.items()
        if n in state and tuple(state[n].shape) != s
    ]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise NanocoreError(f"the weights in {source} do not fit model type {entry.name!r} with their config: {shown}")


def init_reader(path: str | Path, model_args: ModelArgs, registries: Registries) -> ShardReader:
    """A reader over the weights `model.init_method.path` names: an HF folder or a nanocore checkpoint.

    An HF folder's converted model config must equal the YAML's `model.model_config`. Its tensors
    are read like a checkpoint's: the vocabulary rows a layout pads read as zeros.
    """
    if not is_hf_folder(path):
        return ShardReader(resolve_checkpoint(path) / "model")
    hf = load_hf(path, registries, lazy=True)  # each rank reads only the rectangles it holds
    problems = model_differences(model_args, hf.entry.name, hf.model_config)
    if problems:
        hint = (
            f"set these as in {Path(path) / HF_CONFIG} (`nanocore convert --from-hf` writes the matching config.yaml)"
        )
        raise ConfigError([f"{p}, but model.init_method.path {str(path)!r} holds {v}" for p, v in problems] + [hint])
    return ShardReader.from_tensors(hf.state, str(path))


def model_differences(model_args: ModelArgs, model_type: str, model_config: Any) -> list[tuple[str, str]]:
    """(YAML path with the YAML's value, the other value) for every field that differs."""

    def show(value: Any) -> str:  # YAML-like: null, true, {"factor": 8.0}
        return json.dumps(value, default=str)

    if model_args.model_type != model_type:
        return [(f"model.model_config.model_type: the YAML has {show(model_args.model_type)}", show(model_type))]
    mine, theirs = model_args.model_config, model_config
    if not (attrs.has(type(mine)) and attrs.has(type(theirs))):
        return [] if mine == theirs else [(f"model.model_config: the YAML has {mine!r}", repr(theirs))]
    a, b = attrs.asdict(mine), attrs.asdict(theirs)
    return [(f"model.model_config.{k}: the YAML has {show(a[k])}", show(b.get(k))) for k in a if a[k] != b.get(k)]


# -- nanocore checkpoint -> HF ------------------------------------------------------------------
def checkpoint_state(folder: Path, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Every full tensor of a checkpoint's model, assembled from the pieces whatever layout wrote them.

    With the (meta) `model`, the parameters it declares in `vocab_parameters` hold the true
    vocabulary only, also from a format-version-1 checkpoint, which saved the padding.
    """
    reader = ShardReader(folder / "model")
    if not reader.names():
        raise NanocoreError(f"checkpoint {folder} has no model weights")
    state = {}
    for name in reader.names():
        shape = reader.full_shape(name)
        rows = valid_rows(model, name) if model is not None else None
        if rows is not None:
            shape = (rows, *shape[1:])
        state[name] = reader.read(name, attrs.evolve(Placement.whole(shape), valid_rows=rows), shape)
    return state


def to_hf(checkpoint: str | Path, out_dir: str | Path, plugins: Sequence[str] = (), dtype: str | None = None) -> Path:
    """Write checkpoint's model as a transformers folder (config.json, model.safetensors, tokenizer files)."""
    from nanocore.checkpoint.config import read_checkpoint_config, structure_section
    from nanocore.checkpoint.verify import verify_checkpoint
    from nanocore.plugins import load_plugins

    folder = resolve_checkpoint(checkpoint)
    verify_checkpoint(folder, optimizer=False)
    raw = read_checkpoint_config(folder)
    registries = load_plugins(list(plugins)).registries  # never the plugins the checkpoint names
    model_args: ModelArgs = structure_section(raw, "model", ModelArgs, registries)
    entry = registries.model.get(model_args.model_type, path="model.model_config.model_type")
    if "to_hf" not in entry.extras:
        raise PluginError(f"model type {entry.name!r} (plugin {entry.plugin!r}) has no Hugging Face conversion (to_hf)")
    with torch.device("meta"):
        model = entry.factory(model_args)
    out = _empty_folder(out_dir)
    hf_config, hf_state = entry.extras["to_hf"](model_args.model_config, checkpoint_state(folder, model))
    write_hf(out, hf_config, hf_state, dtype)
    _copy_tokenizer((raw.get("tokenizer") or {}).get("tokenizer_name_or_path"), out)
    log.info("wrote %s (step %s of %s) as a transformers folder", out, folder.name, folder.parent)
    return out


def write_hf(out: Path, hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor], dtype: str | None = None) -> None:
    """config.json (with `torch_dtype` of the tensors) and one model.safetensors."""
    if dtype is not None:
        hf_state = {k: v.to(torch_dtype(dtype)) for k, v in hf_state.items()}
    tensors = {k: v.detach().cpu().contiguous() for k, v in hf_state.items()}
    dtypes = [t.dtype for t in tensors.values() if t.is_floating_point()]
    if dtypes:
        hf_config = {**hf_config, "torch_dtype": str(max(set(dtypes), key=dtypes.count)).removeprefix("torch.")}
    save_file(tensors, str(out / HF_WEIGHTS), metadata={"format": "pt"})  # transformers wants the format key
    (out / HF_CONFIG).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def _copy_tokenizer(name_or_path: Any, out: Path) -> None:
    path = Path(str(name_or_path)) if name_or_path else None
    if path is None or not path.exists():
        return  # a registered tokenizer such as `byte` (no files), or none
    if path.is_file():
        shutil.copyfile(path, out / "tokenizer.json")
        return
    for name in TOKENIZER_FILES:
        if (path / name).is_file():
            shutil.copyfile(path / name, out / name)


def _empty_folder(path: str | Path) -> Path:
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise NanocoreError(f"output {path} already exists and is not an empty folder; choose a new one")
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- HF -> nanocore checkpoint ------------------------------------------------------------------
def from_hf(hf_dir: str | Path, out: str | Path, plugins: Sequence[str] = ()) -> Path:
    """Write an HF folder as a nanocore checkpoints folder (step 0 + latest.txt); returns the step folder.

    Its config.yaml is a complete, runnable config (defaults everywhere but the model and the
    tokenizer), usable by `nanocore generate`, `checkpoints.resume_checkpoint_path` and
    `model.init_method.path`.
    """
    from nanocore.config.checks import check_config
    from nanocore.plugins import load_plugins

    hf_dir = Path(hf_dir)
    registries = load_plugins(plugins).registries
    hf = load_hf(hf_dir, registries)
    tokenizer = str(hf_dir.resolve()) if (hf_dir / "tokenizer.json").is_file() else None
    config = Config(
        model=ModelArgs(model_config=hf.model_config, model_type=hf.entry.name),
        general=GeneralArgs(run=hf_dir.resolve().name or "run"),
        tokenizer=TokenizerArgs(tokenizer_name_or_path=tokenizer),
    )
    check_config(config, registries, world_size=None)
    root = _empty_folder(out)
    tmp = begin_save(root, 0, True, lambda: None)
    shards = [ShardedTensor(n, t, Placement.whole(t.shape)) for n, t in sorted(hf.state.items())]
    write_shards(tmp / "model" / "rank-00000.safetensors", shards)
    meta = CheckpointMeta(
        step=0,
        consumed_tokens=0,
        topology=Topology(),  # one process holds every tensor whole
        data={"consumed_samples": {}},
        lr_scheduler={"step": 0},
        model_type=hf.entry.name,
        converted_from=str(hf_dir.resolve()),
    )
    write_meta(tmp, meta)
    (tmp / "config.yaml").write_text(yaml.safe_dump(unstructure_config(config), sort_keys=False))
    folder = finish_save(root, 0, True, lambda: None)
    log.info("wrote %s as nanocore checkpoint %s", hf_dir, folder)
    return folder
