"""Turning a metrics row into plain JSON-able values and into short human-readable text."""

from __future__ import annotations

import math
from typing import Any


def plain(value: Any) -> Any:
    """A Python number (or the value unchanged) for tensors and numpy scalars, so rows serialise anywhere."""
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def numeric(value: Any) -> float | None:
    """The value as a float if it is a real number (not None, not a bool), else None."""
    value = plain(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def human(n: float) -> str:
    """12345678 -> '12.3M': throughput and token counts at a glance."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def format_value(name: str, value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if name.endswith("loss"):
        return f"{value:.4f}"
    if name == "lr":
        return f"{value:.3e}"
    if name == "mfu":
        return f"{100 * value:.1f}%"
    if name.startswith("tokens_per_sec") or name == "consumed_tokens":
        return human(value)
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def format_row(metrics: dict[str, Any]) -> str:
    """'lm_loss 3.4521 | lr 3.000e-04 | ...' for every numeric metric except `step`, in the row's order."""
    parts = []
    for name, value in metrics.items():
        number = numeric(value)
        if name != "step" and number is not None:
            parts.append(f"{name} {format_value(name, number)}")
    return " | ".join(parts)
