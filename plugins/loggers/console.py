"""`console`: a tqdm progress bar on a terminal, plain lines in CI logs."""

from __future__ import annotations

import sys
import time
from typing import Any

import attrs
from tqdm import tqdm

from nanocore.config.schema import doc
from nanocore.logging_api import LoggerContext
from nanocore_plugins.loggers.format import format_row, format_value, numeric


@attrs.define
class ConsoleOptions:
    """Options of the `console` logger."""

    every: int = doc(
        "Without a progress bar, print a line for steps that are a multiple of this (and the last step).", default=1
    )
    progress_bar: bool | None = doc("Show a tqdm progress bar; null = only when stderr is a terminal.", default=None)

    def check(self, config: Any) -> list[str]:
        return [] if self.every >= 1 else [f"every: must be at least 1, got {self.every}"]


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class ConsoleLogger:
    """Progress on stderr: a bar with loss, lr and tokens/s plus tqdm's ETA, or one plain line per step."""

    def __init__(self, options: ConsoleOptions | None, ctx: LoggerContext):
        self.options = options or ConsoleOptions()
        self.stream = sys.stderr
        self.start_step = ctx.start_step
        self.total_steps = ctx.total_steps
        self.started = time.monotonic()
        show_bar = self.options.progress_bar
        if show_bar is None:
            show_bar = _is_terminal(self.stream)
        self.bar: tqdm | None = None
        if show_bar:
            self.bar = tqdm(
                total=ctx.total_steps,
                initial=ctx.start_step,
                file=self.stream,
                desc="train",
                unit="step",
                dynamic_ncols=True,
            )

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        if "val_lm_loss" in metrics:
            self._write(f"step {step} | {format_row(metrics)}")
        elif self.bar is not None:
            self.bar.set_postfix_str(self._postfix(metrics), refresh=False)
            if step > self.bar.n:
                self.bar.update(step - self.bar.n)
            else:
                self.bar.refresh()
        elif step % self.options.every == 0 or step >= self.total_steps:
            self._write(f"step {step}/{self.total_steps} | {format_row(metrics)} | {self._timing(step)}")

    def _postfix(self, metrics: dict[str, Any]) -> str:
        shown = (
            ("lm_loss", "loss"),
            ("moe_aux_loss", "aux"),
            ("moe_max_load", "max_load"),
            ("moe_rank_load", "rank_load"),
            ("moe_sync_load", "sync_load"),
            ("lr", "lr"),
            ("tokens_per_sec", "tok/s"),
            ("mfu", "mfu"),
        )
        parts = []
        for name, label in shown:
            value = numeric(metrics.get(name))
            if value is not None:
                parts.append(f"{label}={format_value(name, value)}")
        return ", ".join(parts)

    def _timing(self, step: int) -> str:
        elapsed = time.monotonic() - self.started
        done = step - self.start_step
        eta = elapsed / done * max(self.total_steps - step, 0) if done > 0 else None
        eta_text = tqdm.format_interval(eta) if eta is not None else "?"
        return f"elapsed {tqdm.format_interval(elapsed)} | ETA {eta_text}"

    def _write(self, line: str) -> None:
        if self.bar is not None:
            tqdm.write(line, file=self.stream)  # keeps the bar below the line
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
