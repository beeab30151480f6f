"""`nanocore generate`: a checkpoint rebuilt on one device has the trained weights and continues prompts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from nanocore.checkpoint.manifest import write_manifest
from nanocore.checkpoint.model import load_checkpoint_model
from nanocore.checkpoint.tensors import ShardedTensor, write_shards
from nanocore.commands.cli import run
from nanocore.config.schema import ModelArgs
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
        assert bool((params[name][:257] == tensor[:257]).all()), name
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # checkpoints hold no padding: zeros
        assert not params[name][257:].any(), name


def test_a_tied_head_is_read_once_and_stays_tied(tmp_path):
    """A tied lm_head is saved once, under the embedding's name; the loaded model must share it again."""
    folder = tmp_path / "checkpoints" / "5"
    config = tiny_config(tmp_path, model={"model_config": {**TINY_MODEL, "tie_word_embeddings": True}})
    (folder / "model").mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    meta = {"step": 5, "consumed_tokens": 0, "topology": {"dp": 1, "tp": 1, "pp": 1, "world_size": 1},
            "data": {"consumed_samples": {}}, "lr_scheduler": {"step": 5}}  # fmt: skip
    (folder / "meta.json").write_text(json.dumps(meta))
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


def retrain_with_plugins(trained, tmp_path, plugins: list[str], model_type: str | None = None):
    """A copy of the trained checkpoint whose config names `plugins` (as a run with local plugins
    writes it), re-manifested so that it verifies: a checkpoint as another user would send it."""
    shutil.copytree(trained["checkpoints"], tmp_path / "checkpoints")
    step = tmp_path / "checkpoints" / "3"
    config = yaml.safe_load((step / "config.yaml").read_text())
    if model_type is not None:
        config["model"]["model_config"]["model_type"] = model_type
    config["plugins"] = plugins
    (step / "config.yaml").write_text(yaml.safe_dump(config))
    write_manifest(step, 3)
    return step


def test_missing_model_plugin_names_the_local_file_to_pass(trained, tmp_path, capsys):
    retrain_with_plugins(trained, tmp_path, ["local_plugins/my_gpt.py"], model_type="my_gpt")
    assert run(["generate", "--ckpt-path", str(tmp_path / "checkpoints"), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert "model.model_config.model_type: unknown model 'my_gpt'" in err
    assert "this checkpoint was trained with local plugin(s) local_plugins/my_gpt.py" in err
    assert "pass --plugin local_plugins/my_gpt.py if you trust them" in err


EVIL = """
from pathlib import Path
Path(__file__).with_name("EVIL_RAN").write_text("a checkpoint ran code")
"""


@pytest.mark.parametrize("spec", ["evil.py", "ABSOLUTE"])
def test_a_plugin_file_a_checkpoint_names_is_never_run(trained, tmp_path, capsys, spec, monkeypatch):
    """A checkpoint folder from elsewhere carries evil.py and names it in its config.yaml: generating
    from it and converting it must not import it, wherever the file lies."""
    evil = tmp_path / "checkpoints" / "evil.py"
    step = retrain_with_plugins(trained, tmp_path, [str(evil) if spec == "ABSOLUTE" else spec])
    evil.write_text(EVIL)
    (step / "evil.py").write_text(EVIL)
    monkeypatch.chdir(tmp_path / "checkpoints")  # even from the folder that holds it
    assert run(["generate", "--ckpt-path", str(step), "--prompt", "ab", "--max-new-tokens", "3"]) == 0
    assert run(["convert", "--to-hf", str(step), str(tmp_path / "hf")]) == 0
    assert not list(tmp_path.rglob("EVIL_RAN")), "a plugin named by a checkpoint was imported"
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    # With the user's consent it is loaded like any local plugin.
    assert (
        run(["generate", "--ckpt-path", str(step), "--prompt", "ab", "--max-new-tokens", "3", "--plugin", str(evil)])
        == 0
    )
    assert (tmp_path / "checkpoints" / "EVIL_RAN").is_file()


def test_resuming_training_never_imports_what_a_checkpoint_names(trained, tmp_path):
    step = retrain_with_plugins(trained, tmp_path, ["evil.py"])
    (step / "evil.py").write_text(EVIL)
    (step.parent / "evil.py").write_text(EVIL)
    config = tiny_config(
        tmp_path,
        model={"model_config": {**TINY_MODEL, "vocab_size": 257}, "make_vocab_size_divisible_by": 64},
        tokenizer={"tokenizer_name_or_path": "byte"},
        tokens={"train_steps": 4},
        checkpoints={"resume_checkpoint_path": str(step.parent)},
    )
    assert len(run_training(config)["losses"]) == 1  # step 4, from the checkpoint of step 3
    assert not list(tmp_path.rglob("EVIL_RAN"))
