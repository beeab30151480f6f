"""The learning-rate schedule: warmup, an optional constant phase, decay, then a floor.

The decay *shape* is a plugin (registry kind `lr_decay`: `fn(progress) -> remaining fraction`); the
phases around it are here. Steps are 1-based optimizer steps, and the phases follow nanotron's
`lr_scheduler_builder`, evaluated at the step about to be taken:

- warmup, steps 1..W (W = `lr_warmup_steps`): `linear` gives lr * step / W (lr / W at step 1, lr at
  step W); `constant` gives lr.
- constant at lr until the decay starts. `lr_decay_starting_step` S (default W) is where decay progress
  is 0, so step S + 1 is the first step with a decayed LR.
- decay over D = `lr_decay_steps` steps (default train_steps - S, so that it ends on the last step):
  lr(step) = min_decay_lr + (lr - min_decay_lr) * fn((step - S) / D).
- after step S + D: progress stays at 1, i.e. `min_decay_lr` (or lr for the `constant` shape).

Unlike nanotron, step 1 of a linear warmup is lr / W rather than 0 (nanotron applies its lambda one
step late), and when only `lr_decay_starting_step` is given the default D is train_steps - S (nanotron
subtracts both W and S, ending the decay early).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanocore.config.schema import LRSchedulerArgs
from nanocore.errors import ConfigError
from nanocore.registry import Registry

DecayFn = Callable[[float], float]


class LRSchedule:
    """LR for each optimizer step: `lr_at(step)`; `apply` also writes it into an optimizer's param groups."""

    def __init__(self, args: LRSchedulerArgs, train_steps: int, decay_fn: DecayFn):
        if args.lr_warmup_style not in ("linear", "constant"):
            raise ConfigError(
                f"optimizer.learning_rate_scheduler.lr_warmup_style: expected linear or constant, "
                f"got {args.lr_warmup_style!r}"
            )
        self.args = args
        self.decay_fn = decay_fn
        self.lr = args.learning_rate
        self.min_lr = args.min_decay_lr
        self.warmup_steps = max(args.lr_warmup_steps, 0)
        self.decay_start = args.lr_decay_starting_step if args.lr_decay_starting_step is not None else self.warmup_steps
        self.decay_steps = args.lr_decay_steps if args.lr_decay_steps is not None else train_steps - self.decay_start
        # The last optimizer step taken with this schedule (the trainer or `apply` sets it); 0 before training.
        self.step = 0

    @classmethod
    def from_registry(cls, args: LRSchedulerArgs, train_steps: int, lr_decay: Registry) -> LRSchedule:
        """Build with the decay shape named by `args.lr_decay_style` from the `lr_decay` registry."""
        entry = lr_decay.get(args.lr_decay_style, path="optimizer.learning_rate_scheduler.lr_decay_style")
        return cls(args, train_steps, entry.factory)

    def lr_at(self, step: int) -> float:
        """The learning rate for 1-based optimizer step `step`."""
        if step <= self.warmup_steps:
            if self.args.lr_warmup_style == "constant":
                return self.lr
            return self.lr * step / self.warmup_steps
        if step <= self.decay_start:
            return self.lr
        # An empty decay window (D <= 0) jumps straight to the end of the decay.
        progress = 1.0 if self.decay_steps <= 0 else min((step - self.decay_start) / self.decay_steps, 1.0)
        return self.min_lr + (self.lr - self.min_lr) * self.decay_fn(progress)

    def apply(self, optimizer: Any, step: int) -> float:
        """Set every param group's `lr` for optimizer step `step` (call before `optimizer.step()`)."""
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        self.step = step
        return lr

    def state_dict(self) -> dict[str, int]:
        # The schedule is a pure function of the step and the config, so the step is all a resume needs;
        # a config changed between launches takes effect from the resumed step on.
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
