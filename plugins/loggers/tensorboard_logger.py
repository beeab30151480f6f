"""`tensorboard`: scalars `train/<metric>` in `log_dir/<subdir>`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from nanocore.config.schema import doc
from nanocore.logging_api import LoggerContext
from nanocore_plugins.loggers.format import numeric


@attrs.define
class TensorBoardOptions:
    """Options of the `tensorboard` logger."""

    subdir: str = doc("Sub-folder of logging.log_dir for the event files.", default="tensorboard")


class TensorBoardLogger:
    """Writes every numeric metric as scalar `train/<name>` (validation rows give `train/val_lm_loss`)."""

    def __init__(self, options: TensorBoardOptions | None, ctx: LoggerContext):
        from torch.utils.tensorboard import SummaryWriter  # slow import; only when this logger is used

        options = options or TensorBoardOptions()
        self.log_dir = Path(ctx.log_dir) / options.subdir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not ctx.append:  # a fresh run (its log_dir was empty, or overwrite was asked for): no old curves
            for old in self.log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        # On resume, hide what a crashed launch logged after the checkpoint it restarts from.
        purge_step = ctx.start_step + 1 if ctx.start_step > 0 else None
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        for name, value in metrics.items():
            number = numeric(value)
            if name != "step" and number is not None:
                self.writer.add_scalar(f"train/{name}", number, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
