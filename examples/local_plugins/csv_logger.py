"""A local plugin: logger `csv`, one row per logged step in `logging.log_dir/metrics.csv`.

Use it with `--plugin examples/local_plugins/csv_logger.py` (or the YAML `plugins:` list, or
NANOCORE_PLUGINS) and name it in the config:

    logging:
      loggers: [console, csv]                  # or {name: csv, filename: train.csv, columns: [step, lm_loss]}

Columns are the standard metric names (`step, lm_loss, lr, grad_norm, tokens_per_sec,
tokens_per_sec_per_gpu, consumed_tokens, mfu`, and `val_lm_loss`, which only validation rows fill);
a metric a row does not have is left empty. Like the built-in `jsonl` logger, a run that continues
(`LoggerContext.append`: a resume) appends to the file and never truncates it; a fresh run starts it.

This file uses only the public plugin API: `nanocore.hookimpl`, `registry.register(...)` with an
attrs options class, and `nanocore.logging_api.LoggerContext`.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import attrs

from nanocore import hookimpl
from nanocore.config.schema import doc
from nanocore.logging_api import LoggerContext

METRICS = (
    "step",
    "lm_loss",
    "lr",
    "grad_norm",
    "tokens_per_sec",
    "tokens_per_sec_per_gpu",
    "consumed_tokens",
    "mfu",
    "peak_memory_mb",
    "val_lm_loss",
)


@attrs.define
class CsvOptions:
    """Options of the `csv` logger (given beside `name: csv` in `logging.loggers`)."""

    filename: str = doc("File written inside logging.log_dir.", default="metrics.csv")
    columns: list[str] = doc(
        "Metric names, one column each, in this order; `step` comes first.", factory=lambda: list(METRICS)
    )

    def check(self, config: Any) -> list[str]:
        problems = []
        if not self.filename or Path(self.filename).name != self.filename:
            problems.append(f"filename: expected a plain file name inside logging.log_dir, got {self.filename!r}")
        if not self.columns or self.columns[0] != "step":
            problems.append(f"columns: the first column must be 'step', got {self.columns!r}")
        repeated = sorted({c for c in self.columns if self.columns.count(c) > 1})
        if repeated:
            problems.append(f"columns: each metric once, got {', '.join(repeated)} more than once")
        return problems


class CsvLogger:
    """Writes a header, then one row per `log_metrics` call, flushed so the file is readable mid-run."""

    def __init__(self, options: CsvOptions | None, ctx: LoggerContext):
        options = options or CsvOptions()
        self.columns = list(options.columns)
        log_dir = Path(ctx.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / options.filename
        appending = ctx.append and self.path.exists() and self.path.stat().st_size > 0
        torn = appending and not self.path.read_bytes().endswith(b"\n")  # a crash mid-row
        self.file = self.path.open("a" if appending else "w", newline="", encoding="utf-8")
        self.writer = csv.DictWriter(self.file, fieldnames=self.columns, extrasaction="ignore", lineterminator="\n")
        if torn:
            self.file.write("\n")
        if not appending:
            self.writer.writeheader()
        self.file.flush()

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        row = {name: _plain(value) for name, value in metrics.items()}
        row["step"] = step
        self.writer.writerow(row)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _plain(value: Any) -> Any:
    """A number for the CSV cell (metrics may be 0-dim tensors or numpy scalars)."""
    return value.item() if hasattr(value, "item") else value


@hookimpl
def register_loggers(registry):
    registry.register(
        "csv",
        CsvLogger,
        config_class=CsvOptions,
        description="one CSV row per logged step in log_dir/metrics.csv (local example plugin)",
    )
