"""The training loop, generic over the parallel engine (a plugin).

Order of events: engine (processes, devices) -> model -> optimizer -> LR schedule -> data -> resume
-> loggers -> steps (with validation and checkpoints) -> final checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from nanocore.checkpoint.folder import (
    FORMAT_VERSION,
    begin_save,
    finish_save,
    load_rng,
    read_json,
    resolve_checkpoint,
    save_rng,
    write_json,
)
from nanocore.checkpoint.tensors import ShardReader, write_shards
from nanocore.config import Config, unstructure_config
from nanocore.config.load import LoadedConfig
from nanocore.convert import init_reader
from nanocore.data.api import DatasetContext
from nanocore.data.build import build_mixture, build_tokenizer, cache_dir, check_vocab
from nanocore.data.schedule import DataSchedule
from nanocore.engine_api import Engine
from nanocore.errors import NanocoreError, TrainingError
from nanocore.logging_api import LoggerContext
from nanocore.lr_schedule import LRSchedule
from nanocore.mfu import mfu, peak_flops_per_device

log = logging.getLogger("nanocore")


class Trainer:
    """Builds everything a run needs from a loaded config, then `train()` runs it."""

    def __init__(self, loaded: LoadedConfig):
        self.config: Config = loaded.config
        self.plugins = loaded.plugins
        self.registries = loaded.plugins.registries
        self.config_dir = loaded.path.resolve().parent if loaded.path else None
        cfg = self.config
        self.run_name = cfg.general.run.replace("%date", datetime.now().strftime("%Y%m%d_%H%M%S"))

        engine_entry = self.registries.parallel_engine.get(cfg.parallelism.engine)
        self.engine: Engine = engine_entry.factory(cfg, self.registries)
        self.tokenizer = build_tokenizer(cfg.tokenizer, self.registries)
        self.engine.setup_model(self.registries.model.get(cfg.model.model_type), cfg.model, cfg.general.seed)
        self.true_vocab_size = self.engine.true_vocab_size
        check_vocab(self.tokenizer, self.true_vocab_size)
        opt = cfg.optimizer
        self.engine.setup_optimizer(
            self.registries.optimizer.get(opt.optimizer_factory.name),
            self.registries.zero_stage.get(str(opt.zero_stage)),
            opt,
        )
        lr_args = opt.learning_rate_scheduler
        self.lr_schedule = LRSchedule(
            lr_args, cfg.tokens.train_steps, self.registries.lr_decay.get(lr_args.lr_decay_style).factory
        )
        self.data = self._data_schedule("dataset")
        self.validation = self._data_schedule("validation_dataset") if self._validating else None
        self.step = 0
        self.consumed_tokens = 0
        self.checkpoint_root = Path(cfg.checkpoints.checkpoints_path)
        self._maybe_resume()
        self.tokens_per_step = cfg.global_batch_size * cfg.tokens.sequence_length
        self._peak = peak_flops_per_device(self.engine.device, self.engine.dtype)
        self.loggers = self._make_loggers() if self.engine.is_main else []

    # -- construction ---------------------------------------------------------------------
    @property
    def _validating(self) -> bool:
        t = self.config.tokens
        return t.val_check_interval > 0 and t.limit_val_batches > 0

    def _data_schedule(self, key: str) -> DataSchedule:
        cfg = self.config
        stages = cfg.data_stages

        def build(index: int):
            stage = stages[index]
            seed = stage.data.seed if stage.data.seed is not None else cfg.general.seed
            ctx = DatasetContext(
                tokenizer=self.tokenizer,
                sequence_length=cfg.tokens.sequence_length,
                vocab_size=self.true_vocab_size,
                seed=seed,
                cache_dir=cache_dir(),
                is_main_process=self.engine.is_main,
                barrier=self.engine.barrier,
                split="train" if key == "dataset" else "validation",
            )
            log.info("data stage %r (%s): building datasets", stage.name, ctx.split)
            return build_mixture(getattr(stage.data, key), ctx, self.registries, seed)

        return DataSchedule(
            [s.name for s in stages],
            [s.start_training_step for s in stages],
            build,
            global_batch_size=cfg.global_batch_size,
            micro_batch_size=cfg.tokens.micro_batch_size,
            dp_rank=self.engine.dp_rank,
            dp_size=self.engine.dp_size,
        )

    def _make_loggers(self) -> list[Any]:
        cfg = self.config
        ctx = LoggerContext(
            log_dir=Path(cfg.logging.log_dir),
            project=cfg.general.project,
            run_name=self.run_name,
            config=cfg,
            config_dict=unstructure_config(cfg),
            start_step=self.step,
            total_steps=cfg.tokens.train_steps,
        )
        return [self.registries.logger.get(s.name).factory(s.options, ctx) for s in cfg.logging.loggers]

    # -- checkpoints ----------------------------------------------------------------------
    def _maybe_resume(self) -> None:
        cfg = self.config.checkpoints
        path = cfg.resume_checkpoint_path
        if path and Path(path).resolve() == self.checkpoint_root.resolve() and not (Path(path) / "latest.txt").exists():
            log.info("no checkpoint in %s yet: starting from scratch", path)
            path = None
        if not path:
            init = self.config.model.init_method.path
            if init:  # a nanocore checkpoint or a Hugging Face folder
                self.engine.load_model(init_reader(init, self.config.model, self.registries))
                log.info("initialised weights from %s", init)
            return
        folder = resolve_checkpoint(path)
        meta = read_json(folder / "meta.json")
        self.engine.load_model(ShardReader(folder / "model"))
        if cfg.load_optimizer:
            self.engine.load_optimizer(ShardReader(folder / "optimizer"))
        if cfg.load_lr_scheduler:
            self.lr_schedule.load_state_dict(meta["lr_scheduler"])
        self.data.load_state_dict(meta["data"])
        self.step = int(meta["step"])
        self.consumed_tokens = int(meta["consumed_tokens"])
        same_layout = meta["topology"]["world_size"] == self.engine.world_size
        if not (same_layout and load_rng(folder, self.engine.rank)):
            log.info("RNG states not restored (checkpoint written by %d ranks)", meta["topology"]["world_size"])
        if self.engine.is_main:
            log.info("resumed from %s at step %d", folder, self.step)

    def save_checkpoint(self) -> Path:
        engine, cfg = self.engine, self.config
        tmp = begin_save(self.checkpoint_root, self.step, engine.is_main, engine.barrier)
        rank_file = f"rank-{engine.rank:05d}.safetensors"
        write_shards(tmp / "model" / rank_file, engine.model_shards())
        write_shards(tmp / "optimizer" / rank_file, engine.optimizer_shards())
        save_rng(tmp, engine.rank)
        if engine.is_main:
            par = cfg.parallelism
            meta = {
                "format_version": FORMAT_VERSION,
                "step": self.step,
                "consumed_tokens": self.consumed_tokens,
                "topology": {"dp": par.dp, "tp": par.tp, "pp": par.pp, "world_size": engine.world_size},
                "data": self.data.state_dict(),
                "lr_scheduler": self.lr_schedule.state_dict(),
                "model_type": cfg.model.model_type,
            }
            write_json(tmp / "meta.json", meta)
            (tmp / "config.yaml").write_text(yaml.safe_dump(self._portable_config(), sort_keys=False))
        folder = finish_save(self.checkpoint_root, self.step, engine.is_main, engine.barrier)
        if engine.is_main:
            log.info("saved checkpoint %s", folder)
        self.plugins.hook.on_checkpoint_saved(step=self.step, path=folder, trainer=self)
        return folder

    def _portable_config(self) -> dict:
        """The config as trained, with local plugin files made absolute so the checkpoint stands alone."""
        data = unstructure_config(self.config)
        resolved = []
        for spec in data.get("plugins", []):
            path = Path(spec)
            if self.config_dir is not None and (spec.endswith(".py") or "/" in spec) and not path.is_absolute():
                path = self.config_dir / path
                spec = str(path.resolve()) if path.exists() else spec
            resolved.append(spec)
        data["plugins"] = resolved
        return data

    # -- the loop -------------------------------------------------------------------------
    def _log(self, metrics: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_metrics(self.step, metrics)

    def validate(self) -> float:
        assert self.validation is not None
        stage = self.validation.stage_index(self.step + 1 if self.step == 0 else self.step)
        mixture = self.validation.mixture(stage)
        g = self.config.global_batch_size
        losses = [
            self.engine.eval_loss(self.validation.micro_batches(mixture, b * g))
            for b in range(self.config.tokens.limit_val_batches)
        ]
        loss = sum(losses) / len(losses)
        metrics = {"step": self.step, "val_lm_loss": loss}
        self._log(metrics)
        self.plugins.hook.on_validation_end(step=self.step, metrics=metrics, trainer=self)
        return loss

    def train(self) -> list[float]:
        """Run to `tokens.train_steps`; returns this launch's per-step losses."""
        cfg = self.config
        losses: list[float] = []
        self.plugins.hook.on_train_start(config=cfg, trainer=self)
        try:
            if cfg.checkpoints.save_initial_state and self.step == 0:
                self.save_checkpoint()
            interval = max(1, cfg.logging.iteration_step_info_interval)
            while self.step < cfg.tokens.train_steps:
                step = self.step + 1
                micro_batches = self.data.next_batch(step)
                # the schedule counts its own steps: equal to `step` unless a resume restarted it
                # (checkpoints.load_lr_scheduler: false), which begins a fresh warmup and decay
                lr = self.lr_schedule.lr_at(self.lr_schedule.step + 1)
                start = time.perf_counter()
                out = self.engine.train_step(micro_batches, lr)
                elapsed = time.perf_counter() - start
                if out.skipped or not math.isfinite(out.loss):
                    last = self.checkpoint_root / "latest.txt"
                    where = f"the last good checkpoint is {last.read_text().strip()} in {self.checkpoint_root}" if last.exists() else "no checkpoint was written yet"
                    raise TrainingError(
                        f"loss is {out.loss} at step {step}: training stopped before updating the weights; {where}. "
                        "Lower optimizer.learning_rate_scheduler.learning_rate, set optimizer.clip_grad, or check the data."
                    )
                self.step = step
                self.lr_schedule.step += 1
                self.consumed_tokens += self.tokens_per_step
                losses.append(out.loss)
                metrics = self._metrics(out, lr, elapsed)
                if step % interval == 0 or step == cfg.tokens.train_steps:
                    self._log(metrics)
                if self.validation is not None and step % cfg.tokens.val_check_interval == 0:
                    self.validate()
                every = cfg.checkpoints.checkpoint_interval
                if every > 0 and step % every == 0:
                    self.save_checkpoint()
                self.plugins.hook.on_step_end(step=step, metrics=metrics, trainer=self)
            if cfg.checkpoints.save_final_state and not (
                cfg.checkpoints.checkpoint_interval > 0 and self.step % cfg.checkpoints.checkpoint_interval == 0
            ):
                self.save_checkpoint()
        finally:
            self.plugins.hook.on_train_end(step=self.step, trainer=self)
            for logger in self.loggers:
                logger.close()
        return losses

    def _metrics(self, out: Any, lr: float, elapsed: float) -> dict[str, Any]:
        tokens_per_sec = self.tokens_per_step / max(elapsed, 1e-9)
        per_device = tokens_per_sec / self.engine.world_size
        metrics: dict[str, Any] = {
            "step": self.step,
            "lm_loss": out.loss,
            "lr": lr,
            "grad_norm": out.grad_norm,
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_gpu": per_device,
            "consumed_tokens": self.consumed_tokens,
        }
        value = mfu(self.engine.flops_per_token(self.config.tokens.sequence_length), per_device, self._peak)
        if value is not None:
            metrics["mfu"] = value
        return metrics

    def close(self) -> None:
        self.engine.shutdown()


def run_training(loaded: LoadedConfig) -> list[float]:
    trainer = Trainer(loaded)
    try:
        return trainer.train()
    finally:
        trainer.close()


__all__ = ["Trainer", "run_training", "NanocoreError"]
