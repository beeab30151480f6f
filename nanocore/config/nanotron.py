"""nanotron compatibility: the nanotron config keys nanocore accepts without acting on them, and renamed keys.

A nanotron YAML (`general`, `parallelism`, `model`, ... as nanotron's dataclasses write them) loads as is.
Keys listed in `IGNORED` are taken out before the strict converter sees the config, and those set to a value
that would have changed something are listed in ONE warning (rank 0), so nothing is dropped silently. Keys
listed in `RENAMED` are read under their nanocore name. Any other unknown key is still an error with a
did-you-mean: a typo never hides behind the compatibility table.

docs/migrating-from-nanotron.md shows every nanotron key; its "ignored" and "renamed" rows are these tables
(tests/core/config/test_nanotron_compat.py compares them).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from nanocore.errors import ConfigError

# Sentinel for `Ignored.quiet`: every value of the key is worth a mention.
NO_QUIET_VALUE: tuple = ()


@attrs.frozen
class Ignored:
    """A nanotron key nanocore accepts and does not act on.

    `quiet` holds the values for which ignoring the key changes nothing (nanotron's "off" value, or the
    value that describes what nanocore does anyway); such a key is accepted without a word, so that
    `lighteval: null` or a config nanocore itself wrote does not warn on every load.
    """

    reason: str
    quiet: tuple = (None,)


# Section path -> {nanotron key: why nanocore ignores it}. "" is the top level; "[]" marks a list whose
# every item is such a section (nanocore's `dataset` may also be a list: each item is checked).
IGNORED: dict[str, dict[str, Ignored]] = {
    "": {
        "lighteval": Ignored("nanocore runs no lighteval evaluations; evaluate a saved checkpoint separately"),
        "profiler": Ignored("no torch profiler integration; wrap run_train.py in torch.profiler yourself"),
        "s3_upload": Ignored("checkpoints stay in checkpoints.checkpoints_path; copy them with your own tools"),
        "metrics_logging": Ignored("no detailed per-layer metrics; logging.loggers write the standard metrics"),
    },
    "general": {
        "step": Ignored("written by nanotron into saved configs; nanocore reads the step from the checkpoint"),
        "consumed_train_samples": Ignored(
            "written by nanotron into saved configs; nanocore reads the data position from the checkpoint"
        ),
        "benchmark_csv_path": Ignored(
            "no benchmark CSV; throughput and MFU are in logging.log_dir/metrics.jsonl and benchmarks/"
        ),
        "ignore_sanity_checks": Ignored(
            "nanocore has no optional runtime sanity checks; its config checks always run", quiet=(True,)
        ),
    },
    "checkpoints": {
        "checkpoints_path_is_shared_file_system": Ignored(
            "nanocore assumes every rank sees the same checkpoints folder (one machine or a shared file system)",
            quiet=(True,),
        ),
    },
    "parallelism": {
        "tp_recompute_allgather": Ignored(
            "decided by tp_linear_async_communication: the overlapped REDUCE_SCATTER linears gather their input "
            "again in backward, the plain ones keep it",
            quiet=NO_QUIET_VALUE,
        ),
        "moe_layer_recompute": Ignored(
            "MoE layers are recomputed with their decoder layer (recompute_layer)", quiet=(False,)
        ),
    },
    "model.init_method": {
        "use_mup": Ignored(
            "spectral muP is not implemented; weights start from a normal with init_method.std", quiet=(False,)
        ),
    },
    "model.model_config": {
        "_attn_implementation": Ignored(
            "the llama plugin picks the kernel: flash-attn on a GPU in 16-bit when installed, else torch's "
            "scaled_dot_product_attention"
        ),
        "z_loss_enabled": Ignored("no z-loss: the loss is plain cross-entropy", quiet=(False,)),
        "z_loss_coefficient": Ignored("no z-loss (see z_loss_enabled)", quiet=NO_QUIET_VALUE),
    },
    "tokenizer": {
        "tokenizer_revision": Ignored("no Hugging Face Hub access: tokenizers are local files, with no revision"),
        "tokenizer_max_length": Ignored("documents are packed into sequence_length windows whatever their length"),
    },
    "tokens": {
        "limit_test_batches": Ignored(
            "no test pass; validation is val_check_interval and limit_val_batches", quiet=(0,)
        ),
    },
    "optimizer": {
        "weight_decay_exclude_named_params": Ignored(
            "fixed rule: no weight decay on norms and biases (parameters with fewer than 2 dimensions)",
            quiet=(None, []),
        ),
    },
    "data_stages[]": {
        "sequence_length": Ignored("one sequence length per run: tokens.sequence_length"),
    },
    "data_stages[].data": {
        "num_loading_workers": Ignored(
            "samples are read in the training process, without DataLoader workers", quiet=(0,)
        ),
    },
    "data_stages[].data.dataset": {
        "tokenizer_name": Ignored(
            "the nanoset format reads it from each folder's .ds.metadata and checks it against the tokenizer"
        ),
        "vocab_size": Ignored("the model's vocabulary is model.model_config.vocab_size"),
        "dataset_read_path": Ignored("folders are read where dataset_folder says"),
        "return_positions": Ignored(
            "positions are computed by the engine: tokens.document_masking: true restarts them at each document"
        ),
        "skip_in_stream": Ignored("samples are indexed directly, never skipped in a stream", quiet=(None, False)),
        "pad_samples_to_global_batch_size": Ignored("every global batch is full", quiet=(None, False)),
        "dataset_max_tokens": Ignored("every token of each folder is used"),
        "shuffle_files": Ignored("samples are shuffled by a seeded permutation, not by file", quiet=(None, False)),
        "use_old_brrr_dataloader": Ignored("one data loader", quiet=(None, False)),
        "sft_dataloader": Ignored("no SFT loader: every document is packed for pretraining", quiet=(None, False)),
        "debug_max_samples": Ignored("point the dataset at a smaller file instead"),
    },
}

# Section path -> {nanotron key: nanocore key}.
RENAMED: dict[str, dict[str, str]] = {
    "data_stages[].data.dataset": {"token_size_in_bytes": "token_size"},
}

# Sections nanotron writes in one shape only. The tables apply to them only when they are written that way,
# so that a nanocore-style section (`model_type:`, `format:`) stays strict: a third-party plugin may own a
# key with one of these names.
NANOTRON_SHAPE: dict[str, Callable[[dict], bool]] = {
    "model.model_config": lambda section: "is_llama_config" in section,
    "data_stages[].data.dataset": lambda section: "format" not in section,
}


@attrs.frozen
class IgnoredKey:
    """One ignored key found in a config: its YAML path and why nanocore ignores it."""

    path: str
    reason: str
    quiet: bool = False  # set to a value for which ignoring it changes nothing


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def sections(raw: Any, pattern: str) -> Iterator[tuple[str, dict]]:
    """Every mapping in `raw` at `pattern` (e.g. 'data_stages[].data'), with its concrete YAML path."""
    parts = [p.removesuffix("[]") for p in pattern.split(".")] if pattern else []
    yield from _walk(raw, "", parts)


def _walk(node: Any, path: str, parts: list[str]) -> Iterator[tuple[str, dict]]:
    if isinstance(node, list):  # data_stages, or a dataset list: every item
        for i, item in enumerate(node):
            yield from _walk(item, _join(path, i), parts)
        return
    if not isinstance(node, dict):
        return
    if not parts:
        yield path, node
        return
    head, rest = parts[0], parts[1:]
    if head in node:
        yield from _walk(node[head], _join(path, head), rest)


def _applies(pattern: str, section: dict) -> bool:
    shape = NANOTRON_SHAPE.get(pattern)
    return shape is None or shape(section)


def accept_nanotron_keys(raw: dict) -> tuple[dict, list[IgnoredKey]]:
    """A copy of `raw` without the ignored keys and with renamed keys under their nanocore names.

    Also returns every ignored key found, in table order, marking those at a value that changes nothing.
    """
    raw = copy.deepcopy(raw)
    found: list[IgnoredKey] = []
    problems: list[str] = []
    for pattern, renames in RENAMED.items():
        for path, section in sections(raw, pattern):
            if not _applies(pattern, section):
                continue
            for old, new in renames.items():
                if old not in section:
                    continue
                if new in section:
                    problems.append(f"{_join(path, old)}: nanotron's name for {new!r}, which is also given; keep one")
                    continue
                section[new] = section.pop(old)
    if problems:
        raise ConfigError(problems)
    for pattern, keys in IGNORED.items():
        for path, section in sections(raw, pattern):
            if not _applies(pattern, section):
                continue
            for key, ignored in keys.items():
                if key not in section:
                    continue
                value = section.pop(key)
                quiet = any(value == q and type(value) is type(q) for q in ignored.quiet)
                found.append(IgnoredKey(_join(path, key), ignored.reason, quiet))
    return raw, found


def accepted_keys(path: str) -> list[str]:
    """The nanotron keys the tables accept in the section at YAML path `path` (for did-you-mean hints)."""
    plain = re.sub(r"\[\d*\]", "", path)
    keys: list[str] = []
    for table in (IGNORED, RENAMED):
        for pattern, section in table.items():
            if pattern.replace("[]", "") == plain:
                keys += list(section)
    return keys


def warning_text(ignored: list[IgnoredKey]) -> str:
    """One message: keys whose value would have mattered with their reason, then the quiet ones by name."""
    lines = [f"  {key.path}: {key.reason}" for key in ignored if not key.quiet]
    quiet = [key.path for key in ignored if key.quiet]
    if quiet:
        lines.append(f"  (at a value that changes nothing) {', '.join(quiet)}")
    return (
        f"{len(ignored)} nanotron config key(s) accepted but not acted on by nanocore "
        "(see docs/migrating-from-nanotron.md):\n" + "\n".join(lines)
    )
