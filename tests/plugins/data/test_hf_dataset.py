"""The hf format: local files through Hugging Face datasets, tokenized once into a nanoset cache."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanocore.errors import DataError
from nanocore_plugins.data.hf import COMPLETE, HFArgs, build_hf

DOCS = ["hello world", "the quick brown fox\njumps over", "ünïcödé 漢字", "", "last one"]


def ds_tokens(dataset):
    """The cached token stream behind a dataset, read straight from its .ds files."""
    import numpy as np

    return [t for f in dataset.files for t in np.fromfile(f.path, dtype="<u2").tolist()]


def write_jsonl(path, docs, column="text"):
    path.write_text("\n".join(json.dumps({column: d, "id": i}) for i, d in enumerate(docs)) + "\n")


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_txt_jsonl_parquet_and_saved_dataset_give_the_hand_tokenized_stream(here, make_ctx, dh):
    import datasets

    write_jsonl(here / "docs.jsonl", DOCS)
    pq.write_table(pa.table({"content": DOCS}), here / "docs.parquet")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(here / "saved"))
    (here / "txt").mkdir()
    for i, doc in enumerate(DOCS[:3]):  # a text file is one document, not one per line
        (here / "txt" / f"{i}.txt").write_text(doc)
    expected = dh.stream(DOCS)
    ctx = make_ctx(sequence_length=5)
    cases = [
        (HFArgs("docs.jsonl"), expected),
        (HFArgs("docs.parquet", text_column_name="content"), expected),
        (HFArgs("saved"), expected),
        (HFArgs("txt"), dh.stream(DOCS[:3])),
        (HFArgs("txt/1.txt"), dh.stream(DOCS[1:2])),
    ]
    for args, tokens in cases:
        [(dataset, weight)] = build_hf(args, ctx)
        assert weight == 1.0
        assert ds_tokens(dataset) == tokens, args
        # samples are the shared nanoset windows over that stream
        assert [dataset[i].tolist() for i in range(len(dataset))] == dh.windows(tokens, 5)


def test_second_load_reuses_the_cache_until_the_source_changes(here, make_ctx, dh):
    write_jsonl(here / "docs.jsonl", DOCS)
    tokenizer = dh.CountingTokenizer()
    ctx = make_ctx(tokenizer=tokenizer)
    [(first, _)] = build_hf(HFArgs("docs.jsonl"), ctx)
    assert tokenizer.documents == len(DOCS)
    ds_file = first.files[0].path
    written = ds_file.stat().st_mtime_ns
    assert (ds_file.parent / COMPLETE).is_file() and ds_file.parent.parent.parent == here / "cache"

    [(second, _)] = build_hf(HFArgs("docs.jsonl"), ctx)
    assert tokenizer.documents == len(DOCS)  # nothing tokenized again
    assert second.files[0].path == ds_file and ds_file.stat().st_mtime_ns == written
    assert [second[i].tolist() for i in range(len(second))] == [first[i].tolist() for i in range(len(first))]

    build_hf(HFArgs("docs.jsonl", dataset_overwrite_cache=True), ctx)
    assert tokenizer.documents == 2 * len(DOCS)

    write_jsonl(here / "docs.jsonl", DOCS + ["one more document"])
    [(changed, _)] = build_hf(HFArgs("docs.jsonl"), ctx)
    assert changed.files[0].path != ds_file
    assert ds_tokens(changed) == dh.stream(DOCS + ["one more document"])


def test_other_ranks_wait_then_read_what_the_main_process_wrote(here, make_ctx):
    write_jsonl(here / "docs.jsonl", DOCS)
    calls = []
    other = make_ctx(is_main_process=False, barrier=lambda: calls.append("barrier"))
    with pytest.raises(DataError, match="cache_dir must be on a file system every rank can read"):
        build_hf(HFArgs("docs.jsonl"), other)
    main = make_ctx(barrier=lambda: calls.append("main barrier"))
    [(written, _)] = build_hf(HFArgs("docs.jsonl"), main)
    [(read, _)] = build_hf(HFArgs("docs.jsonl"), other)
    assert calls == ["barrier", "main barrier", "barrier"]
    assert read.files[0].path == written.files[0].path


def test_mixture_weights_and_cache_dir_override(here, make_ctx):
    write_jsonl(here / "a.jsonl", DOCS * 4)
    write_jsonl(here / "b.jsonl", DOCS)
    ctx = make_ctx()
    mixed = build_hf(HFArgs({"a.jsonl": 1, "b.jsonl": 3}, cache_dir="my_cache"), ctx)
    assert [w for _, w in mixed] == [0.25, 0.75]
    assert all(d.folder.resolve().is_relative_to(here / "my_cache") for d, _ in mixed)
    by_size = build_hf(HFArgs(["a.jsonl", "b.jsonl"]), ctx)
    assert len(by_size[0][0]) > len(by_size[1][0])
    assert by_size[0][1] == pytest.approx(len(by_size[0][0]) / (len(by_size[0][0]) + len(by_size[1][0])))


def test_splits_of_a_saved_dataset_dict(here, make_ctx, dh):
    import datasets

    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": DOCS}),
            "validation": datasets.Dataset.from_dict({"text": ["v" * 20]}),
        }
    ).save_to_disk(str(here / "dd"))
    [(val, _)] = build_hf(HFArgs("dd", hf_dataset_splits="validation"), make_ctx())
    assert ds_tokens(val) == dh.stream(["v" * 20])
    [(both, _)] = build_hf(HFArgs("dd", hf_dataset_splits=["train", "validation"]), make_ctx())
    assert ds_tokens(both) == dh.stream(DOCS + ["v" * 20])
    with pytest.raises(DataError, match="no split 'test'; it has 'train', 'validation'"):
        build_hf(HFArgs("dd", hf_dataset_splits="test"), make_ctx())


def test_splits_of_a_data_folder_follow_the_file_names(here, make_ctx, dh):
    (here / "corpus" / "data").mkdir(parents=True)
    write_jsonl(here / "corpus" / "data" / "train.jsonl", DOCS)
    write_jsonl(here / "corpus" / "data" / "validation.jsonl", ["held out text"])
    [(val, _)] = build_hf(HFArgs("corpus", hf_dataset_splits="validation"), make_ctx())
    assert ds_tokens(val) == dh.stream(["held out text"])
    [(train, _)] = build_hf(HFArgs("corpus"), make_ctx())
    assert ds_tokens(train) == dh.stream(DOCS)
    with pytest.raises(DataError, match="could not load split 'test'.*Unknown split"):
        build_hf(HFArgs("corpus", hf_dataset_splits="test"), make_ctx())


def test_errors_name_the_problem(here, make_ctx):
    write_jsonl(here / "docs.jsonl", DOCS, column="body")
    with pytest.raises(DataError, match="no text column 'text'; columns are 'body', 'id'"):
        build_hf(HFArgs("docs.jsonl"), make_ctx())
    with pytest.raises(DataError, match="'allenai/c4' does not exist.*local data only.*save_to_disk"):
        build_hf(HFArgs("allenai/c4"), make_ctx())
    problems = HFArgs(["docs.jsonl", "allenai/c4"], dataset_weights=[1.0]).check(None)
    assert problems[0] == "dataset_weights: 1 weight(s) for 2 dataset(s)"
    assert problems[1].startswith("hf_dataset_or_datasets: 'allenai/c4' does not exist")
    assert len(problems) == 2
