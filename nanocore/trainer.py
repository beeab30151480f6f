"""The training loop, generic over the parallel engine (a plugin).

Order of events: engine (processes, devices) -> model -> optimizer -> LR schedule -> data -> resume
-> loggers -> steps (with validation and checkpoints) -> final checkpoint.
"""

from __future__ import annotations

import logging
import math
import signal
import time
import traceback
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from nanocore.checkpoint.background import BackgroundWrite, HostBuffers, rng_bytes
from nanocore.checkpoint.folder import begin_save, finish_save, load_rng, resolve_checkpoint, save_rng, step_folder
from nanocore.checkpoint.meta import CheckpointMeta, Topology, write_meta
from nanocore.checkpoint.tensors import ShardReader, write_shards
from nanocore.checkpoint.verify import verify_for_resume
from nanocore.config import Config, unstructure_config
from nanocore.config.load import LoadedConfig
from nanocore.data.build import build_tokenizer, check_vocab, document_separator, stage_mixture
from nanocore.data.mixture import Mixture
from nanocore.data.schedule import DataSchedule
from nanocore.engine_api import Engine
from nanocore.errors import NanocoreError, TrainingError, TrainingInterrupted, explain_collective_failure
from nanocore.hardware import load_hardware
from nanocore.hf_interop import init_reader, is_hf_folder
from nanocore.launch_env import launch_env
from nanocore.logging_api import LoggerContext
from nanocore.lr_schedule import LRSchedule
from nanocore.memory import MemoryMeter, return_freed_memory
from nanocore.mfu import Peak, mfu, mfu_peak, remeasure_cpu_probe
from nanocore.plugins import is_plugin_file
from nanocore.run_folders import clear_for_overwrite, plan_run_folders
from nanocore.run_lock import FolderLocks, lock_run_folders
from nanocore.signals import StopRequests
from nanocore.spike_guard import SpikeGuard
from nanocore.summary import RunFacts, run_summary

log = logging.getLogger("nanocore")


class Trainer:
    """Builds everything a run needs from a loaded config, then `train()` runs it."""

    def __init__(self, loaded: LoadedConfig):
        self.config: Config = loaded.config
        self.plugins = loaded.plugins
        self.registries = loaded.plugins.registries
        self.config_dir = loaded.path.resolve().parent if loaded.path else None
        self.overrides = list(loaded.overrides)
        cfg = self.config
        self.run_name = cfg.general.run.replace("%date", datetime.now().strftime("%Y%m%d_%H%M%S"))
        self.run_id = uuid.uuid4().hex[:16]  # replaced by the checkpoint's when this run continues
        # Decided before any process group exists: a refusal leaves everything on disk as it was.
        self.folders = plan_run_folders(cfg)
        self.folder_locks = FolderLocks()
        self.loggers: list[Any] = []
        self._closed = False
        self._pending: BackgroundWrite | None = None  # an asynchronous checkpoint being written
        self._host_model, self._host_optimizer = HostBuffers(), HostBuffers()  # its copies (async_save)
        try:
            if launch_env().rank == 0:  # holds the folders for the whole launch (nanocore/run_lock.py)
                self.folder_locks = lock_run_folders(
                    {"checkpoints.checkpoints_path": self.folders.checkpoints, "logging.log_dir": self.folders.log_dir},
                    cfg.checkpoints.folder_lock,
                    self.run_name,
                )
                # again, now that no other run can start here: one that ended while this run was
                # starting may have left checkpoints, and `latest` may have moved
                self.folders = plan_run_folders(cfg)
            self.checkpoint_root = self.folders.checkpoints
            engine_entry = self.registries.parallel_engine.get(cfg.parallelism.engine)
            self.engine: Engine = engine_entry.factory(cfg, self.registries)
        except BaseException:
            self.folder_locks.release()
            raise
        try:
            self._build()
        except BaseException as exc:
            # the frames of a failed build hold the model's layers, and through them process groups
            traceback.clear_frames(exc.__traceback__)
            self.close()
            raise

    def _build(self) -> None:
        cfg, engine = self.config, self.engine
        return_freed_memory()  # freed host buffers leave the resident set (nanocore/memory.py)
        self.memory = MemoryMeter(engine.device)  # after start-up, before the run holds anything
        self.tokenizer = build_tokenizer(cfg.tokenizer, self.registries)
        if cfg.tokens.document_masking:
            engine.set_document_separator(document_separator(self.tokenizer))
        engine.setup_model(self.registries.model.get(cfg.model.model_type), cfg.model, cfg.general.seed)
        self.true_vocab_size = engine.true_vocab_size
        check_vocab(self.tokenizer, self.true_vocab_size)
        opt = cfg.optimizer
        engine.setup_optimizer(
            self.registries.optimizer.get(opt.optimizer_factory.name),
            self.registries.zero_stage.get(str(opt.zero_stage)),
            opt,
        )
        lr_args = opt.learning_rate_scheduler
        self.guard = SpikeGuard(opt.skip_spikes) if opt.skip_spikes.enabled else None
        self.lr_schedule = LRSchedule(
            lr_args, cfg.tokens.train_steps, self.registries.lr_decay.get(lr_args.lr_decay_style).factory
        )
        self.data = self._data_schedule("dataset")
        self.validation = self._data_schedule("validation_dataset") if self._validating else None
        self.step = 0
        self.consumed_tokens = 0
        self._maybe_resume()
        if self.folders.overwrite and engine.is_main:
            clear_for_overwrite(self.folders)
        self.tokens_per_step = cfg.global_batch_size * cfg.tokens.sequence_length
        hardware = load_hardware(cfg.general.hardware) if cfg.general.hardware is not None else None
        self._peak: Peak | None = mfu_peak(engine.device, engine.dtype, hardware)
        summary = run_summary(self._facts())  # every rank takes part: it gathers per-rank sizes
        if engine.is_main:
            log.info("%s", summary)
            self.loggers = self._make_loggers()

    # -- construction ---------------------------------------------------------------------
    def _facts(self) -> RunFacts:
        """What the start-of-run summary reports about this run, once everything is built."""
        return RunFacts(
            config=self.config,
            registries=self.registries,
            plugin_infos=self.plugins.list(),
            engine=self.engine,
            data=self.data,
            folders=self.folders,
            run_name=self.run_name,
            run_id=self.run_id,
            overrides=self.overrides,
            step=self.step,
            tokens_per_step=self.tokens_per_step,
            peak=self._peak,
        )

    @property
    def _validating(self) -> bool:
        t = self.config.tokens
        return t.val_check_interval > 0 and t.limit_val_batches > 0

    def _data_schedule(self, key: str) -> DataSchedule:
        cfg = self.config
        stages = cfg.data_stages

        def build(index: int) -> Mixture:
            split = "train" if key == "dataset" else "validation"
            log.info("data stage %r (%s): building datasets", stages[index].name, split)
            return stage_mixture(
                cfg,
                index,
                key,
                self.tokenizer,
                self.true_vocab_size,
                self.registries,
                is_main=self.engine.is_main,
                barrier=self.engine.barrier,
                config_dir=self.config_dir,
            )

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
            append=self.folders.continues,
            run_id=self.run_id,
        )
        return [self.registries.logger.get(s.name).factory(s.options, ctx) for s in cfg.logging.loggers]

    # -- checkpoints ----------------------------------------------------------------------
    def _maybe_resume(self) -> None:
        cfg = self.config.checkpoints
        # resolved (`latest` included) before the engine was made; rank 0 resolved it again once it held
        # the folders (nanocore/run_lock.py), so its answer is the one every rank takes
        self.folders = self.engine.all_gather_object(self.folders)[0]
        folder = self.folders.resume_from
        if folder is None:
            if self.folders.continues:
                log.info("no checkpoint in %s yet: starting from scratch", self.checkpoint_root)
            init = self.config.model.init_method.path
            if init:  # a nanocore checkpoint or a Hugging Face folder
                if not is_hf_folder(init):
                    self._verify(resolve_checkpoint(init), load_optimizer=False)
                self.engine.load_model(init_reader(init, self.config.model, self.registries))
                log.info("initialised weights from %s", init)
            return
        meta = self._verify(folder, load_optimizer=cfg.load_optimizer)
        if self.folders.continues and meta.run_id:
            self.run_id = meta.run_id  # the same run goes on: loggers such as W&B continue it
        self.engine.load_model(ShardReader(folder / "model"))
        if cfg.load_optimizer:
            self.engine.load_optimizer(ShardReader(folder / "optimizer"))
        elif self.engine.is_main:
            log.info("optimizer state not loaded (checkpoints.load_optimizer: false): it starts afresh")
        if cfg.load_lr_scheduler:
            self.lr_schedule.load_state_dict(meta.lr_scheduler)
        self.data.load_state_dict(meta.data)
        if self.guard is not None and meta.spike_guard:
            self.guard.load_state_dict(meta.spike_guard)
        self.step = meta.step
        self.consumed_tokens = meta.consumed_tokens
        same_layout = meta.topology.world_size == self.engine.world_size
        if not (same_layout and load_rng(folder, self.engine.rank)):
            log.info("RNG states not restored (checkpoint written by %d ranks)", meta.topology.world_size)
        if self.engine.is_main:
            log.info("resumed from %s at step %d", folder, self.step)

    def _verify(self, folder: Path, load_optimizer: bool) -> CheckpointMeta:
        """Every rank checks its share of the checkpoint's checksums; all stop with one message on damage."""
        engine = self.engine
        return verify_for_resume(
            folder,
            rank=engine.rank,
            world_size=engine.world_size,
            gather=engine.all_gather_object,
            load_optimizer=load_optimizer,
        )

    def save_checkpoint(self) -> Path:
        """Save this step (`checkpoints.async_save`: start saving it; the folder appears once every rank's
        background write is done, see `nanocore.checkpoint.background`). Returns the step's folder."""
        engine, cfg = self.engine, self.config
        background = cfg.checkpoints.async_save
        if background:
            self.wait_for_checkpoint()  # at most one save in flight
        # a write failing on one rank (a full disk) fails the save on every rank with one message
        tmp = begin_save(self.checkpoint_root, self.step, engine.is_main, engine.barrier, engine.all_ranks_ok)
        failure = None
        try:
            if background:
                model = self._host_model.copy(engine.model_shards())
                optimizer = self._host_optimizer.copy(engine.optimizer_shards())
                self._pending = BackgroundWrite(tmp, self.step, engine.rank, model, optimizer, rng_bytes())
            else:
                rank_file = f"rank-{engine.rank:05d}.safetensors"
                write_shards(tmp / "model" / rank_file, engine.model_shards())
                write_shards(tmp / "optimizer" / rank_file, engine.optimizer_shards())
                save_rng(tmp, engine.rank)
            if engine.is_main:
                par = cfg.parallelism
                meta = CheckpointMeta(
                    step=self.step,
                    consumed_tokens=self.consumed_tokens,
                    topology=Topology(
                        dp=par.dp, tp=par.tp, pp=par.pp, cp=par.context_parallel_size, world_size=engine.world_size
                    ),
                    data=self.data.state_dict(),
                    lr_scheduler=self.lr_schedule.state_dict(),
                    model_type=cfg.model.model_type,
                    run_id=self.run_id,
                    spike_guard=self.guard.state_dict() if self.guard is not None else None,
                )
                write_meta(tmp, meta)
                (tmp / "config.yaml").write_text(yaml.safe_dump(self._portable_config(), sort_keys=False))
        except Exception as exc:  # handed to finish_save, which tells every rank
            failure = exc
        if background and failure is None:
            return step_folder(self.checkpoint_root, self.step)
        return self._seal(self.step, failure, part_written=False)

    def _seal(self, step: int, failure: BaseException | None, part_written: bool) -> Path:
        engine = self.engine
        folder = finish_save(
            self.checkpoint_root,
            step,
            engine.is_main,
            engine.barrier,
            rank=engine.rank,
            failure=failure,
            agree=engine.all_ranks_ok,
            keep_last_n=self.config.checkpoints.keep_last_n,
            part_written=part_written,
        )
        if engine.is_main:
            log.info("saved checkpoint %s", folder)
        self.plugins.hook.on_checkpoint_saved(step=step, path=folder, trainer=self)
        return folder

    def _poll_checkpoint(self) -> None:
        """While a background save is in flight: seal it once every rank has written its part (one small
        agreement per step, the same on every rank)."""
        pending = self._pending
        if pending is not None and self.engine.all_ranks_ok(pending.done()):
            self.wait_for_checkpoint()

    def wait_for_checkpoint(self) -> Path | None:
        """Wait for the background save in flight, if any, and seal it on every rank (a collective: every
        rank calls it at the same point). Returns its folder."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if self.engine.is_main and not pending.done():
            log.info("waiting for the checkpoint of step %d to be written", pending.step)
        pending.wait()
        return self._seal(pending.step, pending.error, part_written=True)

    def _abandon_checkpoint(self) -> None:
        """The run stops on an error: let the background write finish (its thread joined) but do not seal
        it, since the ranks may not be able to agree; `latest.txt` keeps naming the last complete save."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
            log.warning(
                "the checkpoint of step %d written in the background was not completed (the run stopped on an "
                "error); the latest complete checkpoint is the one %s names",
                pending.step,
                self.checkpoint_root / "latest.txt",
            )

    def _portable_config(self) -> dict:
        """The config as trained, with local plugin files made absolute so the checkpoint stands alone."""
        data = unstructure_config(self.config)
        resolved = []
        for spec in data.get("plugins", []):
            path = Path(spec)
            if self.config_dir is not None and is_plugin_file(spec) and not path.is_absolute():
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
        """Run to `tokens.train_steps`; returns this launch's per-step losses.

        SIGTERM / SIGINT end the run after the current step with a checkpoint (`TrainingInterrupted`).
        """
        cfg = self.config
        losses: list[float] = []
        self.plugins.hook.on_train_start(config=cfg, trainer=self)
        try:
            with StopRequests() as stops:
                if cfg.checkpoints.save_initial_state and self.step == 0:
                    self.save_checkpoint()
                interval = max(1, cfg.logging.iteration_step_info_interval)
                self.memory.reset()
                while self.step < cfg.tokens.train_steps:
                    saved = self._train_one_step(losses, interval)
                    if self._agree_to_stop(stops):
                        folder = saved or self.save_checkpoint()
                        self.wait_for_checkpoint()
                        raise TrainingInterrupted(stops.signal_number or signal.SIGTERM, self.step, folder)
                if cfg.checkpoints.save_final_state and not (
                    cfg.checkpoints.checkpoint_interval > 0 and self.step % cfg.checkpoints.checkpoint_interval == 0
                ):
                    self.save_checkpoint()
                self.wait_for_checkpoint()
        except Exception as exc:
            explained = explain_collective_failure(exc, cfg.parallelism.collective_timeout_seconds)
            if explained is None:
                raise
            raise explained from exc
        finally:
            self._abandon_checkpoint()  # any way out, KeyboardInterrupt too: a write in flight is finished, not sealed
            self.plugins.hook.on_train_end(step=self.step, trainer=self)
            self._close_loggers()
        return losses

    def _train_one_step(self, losses: list[float], interval: int) -> Path | None:
        """One optimizer step with its logging, validation, checkpoint and hooks; the checkpoint saved, if any."""
        cfg = self.config
        step = self.step + 1
        micro_batches = self.data.next_batch(step)
        # the schedule counts its own steps: equal to `step` unless a resume restarted it
        # (checkpoints.load_lr_scheduler: false), which begins a fresh warmup and decay
        lr = self.lr_schedule.lr_at(self.lr_schedule.step + 1)
        start = time.perf_counter()
        if self.guard is None:  # an engine written before the guard existed takes two arguments
            out = self.engine.train_step(micro_batches, lr)
        else:
            out = self.engine.train_step(micro_batches, lr, guard=self.guard)
        elapsed = time.perf_counter() - start
        if self.guard is None and (out.skipped or not math.isfinite(out.loss)):
            what = f"loss is {out.loss}" if not math.isfinite(out.loss) else f"gradient norm is {out.grad_norm}"
            raise TrainingError(
                f"{what} at step {step}: training stopped before updating the weights; {self._last_good()}. Lower "
                "optimizer.learning_rate_scheduler.learning_rate, set optimizer.clip_grad or optimizer.skip_spikes, "
                "or check the data."
            )
        if out.skipped:
            self._skipped(step)
        self.step = step
        self.lr_schedule.step += 1
        self.consumed_tokens += self.tokens_per_step
        losses.append(out.loss)
        metrics = self._metrics(out, lr, elapsed)
        if step % interval == 0 or step == cfg.tokens.train_steps or out.skipped:  # a skipped step always shows
            self._log(metrics)
            self.memory.reset()  # each row's peak is the peak since the previous row
        if self.validation is not None and step % cfg.tokens.val_check_interval == 0:
            self.validate()
        self._poll_checkpoint()  # seal a background save once every rank has written its part
        saved = None
        every = cfg.checkpoints.checkpoint_interval
        if every > 0 and step % every == 0:
            saved = self.save_checkpoint()
        self.plugins.hook.on_step_end(step=step, metrics=metrics, trainer=self)
        return saved

    def _last_good(self) -> str:
        last = self.checkpoint_root / "latest.txt"
        if last.exists():
            return f"the last good checkpoint is {last.read_text().strip()} in {self.checkpoint_root}"
        return "no checkpoint was written yet"

    def _skipped(self, step: int) -> None:
        """The guard rejected step `step`: no update was made. Say so, and stop after too many in a row."""
        assert self.guard is not None
        why = self.guard.last.reason
        if self.engine.is_main:
            log.warning("step %d skipped, no update made: %s (%d in a row)", step, why, self.guard.consecutive)
        if self.guard.exhausted:
            raise TrainingError(
                f"{self.guard.consecutive} steps in a row were skipped (optimizer.skip_spikes.max_consecutive), the "
                f"last at step {step}: {why}; training stopped. The weights are those before the first of them; "
                f"{self._last_good()}. Lower optimizer.learning_rate_scheduler.learning_rate, set optimizer.clip_grad, "
                "or check the data."
            )

    def _agree_to_stop(self, stops: StopRequests) -> bool:
        """True on every rank once any rank got SIGTERM/SIGINT (signals reach ranks at different steps)."""
        if self.engine.world_size == 1:
            return stops.requested
        return not self.engine.all_ranks_ok(not stops.requested)

    def _metrics(self, out: Any, lr: float, elapsed: float) -> dict[str, Any]:
        tokens_per_sec = self.tokens_per_step / max(elapsed, 1e-9)
        per_device = tokens_per_sec / self.engine.world_size
        metrics: dict[str, Any] = {
            "step": self.step,
            "lm_loss": out.loss,
            **getattr(out, "metrics", {}),  # the engine's own figures (MoE: moe_aux_loss, moe_max_load...)
            "lr": lr,
            "grad_norm": out.grad_norm,
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_gpu": per_device,
            "consumed_tokens": self.consumed_tokens,
        }
        value = self._mfu(per_device)
        if value is not None:
            metrics["mfu"] = value
        metrics["peak_memory_mb"] = self.memory.peak_mb()
        if self.guard is not None:
            metrics["skipped_steps"] = self.guard.skipped  # in this run, its earlier launches included
        return metrics

    def _mfu(self, tokens_per_sec_per_device: float) -> float | None:
        """MFU against the peak in force; never above 1. A CPU probe beaten by the step is measured
        again once (it was taken too low); a peak still beaten is not a peak: MFU goes unreported,
        with a warning naming it."""
        flops = self.engine.flops_per_token(self.config.tokens.sequence_length)
        peak = self._peak
        value = mfu(flops, tokens_per_sec_per_device, peak.flops if peak is not None else None)
        if value is None or value <= 1.0 or peak is None:
            return value
        if peak.source.startswith("CPU"):
            remeasured = remeasure_cpu_probe()
            if remeasured is not None and remeasured > peak.flops:
                self._peak = peak = Peak(remeasured, peak.source)
                value = mfu(flops, tokens_per_sec_per_device, peak.flops)
                if value is not None and value <= 1.0:
                    return value
        log.warning(
            "mfu: the step ran at %.3g FLOP/s per device, above the peak it is measured against (%.3g, %s); "
            "mfu is not reported. Set general.hardware to a description of this machine (nanocore calibrate).",
            (flops or 0.0) * tokens_per_sec_per_device,
            peak.flops,
            peak.source,
        )
        self._peak = None
        return None

    def _close_loggers(self) -> None:
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close()

    def close(self) -> None:
        """Close the loggers and shut the engine down (process groups destroyed, threads joined); idempotent."""
        self._close_loggers()
        self._abandon_checkpoint()
        if not self._closed:
            self._closed = True
            self.engine.shutdown()
        self.folder_locks.release()  # last: nothing of this run writes to its folders after this


def run_training(loaded: LoadedConfig) -> list[float]:
    """Build, train and shut down; the engine is shut down on every way out."""
    trainer = Trainer(loaded)  # shuts its engine down itself if building fails
    try:
        return trainer.train()
    except BaseException as exc:
        # Frames of the failed step hold the model's layers, and through them the process groups:
        # free them so that shutting down really destroys the groups and joins their threads.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        trainer.close()


__all__ = ["Trainer", "run_training", "NanocoreError"]
