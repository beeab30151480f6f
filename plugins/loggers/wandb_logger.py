"""`wandb`: Weights & Biases runs (online, offline or disabled)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from nanocore.config.schema import doc
from nanocore.errors import NanocoreError
from nanocore.logging_api import LoggerContext
from nanocore_plugins.loggers.format import numeric

MODES = ("online", "offline", "disabled")


@attrs.define
class WandbOptions:
    """Options of the `wandb` logger. Project and run name come from `general.project` and `general.run`."""

    entity: str | None = doc("W&B team or user; null = your default entity.", default=None)
    mode: str | None = doc("online, offline or disabled; null = wandb's own setting (WANDB_MODE).", default=None)
    tags: list[str] = doc("Tags attached to the run.", factory=list)

    def check(self, config: Any) -> list[str]:
        if self.mode is not None and self.mode not in MODES:
            return [f"mode: expected one of {', '.join(MODES)} or null, got {self.mode!r}"]
        return []


class WandbLogger:
    """Starts a W&B run with the whole config; each row becomes `wandb.log(metrics, step=step)`."""

    def __init__(self, options: WandbOptions | None, ctx: LoggerContext):
        try:
            import wandb
        except ImportError as exc:
            raise NanocoreError("logger 'wandb' needs the wandb package: pip install wandb") from exc
        options = options or WandbOptions()
        log_dir = Path(ctx.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=ctx.project,
            name=ctx.run_name,
            entity=options.entity,
            config=ctx.config_dict,
            dir=str(log_dir),
            mode=options.mode,
            tags=list(options.tags) or None,
            # one W&B run per nanocore run: a resumed launch continues it (the id is kept in checkpoints)
            id=ctx.run_id,
            resume="allow" if ctx.run_id else None,
        )

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        row = {name: numeric(value) for name, value in metrics.items() if name != "step"}
        self.run.log({name: value for name, value in row.items() if value is not None}, step=step)

    def close(self) -> None:
        self.run.finish()
