"""A checkpoint's model on one device, with its tokenizer: what `nanocore generate` and the tests sample from.

The model and tokenizer are rebuilt through the registries from the config stored in the
checkpoint, so any model plugin works. Only the `model` and `tokenizer` sections of that config are
read: a plugin that only provided the training data need not be installed to sample text.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from nanocore.checkpoint.config import named_plugins, read_checkpoint_config, structure_section, untrusted_note
from nanocore.checkpoint.folder import resolve_checkpoint
from nanocore.checkpoint.tensors import ShardReader
from nanocore.checkpoint.verify import verify_checkpoint
from nanocore.config.schema import ModelArgs, TokenizerArgs
from nanocore.data.build import build_tokenizer
from nanocore.dtypes import resolve_dtype
from nanocore.model_api import check_model, tie_parameters, whole_placement
from nanocore.plugins import load_plugins

if TYPE_CHECKING:
    from torch import nn

    from nanocore.data.api import Tokenizer

log = logging.getLogger("nanocore")


@attrs.define
class CheckpointModel:
    """A checkpoint's model (eval mode, on one device) and its tokenizer."""

    model: nn.Module
    tokenizer: Tokenizer | None
    model_args: ModelArgs
    folder: Path  # the step folder
    step: int


def load_checkpoint_model(
    path: str | Path, plugins: Sequence[str] = (), device: str | torch.device = "cpu"
) -> CheckpointModel:
    """Build the checkpoint's model on `device` (float32 on CPU, the trained dtype elsewhere) with its weights."""
    folder = resolve_checkpoint(path)
    meta = verify_checkpoint(folder, optimizer=False).meta  # a damaged file is one message naming it
    raw = read_checkpoint_config(folder)
    registries = load_plugins(list(plugins)).registries  # never the plugins the checkpoint names
    model_args: ModelArgs = structure_section(raw, "model", ModelArgs, registries)
    tokenizer_args: TokenizerArgs = structure_section(raw, "tokenizer", TokenizerArgs, registries)
    if named_plugins(raw):
        log.info("%s (only needed if they provide the model or the tokenizer)", untrusted_note(named_plugins(raw)))

    entry = registries.model.get(model_args.model_type, path="model.model_config.model_type")
    device = torch.device(device)
    # float32 on CPU whatever was trained (half-precision CPU kernels are slow or missing)
    dtype = torch.float32 if device.type == "cpu" else resolve_dtype(model_args.dtype, device)
    with torch.device("meta"):
        # One device: pad the vocabulary as tp=1 would; checkpoints hold the true rows (zeros fill the rest).
        model = entry.factory(model_args, vocab_multiple=model_args.make_vocab_size_divisible_by)
    check_model(model, entry.name)
    model.to(dtype).to_empty(device=device)
    tie_parameters(model, getattr(model, "tied_parameters", []))  # to_empty unties shared parameters
    reader = ShardReader(folder / "model")
    with torch.no_grad():
        # named_parameters() lists a tied parameter once, under its first name: the name it was saved under.
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            param.copy_(reader.read(name, whole_placement(model, name, shape), shape, dtype=dtype))
    model.eval()
    tokenizer = build_tokenizer(tokenizer_args, registries)
    return CheckpointModel(model, tokenizer, model_args, folder, meta.step)
