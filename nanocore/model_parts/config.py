"""The config fields every LLaMA-family decoder shares (LLaMA, Mixtral, Qwen3, Qwen3-MoE), with
transformers' names, and their checks. A model type's config class extends `DecoderConfig`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from nanocore.config.schema import doc
from nanocore.model_parts.layers import ACT_FNS
from nanocore.model_parts.rotary import rope_problems, rope_type


@attrs.define
class DecoderConfig:
    """A pre-norm decoder: RMSNorm, rotary positions, grouped-query attention, gated MLP.

    Field names and meanings match Hugging Face transformers' configs (and nanotron's), so a
    checkpoint's `config.json` values can be copied over.
    """

    bos_token_id: int = doc("Beginning-of-sequence token id.", default=1)
    eos_token_id: int = doc("End-of-sequence token id (generation stops on it).", default=2)
    hidden_act: str = doc(f"MLP activation: one of {', '.join(ACT_FNS)}.", default="silu")
    hidden_size: int = doc("Width of the residual stream.", default=64)
    initializer_range: float = doc(
        "nanotron/transformers compatibility; nanocore initialises with model.init_method.std.", default=0.02
    )
    intermediate_size: int = doc("Width of the MLP's hidden layer.", default=256)
    max_position_embeddings: int = doc(
        "Longest sequence the model is meant for (RoPE has no hard limit).", default=2048
    )
    num_attention_heads: int = doc("Query heads per layer.", default=4)
    num_hidden_layers: int = doc("Decoder layers.", default=2)
    attention_bias: bool = doc("Give the q, k, v and o projections a bias.", default=False)
    num_key_value_heads: int | None = doc(
        "Key/value heads per layer (grouped-query attention); null means as many as num_attention_heads.",
        default=None,
    )
    head_dim: int | None = doc(
        "Width of each attention head; null means hidden_size / num_attention_heads.", default=None
    )
    pad_token_id: int | None = doc("Padding token id, if the tokenizer has one.", default=None)
    rms_norm_eps: float = doc("Epsilon inside RMSNorm.", default=1e-6)
    rope_scaling: dict[str, Any] | None = doc(
        "RoPE frequency scaling, as in transformers: null, {rope_type: linear, factor} or LLaMA-3's "
        "{rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}.",
        default=None,
    )
    rope_theta: float = doc("RoPE base period (10000 for LLaMA 2, 500000 for LLaMA 3).", default=10000.0)
    tie_word_embeddings: bool = doc("Share the input embedding matrix with the output head.", default=False)
    use_cache: bool = doc("transformers compatibility; generation always uses a key/value cache.", default=True)
    vocab_size: int = doc("Tokenizer vocabulary size (padded by model.make_vocab_size_divisible_by).", default=256)

    @property
    def kv_heads(self) -> int:
        """num_key_value_heads, with null meaning one per query head."""
        return self.num_key_value_heads if self.num_key_value_heads is not None else self.num_attention_heads

    @property
    def head_size(self) -> int:
        """head_dim, with null meaning hidden_size / num_attention_heads."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    def attention_window(self, layer_idx: int) -> int | None:
        """Layer `layer_idx`'s sliding window (a query sees itself and the window - 1 keys before it, as
        transformers' `sliding_window` means it), or None for full causal attention: every layer here;
        a config with `layer_types` says per layer (`layer_windows`)."""
        return None

    @property
    def rope_type(self) -> str:
        return rope_type(self.rope_scaling)

    def problems(self, tp: int = 1) -> list[str]:
        """Problems with this config (as 'field: message') for a tensor-parallel size of `tp`."""
        p: list[str] = []
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
            if getattr(self, key) < 1:
                p.append(f"{key}: must be at least 1, got {getattr(self, key)}")
        for key in ("num_key_value_heads", "head_dim"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                p.append(f"{key}: must be at least 1 or null, got {getattr(self, key)}")
        if p:
            return p
        heads, kv = self.num_attention_heads, self.kv_heads
        if self.head_dim is None and self.hidden_size % heads:
            p.append(
                f"hidden_size: {self.hidden_size} is not divisible by num_attention_heads = {heads} (or set head_dim)"
            )
        elif self.head_size % 2:
            field = "head_dim" if self.head_dim is not None else "hidden_size"
            p.append(f"{field}: head size {self.head_size} must be even for RoPE")
        if heads % kv:
            p.append(
                f"num_key_value_heads: num_attention_heads = {heads} is not divisible by num_key_value_heads = {kv}"
            )
        if heads % tp:
            p.append(
                f"num_attention_heads: {heads} heads cannot be split over parallelism.tp = {tp} ranks; "
                "choose a tp that divides the number of heads"
            )
        if kv % tp and tp % kv:
            p.append(
                f"num_key_value_heads: {kv} key/value heads cannot be split over or replicated across "
                f"parallelism.tp = {tp} ranks; one must divide the other"
            )
        if self.hidden_act not in ACT_FNS:
            p.append(f"hidden_act: unsupported activation {self.hidden_act!r}; expected one of {', '.join(ACT_FNS)}")
        p += rope_problems(self.rope_scaling)
        return p

    def check(self, config: Any) -> list[str]:
        """Cross-field checks against the whole run config (see nanocore.config.checks)."""
        return self.problems(tp=config.parallelism.tp)


LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(layer_types: Sequence[str], sliding_window: int | None) -> list[int | None]:
    """transformers' `layer_types` -> each layer's window (None for a full layer)."""
    return [sliding_window if t == "sliding_attention" else None for t in layer_types]


def layer_type_problems(layer_types: Sequence[str] | None, num_layers: int, sliding_window: int | None) -> list[str]:
    """What is wrong with a `layer_types` list and the `sliding_window` its sliding layers use."""
    if layer_types is None:
        return []
    p: list[str] = []
    if len(layer_types) != num_layers:
        p.append(f"layer_types: {len(layer_types)} entries for num_hidden_layers = {num_layers}; give one per layer")
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        p.append(f"layer_types: unknown {unknown}; each entry is one of {', '.join(LAYER_TYPES)}")
    if "sliding_attention" in layer_types and (sliding_window is None or sliding_window < 1):
        p.append(f"sliding_window: sliding_attention layers need a window of at least 1 token, got {sliding_window}")
    return p
