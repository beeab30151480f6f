"""Rotary position embeddings (RoPE), with transformers' frequency-scaling rules.

`Rotary` is a plain object, shared by every layer of a model: models hold no buffers (engines
materialise them from the meta device and only know parameters), so the tables are computed from
the config on first use.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ROPE_KEYS = {
    "yarn": ("factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The kind of a `rope_scaling` dict; transformers' older configs spell the key `type`."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_problems(scaling: dict[str, Any] | None) -> list[str]:
    """Problems with a `rope_scaling` setting, as 'rope_scaling: message'."""
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        return [f"rope_scaling: unknown rope_type {kind!r}; supported: {', '.join(ROPE_TYPES)}"]
    missing = [k for k in ROPE_KEYS.get(kind, ()) if k not in (scaling or {})]
    return [f"rope_scaling: rope_type {kind} needs {', '.join(missing)}"] if missing else []


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `scale` times (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's `attention_factor` (given, or from factor, mscale and
    mscale_all_dim as transformers infers it); 1 for every other kind."""
    if rope_type(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_inverse_frequencies(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (NTK-by-parts): high frequencies kept, low ones divided by `factor`, a linear ramp between
    the dimensions that rotate beta_fast and beta_slow times over the original context."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq: torch.Tensor = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq


def rope_inverse_frequencies(dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies (float32, CPU) of a `dim`-wide rotary embedding."""
    kind, scaling = rope_type(scaling), scaling or {}
    if kind == "yarn":
        return _yarn_inverse_frequencies(dim, theta, scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        linear: torch.Tensor = inv_freq / scaling["factor"]
        return linear
    if kind == "llama3":
        # LLaMA 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


class Rotary:
    """Rotary cos/sin tables, shared by every layer; a plain object so that it owns no buffers.

    One table per (device, dtype) covers positions [0, n) and grows when a longer sequence comes.
    """

    def __init__(self, dim: int, theta: float, scaling: dict[str, Any] | None, min_length: int):
        with torch.device("cpu"):  # the model may be built under torch.device("meta")
            self.inv_freq = rope_inverse_frequencies(dim, theta, scaling)
        self.attention_factor = rope_attention_factor(scaling)
        self.min_length = min_length
        self._last: tuple | None = None  # (positions, (device, dtype), cos, sin) of the last `at`
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _scaled(self, table: torch.Tensor) -> torch.Tensor:
        return table * self.attention_factor if self.attention_factor != 1.0 else table

    def _direct(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at `positions` computed without the tables (the same values): inside a compiled
        graph (`model.compile`), which must not depend on what an earlier call stored, or a block
        recomputed in backward would run another graph than its forward did."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return self._scaled(emb.cos()).to(dtype), self._scaled(emb.sin()).to(dtype)

    def cos_sin(
        self, seq_len: int, offset: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        end = offset + seq_len
        if torch.compiler.is_compiling():
            return self._direct(torch.arange(offset, end, device=device), dtype)
        if key not in self._tables or self._tables[key][0].shape[0] < end:
            # Normal tensors even under inference_mode, so a later training step may use the table.
            with torch.inference_mode(False), torch.no_grad():
                positions = torch.arange(max(end, self.min_length), device=device, dtype=torch.float32)
                freqs = torch.outer(positions, self.inv_freq.to(device))
                emb = torch.cat((freqs, freqs), dim=-1)
                self._tables[key] = (self._scaled(emb.cos()).to(dtype), self._scaled(emb.sin()).to(dtype))
        cos, sin = self._tables[key]
        return cos[offset:end], sin[offset:end]

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [b or 1, 1, s, head_dim] at explicit positions [b or 1, s] (context parallelism,
        document masking). Every layer of a micro-batch asks for the same positions: computed once."""
        if torch.compiler.is_compiling():
            cos, sin = self._direct(positions, dtype)
            return cos[:, None], sin[:, None]
        key = (positions.device, dtype)
        if self._last is not None and self._last[0] is positions and self._last[1] == key:
            return self._last[2], self._last[3]
        cos, sin = self.cos_sin(int(positions.max()) + 1, 0, positions.device, dtype)
        cos, sin = cos[positions][:, None], sin[positions][:, None]
        self._last = (positions, key, cos, sin)
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, s, head_dim]; cos, sin: [s, rotary_dim]. A rotary_dim below head_dim rotates the
    first rotary_dim features and passes the rest through (partial rotary: Qwen3-Next, GPT-NeoX)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat([rotated * cos + rotate_half(rotated) * sin, passed], dim=-1)
    return x * cos + rotate_half(x) * sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's weights); the result comes out
    de-interleaved (the rotated evens, then the rotated odds), as transformers computes it: queries and
    keys are permuted alike, so their products are unchanged."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
