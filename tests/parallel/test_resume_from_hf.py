"""A checkpoint written by `nanocore convert --from-hf` is a checkpoint like a trained one: the same
meta.json record (topology with `cp`), accepted by `nanocore checkpoint verify`, and resumed at other
layouts (context parallel, dp x tp) it trains like one process resumed from it.

The folder ties its embeddings and has an odd vocabulary, padded for tp=2 and split over the stages.
"""

from __future__ import annotations

import json

import pytest
import yaml

from nanocore.commands.cli import run as cli
from tests.helpers.compare import rel_diff
from tests.helpers.hf_models import save_hf_llama
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow

STEPS = 2
GLOBAL_MICROBATCHES = 4


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The converted checkpoints folder and the model_config its config.yaml holds."""
    tmp = tmp_path_factory.mktemp("hf")
    folder = save_hf_llama(tmp / "hf", seed=5, tie_word_embeddings=True)
    assert cli(["convert", "--from-hf", str(folder), str(tmp / "converted")]) == 0
    config = yaml.safe_load((tmp / "converted" / "0" / "config.yaml").read_text())
    return {"checkpoints": tmp / "converted", "model_config": config["model"]["model_config"]}


def resume_config(tmp, converted, dp=1, tp=1, cp=1):
    return tiny_config(
        tmp,
        model={"model_config": converted["model_config"]},
        parallelism={"dp": dp, "tp": tp, "pp": 1, "context_parallel_size": cp},
        tokens={"train_steps": STEPS, "batch_accumulation_per_replica": GLOBAL_MICROBATCHES // dp},
        checkpoints={"resume_checkpoint_path": str(converted["checkpoints"])},
    )


@pytest.fixture(scope="module")
def one_process(converted, tmp_path_factory):
    return run_training(resume_config(tmp_path_factory.mktemp("one"), converted))


def test_converted_meta_is_the_trainers_record_and_verify_accepts_it(converted, capsys):
    meta = json.loads((converted["checkpoints"] / "0" / "meta.json").read_text())
    assert meta["topology"] == {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "world_size": 1}
    assert meta["step"] == 0 and meta["model_type"] == "llama" and meta["converted_from"].endswith("hf")
    assert cli(["checkpoint", "verify", str(converted["checkpoints"])]) == 0
    out = capsys.readouterr().out
    assert f"ok {converted['checkpoints'] / '0'}" in out
    assert "meta.json: step 0, written by 1 rank(s)" in out


@pytest.mark.parametrize(("name", "layout"), [("cp2", {"cp": 2}), ("dp2_tp2", {"dp": 2, "tp": 2})])
def test_converted_checkpoint_resumes_at_another_layout(name, layout, converted, one_process, tmp_path):
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("cp", 1)
    resumed = run_training(resume_config(tmp_path, converted, **layout), world_size=world)
    assert len(resumed["losses"]) == STEPS  # a step-0 checkpoint: every step still to train
    diffs = [rel_diff(a, b) for a, b in zip(resumed["losses"], one_process["losses"], strict=True)]
    assert max(diffs) <= 1e-5, f"{name}: relative loss differences {diffs}"
