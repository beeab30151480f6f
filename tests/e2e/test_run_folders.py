"""A run owns its checkpoints folder and log dir: a fresh run never overwrites another run's work,
a rerun with `resume_checkpoint_path: latest` continues, and `checkpoints.overwrite` replaces on request.

The scenario a user reported: four steps into `ckpt/` (checkpoints 2 and 4), then a second run with
another seed and the same paths. It exited 0, replaced checkpoint 2, pointed latest.txt back to 2 and
cut metrics.jsonl from 4 rows to 2. Now it refuses and touches nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanocore import hookimpl
from nanocore.errors import NanocoreError
from tests.helpers.training import run_training, tiny_config


def config(tmp: Path, seed: int = 7, steps: int = 4, **checkpoints) -> dict:
    return tiny_config(
        tmp,
        general={"seed": seed},
        tokens={"train_steps": steps, "batch_accumulation_per_replica": 1},
        checkpoints={"checkpoint_interval": 2, "save_final_state": True, **checkpoints},
        logging={"log_dir": str(tmp / "logs"), "loggers": ["jsonl"]},
        optimizer={"learning_rate_scheduler": {"lr_warmup_steps": 0, "lr_decay_style": "constant"}},
    )


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def rows(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_a_fresh_run_refuses_another_runs_folders_and_touches_nothing(tmp_path):
    run_training(config(tmp_path))
    before = snapshot(tmp_path)
    assert (tmp_path / "checkpoints" / "latest.txt").read_text().strip() == "4"
    with pytest.raises(NanocoreError) as caught:
        run_training(config(tmp_path, seed=8))
    message = str(caught.value)
    assert (
        f"checkpoints.checkpoints_path {str(tmp_path / 'checkpoints')!r} already holds checkpoints of another "
        "run (2, 4, latest.txt)" in message
    )
    assert f"logging.log_dir {str(tmp_path / 'logs')!r} already holds logs of another run (metrics.jsonl)" in message
    assert "Nothing was changed" in message
    for way in ("resume_checkpoint_path: latest", "choose another checkpoints_path", "checkpoints.overwrite: true"):
        assert way in message
    assert snapshot(tmp_path) == before, "a refused run must not change a byte of the earlier run"


def test_only_the_log_dir_in_use_is_refused_too(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text('{"step": 1, "lm_loss": 3.0}\n')
    with pytest.raises(NanocoreError, match=r"logging.log_dir .* already holds logs of another run \(metrics.jsonl\)"):
        run_training(config(tmp_path))
    assert not (tmp_path / "checkpoints").exists()


def test_latest_starts_fresh_then_continues_after_a_preemption(tmp_path):
    uninterrupted = run_training(config(tmp_path / "whole", steps=6))["losses"]
    rerun = config(tmp_path / "rerun", steps=6, resume_checkpoint_path="latest")

    class Preempted(Exception):
        pass

    class PreemptAfter:
        @hookimpl
        def on_step_end(self, step, metrics, trainer):
            if step == 3:
                raise Preempted

    with pytest.raises(Preempted):  # the first launch: an empty folder, so a fresh start
        run_training(rerun, extra_plugins=(PreemptAfter(),))
    assert (tmp_path / "rerun" / "checkpoints" / "latest.txt").read_text().strip() == "2"
    second = run_training(rerun)  # the same command again: continues from checkpoint 2
    assert second["losses"] == uninterrupted[2:]
    logged = rows(tmp_path / "rerun")
    assert [r["step"] for r in logged] == [1, 2, 3, 3, 4, 5, 6], "appended: the preempted launch's step 3 is kept"
    assert [r["lm_loss"] for r in logged[3:]] == uninterrupted[2:]
    run_ids = {
        json.loads((tmp_path / "rerun" / "checkpoints" / s / "meta.json").read_text())["run_id"] for s in ("2", "6")
    }
    assert len(run_ids) == 1, "one run across its launches: loggers (W&B) continue it under this id"


def test_overwrite_replaces_the_earlier_run(tmp_path):
    run_training(config(tmp_path, steps=4))
    result = run_training(config(tmp_path, seed=8, steps=2, overwrite=True))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [".nanocore-lock", "2", "latest.txt"]
    assert (tmp_path / "checkpoints" / "latest.txt").read_text().strip() == "2"
    assert [r["lm_loss"] for r in rows(tmp_path)] == result["losses"], "the old run's rows are replaced"


def test_a_run_resumed_from_elsewhere_needs_folders_of_its_own(tmp_path):
    run_training(config(tmp_path / "a"))
    run_training(config(tmp_path / "b"))
    other = config(tmp_path / "b", steps=6, resume_checkpoint_path=str(tmp_path / "a" / "checkpoints"))
    with pytest.raises(NanocoreError, match="a run resumed from another folder writes into folders of its own"):
        run_training(other)
    fresh = config(tmp_path / "c", steps=6, resume_checkpoint_path=str(tmp_path / "a" / "checkpoints" / "2"))
    assert len(run_training(fresh)["losses"]) == 4  # steps 3..6 from a's checkpoint 2, into c's own folders
