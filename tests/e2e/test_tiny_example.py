"""The tiny example as a user runs it: the config script, the stdlib corpus plugin, run_train.py
(shortened) and run_generate.py, each as its own process."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from nanocore_plugins.tokenizers.byte import ByteTokenizer
from tests.helpers.examples import copy_example, run_python
from tests.helpers.paths import EXAMPLES, REPO

COMMITTED_YAML = EXAMPLES / "config_tiny_llama.yaml"


def corpus_module():
    spec = importlib.util.spec_from_file_location(
        "stdlib_corpus_under_test", EXAMPLES / "local_plugins/stdlib_corpus.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_script_writes_exactly_the_committed_yaml(tmp_path):
    folder = copy_example(tmp_path)
    result = run_python(str(folder / "config_tiny_llama.py"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("config_tiny_llama.yaml", "config_tiny_llama_3d.yaml"):
        assert (folder / name).read_bytes() == (EXAMPLES / name).read_bytes(), (
            f"examples/{name} is stale: run `python examples/config_tiny_llama.py` and commit the result"
        )


def test_stdlib_corpus_holds_out_validation_files_and_packs_windows():
    m = corpus_module()
    args = m.StdlibCorpusArgs(max_megabytes=1.0, validation_every=10)
    train, validation = m.corpus_files(args, "train"), m.corpus_files(args, "validation")
    assert train and validation
    assert not set(train) & set(validation), "validation files must never be trained on"
    assert len(train) // len(validation) in (8, 9, 10)
    assert m.corpus_files(args, "train") == train, "the file order must be deterministic"
    assert 1e6 <= sum(p.stat().st_size for p in train) < 1e6 + max(p.stat().st_size for p in train)
    parts = {part for p in train + validation for part in p.relative_to(m.stdlib_root(args)).parts}
    assert not parts & {"site-packages", "test", "encodings"}

    tokens = m.tokenize_files(train[:3], ByteTokenizer())
    assert (tokens == 256).sum() == 3, "one end-of-sequence token after each file"
    # Python source: far from uniform over 256 bytes (5.5 nats) and far from trivial.
    assert 2.8 < m.unigram_entropy(tokens) < 3.8
    dataset = m.PackedTokens(tokens, sequence_length=16)
    assert len(dataset) == len(tokens) // 17
    assert dataset[1].tolist() == tokens[17:34].tolist()
    with pytest.raises(IndexError):
        dataset[len(dataset)]


@pytest.mark.slow
def test_tiny_example_trains_checkpoints_logs_and_generates(tmp_path):
    folder = copy_example(tmp_path)
    config = yaml.safe_load(COMMITTED_YAML.read_text())
    # The committed pipeline, shortened: fewer, smaller steps and a smaller slice of the corpus.
    config["tokens"].update(
        train_steps=30, sequence_length=128, micro_batch_size=4, val_check_interval=10, limit_val_batches=2
    )
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 5
    for spec in config["data_stages"][0]["data"]["dataset"] + config["data_stages"][0]["data"]["validation_dataset"]:
        spec["max_megabytes"] = 0.5
    config["checkpoints"].update(checkpoints_path=str(tmp_path / "checkpoints"), checkpoint_interval=20)
    config["logging"]["log_dir"] = str(tmp_path / "logs")
    config_file = folder / "short.yaml"  # beside local_plugins/, as the plugin path is relative to the YAML
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))

    train = run_python(str(REPO / "run_train.py"), "--config-file", str(config_file), cwd=REPO)
    assert train.returncode == 0, train.stderr[-3000:]

    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert [r["step"] for r in rows if "lm_loss" in r] == list(range(1, 31))
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, f"loss did not go down: {losses}"
    val = [r for r in rows if "val_lm_loss" in r]
    assert [r["step"] for r in val] == [10, 20, 30]
    # Held-out files, never trained on: far better than uniform guessing (ln 257 = 5.55 nats), and improving.
    assert val[-1]["val_lm_loss"] < min(4.0, val[0]["val_lm_loss"])
    assert list((tmp_path / "logs" / "tensorboard").glob("events.out.tfevents.*"))

    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest.txt").read_text().strip() == "30"
    for step in (20, 30):
        assert (checkpoints / str(step) / "meta.json").exists()
        assert list((checkpoints / str(step) / "model").glob("*.safetensors"))
    assert yaml.safe_load((checkpoints / "30" / "config.yaml").read_text())["tokens"]["train_steps"] == 30

    # From the repository root, where the checkpoint's relative plugin path does not resolve: the data
    # plugin is not needed to sample text.
    args = ["--ckpt-path", str(checkpoints), "--prompt", "def ", "--max-new-tokens", "20", "--temperature", "0"]
    generated = run_python(str(REPO / "run_generate.py"), *args, cwd=REPO)
    assert generated.returncode == 0, generated.stderr[-3000:]
    text = generated.stdout.rstrip("\n")
    assert text.startswith("def ") and len(text) > len("def ")
