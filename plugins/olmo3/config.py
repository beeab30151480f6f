"""The `olmo3` config section (`model.model_config`), with transformers' names (`Olmo3Config`).

OLMo 3 interleaves sliding-window and full attention layers: `layer_types` lists one per layer
(`sliding_attention` or `full_attention`); left null it is transformers' default, three windowed
layers then one full (layer i is full when (i + 1) % 4 == 0). `rope_scaling` (YaRN in OLMo 3's
long-context checkpoints) applies to the full layers only, as transformers applies it; the windowed
layers rotate with plain RoPE at the same `rope_theta`.
"""

from __future__ import annotations

from typing import Any

import attrs

from nanocore.config.schema import doc
from nanocore.model_parts.config import DecoderConfig, layer_type_problems, layer_windows


def default_layer_types(num_layers: int) -> list[str]:
    """transformers' OLMo 3 pattern: three sliding-window layers, then a full one."""
    return ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(num_layers)]


@attrs.define
class Olmo3Config(DecoderConfig):
    """An OLMo 3 decoder: LLaMA's parts in a post-norm block (x + norm(attn(x)), then + norm(mlp(.))),
    an RMSNorm over the whole query and key projections before rotary, and sliding-window layers."""

    sliding_window: int = doc("Tokens a sliding_attention layer's query sees, itself included.", default=4096)
    layer_types: list[str] | None = doc(
        "Each layer's attention, sliding_attention or full_attention; null: three sliding, then one full.",
        default=None,
    )
    rms_norm_eps: float = doc("Epsilon inside RMSNorm.", default=1e-5)
    rope_theta: float = doc("RoPE base period of every layer.", default=500000.0)
    attention_dropout: float = doc("transformers compatibility; only 0 (nanocore has no dropout).", default=0.0)

    @property
    def attention_layer_types(self) -> list[str]:
        """`layer_types`, with null meaning transformers' default pattern."""
        return list(self.layer_types) if self.layer_types is not None else default_layer_types(self.num_hidden_layers)

    def attention_window(self, layer_idx: int) -> int | None:
        return layer_windows(self.attention_layer_types, self.sliding_window)[layer_idx]

    def layer_rope_scaling(self, layer_idx: int) -> dict[str, Any] | None:
        """The RoPE scaling of layer `layer_idx`: `rope_scaling` on full layers, none on windowed ones."""
        return self.rope_scaling if self.attention_window(layer_idx) is None else None

    def problems(self, tp: int = 1) -> list[str]:
        """Problems with this config (as 'field: message') for a tensor-parallel size of `tp`."""
        p = super().problems(tp=1)
        p += layer_type_problems(self.attention_layer_types, self.num_hidden_layers, self.sliding_window)
        if tp > 1:
            p.append(
                f"parallelism.tp: OLMo 3 normalises the whole query and key projections (all heads at once), "
                f"which nanocore does not yet split over tensor-parallel ranks; got tp = {tp}, use tp: 1 "
                "(data, context, pipeline parallelism and ZeRO all work)"
            )
        if self.attention_dropout:
            p.append(f"attention_dropout: must be 0 (nanocore has no dropout), got {self.attention_dropout}")
        return p
