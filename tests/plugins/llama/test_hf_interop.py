"""`nanocore convert` with transformers' LlamaForCausalLM: exact round trips, equal logits and greedy
generations, and clear refusals (pickled weights, architectures no plugin converts)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanocore.checkpoint.model import load_checkpoint_model
from nanocore.commands.cli import run as cli
from nanocore.config.load import load_config
from nanocore.errors import NanocoreError
from nanocore.generation import generate
from nanocore.hf_interop import from_hf
from tests.helpers.compare import rel_diff
from tests.helpers.hf_models import hf_model, save_hf_llama

CASES = {
    # grouped-query attention with q/k/v/o biases, saved as index + several shards
    "gqa": {"attention_bias": True, "max_shard_size": "30KB"},
    "tied": {"tie_word_embeddings": True, "num_key_value_heads": 4},
    # heads of 12, not hidden_size / heads = 8 (as Gemma and others size them)
    "head_dim": {"head_dim": 12},
    "llama3_rope": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
}


def hf_config_fields(folder: Path) -> dict:
    from transformers import AutoConfig

    fields = AutoConfig.from_pretrained(folder).to_dict()
    for key in ("_name_or_path", "transformers_version"):
        fields.pop(key, None)
    return fields


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """An HF folder and its `convert --from-hf` checkpoint (once per case)."""
    tmp = tmp_path_factory.mktemp(request.param)
    hf_dir = save_hf_llama(tmp / "hf", **CASES[request.param])
    assert cli(["convert", "--from-hf", str(hf_dir), str(tmp / "nanocore")]) == 0
    return {"case": request.param, "hf": hf_dir, "checkpoints": tmp / "nanocore", "tmp": tmp}


def test_hf_to_nanocore_to_hf_is_exact(converted):
    if converted["case"] == "gqa":
        assert (converted["hf"] / "model.safetensors.index.json").exists(), "the sharded input is exercised"
    out = converted["tmp"] / "back"
    assert cli(["convert", "--to-hf", str(converted["checkpoints"]), str(out)]) == 0
    original = {}
    for file in converted["hf"].glob("*.safetensors"):
        original.update(load_file(file))
    back = load_file(out / "model.safetensors")
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert hf_config_fields(out) == hf_config_fields(converted["hf"])


def test_converted_checkpoint_has_a_runnable_config_and_step_zero(converted):
    root = converted["checkpoints"]
    assert (root / "latest.txt").read_text().strip() == "0"
    loaded = load_config(root / "0" / "config.yaml", world_size=1)
    assert loaded.config.model.model_type == "llama"
    assert loaded.config.model.model_config.vocab_size == 67
    assert json.loads((root / "0" / "meta.json").read_text())["step"] == 0


def test_logits_and_greedy_generation_equal_transformers(converted):
    ours = load_checkpoint_model(converted["checkpoints"]).model
    theirs = hf_model(converted["hf"])
    torch.manual_seed(1)
    ids = torch.randint(0, 67, (2, 24))  # longer than original_max_position_embeddings in the llama3 case
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids)
    assert got.shape == expected.shape
    # the same float32 math in other kernels: relative to the logits' largest magnitude (~4 here), as in
    # test_llama_model's parity with transformers
    assert rel_diff(got, expected) <= 1e-5, rel_diff(got, expected)

    prompt = [5, 17, 42, 3]
    eos = theirs.config.eos_token_id
    new = generate(ours, prompt, 20, temperature=0, eos_token_id=eos)
    hf_out = theirs.generate(
        torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )
    assert new == hf_out[0, len(prompt) :].tolist()
    assert len(set(new)) > 2, "a degenerate continuation would hide differences"


def test_pickled_weights_are_refused_without_being_unpickled(tmp_path):
    folder = save_hf_llama(tmp_path / "hf")
    for file in folder.glob("*.safetensors"):
        file.unlink()
    marker = tmp_path / "unpickled"

    class Trap:  # unpickling this file would create `marker`
        def __reduce__(self):
            return (Path.touch, (marker,))

    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Trap()))
    with pytest.raises(NanocoreError) as info:
        from_hf(folder, tmp_path / "out")
    message = str(info.value)
    assert "pytorch_model.bin" in message and "safetensors" in message and "never" in message
    assert not marker.exists()
    assert cli(["convert", "--from-hf", str(folder), str(tmp_path / "out2")]) == 2


def test_unknown_architecture_names_the_supported_ones(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    save_file({"transformer.wte.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    assert cli(["convert", "--from-hf", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err
    assert not (tmp_path / "out").exists()


def test_unsupported_llama_variant_and_occupied_output_are_errors(tmp_path, capsys):
    folder = save_hf_llama(tmp_path / "hf", mlp_bias=True)
    assert cli(["convert", "--from-hf", str(folder), str(tmp_path / "out")]) == 2
    assert "mlp_bias" in capsys.readouterr().err
    good = save_hf_llama(tmp_path / "good")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    assert cli(["convert", "--from-hf", str(good), str(tmp_path / "taken")]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_tokenizer_travels_both_ways_and_generate_runs(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = save_hf_llama(tmp_path / "hf")
    vocab = {**{f"w{i}": i for i in range(60)}, "[UNK]": 60}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    assert cli(["convert", "--from-hf", str(folder), str(tmp_path / "ckpt")]) == 0
    config = load_config(tmp_path / "ckpt" / "0" / "config.yaml", world_size=1).config
    assert config.tokenizer.tokenizer_name_or_path == str(folder.resolve())
    capsys.readouterr()
    args = ["--prompt", "w1 w2", "--max-new-tokens", "3", "--temperature", "0"]
    assert cli(["generate", "--ckpt-path", str(tmp_path / "ckpt"), *args]) == 0
    assert capsys.readouterr().out.startswith("w1 w2")
    assert cli(["convert", "--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


def test_training_from_an_hf_folder_reads_only_the_rectangles_a_rank_needs(tmp_path, monkeypatch):
    """A LLaMA folder's tensors are read lazily: a rank's piece costs a safetensors slice of its own
    rows, never the whole tensor, and holds the same values as the eager read."""
    from nanocore.checkpoint.tensors import ShardReader
    from nanocore.hf_interop import LazyTensor, load_hf
    from nanocore.plugins import load_plugins
    from nanocore.sharding import Placement

    folder = save_hf_llama(tmp_path / "hf", max_shard_size="20KB")  # several files, as a large model has
    registries = load_plugins().registries
    lazy, eager = load_hf(folder, registries, lazy=True), load_hf(folder, registries)
    assert all(isinstance(t, LazyTensor) for t in lazy.state.values())
    assert not any(isinstance(t, LazyTensor) for t in eager.state.values())
    reads = []
    read = LazyTensor.__getitem__
    monkeypatch.setattr(LazyTensor, "__getitem__", lambda self, index: reads.append(index) or read(self, index))
    name = "model.embed_tokens.weight"
    full = eager.state[name]
    placement = Placement(tuple(full.shape), (20, 0))  # rows 20..39 of the 67, as a TP rank would hold
    piece = ShardReader.from_tensors(lazy.state, str(folder)).read(name, placement, (20, full.shape[1]))
    assert torch.equal(piece, full[20:40])
    assert reads == [(slice(20, 40), slice(0, full.shape[1]))]
