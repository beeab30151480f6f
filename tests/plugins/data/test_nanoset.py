"""The nanoset format: datatrove's on-disk layout, window cutting, and the errors users meet."""

import pickle

import numpy as np
import pytest

from nanocore.errors import DataError
from nanocore_plugins.data.nanoset import NanosetArgs, build_nanoset, open_folder, read_metadata
from nanocore_plugins.data.writer import NanosetWriter

TEXTS = ["hello world", "a", "the quick brown fox jumps over the lazy dog", "ü漢字", "x" * 30]


def test_writer_output_reads_back_as_the_token_stream(tmp_path, dh):
    tokens = dh.stream(TEXTS)
    with NanosetWriter(tmp_path / "ds", tokenizer_name="byte", token_size=2) as writer:
        for doc in TEXTS:
            writer.add_document(list(doc.encode()) + [256])
    files = sorted((tmp_path / "ds").glob("*.ds"))
    assert [f.name for f in files] == ["00000_tokenized.ds"]
    assert np.fromfile(files[0], dtype="<u2").tolist() == tokens
    doc_ends = np.fromfile(f"{files[0]}.index", dtype="<u8").tolist()
    assert doc_ends == np.cumsum([len(d.encode()) + 1 for d in TEXTS]).tolist()
    meta = read_metadata(tmp_path / "ds" / "00000_tokenized.ds.metadata")
    assert (meta.tokenizer_name, meta.token_size, meta.token_count) == ("byte", 2, len(tokens))

    ds = open_folder(tmp_path / "ds", sequence_length=7, vocab_size=257, tokenizer=dh.NamedTokenizer("byte"))
    assert len(ds) == len(tokens) // 8
    assert [ds[i].tolist() for i in range(len(ds))] == dh.windows(tokens, 7)
    assert ds[0].dtype.is_floating_point is False and ds[0].shape == (8,)
    assert ds[-1].tolist() == dh.windows(tokens, 7)[-1]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_reads_a_hand_written_datatrove_folder(tmp_path, dh):
    """Files in sorted order, each cut on its own into seq+1 windows with stride seq+1 (tails unused),
    the way DatatroveFolderDataset/DatatroveFileDataset do; merger-style folder metadata is ignored."""
    folder = tmp_path / "dt"
    folder.mkdir()
    b = dh.write_datatrove_file(folder, "001_data.ds", [[5, 6, 7], [8, 9, 10, 11, 12], [13]])  # 9 tokens
    a = dh.write_datatrove_file(folder, "000_data.ds", [[1, 2, 3, 4], [50000, 60000, 3]])  # 7 tokens
    (folder / "data.ds.metadata").write_text("gpt2|2\n16\n16 T")  # DocumentTokenizerMerger's total file
    ds = open_folder(folder, sequence_length=2, vocab_size=65536, tokenizer=dh.NamedTokenizer("gpt2", 50257))
    expected = [a[0:3], a[3:6], b[0:3], b[3:6], b[6:9]]
    assert expected == [[1, 2, 3], [4, 50000, 60000], [5, 6, 7], [8, 9, 10], [11, 12, 13]]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds.tokenizer_name == "gpt2"


def test_four_byte_tokens_from_metadata_and_from_vocab_size(tmp_path, dh):
    docs = [[70000, 1, 99999], [2, 3, 100000, 4]]
    folder = tmp_path / "big"
    folder.mkdir()
    tokens = dh.write_datatrove_file(folder, "a.ds", docs, tokenizer="big-tok", token_size=4)
    ds = open_folder(folder, sequence_length=2, vocab_size=100001, tokenizer=dh.NamedTokenizer("big-tok", 100001))
    assert [ds[i].tolist() for i in range(len(ds))] == dh.windows(tokens, 2)
    # older datatrove metadata has no "|4": the tokenizer's vocabulary (> 65536) decides, like nanotron
    (folder / "a.ds.metadata").write_text(f"big-tok\n{len(tokens)}\n7 T")
    ds = open_folder(folder, sequence_length=2, vocab_size=100001, tokenizer=dh.NamedTokenizer("big-tok", 100001))
    assert ds[1].tolist() == [2, 3, 100000]


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(DataError, match="'.*nope' does not exist"):
        open_folder(tmp_path / "nope", sequence_length=4, vocab_size=257)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"has no \*\.ds files.*nanocore preprocess"):
        open_folder(tmp_path / "empty", sequence_length=4, vocab_size=257)


def test_truncated_files_are_reported(tmp_path, dh):
    folder = tmp_path / "t"
    folder.mkdir()
    dh.write_datatrove_file(folder, "a.ds", [[1, 2, 3, 4, 5], [6, 7, 8]], tokenizer="byte")
    data = (folder / "a.ds").read_bytes()
    (folder / "a.ds").write_bytes(data[:-1])  # half a token: an interrupted copy
    with pytest.raises(DataError, match="not a multiple of the token size.*truncated"):
        open_folder(folder, sequence_length=2, vocab_size=257)
    (folder / "a.ds").write_bytes(data[:-4])  # two whole tokens missing: the index knows
    with pytest.raises(DataError, match="holds 6 tokens but its index says the last document ends at token 8"):
        open_folder(folder, sequence_length=2, vocab_size=257)
    (folder / "a.ds.index").unlink()  # without an index, the metadata's count still catches it
    with pytest.raises(DataError, match="holds 6 tokens but a.ds.metadata says 8"):
        open_folder(folder, sequence_length=2, vocab_size=257)


def test_token_ids_beyond_the_model_vocabulary(tmp_path, dh):
    folder = tmp_path / "v"
    folder.mkdir()
    dh.write_datatrove_file(folder, "a.ds", [[1, 2, 3], [4, 300, 5]], tokenizer="byte")
    with pytest.raises(DataError, match="contains token id 300 but the model's vocabulary has 257 ids"):
        open_folder(folder, sequence_length=2, vocab_size=257)


def test_tokenizer_mismatch_says_how_to_fix(tmp_path, dh):
    folder = tmp_path / "m"
    folder.mkdir()
    dh.write_datatrove_file(folder, "a.ds", [[1, 2, 3, 4, 5, 6]], tokenizer="gpt2")
    with pytest.raises(DataError) as err:
        open_folder(folder, sequence_length=2, vocab_size=257, tokenizer=dh.NamedTokenizer("byte"))
    message = str(err.value)
    assert "tokenized with 'gpt2'" in message and "configured tokenizer is 'byte'" in message
    assert "tokenizer.tokenizer_name_or_path" in message and "nanocore preprocess" in message
    # a local copy of the same Hub tokenizer is the same tokenizer
    ds = open_folder(
        folder, sequence_length=2, vocab_size=257, tokenizer=dh.NamedTokenizer("/models/gpt2/tokenizer.json")
    )
    assert len(ds) == 2
    ds = open_folder(
        folder, sequence_length=2, vocab_size=257, tokenizer=dh.NamedTokenizer("byte"), check_tokenizer=False
    )
    assert len(ds) == 2


def test_too_short_for_one_sample(tmp_path, dh):
    folder = tmp_path / "s"
    folder.mkdir()
    dh.write_datatrove_file(folder, "a.ds", [[1, 2, 3]], tokenizer="byte")
    with pytest.raises(DataError, match="no .ds file holds 9 tokens"):
        open_folder(folder, sequence_length=8, vocab_size=257)


def test_build_weights_follow_nanotron_forms(tmp_path, make_ctx, monkeypatch, dh):
    monkeypatch.chdir(tmp_path)
    for name, n in (("a", 30), ("b", 10)):
        (tmp_path / name).mkdir()
        dh.write_datatrove_file(tmp_path / name, "x.ds", [list(range(n))], tokenizer="byte")
    ctx = make_ctx(sequence_length=4)  # 5-token windows: a has 6 samples, b has 2
    default = build_nanoset(NanosetArgs(dataset_folder=["a", "b"]), ctx)
    assert [len(d) for d, _ in default] == [6, 2]
    assert [w for _, w in default] == [0.75, 0.25]  # proportional to size, like nanotron
    given = build_nanoset(NanosetArgs(dataset_folder=["a", "b"], dataset_weights=[1, 3]), ctx)
    assert [w for _, w in given] == [0.25, 0.75]
    mapping = build_nanoset(NanosetArgs(dataset_folder={"b": 2.0, "a": 2.0}), ctx)
    assert [d.folder.name for d, _ in mapping] == ["b", "a"] and [w for _, w in mapping] == [0.5, 0.5]
    assert [w for _, w in build_nanoset(NanosetArgs(dataset_folder="a"), ctx)] == [1.0]


def test_config_check_problems(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    problems = NanosetArgs(dataset_folder=["x", "empty"], dataset_weights=[1.0], token_size=3).check(None)
    assert problems[0] == "dataset_weights: 1 weight(s) for 2 folder(s)"
    assert "token_size: must be 2 or 4 (bytes per token), got 3" in problems
    assert any(
        p.startswith("dataset_folder: folder 'x' does not exist (relative to the current directory") for p in problems
    )
    assert "dataset_folder: folder 'empty' has no *.ds files (make them with `nanocore preprocess`)" in problems
    assert NanosetArgs(dataset_folder=3).check(None)[0].startswith("dataset_folder: expected a folder")


def test_yaml_shapes_structure_through_the_config_converter():
    from nanocore.config.converter import make_converter
    from nanocore.config.schema import DatasetSpec
    from nanocore.registry import Registries
    from nanocore_plugins.data import plugin

    registries = Registries()
    plugin.register_dataset_formats(registry=registries.dataset_format)
    conv = make_converter(registries)
    spec = conv.structure({"dataset_folder": {"a": 1.0, "b": 3}, "token_size": 2}, DatasetSpec)
    assert spec.format == "nanoset" and spec.args == NanosetArgs({"a": 1.0, "b": 3}, None, 2, True)
    assert conv.unstructure(spec) == {
        "format": "nanoset",
        "dataset_folder": {"a": 1.0, "b": 3},
        "dataset_weights": None,
        "token_size": 2,
        "check_tokenizer": True,
    }
    hf = conv.structure({"hf_dataset_or_datasets": ["x.jsonl"], "text_column_name": "content"}, DatasetSpec)
    assert hf.format == "hf" and hf.args.text_column == "content"
    assert conv.structure({}, DatasetSpec).format == "dummy"


def test_pickled_dataset_does_not_carry_the_tokens(tmp_path, dh):
    folder = tmp_path / "p"
    folder.mkdir()
    dh.write_datatrove_file(folder, "a.ds", [list(range(200)) * 50], tokenizer="byte", metadata=False)
    ds = open_folder(folder, sequence_length=9, vocab_size=257)
    first = ds[3].tolist()
    blob = pickle.dumps(ds)  # what a DataLoader worker receives
    assert len(blob) < 4000
    assert pickle.loads(blob)[3].tolist() == first
