"""meta.json has one owner (nanocore/checkpoint/meta.py): written and read back as the same record,
older files read with defaults, a damaged one named with what is wrong."""

from __future__ import annotations

import json

import pytest

from nanocore.checkpoint.folder import CheckpointError
from nanocore.checkpoint.meta import (
    FORMAT_VERSION,
    CheckpointMeta,
    MetaError,
    Topology,
    parse_meta,
    read_meta,
    write_meta,
)


def meta(**changes) -> CheckpointMeta:
    fields = dict(
        step=4,
        consumed_tokens=256,
        topology=Topology(dp=2, tp=2, pp=1, cp=1, world_size=4),
        data={"consumed_samples": {"stable": 16}},
        lr_scheduler={"step": 4},
        model_type="llama",
        run_id="abc123",
    )
    return CheckpointMeta(**{**fields, **changes})


def test_written_meta_reads_back_equal_and_leaves_unset_fields_out(tmp_path):
    write_meta(tmp_path, meta())
    assert read_meta(tmp_path) == meta()
    data = json.loads((tmp_path / "meta.json").read_text())
    assert data["topology"] == {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "world_size": 4}
    assert data["format_version"] == FORMAT_VERSION
    assert "converted_from" not in data


def test_meta_written_before_cp_and_run_ids_reads_with_defaults():
    old = {
        "step": 2,
        "consumed_tokens": 64,
        "topology": {"dp": 1, "tp": 1, "pp": 2, "world_size": 2},
        "data": {"consumed_samples": {}},
        "lr_scheduler": {"step": 2},
    }
    record = parse_meta(json.dumps(old))
    assert record.topology == Topology(dp=1, tp=1, pp=2, cp=1, world_size=2)
    assert (record.run_id, record.model_type, record.format_version) == (None, None, 1)


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("{ not json", "is not valid JSON"),
        ("[1, 2]", "is not a JSON object"),
        (json.dumps({"step": 1}), "lacks 'consumed_tokens'"),
        (json.dumps({**meta().to_json(), "topology": [1]}), "has no valid 'topology'"),
        (json.dumps({**meta().to_json(), "step": "4"}), "has step '4', expected an integer >= 0"),
        (json.dumps({**meta().to_json(), "topology": {"dp": 0}}), "has topology.dp 0, expected an integer >= 1"),
    ],
)
def test_a_damaged_meta_says_what_is_wrong(text, what):
    with pytest.raises(MetaError, match=what):
        parse_meta(text)


def test_reading_a_damaged_meta_names_the_file(tmp_path):
    step = tmp_path / "checkpoints" / "3"
    step.mkdir(parents=True)
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        read_meta(step)
    (step / "meta.json").write_text("[]")
    with pytest.raises(CheckpointError, match=r"3/meta.json is not a JSON object; there is no earlier complete"):
        read_meta(step)
