"""LR decay shapes: `fn(progress) -> remaining`, both in [0, 1].

`progress` is how far through the decay window a step is (0 at its start, 1 at its end); the result is
the fraction of the way from `min_decay_lr` up to `learning_rate` that is left, so the LR is
`min_decay_lr + (learning_rate - min_decay_lr) * fn(progress)` (see `nanocore.lr_schedule`).
"""

from __future__ import annotations

import math


def _clamp(progress: float) -> float:
    return min(max(progress, 0.0), 1.0)


def cosine(progress: float) -> float:
    """Half a cosine period: slow start, fast middle, slow end."""
    return 0.5 * (1.0 + math.cos(math.pi * _clamp(progress)))


def linear(progress: float) -> float:
    """A straight line from 1 to 0."""
    return 1.0 - _clamp(progress)


def one_minus_sqrt(progress: float) -> float:
    """1 - sqrt(progress): drops fast at first; the usual cooldown shape for warmup-stable-decay runs."""
    return 1.0 - math.sqrt(_clamp(progress))


def constant(progress: float) -> float:
    """No decay: the LR stays at `learning_rate` after warmup."""
    return 1.0


DECAY_SHAPES = {"cosine": cosine, "linear": linear, "1-sqrt": one_minus_sqrt, "constant": constant}
