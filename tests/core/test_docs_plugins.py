"""docs/plugins.md works as written: its runnable code blocks (```python starting with `# docs-test: <name>`)
are written to files and used as plugins (the model, dataset, logger and observer train two steps together
through the real trainer; the schedule goes through the pipeline simulator and the config checks), and its
hook and registry references name every hook and every registry the code declares."""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.config.load import load_config
from nanocore.errors import ConfigError
from nanocore.hookspecs import NanocoreSpecs
from nanocore.pipeline_sim import simulate
from nanocore.plugins import hook_names, load_plugins
from nanocore.registry import REGISTRY_KINDS
from nanocore.trainer import Trainer, run_training
from tests.helpers.distributed import run_ranks

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
BLOCK = re.compile(r"^```python\n# docs-test: (\w+)\n(.*?)^```$", re.S | re.M)
TEXT = "hello nanocore "
COPIES = 50
SEQ = 16


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("NANOCORE_PLUGINS", "NANOCORE_DISABLE_PLUGINS", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def blocks(tmp_path_factory) -> dict[str, Path]:
    """Each runnable block as a plugin file `docs_<name>.py`."""
    folder = tmp_path_factory.mktemp("docs_plugins")
    files: dict[str, Path] = {}
    for name, code in BLOCK.findall(DOC.read_text()):
        assert name not in files, f"two blocks are named {name!r}"
        files[name] = folder / f"docs_{name}.py"
        files[name].write_text(code)
    assert sorted(files) == ["dataset", "logger", "model", "observer", "optimizer", "parts_model", "schedule"]
    return files


def write_config(folder: Path, **parallelism: object) -> Path:
    config = {
        "general": {"project": "docs", "run": "plugins", "seed": 1},
        "parallelism": parallelism,
        "model": {
            "dtype": "float32",
            "model_config": {"model_type": "tiny_mlp", "vocab_size": 257, "hidden_size": 32, "mlp_size": 64},
        },
        "tokenizer": {"tokenizer_name_or_path": "byte"},
        "tokens": {
            "sequence_length": SEQ,
            "train_steps": 2,
            "micro_batch_size": 2,
            "batch_accumulation_per_replica": 2,
        },
        "optimizer": {"learning_rate_scheduler": {"learning_rate": 0.01, "lr_warmup_steps": 0}},
        "data_stages": [
            {
                "name": "stable",
                "start_training_step": 1,
                "data": {"dataset": {"format": "repeated_text", "text": TEXT, "copies": COPIES}},
            }
        ],
        "checkpoints": {"checkpoints_path": str(folder / "checkpoints"), "save_final_state": False},
        "logging": {"log_dir": str(folder / "logs"), "loggers": [{"name": "loss_file", "filename": "loss.txt"}]},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "docs.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_model_dataset_logger_and_observer_blocks_train_together(blocks, tmp_path):
    plugins = [str(blocks[name]) for name in ("model", "dataset", "logger", "observer")]
    loaded = load_config(write_config(tmp_path), plugins)
    trainer = Trainer(loaded)
    batches: list[torch.Tensor] = []
    train_step = trainer.engine.train_step

    def recording_train_step(micro_batches, lr):
        batches.extend(micro_batches)
        return train_step(micro_batches, lr)

    trainer.engine.train_step = recording_train_step
    try:
        losses = trainer.train()
        names = {shard.name for shard in trainer.engine.model_shards()}
    finally:
        trainer.close()

    # the model: tiny_mlp's parameters were trained
    assert {"embed.weight", "block.up.weight", "block.down.weight", "norm.weight", "head.weight"} <= names
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert abs(losses[0] - math.log(257)) < 0.1  # a fresh model guesses among the 257 byte tokens
    # the dataset: every sample the steps used is a window of the repeated text
    stream = (list(TEXT.encode()) + [256]) * COPIES
    windows = [stream[i : i + SEQ + 1] for i in range(0, len(stream) - SEQ, SEQ + 1)]
    samples = [row.tolist() for batch in batches for row in batch]
    assert len(samples) == 2 * 4  # 2 steps x 2 micro-batches x 2 samples
    assert all(sample in windows for sample in samples)
    # the logger: one line per step
    lines = (tmp_path / "logs" / "loss.txt").read_text().splitlines()
    assert lines == [f"{step} {loss:.6f}" for step, loss in enumerate(losses, start=1)]
    # the observer: the best loss of the run
    best = min(range(2), key=lambda i: losses[i])
    assert (tmp_path / "logs" / "best_loss.txt").read_text() == f"{losses[best]:.6f} at step {best + 1}\n"


def test_schedule_block_passes_the_simulator_and_the_config_checks(blocks):
    registries = load_plugins([str(blocks["schedule"])]).registries
    entry = registries.pipeline_schedule.get("afab_lifo")
    schedule = entry.factory(None)
    for p in (1, 2, 4):
        for m in (1, 3, 8):
            result = simulate(schedule, p, m)  # raises on a missing action or a deadlock
            assert result.bubble_fraction == pytest.approx(schedule.theoretical_bubble(p, m, 1))
            assert result.peak_in_flight == [m] * p
    assert [str(a) for a in schedule.actions(2, 0, 3, 1)] == ["F0", "F1", "F2", "B2", "B1", "B0"]

    raw = {
        "model": {"model_config": {"model_type": "llama", "num_hidden_layers": 4}},
        "parallelism": {"pp": 2, "pp_engine": "afab_lifo", "pp_virtual_stages": 2},
        "tokens": {"batch_accumulation_per_replica": 4},
    }
    with pytest.raises(ConfigError) as err:
        check_config(structure_config(raw, registries), registries, world_size=None)
    assert err.value.problems == ["parallelism.pp_virtual_stages: afab_lifo runs one chunk per rank; set it to 1"]
    raw["parallelism"]["pp_virtual_stages"] = 1
    check_config(structure_config(raw, registries), registries, world_size=None)


def _train_rank(rank: int, world_size: int, config: str, plugins: list[str]) -> list[float]:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    return run_training(load_config(config, plugins))


@pytest.mark.slow
def test_model_block_tp_plan_and_schedule_block_train_like_one_process(blocks, tmp_path):
    """What the doc says of tiny_mlp's tp_plan and of afab_lifo holds on real ranks: the same losses as one process."""
    plugins = [str(blocks[name]) for name in ("model", "dataset", "logger", "schedule")]
    reference = run_training(load_config(write_config(tmp_path / "one"), plugins))
    layouts = {
        "tp2-sequence-parallel": {"tp": 2, "tp_mode": "REDUCE_SCATTER"},
        "pp2-afab_lifo": {"pp": 2, "pp_engine": "afab_lifo"},
    }
    for name, parallelism in layouts.items():
        config = str(write_config(tmp_path / name, **parallelism))
        losses = run_ranks(2, _train_rank, config, plugins, timeout=300)[0]
        assert losses == pytest.approx(reference, rel=1e-5), name


@pytest.mark.slow
def test_optimizer_block_distributes_itself_through_the_core_contract(blocks, tmp_path):
    """`normalized_sgd` normalises by the whole parameter's gradient norm from the `ParamPiece`s the ZeRO
    stage hands it: dp2 with ZeRO-1 (rows) and tp2 (pieces) train like one process, where a per-rank
    norm would take longer steps (a step of lr per piece instead of per parameter)."""
    plugins = [str(blocks[name]) for name in ("model", "dataset", "logger", "optimizer")]

    def config(name: str, zero: int = 0, **parallelism: object) -> str:
        path = write_config(tmp_path / name, **parallelism)
        raw = yaml.safe_load(path.read_text())
        raw["optimizer"]["optimizer_factory"] = {"name": "normalized_sgd", "eps": 1e-8}
        raw["optimizer"]["zero_stage"] = zero
        raw["optimizer"]["learning_rate_scheduler"]["learning_rate"] = 0.5
        raw["tokens"]["train_steps"] = 4
        raw["tokens"]["batch_accumulation_per_replica"] = 2 // parallelism.get("dp", 1)  # type: ignore[operator]
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return str(path)

    reference = run_training(load_config(config("one"), plugins))
    assert reference[0] - reference[-1] > 0.05, reference  # it trains
    for name, zero, parallelism in (("dp2_zero1", 1, {"dp": 2}), ("tp2", 0, {"tp": 2, "tp_mode": "ALL_REDUCE"})):
        losses = run_ranks(2, _train_rank, config(name, zero, **parallelism), plugins, timeout=300)[0]
        assert losses == pytest.approx(reference, rel=1e-5), name


def section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


@pytest.mark.slow
def test_parts_model_block_trains_at_tp2_like_one_process(blocks, tmp_path):
    """The third-party model composed from the shared parts: its head norms are in the TP plan, and it
    trains at tp2 (where those norms need their gradients summed) as on one process."""
    plugins = [str(blocks[name]) for name in ("parts_model", "dataset", "logger")]
    model = {"model_type": "qk_llama", "vocab_size": 257, "hidden_size": 32, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 12, "intermediate_size": 64, "num_hidden_layers": 2}  # fmt: skip
    configs = {}
    for name, parallelism in {"one": {}, "tp2": {"tp": 2, "tp_mode": "ALL_REDUCE"}}.items():
        path = write_config(tmp_path / name, **parallelism)
        config = yaml.safe_load(path.read_text())
        config["model"]["model_config"] = model
        config["tokens"]["train_steps"] = 8  # enough updates for the head norms' gradients to show
        config["optimizer"]["learning_rate_scheduler"]["learning_rate"] = 0.03
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        configs[name] = path
    reference = run_training(load_config(configs["one"], plugins))
    losses = run_ranks(2, _train_rank, str(configs["tp2"]), plugins, timeout=300)[0]
    assert losses == pytest.approx(reference, rel=1e-5)


def test_hook_reference_lists_every_hook_with_its_arguments():
    reference = section("Hook reference")
    for name in hook_names():
        arguments = list(inspect.signature(getattr(NanocoreSpecs, name)).parameters)[1:]  # without self
        assert f"`{name}({', '.join(arguments)})`" in reference, name
    assert sorted(re.findall(r"^\| `(\w+)\(", reference, re.M)) == hook_names()


def test_registry_reference_lists_every_registry_with_its_hook():
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \|.*\| ([^|]+) \|$", section("Registry reference"), re.M)
    assert {kind: hook for kind, hook, _ in rows} == {kind: spec.hook for kind, spec in REGISTRY_KINDS.items()}
    assert len(rows) == len(REGISTRY_KINDS)
    for kind, _, extras in rows:  # the extras column names exactly what the kind accepts
        assert sorted(re.findall(r"`(\w+)`", extras)) == sorted(REGISTRY_KINDS[kind].extras), kind
