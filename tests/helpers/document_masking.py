"""Packed short documents for the document-masking parity tests (tests/parallel/test_document_masking_parity.py
and the compiled run in test_compile_parity.py): the data, the config, the one-process reference."""

from __future__ import annotations

import json
import random

from tests.helpers.training import run_training, tiny_config


def corpus(folder) -> str:
    """One document per line, 2 to 20 characters: several per 32-token sample."""
    rng = random.Random(0)
    letters = "abcdefghij klmnop"
    lines = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 20))) for _ in range(400)]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return str(path)


def masked_config(tmp, data: str, masking: bool = True, **sections) -> dict:
    raw = tiny_config(tmp, tokenizer={"tokenizer_name_or_path": "byte"}, **sections)
    raw["model"]["model_config"]["vocab_size"] = 260
    raw["tokens"]["sequence_length"] = 32
    raw["tokens"]["document_masking"] = masking
    raw["data_stages"][0]["data"]["dataset"] = {"format": "hf", "hf_dataset_or_datasets": data}
    return raw


_reference: dict[bool, dict] = {}


def reference(tmp_path_factory, masking: bool = True) -> dict:
    if masking not in _reference:
        tmp = tmp_path_factory.mktemp(f"masked_reference_{masking}")
        _reference[masking] = run_training(masked_config(tmp, corpus(tmp / "data"), masking))
    return _reference[masking]
