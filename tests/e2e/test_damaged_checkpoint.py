"""End to end: resuming from a damaged checkpoint is one message whose advice works;
`nanocore checkpoint verify`; a disk that fills up mid-run; a dp2 checkpoint's manifest."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from nanocore import hookimpl
from nanocore.checkpoint.folder import LATEST, CheckpointError
from nanocore.checkpoint.verify import verify_checkpoint
from nanocore.config.converter import structure_config
from nanocore.config.load import LoadedConfig
from nanocore.plugins import load_plugins
from nanocore.trainer import Trainer
from tests.helpers.distributed import run_ranks
from tests.helpers.training import run_training, tiny_config

pytestmark = pytest.mark.slow
ERROR = "nanocore: error: "
WEIGHTS = "model/rank-00000.safetensors"


def config(tmp: Path, **checkpoints) -> dict:
    return tiny_config(tmp, tokens={"train_steps": 4}, checkpoints={"checkpoint_interval": 2, **checkpoints})


def launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOCORE_") and k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "nanocore", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def one_error(result: subprocess.CompletedProcess) -> str:
    """The one message of a command that failed with a user error."""
    assert result.returncode == 2, result.stderr
    assert result.stderr.count(ERROR) == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.split(ERROR, 1)[1].strip()


def zero_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1000:-900] = bytes(100)  # inside the last tensor's data
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[float]]:
    """A 4-step run with checkpoints 2 and 4, and its losses."""
    tmp = tmp_path_factory.mktemp("trained")
    return tmp / "checkpoints", run_training(config(tmp))["losses"]


@pytest.fixture
def copy(trained, tmp_path) -> Path:
    """This test's own copy of the trained run's checkpoints folder (same layout as config(tmp_path))."""
    shutil.copytree(trained[0], tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


def test_resuming_from_a_damaged_checkpoint_is_one_message_whose_advice_works(copy, trained, tmp_path):
    zero_bytes(copy / "4" / WEIGHTS)
    raw = config(tmp_path, resume_checkpoint_path="latest")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    message = one_error(launch(["train", "--config-file", "config.yaml"], tmp_path))
    assert message.startswith(f"checkpoint {copy / '4'} is damaged: {WEIGHTS} does not match its checksum"), message
    assert message.endswith(f"checkpoints.resume_checkpoint_path: {copy / '2'}"), message

    raw["checkpoints"]["resume_checkpoint_path"] = str(copy / "2")  # the way on the message names
    assert run_training(raw)["losses"] == trained[1][2:]
    assert (copy / LATEST).read_text().strip() == "4"
    verify_checkpoint(copy / "4")  # saved again, whole


def test_a_missing_optimizer_file_stops_the_resume_unless_load_optimizer_is_false(copy, tmp_path):
    (copy / "4" / "optimizer" / "rank-00000.safetensors").unlink()
    raw = config(tmp_path, resume_checkpoint_path="latest")
    raw["tokens"]["train_steps"] = 5
    with pytest.raises(CheckpointError, match="optimizer/rank-00000.safetensors is missing.*load_optimizer: false"):
        run_training(raw)
    raw["checkpoints"]["load_optimizer"] = False
    assert len(run_training(raw)["losses"]) == 1  # step 5, from step 4's weights with fresh moments


def test_checkpoint_verify_command(copy, tmp_path):
    good = launch(["checkpoint", "verify", str(copy)], tmp_path)
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith(f"ok {copy / '4'}\n")
    for line in (
        "manifest.json: 5 files",
        "meta.json: step 4",
        "config.yaml: parses",
        "model: ",
        "optimizer: ",
        "rng: ",
    ):
        assert f"\n  {line}" in good.stdout, good.stdout
    assert launch(["checkpoint", "verify", "--all", str(copy)], tmp_path).returncode == 0

    os.truncate(copy / "2" / WEIGHTS, 1000)
    assert launch(["checkpoint", "verify", str(copy)], tmp_path).returncode == 0  # latest (4) is whole
    message = one_error(launch(["checkpoint", "verify", str(copy / "2")], tmp_path))
    assert f"{WEIGHTS} has 1000 bytes" in message and f"no earlier complete checkpoint in {copy}" in message
    every = launch(["checkpoint", "verify", "--all", str(copy)], tmp_path)
    assert one_error(every) == f"1 of 2 checkpoints in {copy} are damaged: 2"
    assert f"ok {copy / '4'}" in every.stdout and f"DAMAGED: checkpoint {copy / '2'} is damaged" in every.stdout


FILL_THE_DISK = textwrap.dedent(
    """
    import resource, signal
    from nanocore import hookimpl

    @hookimpl
    def on_checkpoint_saved(step, path, trainer):
        if step == 2:  # from now on no file may grow past 100 kB: the next checkpoint cannot be written
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
    """
)


def test_a_disk_that_fills_up_mid_run_is_one_message_and_keeps_the_last_checkpoint(tmp_path):
    (tmp_path / "fill_the_disk.py").write_text(FILL_THE_DISK)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config(tmp_path)))
    result = launch(["train", "--config-file", "config.yaml", "--plugin", "fill_the_disk.py"], tmp_path)
    root = tmp_path / "checkpoints"
    message = one_error(result)
    assert message.startswith(f"could not save the checkpoint of step 4 in {root}: [Errno 27] File too large"), message
    assert f"the last good checkpoint ({root / '2'}) and latest.txt are as they were" in message
    assert sorted(p.name for p in root.iterdir()) == [".nanocore-lock", "2", LATEST]
    assert (root / LATEST).read_text().strip() == "2"
    verify_checkpoint(root / "2")


def dp2_config(tmp: Path, train_steps: int) -> dict:
    return tiny_config(
        tmp,
        parallelism={"dp": 2},
        optimizer={"zero_stage": 1},  # each rank writes its own optimizer file
        tokens={"train_steps": train_steps, "batch_accumulation_per_replica": 2},
        checkpoints={"checkpoint_interval": 2},
    )


def test_a_dp2_checkpoint_manifest_covers_both_ranks(tmp_path):
    run_training(dp2_config(tmp_path, 2), 2)
    folder = tmp_path / "checkpoints" / "2"
    files = json.loads((folder / "manifest.json").read_text())["files"]
    assert sorted(files) == [
        "config.yaml",
        "meta.json",
        "model/rank-00000.safetensors",  # dp rank 1 holds the same weights and writes none
        "optimizer/rank-00000.safetensors",  # ZeRO-1: each rank its rows
        "optimizer/rank-00001.safetensors",
        "rng/rank-00000.pt",
        "rng/rank-00001.pt",
    ]
    report = verify_checkpoint(folder)
    assert "by 2 file(s)" in report.checked[4] and report.checked[5] == "rng: 2 file(s) (checked by checksum)"


class FillTheDisk:
    """After the checkpoint of step 2, this process can write no file past 120 kB."""

    @hookimpl
    def on_checkpoint_saved(self, step, path, trainer):
        if step == 2:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (120_000, resource.RLIM_INFINITY))


def _rank_with_a_full_disk(rank: int, world_size: int, raw: dict) -> str | None:
    """Train on one rank of two, rank 1's disk filling up; the save's error, if any."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    plugins = load_plugins()
    if rank == 1:
        plugins.register_object(FillTheDisk(), "fill_the_disk")
    trainer = Trainer(LoadedConfig(structure_config(raw, plugins.registries), plugins, None))
    try:
        trainer.train()
    except CheckpointError as exc:
        return str(exc)
    finally:
        trainer.close()
    return None


def test_a_full_disk_on_one_rank_fails_the_save_on_both(tmp_path):
    root = tmp_path / "checkpoints"
    on_rank_0, on_rank_1 = run_ranks(2, _rank_with_a_full_disk, dp2_config(tmp_path, 4), timeout=600)
    assert on_rank_0.startswith(f"could not save the checkpoint of step 4 in {root}: another rank could not write")
    assert on_rank_1.startswith(f"could not save the checkpoint of step 4 in {root}: [Errno 27] File too large")
    assert sorted(p.name for p in root.iterdir()) == [".nanocore-lock", "2", LATEST]
    verify_checkpoint(root / "2")


def test_a_converted_checkpoint_has_a_manifest(tmp_path):
    from nanocore.hf_interop import from_hf
    from tests.helpers.hf_models import save_hf_llama

    report = verify_checkpoint(from_hf(save_hf_llama(tmp_path / "hf"), tmp_path / "converted"))
    assert report.has_manifest and report.checked[0].startswith("manifest.json: 3 files")


def _resume_rank(rank: int, world_size: int, raw: dict) -> str | None:
    """Resume on one rank of two; the message this rank stops with, if any."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    plugins = load_plugins()
    try:
        trainer = Trainer(LoadedConfig(structure_config(raw, plugins.registries), plugins, None))
    except CheckpointError as exc:
        return str(exc)
    trainer.close()
    return None


def test_two_ranks_share_the_check_and_stop_with_one_message(tmp_path):
    """dp2: rank r hashes every other file of the manifest; damage only rank 1 hashes stops both ranks alike."""
    run_training(dp2_config(tmp_path, 2), 2)
    folder = tmp_path / "checkpoints" / "2"
    files = sorted(json.loads((folder / "manifest.json").read_text())["files"])
    victim = next(name for i, name in enumerate(files) if i % 2 == 1 and name.endswith(".safetensors"))
    zero_bytes(folder / victim)
    raw = dp2_config(tmp_path, 4)
    raw["checkpoints"]["resume_checkpoint_path"] = str(tmp_path / "checkpoints")
    on_rank_0, on_rank_1 = run_ranks(2, _resume_rank, raw, timeout=600)
    assert on_rank_0 == on_rank_1, (on_rank_0, on_rank_1)
    assert f"checkpoint {folder} is damaged: {victim} does not match its checksum" in on_rank_0
