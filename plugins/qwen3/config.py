"""The `qwen3` and `qwen3_moe` config sections (`model.model_config`), with transformers' names
(`Qwen3Config`, `Qwen3MoeConfig`). Released Qwen3 checkpoints set `head_dim` (128) and
`rope_theta` (1000000) in their config.json; `nanocore convert --from-hf` copies them."""

from __future__ import annotations

from typing import Any

import attrs

from nanocore.config.schema import doc
from nanocore.model_parts.config import DecoderConfig, layer_type_problems, layer_windows
from nanocore.model_parts.moe import MoESpec, expert_problems


@attrs.define
class Qwen3Config(DecoderConfig):
    """A Qwen3 decoder: LLaMA's, with an RMSNorm on each query and key head before rotary (qk-norm)
    and a head size of its own (`head_dim`)."""

    use_sliding_window: bool = doc(
        "Sliding-window attention on the layers layer_types marks sliding_attention (by default, Qwen3's "
        "layers from max_window_layers on; every layer of Qwen3-MoE).",
        default=False,
    )
    sliding_window: int | None = doc(
        "Tokens a sliding layer's query sees, itself included; unused while use_sliding_window is false.",
        default=None,
    )
    max_window_layers: int = doc(
        "Qwen3: layers before this one stay full when use_sliding_window is on (transformers' default pattern).",
        default=28,
    )
    layer_types: list[str] | None = doc(
        "Each layer's attention, sliding_attention or full_attention, read while use_sliding_window is on; "
        "null: transformers' pattern (see use_sliding_window).",
        default=None,
    )
    attention_dropout: float = doc("transformers compatibility; only 0 (nanocore has no dropout).", default=0.0)

    @property
    def attention_layer_types(self) -> list[str]:
        """`layer_types`, with null meaning transformers' Qwen3 pattern."""
        if self.layer_types is not None:
            return list(self.layer_types)
        sliding = self.use_sliding_window and self.sliding_window is not None
        return [
            "sliding_attention" if sliding and i >= self.max_window_layers else "full_attention"
            for i in range(self.num_hidden_layers)
        ]

    def attention_window(self, layer_idx: int) -> int | None:
        if not self.use_sliding_window:  # transformers drops the window then, whatever layer_types says
            return None
        return layer_windows(self.attention_layer_types, self.sliding_window)[layer_idx]

    def problems(self, tp: int = 1) -> list[str]:
        """Problems with this config (as 'field: message') for a tensor-parallel size of `tp`."""
        p = super().problems(tp=tp)
        if self.use_sliding_window and self.sliding_window is None:
            p.append("use_sliding_window: true needs sliding_window (the tokens a query sees), got null")
        elif self.use_sliding_window:
            p += layer_type_problems(self.attention_layer_types, self.num_hidden_layers, self.sliding_window)
        if self.attention_dropout:
            p.append(f"attention_dropout: must be 0 (nanocore has no dropout), got {self.attention_dropout}")
        return p


@attrs.define
class Qwen3MoeConfig(Qwen3Config):
    """A Qwen3-MoE decoder: Qwen3's attention; each MLP a sparse mixture of fine-grained SwiGLU experts
    (softmax router, top-k), except the layers `mlp_only_layers` and `decoder_sparse_step` keep dense."""

    num_experts: int = doc("Routed experts per sparse layer.", default=8)
    num_experts_per_tok: int = doc("Experts each token is routed to (top-k).", default=2)
    moe_intermediate_size: int = doc("Each expert's MLP width (intermediate_size is the dense layers').", default=64)
    norm_topk_prob: bool = doc("Renormalise the top-k probabilities to sum to 1 (Qwen3-MoE: true).", default=False)
    decoder_sparse_step: int = doc("Layer i is sparse when (i + 1) % decoder_sparse_step == 0.", default=1)
    mlp_only_layers: list[int] = doc("Layers that keep a dense MLP whatever decoder_sparse_step says.", factory=list)
    router_aux_loss_coef: float = doc(
        "Weight of the load-balancing loss (transformers' definition, see nanocore.model_parts.moe); 0 turns it off.",
        default=0.001,
    )
    router_z_loss_coef: float = doc(
        "Weight of the router z-loss (ST-MoE; not in transformers' Qwen3-MoE); 0 turns it off.", default=0.0
    )
    output_router_logits: bool = doc(
        "transformers compatibility; accepted and ignored (the auxiliary loss is on when its coefficient is).",
        default=False,
    )

    @property
    def attention_layer_types(self) -> list[str]:
        """transformers' Qwen3-MoE windows every layer when use_sliding_window is on (no max_window_layers)."""
        if self.layer_types is not None:
            return list(self.layer_types)
        kind = "sliding_attention" if self.use_sliding_window else "full_attention"
        return [kind] * self.num_hidden_layers

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """transformers' rule: not listed in mlp_only_layers, experts exist, and on the sparse step."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def moe_spec(self) -> MoESpec:
        """The sparse block of the sparse layers (`nanocore.model_parts.moe`; the model counts them)."""
        return MoESpec(
            hidden_size=self.hidden_size,
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            hidden_act=self.hidden_act,
            norm_topk_prob=self.norm_topk_prob,
            aux_loss_coef=self.router_aux_loss_coef,
            z_loss_coef=self.router_z_loss_coef,
        )

    def problems(self, tp: int = 1, ep: int = 1) -> list[str]:
        """Problems with this config (as 'field: message') for tensor- and expert-parallel sizes `tp`, `ep`."""
        p = super().problems(tp=tp)
        p += expert_problems(self.num_experts, self.num_experts_per_tok, ep, "num_experts")
        if self.moe_intermediate_size < 1:
            p.append(f"moe_intermediate_size: must be at least 1, got {self.moe_intermediate_size}")
        if self.decoder_sparse_step < 1:
            p.append(f"decoder_sparse_step: must be at least 1, got {self.decoder_sparse_step}")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            p.append(f"mlp_only_layers: {outside} are not layers of this model (0..{self.num_hidden_layers - 1})")
        for key in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, key) < 0:
                p.append(f"{key}: must be 0 or more, got {getattr(self, key)}")
        return p

    def check(self, config: Any) -> list[str]:
        """Cross-field checks against the whole run config (see nanocore.config.checks)."""
        par = config.parallelism
        return self.problems(tp=par.tp, ep=getattr(par, "expert_parallel_size", 1))
