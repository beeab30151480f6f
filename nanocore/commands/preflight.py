"""What `nanocore config` checks beyond the config itself: the inputs a run would read.

The tokenizer is loaded and must fit the model's vocabulary; every data stage's datasets are built
as the trainer builds them (one process; tokenized data is cached, so the run that follows reuses
it). A problem is one message with the YAML path of the section that names the input.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nanocore.config.schema import Config
from nanocore.data.build import build_tokenizer, check_vocab, stage_mixture
from nanocore.errors import ConfigError, NanocoreError
from nanocore.registry import Registries


def model_vocab_size(config: Config, registries: Registries) -> int:
    """The model's true vocabulary size (before any padding a layout adds)."""
    entry = registries.model.get(config.model.model_type)
    with torch.device("meta"):
        model = entry.factory(config.model, vocab_multiple=1)
    return int(getattr(model, "true_vocab_size", model.vocab_size))


def check_inputs(config: Config, registries: Registries, config_dir: Path | None, *, data: bool = True) -> list[str]:
    """Load the tokenizer and (with `data`) every stage's datasets; one line per input, or a ConfigError."""
    lines = []
    try:
        tokenizer = build_tokenizer(config.tokenizer, registries)
    except NanocoreError as exc:
        raise ConfigError(f"tokenizer.tokenizer_name_or_path: {exc}") from None
    vocab = model_vocab_size(config, registries)
    check_vocab(tokenizer, vocab)
    if tokenizer is None:
        lines.append(f"tokenizer: none (token ids straight from the data); model vocabulary {vocab}")
    else:
        lines.append(
            f"tokenizer: {config.tokenizer.tokenizer_name_or_path} ({tokenizer.vocab_size} tokens) fits the "
            f"model vocabulary ({vocab})"
        )
    if not data:
        return lines
    validating = config.tokens.val_check_interval > 0 and config.tokens.limit_val_batches > 0
    for index, stage in enumerate(config.data_stages):
        for key in ("dataset", "validation_dataset") if validating else ("dataset",):
            where = f"data_stages[{index}].data.{key}"
            try:
                mixture = stage_mixture(config, index, key, tokenizer, vocab, registries, config_dir=config_dir)
            except NanocoreError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            except OSError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            samples = sum(source.size for source in mixture.sources)
            formats = ", ".join(spec.format for spec in getattr(stage.data, key))
            lines.append(
                f"{where} ({stage.name!r}, {formats}): {samples:,} samples of {config.tokens.sequence_length} tokens"
            )
    return lines
