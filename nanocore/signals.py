"""SIGTERM and SIGINT end a run with a checkpoint instead of killing it mid-step.

Clusters send SIGTERM before they preempt a job, and torchrun forwards SIGTERM/SIGINT to every
worker. While training, the first such signal only records a request; the trainer finishes the
step, the ranks agree to stop (a signal reaches them at slightly different times), one checkpoint
is saved and the run exits non-zero. A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("nanocore")

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """Context manager installing the handlers (main thread only); `signal_number` is the first received."""

    def __init__(self) -> None:
        self.signal_number: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_number is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        if self.signal_number is None:
            self.signal_number = signum
            log.warning(
                "received %s: finishing this step, then saving a checkpoint and stopping (Ctrl-C again to stop now)",
                signal.Signals(signum).name,
            )

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
