"""A model declares its vocabulary parameters; the engine marks their layout padding, so checkpoints
hold the true rows only (see tests/parallel/test_checkpoint_vocab_padding.py for resumes)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nanocore.checkpoint.model import load_checkpoint_model
from nanocore.checkpoint.tensors import ShardedTensor, ShardReader, write_shards
from nanocore.commands.cli import run as cli
from nanocore.config.schema import ModelArgs
from nanocore.errors import PluginError
from nanocore.model_api import check_model, vocab_parameters, whole_placement
from nanocore.plugins import load_plugins
from nanocore.sharding import Placement, get_placement
from nanocore_plugins.llama.config import LlamaConfig
from nanocore_plugins.parallel.build import build_local_model, meta_model
from tests.helpers.training import TINY_MODEL, run_training, tiny_config

LLAMA = {k: v for k, v in TINY_MODEL.items() if k != "model_type"}


@pytest.mark.parametrize("tied", [False, True])
def test_one_process_marks_the_padding_of_the_declared_parameters(tied):
    args = ModelArgs(model_config=LlamaConfig(**{**LLAMA, "vocab_size": 61, "tie_word_embeddings": tied}))
    local = build_local_model(
        meta_model(load_plugins().registries.model.get("llama"), args, vocab_multiple=8),
        seed=1,
        device=torch.device("cpu"),
        dtype=torch.float32,
        pp_size=1,
        pp_rank=0,
        virtual_stages=1,
    )
    padded = {}
    for name, param in local.module.named_parameters(remove_duplicate=False):
        placement = get_placement(param)
        if placement.valid_rows is not None:
            padded[name] = (placement.full_shape, placement.valid_rows)
    assert padded == {n: ((64, 32), 61) for n in ("model.embed_tokens.weight", "lm_head.weight")}


class TwoTables(nn.Module):
    """A token table and a position table: only the first is a vocabulary."""

    tp_plan = {"tokens": "vocab_embedding", "positions": "vocab_embedding"}
    tied_parameters = [("tokens.weight", "head.weight")]
    vocab_size, true_vocab_size = 8, 5

    def __init__(self, declared):
        super().__init__()
        self.vocab_parameters = declared
        self.tokens, self.positions = nn.Embedding(8, 4), nn.Embedding(16, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.tokens.weight

    def pipeline_blocks(self):
        return [["tokens"], ["head"]]

    def init_parameter(self, name, tensor, generator):
        tensor.normal_(generator=generator)

    def flops_per_token(self, sequence_length):
        return 0.0


def test_a_tied_pair_is_declared_by_either_name():
    model = TwoTables(["head.weight"])
    check_model(model, "two_tables")
    assert vocab_parameters(model) == {"tokens.weight", "head.weight"}
    assert whole_placement(model, "tokens.weight", (8, 4)).valid_rows == 5
    assert whole_placement(model, "positions.weight", (16, 4)).valid_rows is None


@pytest.mark.parametrize(
    "declared,message",
    [(["positions.weight"], r"shape \[16, 4\]"), (["token.weight"], "no such parameter")],
)
def test_a_wrong_declaration_is_refused_by_name(declared, message):
    with pytest.raises(
        PluginError, match=f"'two_tables' lists '{declared[0]}' in vocab_parameters, but it has {message}"
    ):
        check_model(TwoTables(declared), "two_tables")


def as_format_version_1(new, old, rows: int) -> None:
    """Copy checkpoint `new` to `old` as format version 1 wrote it: vocabulary rows padded (here to
    `rows`, with 7.0, as a much wider tp would) and saved, and no manifest."""
    shutil.copytree(new, old, ignore=shutil.ignore_patterns("manifest.json"))
    for part in ("model", "optimizer"):
        reader, shards = ShardReader(new / part), []
        for name in reader.names():
            shape = reader.full_shape(name)
            tensor = reader.read(name, Placement.whole(shape), shape)
            if name.split("::")[0] in ("model.embed_tokens.weight", "lm_head.weight") and shape:
                tensor = torch.cat([tensor, torch.full((rows - shape[0], *shape[1:]), 7.0)])
            shards.append(ShardedTensor(name, tensor, Placement.whole(tensor.shape)))
        shutil.rmtree(old / part)
        write_shards(old / part / "rank-00000.safetensors", shards)
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))


def test_an_old_padded_checkpoint_resumes_generates_and_exports_its_true_vocabulary(tmp_path):
    def config(tmp, **checkpoints):
        raw = tiny_config(
            tmp,
            model={"model_config": {**TINY_MODEL, "vocab_size": 61}},
            tokens={"train_steps": 2},
            optimizer={"learning_rate_scheduler": {"lr_decay_steps": 2}},
            checkpoints={"checkpoint_interval": 1, **checkpoints},
        )
        raw["model"]["make_vocab_size_divisible_by"] = 8  # 61 -> 64 rows here
        return raw

    full = run_training(config(tmp_path / "new"))
    new, old = tmp_path / "new" / "checkpoints" / "1", tmp_path / "old" / "1"
    assert ShardReader(new / "model").full_shape("model.embed_tokens.weight") == (61, 32)
    as_format_version_1(new, old, rows=128)

    resumed = run_training(config(tmp_path / "resumed", resume_checkpoint_path=str(old)))
    assert resumed["losses"] == full["losses"][1:]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert not resumed["weights"][name][61:].any(), f"{name}: the old padding (7.0) is not loaded"

    ours = dict(load_checkpoint_model(old).model.named_parameters())
    for name, tensor in load_checkpoint_model(new).model.named_parameters():
        assert torch.equal(ours[name], tensor), name
    assert cli(["convert", "--to-hf", str(old), str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported["model.embed_tokens.weight"].shape == exported["lm_head.weight"].shape == (61, 32)
