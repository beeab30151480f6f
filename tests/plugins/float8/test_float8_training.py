"""FP8 trains like bfloat16: the tiny example's model (examples/config_tiny_llama.yaml: hidden 128, 4
layers, the byte tokenizer) on Python source for 200 steps, in bfloat16 and under each FP8 recipe.
The final loss (the mean of the last 20 steps, which evens out one batch's noise) is within 2 % of
bfloat16's. The batch is 4 x 128 tokens (the example's is 16 x 256) to keep the three runs short."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import EXAMPLES
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

STEPS = 200


def python_corpus(folder: Path) -> str:
    """About 400 KB of the standard library's source, one ~2 KB chunk per line (local files only)."""
    import argparse
    import collections
    import dataclasses
    import json as json_module
    import pathlib

    text = "".join(Path(m.__file__).read_text() for m in (argparse, collections, dataclasses, json_module, pathlib))
    chunks = [text[i : i + 2048] for i in range(0, min(len(text), 400_000), 2048)]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "python.jsonl"
    path.write_text("".join(json.dumps({"text": c}) + "\n" for c in chunks))
    return str(path)


def example_config(tmp: Path, data: str, recipe: str | None) -> dict:
    example = yaml.safe_load((EXAMPLES / "config_tiny_llama.yaml").read_text())
    model = {**example["model"], "dtype": "bfloat16", "float8_recipe": recipe}
    raw = tiny_config(
        tmp,
        model=model,
        tokenizer={"tokenizer_name_or_path": "byte"},
        tokens={
            "sequence_length": 128,
            "train_steps": STEPS,
            "micro_batch_size": 4,
            "batch_accumulation_per_replica": 1,
        },
        optimizer={**example["optimizer"], "optimizer_factory": {"name": "adam_w", "torch_adam_is_fused": False}},
    )
    raw["data_stages"][0]["data"]["dataset"] = {"format": "hf", "hf_dataset_or_datasets": data}
    return raw


@pytest.mark.timeout(1800)
def test_each_recipe_ends_within_2_percent_of_bfloat16(tmp_path):
    data = python_corpus(tmp_path / "data")
    final = {}
    for recipe in (None, "tensorwise", "rowwise"):
        start = time.perf_counter()
        losses = run_training(example_config(tmp_path / str(recipe), data, recipe))["losses"]
        print(f"{recipe}: {time.perf_counter() - start:.0f} s, final {sum(losses[-20:]) / 20:.4f}")
        assert len(losses) == STEPS
        final[recipe] = sum(losses[-20:]) / 20
        if recipe is None:
            assert losses[0] - final[None] > 2.0, f"bfloat16 must learn for the comparison to mean anything: {losses}"
    report = textwrap.shorten(str(final), 200)
    for recipe in ("tensorwise", "rowwise"):
        assert abs(final[recipe] - final[None]) <= 0.02 * final[None], report
