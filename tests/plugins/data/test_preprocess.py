"""`nanocore preprocess`: local text in, a datatrove-layout nanoset folder out."""

import argparse
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanocore.errors import DataError
from nanocore.plugins import load_plugins
from nanocore_plugins.data.hf import HFArgs, build_hf
from nanocore_plugins.data.nanoset import open_folder, read_metadata

TEXTS = ["first document\nwith two lines", "second", "third — ünïcödé", "fourth " * 5]


def preprocess(*argv):
    """Parse argv the way `nanocore preprocess` does (through the registered command) and run it."""
    entry = load_plugins().registries.command.get("preprocess")
    parser = argparse.ArgumentParser(prog="nanocore preprocess")
    entry.extras["add_arguments"](parser)
    return entry.factory(parser.parse_args(list(argv)))


@pytest.fixture
def corpus(tmp_path, monkeypatch, only_data_plugins):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "books" / "sub").mkdir(parents=True)
    (tmp_path / "books" / "a.txt").write_text(TEXTS[0])
    (tmp_path / "books" / "sub" / "b.txt").write_text(TEXTS[1])
    (tmp_path / "books" / "notes.md").write_text("not matched by the default glob")
    (tmp_path / "more.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in TEXTS[2:]))
    return tmp_path


def test_folder_and_jsonl_into_one_nanoset(corpus, capsys, dh):
    assert preprocess("--input", "books", "more.jsonl", "--output", "out", "--text-column", "body") == 0
    expected = dh.stream(TEXTS)
    assert dh.read_ds(corpus / "out") == [expected]
    meta = read_metadata(corpus / "out" / "00000_tokenized.ds.metadata")
    assert (meta.tokenizer_name, meta.token_size, meta.token_count) == ("byte", 2, len(expected))
    doc_ends = np.fromfile(corpus / "out" / "00000_tokenized.ds.index", dtype="<u8").tolist()
    assert doc_ends == np.cumsum([len(t.encode()) + 1 for t in TEXTS]).tolist()
    out = capsys.readouterr().out
    assert f"Wrote 4 documents, {len(expected)} tokens" in out and "in 1 file(s)" in out
    # and the nanoset format reads it as windows over that stream
    ds = open_folder(corpus / "out", sequence_length=6, vocab_size=257, tokenizer=dh.NamedTokenizer("byte"))
    assert [ds[i].tolist() for i in range(len(ds))] == dh.windows(expected, 6)


def test_max_tokens_per_file_splits_between_documents(corpus, dh):
    docs = [f"document number {i} " * (i % 3 + 1) for i in range(12)]
    pq.write_table(pa.table({"text": docs}), corpus / "docs.parquet")
    preprocess("--input", "docs.parquet", "--output", "out", "--max-tokens-per-file", "60")
    files = dh.read_ds(corpus / "out")
    assert len(files) > 2
    assert [t for f in files for t in f] == dh.stream(docs)
    for ids in files:
        assert len(ids) <= 60 and ids[-1] == 256  # every file ends on a document boundary
    total = read_metadata(corpus / "out" / "tokenized.ds.metadata")
    assert total.token_count == len(dh.stream(docs))


def test_glob_saved_dataset_and_hf_format_agree(corpus, make_ctx, dh):
    import datasets

    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(corpus / "saved"))
    preprocess("--input", "saved", "books", "--glob", "**/*.md", "--output", "out")
    assert dh.read_ds(corpus / "out") == [dh.stream([*TEXTS, "not matched by the default glob"])]
    # the hf format packs the same tokens the same way
    [(cached, _)] = build_hf(HFArgs("saved"), make_ctx(sequence_length=6))
    ours = open_folder(corpus / "out", sequence_length=6, vocab_size=257)
    assert [cached[i].tolist() for i in range(len(cached))] == [ours[i].tolist() for i in range(len(cached))]


def test_hf_tokenizer_path(corpus, dh):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate("first document with two lines second".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (corpus / "tok").mkdir()
    tok.save(str(corpus / "tok" / "tokenizer.json"))
    (corpus / "tok" / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    preprocess("--input", "books", "--output", "out", "--tokenizer", "tok")
    assert dh.read_ds(corpus / "out") == [[2, 3, 4, 5, 6, 1, 7, 1]]
    assert read_metadata(corpus / "out" / "00000_tokenized.ds.metadata").tokenizer_name == "tok"


def test_mistakes_are_reported(corpus):
    with pytest.raises(DataError, match="--input 'missing.txt' does not exist"):
        preprocess("--input", "missing.txt", "--output", "out")
    with pytest.raises(DataError, match="no text column 'text'; columns are 'body'"):
        preprocess("--input", "more.jsonl", "--output", "out")
    preprocess("--input", "books", "--output", "out")
    with pytest.raises(DataError, match="already holds 1 .ds file.*--overwrite"):
        preprocess("--input", "books", "--output", "out")
    preprocess("--input", "books/a.txt", "--output", "out", "--overwrite")
    assert sorted(p.name for p in (corpus / "out").iterdir()) == [
        "00000_tokenized.ds",
        "00000_tokenized.ds.index",
        "00000_tokenized.ds.metadata",
        "tokenized.ds.metadata",
    ]
    with pytest.raises(DataError, match="no files match"):
        preprocess("--input", "books", "--glob", "*.csv", "--output", "out2")
