"""`nanocore generate` / `run_generate.py`: load a checkpoint on one device and continue a prompt.

The model and tokenizer are rebuilt through the registries from the config stored in the
checkpoint, so any model plugin works. Only the `model` and `tokenizer` sections of that config are
read: a plugin that only provided the training data need not be installed to sample text.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from nanocore.errors import NanocoreError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nanocore.config.schema import ModelArgs
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ckpt-path", required=True, help="a checkpoints folder (follows latest.txt) or one step folder"
    )
    parser.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="generate at most this many tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (always the most likely token)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens only")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set reaching P")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same text)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument(
        "--plugin", action="append", default=[], metavar="FILE_OR_MODULE", help="load a local plugin (repeatable)"
    )


def load_checkpoint_model(
    path: str | Path, plugins: Sequence[str] = (), device: str | torch.device = "cpu"
) -> CheckpointModel:
    """Build the checkpoint's model on `device` (float32 on CPU, the trained dtype elsewhere) with its weights."""
    # Imported here rather than at the top so that `nanocore --help` does not wait for torch.
    import torch

    from nanocore.checkpoint.config import named_plugins, read_checkpoint_config, structure_section, untrusted_note
    from nanocore.checkpoint.folder import read_json, resolve_checkpoint
    from nanocore.checkpoint.tensors import ShardReader
    from nanocore.checkpoint.verify import verify_checkpoint
    from nanocore.config.schema import ModelArgs, TokenizerArgs
    from nanocore.data.build import build_tokenizer
    from nanocore.model_api import check_model, whole_placement
    from nanocore.plugins import load_plugins

    folder = resolve_checkpoint(path)
    verify_checkpoint(folder, optimizer=False)  # a damaged file is one message naming it
    meta = read_json(folder / "meta.json")
    raw = read_checkpoint_config(folder)
    registries = load_plugins(list(plugins)).registries  # never the plugins the checkpoint names
    model_args: ModelArgs = structure_section(raw, "model", ModelArgs, registries)
    tokenizer_args: TokenizerArgs = structure_section(raw, "tokenizer", TokenizerArgs, registries)
    if named_plugins(raw):
        log.info("%s (only needed if they provide the model or the tokenizer)", untrusted_note(named_plugins(raw)))

    entry = registries.model.get(model_args.model_type, path="model.model_config.model_type")
    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" or model_args.dtype == "float32" else torch.bfloat16
    if device.type != "cpu" and model_args.dtype == "float16":
        dtype = torch.float16
    with torch.device("meta"):
        # One device: pad the vocabulary as tp=1 would; checkpoints hold the true rows (zeros fill the rest).
        model = entry.factory(model_args, vocab_multiple=model_args.make_vocab_size_divisible_by)
    check_model(model, entry.name)
    model.to(dtype).to_empty(device=device)
    for first, second in getattr(model, "tied_parameters", []):  # to_empty unties shared parameters
        module, _, attr = second.rpartition(".")
        setattr(model.get_submodule(module), attr, model.get_parameter(first))
    reader = ShardReader(folder / "model")
    with torch.no_grad():
        # named_parameters() lists a tied parameter once, under its first name: the name it was saved under.
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            param.copy_(reader.read(name, whole_placement(model, name, shape), shape, dtype=dtype))
    model.eval()
    tokenizer = build_tokenizer(tokenizer_args, registries)
    return CheckpointModel(model, tokenizer, model_args, folder, int(meta["step"]))


def run(args: argparse.Namespace) -> int:
    """The `generate` command: print the prompt followed by the generated text."""
    from nanocore.generation import generate
    from nanocore.log_setup import setup_logging

    setup_logging()
    if args.max_new_tokens < 0:
        raise NanocoreError(f"--max-new-tokens must be 0 or more, got {args.max_new_tokens}")
    loaded = load_checkpoint_model(args.ckpt_path, args.plugin, args.device)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise NanocoreError(
            f"checkpoint {loaded.folder} was trained without a tokenizer (tokenizer_name_or_path: null): "
            "there is no way to turn text into its token ids"
        )
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:  # a new document starts after a separator token
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if start is None:
            raise NanocoreError("--prompt is empty and the tokenizer has no BOS or EOS token to start from")
        prompt_ids = [start]
    log.info("step %d of %s: generating up to %d tokens", loaded.step, loaded.folder, args.max_new_tokens)
    new_ids = generate(
        loaded.model,
        prompt_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=tokenizer.eos_token_id,
        seed=args.seed,
    )
    sys.stdout.write(args.prompt + tokenizer.decode(new_ids) + "\n")
    sys.stdout.flush()
    return 0
