"""`nanocore generate`: a checkpoint rebuilt on one device has the trained weights and continues prompts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from nanocore.checkpoint.tensors import ShardedTensor, write_shards
from nanocore.cli import run
from nanocore.config.schema import ModelArgs
from nanocore.generate_cmd import load_checkpoint_model
from nanocore.generation import generate
from nanocore.sharding import Placement
from nanocore_plugins.llama.config import LlamaConfig
from nanocore_plugins.llama.plugin import build
from tests.helpers.training import TINY_MODEL, run_training, tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step byte-level run with a final checkpoint in `trained['checkpoints']` (trained once per module)."""
    tmp_path = tmp_path_factory.mktemp("trained")
    config = tiny_config(
        tmp_path,
        model={"model_config": {**TINY_MODEL, "vocab_size": 257}},
        tokenizer={"tokenizer_name_or_path": "byte"},
        tokens={"train_steps": 3},
        checkpoints={"save_final_state": True},
    )
    config["model"]["make_vocab_size_divisible_by"] = 64
    return {**run_training(config), "checkpoints": tmp_path / "checkpoints"}


def test_checkpoint_model_has_the_trained_weights(trained):
    loaded = load_checkpoint_model(trained["checkpoints"])
    assert loaded.step == 3
    params = dict(loaded.model.named_parameters())
    assert params.keys() == trained["weights"].keys()
    assert params["model.embed_tokens.weight"].shape == (320, 32)  # 257 padded to a multiple of 64
    for name, tensor in trained["weights"].items():
        assert bool((params[name] == tensor).all()), name


def test_a_tied_head_is_read_once_and_stays_tied(tmp_path):
    """A tied lm_head is saved once, under the embedding's name; the loaded model must share it again."""
    folder = tmp_path / "checkpoints" / "5"
    config = tiny_config(tmp_path, model={"model_config": {**TINY_MODEL, "tie_word_embeddings": True}})
    (folder / "model").mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "meta.json").write_text(json.dumps({"step": 5, "topology": {"tp": 1}}))
    model_config = {k: v for k, v in config["model"]["model_config"].items() if k != "model_type"}
    with torch.device("meta"):
        reference = build(ModelArgs(model_config=LlamaConfig(**model_config)))
    torch.manual_seed(0)
    shards = [  # what the trainer writes: named_parameters() lists the tied pair once
        ShardedTensor(name, torch.randn(p.shape), Placement.whole(p.shape)) for name, p in reference.named_parameters()
    ]
    write_shards(folder / "model" / "rank-00000.safetensors", shards)

    model = load_checkpoint_model(tmp_path / "checkpoints" / "5").model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for shard in shards:
        assert bool((model.get_parameter(shard.name) == shard.tensor).all()), shard.name
    assert "lm_head.weight" not in {s.name for s in shards}


def test_generate_command_prints_prompt_and_continuation(trained, capsys):
    step = trained["checkpoints"] / "3"
    args = ["generate", "--ckpt-path", str(step), "--prompt", "ab", "--max-new-tokens", "5", "--temperature", "0"]
    assert run(args) == 0
    out = capsys.readouterr().out
    model = load_checkpoint_model(step)
    expected = generate(model.model, [97, 98], 5, temperature=0, eos_token_id=256)
    assert out == "ab" + model.tokenizer.decode(expected) + "\n"

    sampled = []
    for _ in range(2):
        assert run([*args[:-2], "--temperature", "1", "--seed", "3"]) == 0
        sampled.append(capsys.readouterr().out)
    assert sampled[0] == sampled[1], "the same seed gives the same text"
    assert sampled[0].startswith("ab") and sampled[0] != out


def test_missing_model_plugin_names_the_local_file_to_pass(trained, tmp_path, capsys):
    shutil.copytree(trained["checkpoints"], tmp_path / "checkpoints")
    config_file = tmp_path / "checkpoints" / "3" / "config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["model"]["model_config"]["model_type"] = "my_gpt"
    config["plugins"] = ["local_plugins/my_gpt.py"]
    config_file.write_text(yaml.safe_dump(config))
    assert run(["generate", "--ckpt-path", str(tmp_path / "checkpoints"), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert "model.model_config.model_type: unknown model 'my_gpt'" in err
    assert "local_plugins/my_gpt.py" in err and "--plugin" in err
