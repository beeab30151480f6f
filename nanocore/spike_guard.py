"""A stability guard (`optimizer.skip_spikes`): a step whose loss or gradient norm is not finite, or
lies far above the recent steps', updates nothing.

The engine computes the step's loss and global gradient norm (both reduced: identical on every rank)
and asks `SpikeGuard.accept` before the optimizer steps; a rejected step leaves weights and optimizer
state as they were (as OLMo-core's skip-step optimizers do), its batch is consumed, and the trainer
logs it (`skipped_steps`). After `max_consecutive` rejected steps in a row the run stops, pointing at
the last good checkpoint. Every rank keeps the same history of the same reduced values, so every
rank decides alike without another collective.

A spike: the loss (or the gradient norm) more than `sigmas` standard deviations above the mean of
the last `window` accepted steps, judged once `min_history` steps are in the window. The spread has
a floor of `1e-3` of the mean, so a flat, noiseless curve does not make every wobble a spike.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import attrs

from nanocore.config.schema import SkipSpikesArgs


@attrs.frozen
class Verdict:
    """Why a step was rejected ('' when accepted)."""

    accepted: bool
    reason: str = ""


def _spike(value: float, history: deque[float], sigmas: float) -> str:
    n = len(history)
    mean = sum(history) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in history) / n)
    limit = mean + sigmas * max(std, 1e-3 * abs(mean))
    return f"{value:.4g} > {limit:.4g} (mean {mean:.4g} + {sigmas:g} sd of the last {n} steps)" if value > limit else ""


class SpikeGuard:
    """`accept(loss, grad_norm)`: whether a step may update the weights (see the module docstring)."""

    def __init__(self, args: SkipSpikesArgs):
        self.args = args
        self.losses: deque[float] = deque(maxlen=args.window)
        self.norms: deque[float] = deque(maxlen=args.window)
        self.consecutive = 0  # rejected steps in a row
        self.skipped = 0  # rejected steps in this run (its earlier launches included)
        self.last = Verdict(True)

    def judge(self, loss: float, grad_norm: float) -> Verdict:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return Verdict(False, f"loss {loss}, gradient norm {grad_norm}: not finite")
        if len(self.losses) >= self.args.min_history:
            for name, value, history in (("loss", loss, self.losses), ("gradient norm", grad_norm, self.norms)):
                why = _spike(value, history, self.args.sigmas)
                if why:
                    return Verdict(False, f"{name} spike: {why}")
        return Verdict(True)

    def accept(self, loss: float, grad_norm: float) -> bool:
        self.last = verdict = self.judge(loss, grad_norm)
        if verdict.accepted:
            self.consecutive = 0
            self.losses.append(loss)
            self.norms.append(grad_norm)
        else:
            self.consecutive += 1
            self.skipped += 1
        return verdict.accepted

    @property
    def exhausted(self) -> bool:
        """`max_consecutive` steps in a row were rejected: the run should stop."""
        return bool(self.consecutive >= self.args.max_consecutive)

    def state_dict(self) -> dict[str, Any]:
        """Saved in each checkpoint's meta.json: a resumed run judges by the same recent steps."""
        return {
            "losses": list(self.losses),
            "norms": list(self.norms),
            "consecutive": self.consecutive,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses.extend(float(v) for v in state.get("losses", []))
        self.norms.extend(float(v) for v in state.get("norms", []))
        self.consecutive = int(state.get("consecutive", 0))
        self.skipped = int(state.get("skipped", 0))
