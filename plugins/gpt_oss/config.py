"""The `gpt_oss` config section (`model.model_config`), with transformers' names (`GptOssConfig`).

gpt-oss alternates sliding-window layers (even indices, 128 tokens) with full ones (`layer_types`),
gives every attention head a learned sink logit, biases in every attention projection, YaRN RoPE,
and a sparse MLP in every layer: a biased router (top-k of the logits, then a softmax over those k)
and experts with biases and a clamped SwiGLU.
"""

from __future__ import annotations

from typing import Any

import attrs

from nanocore.config.schema import doc
from nanocore.model_parts.config import DecoderConfig, layer_type_problems, layer_windows
from nanocore.model_parts.moe import MoESpec, expert_problems

YARN_DEFAULT: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def default_layer_types(num_layers: int) -> list[str]:
    """transformers' gpt-oss pattern: sliding-window layers at even indices, full ones at odd."""
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]


@attrs.define
class GptOssConfig(DecoderConfig):
    """A gpt-oss decoder (see the module docstring)."""

    attention_bias: bool = doc("Give the q, k, v and o projections a bias (gpt-oss: true).", default=True)
    rms_norm_eps: float = doc("Epsilon inside RMSNorm.", default=1e-5)
    rope_theta: float = doc("RoPE base period.", default=150000.0)
    rope_scaling: dict[str, Any] | None = doc(
        "RoPE frequency scaling (gpt-oss: YaRN, factor 32 over 4096 positions, truncate false).",
        factory=lambda: dict(YARN_DEFAULT),
    )
    sliding_window: int = doc("Tokens a sliding_attention layer's query sees, itself included.", default=128)
    layer_types: list[str] | None = doc(
        "Each layer's attention, sliding_attention or full_attention; null: alternating, sliding first.",
        default=None,
    )
    num_local_experts: int = doc("Routed experts per layer.", default=8)
    num_experts_per_tok: int = doc("Experts each token is routed to (top-k).", default=2)
    swiglu_alpha: float = doc("Sigmoid gain of the experts' clamped SwiGLU.", default=1.702)
    swiglu_limit: float = doc("Clamp of the gate (above) and up projection (both sides) in that SwiGLU.", default=7.0)
    router_aux_loss_coef: float = doc(
        "Weight of the load-balancing loss (transformers' definition); 0 turns it off.", default=0.001
    )
    router_z_loss_coef: float = doc("Weight of the router z-loss (not in transformers); 0 turns it off.", default=0.0)
    output_router_logits: bool = doc("transformers compatibility; accepted and ignored.", default=False)
    attention_dropout: float = doc("transformers compatibility; only 0 (nanocore has no dropout).", default=0.0)

    @property
    def attention_layer_types(self) -> list[str]:
        """`layer_types`, with null meaning transformers' alternating pattern."""
        return list(self.layer_types) if self.layer_types is not None else default_layer_types(self.num_hidden_layers)

    def attention_window(self, layer_idx: int) -> int | None:
        return layer_windows(self.attention_layer_types, self.sliding_window)[layer_idx]

    def moe_spec(self) -> MoESpec:
        """Every layer's sparse block (`nanocore.model_parts.moe`; the model counts the layers)."""
        return MoESpec(
            hidden_size=self.hidden_size,
            num_experts=self.num_local_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.intermediate_size,
            scoring_func="topk_softmax",
            aux_loss_coef=self.router_aux_loss_coef,
            z_loss_coef=self.router_z_loss_coef,
            router_bias=True,
            expert_bias=True,
            swiglu_limit=self.swiglu_limit,
            swiglu_alpha=self.swiglu_alpha,
        )

    def problems(self, tp: int = 1, ep: int = 1) -> list[str]:
        """Problems with this config (as 'field: message') for tensor- and expert-parallel sizes `tp`, `ep`."""
        p = super().problems(tp=1)
        p += layer_type_problems(self.attention_layer_types, self.num_hidden_layers, self.sliding_window)
        p += expert_problems(self.num_local_experts, self.num_experts_per_tok, ep, "num_local_experts")
        if tp > 1:
            p.append(
                f"parallelism.tp: gpt-oss's per-head sink logits are not yet split over tensor-parallel ranks; "
                f"got tp = {tp}, use tp: 1 (data, context, pipeline and expert parallelism and ZeRO all work)"
            )
        if self.swiglu_limit <= 0:
            p.append(f"swiglu_limit: must be above 0, got {self.swiglu_limit}")
        for key in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, key) < 0:
                p.append(f"{key}: must be 0 or more, got {getattr(self, key)}")
        if self.attention_dropout:
            p.append(f"attention_dropout: must be 0 (nanocore has no dropout), got {self.attention_dropout}")
        return p

    def check(self, config: Any) -> list[str]:
        """Cross-field checks against the whole run config (see nanocore.config.checks)."""
        par = config.parallelism
        return self.problems(tp=par.tp, ep=getattr(par, "expert_parallel_size", 1))
