"""A tokenizer larger than the model's vocabulary is refused before training starts."""

from __future__ import annotations

import pytest

from nanocore.errors import DataError
from tests.helpers.training import run_training, tiny_config


def test_tokenizer_larger_than_the_model_vocabulary_is_a_clear_error(tmp_path):
    config = tiny_config(tmp_path, tokenizer={"tokenizer_name_or_path": "byte"})  # 257 tokens, model has 64
    with pytest.raises(DataError, match="the tokenizer has 257 tokens but the model's vocab_size is 64"):
        run_training(config)
    assert not (tmp_path / "checkpoints").exists()
