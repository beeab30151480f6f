"""`jsonl`: one JSON object per logged row in `log_dir/metrics.jsonl`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nanocore.logging_api import LoggerContext
from nanocore_plugins.loggers.format import plain

FILENAME = "metrics.jsonl"


class JsonlLogger:
    """Appends `{"step": step, **metrics}` to metrics.jsonl and flushes, so the file is readable mid-run.

    A run that continues (a resume) appends to the file: nothing an earlier launch logged is lost,
    and a step logged by a launch that crashed after its last checkpoint appears again after the
    resume (the later row is the one that continued). A fresh run starts the file (its log_dir was
    empty, or `checkpoints.overwrite: true` asked to replace the old run's logs)."""

    def __init__(self, options: None, ctx: LoggerContext):
        log_dir = Path(ctx.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / FILENAME
        if not ctx.append and self.path.exists():
            self.path.unlink()
        self._needs_newline = self.path.exists() and self.path.stat().st_size > 0 and not _ends_with_newline(self.path)
        self.file = self.path.open("a", encoding="utf-8")

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: plain(v) for k, v in metrics.items() if k != "step"}}
        if self._needs_newline:  # never glue a row onto a line torn by a crash
            self.file.write("\n")
            self._needs_newline = False
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
