"""Turn the config's tokenizer and dataset sections into objects, through the registries."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from nanocore.config.schema import Config, DatasetSpec, TokenizerArgs
from nanocore.data.api import DatasetContext, Tokenizer
from nanocore.data.mixture import Mixture
from nanocore.errors import ConfigError, DataError
from nanocore.registry import Registries


def cache_dir() -> Path:
    return Path(os.environ.get("NANOCORE_CACHE", "~/.cache/nanocore")).expanduser()


def build_tokenizer(args: TokenizerArgs, registries: Registries) -> Tokenizer | None:
    """`tokenizer_type` if given; else a registered name (`byte`); else a local path read by `hf`."""
    name = args.tokenizer_name_or_path
    if name is None:
        return None
    kind = args.tokenizer_type or (name if name in registries.tokenizer else "hf")
    if kind not in registries.tokenizer:
        raise ConfigError(f"tokenizer.tokenizer_name_or_path: {registries.tokenizer.unknown_message(kind)}")
    tokenizer: Tokenizer = registries.tokenizer.get(kind).factory(name)
    return tokenizer


def document_separator(tokenizer: Tokenizer | None) -> int:
    """The token that ends a document, for `tokens.document_masking`: the tokenizer's eos_token_id."""
    if tokenizer is None:
        raise ConfigError(
            "tokens.document_masking: documents end with the tokenizer's eos_token_id, but there is no tokenizer "
            "(tokenizer.tokenizer_name_or_path is null); set a tokenizer or turn document_masking off"
        )
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"tokens.document_masking: the tokenizer {tokenizer!r} has no eos_token_id, so documents cannot be "
            "told apart; use a tokenizer with an end-of-document token or turn document_masking off"
        )
    return int(tokenizer.eos_token_id)


def check_vocab(tokenizer: Tokenizer | None, model_vocab_size: int) -> None:
    if tokenizer is not None and tokenizer.vocab_size > model_vocab_size:
        raise DataError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model_vocab_size}: "
            f"set model.model_config.vocab_size to at least {tokenizer.vocab_size}"
        )


def build_mixture(specs: list[DatasetSpec], ctx: DatasetContext, registries: Registries, seed: int) -> Mixture:
    """Each spec's datasets, weighted by spec weight x the format's own relative weights."""
    parts = []
    total = sum(spec.weight for spec in specs)
    for spec in specs:
        produced = registries.dataset_format.get(spec.format).factory(spec.args, ctx)
        if not produced:
            raise DataError(f"dataset format {spec.format!r} produced no dataset")
        inner = sum(w for _, w in produced)
        parts += [(ds, spec.weight / total * w / inner) for ds, w in produced]
    return Mixture(parts, seed)


def stage_mixture(
    config: Config,
    index: int,
    key: str,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    registries: Registries,
    *,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
    config_dir: Path | None = None,
) -> Mixture:
    """The mixture of data stage `index`'s `key` ("dataset" or "validation_dataset"), as training reads it."""
    stage = config.data_stages[index]
    seed = stage.data.seed if stage.data.seed is not None else config.general.seed
    ctx = DatasetContext(
        tokenizer=tokenizer,
        sequence_length=config.tokens.sequence_length,
        vocab_size=vocab_size,
        seed=seed,
        cache_dir=cache_dir(),
        is_main_process=is_main,
        barrier=barrier,
        config_dir=config_dir,
        split="train" if key == "dataset" else "validation",
    )
    return build_mixture(getattr(stage.data, key), ctx, registries, seed)
