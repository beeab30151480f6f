"""`jsonl`: one JSON object per logged row in `log_dir/metrics.jsonl`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nanocore.logging_api import LoggerContext
from nanocore_plugins.loggers.format import plain

FILENAME = "metrics.jsonl"


def drop_rows_after(path: Path, step: int) -> None:
    """Remove rows logged after `step` (by a launch that crashed after its last checkpoint), and torn lines.

    A resumed run logs those steps again; without this the file would hold two rows per step.
    """
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a row torn by a crash mid-write
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class JsonlLogger:
    """Appends `{"step": step, **metrics}` to metrics.jsonl and flushes, so the file is readable mid-run.

    A fresh run replaces an old file; a resumed run keeps the rows up to its resume step."""

    def __init__(self, options: None, ctx: LoggerContext):
        log_dir = Path(ctx.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / FILENAME
        if ctx.start_step > 0 and self.path.exists():
            drop_rows_after(self.path, ctx.start_step)
        elif self.path.exists():  # a fresh run (step 0) starts a fresh file instead of mixing two runs
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
