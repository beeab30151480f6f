"""Interface for logger plugins: `factory(options, ctx: LoggerContext) -> Logger`.

Loggers are created on the logging rank only (global rank 0). A training row (`nanocore.trainer`'s
`Trainer._metrics`, README "What a run writes") has `step, lm_loss, lr, grad_norm, tokens_per_sec,
tokens_per_sec_per_gpu, consumed_tokens, peak_memory_mb`, `mfu` where the device's peak FLOPs are known,
and whatever the engine measured (`StepOutput.metrics`: a mixture of experts adds `moe_aux_loss`,
`moe_z_loss` when the z-loss is on, `moe_max_load`, and `moe_rank_load` and `moe_sync_load` under expert
parallelism).
A validation row has `step, val_lm_loss`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:
    from nanocore.config.schema import Config


@attrs.define
class LoggerContext:
    log_dir: Path
    project: str
    run_name: str
    config: Config  # the whole run's config
    config_dict: dict[str, object]  # the config as plain data (what wandb/tensorboard record)
    start_step: int  # last completed step before this launch (0 for a fresh run)
    total_steps: int
    # True when this launch continues the run that wrote log_dir (a resume, or a rerun with
    # `resume_checkpoint_path: latest`): append to its files, never truncate them. False for a fresh
    # run, whose log_dir was empty (or `checkpoints.overwrite: true` asked to replace it).
    append: bool = False
    run_id: str | None = None  # stable across the launches of one run (kept in checkpoints); W&B uses it


class Logger(Protocol):
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """One row of metrics for `step` (training rows, or validation rows with val_lm_loss)."""

    def close(self) -> None: ...
