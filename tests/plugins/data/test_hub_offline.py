"""The `hf` data plugin keeps the Hugging Face Hub off for its own calls to `datasets` only: the
process around it (transformers, a notebook) reaches the Hub as it would without nanocore."""

from __future__ import annotations

import os

from nanocore_plugins.data.hf import load_local_dataset
from nanocore_plugins.data.sources import OFFLINE_ENV, offline_datasets


def test_offline_inside_the_block_and_as_before_after_it(monkeypatch):
    import datasets
    import huggingface_hub.constants as hub

    for name in OFFLINE_ENV:
        monkeypatch.delenv(name, raising=False)
    before = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    with offline_datasets() as module:
        assert module is datasets
        assert all(os.environ[name] == "1" for name in OFFLINE_ENV)
        assert hub.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE
        assert not datasets.logging.is_progress_bar_enabled()
    assert not any(name in os.environ for name in OFFLINE_ENV)
    assert (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE) == before


def test_loading_local_files_leaves_the_process_online(monkeypatch, tmp_path):
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    before = hub.HF_HUB_OFFLINE
    (tmp_path / "docs.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    dataset = load_local_dataset(tmp_path / "docs.jsonl", ["train"], None, 1, tmp_path / "cache")
    assert list(dataset["text"]) == ["one", "two"]
    assert os.environ["HF_HUB_OFFLINE"] == "0" and "HF_DATASETS_OFFLINE" not in os.environ
    assert hub.HF_HUB_OFFLINE == before
