"""The LLaMA model's config section (`model.model_config`), with nanotron's field names."""

from __future__ import annotations

from typing import Any

import attrs

from nanocore.config.schema import doc
from nanocore.model_parts.config import DecoderConfig
from nanocore.model_parts.moe import SCORING_FUNCS, MoESpec, expert_problems


@attrs.define
class LlamaConfig(DecoderConfig):
    """A LLaMA decoder (LLaMA 1/2/3 family): RMSNorm, rotary positions, grouped-query attention, SwiGLU.

    Field names and meanings match nanotron's and Hugging Face transformers' `LlamaConfig`, so a
    checkpoint's `config.json` values can be copied over.
    """

    pretraining_tp: int = doc("transformers compatibility; accepted and ignored.", default=1)
    rope_interleaved: bool = doc(
        "nanotron compatibility; only false (transformers' rotate-half convention) is supported.", default=False
    )

    def problems(self, tp: int = 1) -> list[str]:
        """Problems with this config (as 'field: message') for a tensor-parallel size of `tp`."""
        p = super().problems(tp=tp)
        if self.rope_interleaved:
            p.append(
                "rope_interleaved: interleaved RoPE is not supported; set it to false (the transformers/LLaMA-3 "
                "convention; permute q_proj/k_proj rows when converting an interleaved checkpoint)"
            )
        return p


@attrs.define
class MixtralConfig(LlamaConfig):
    """A Mixtral decoder: LLaMA's attention and norms, each MLP a sparse mixture of SwiGLU experts.

    Field names match transformers' `MixtralConfig` (`intermediate_size` is each expert's width);
    `num_shared_experts`, `scoring_func`, `router_bias_update_rate` and `router_z_loss_coef` go
    beyond Mixtral (DeepSeek-V3 / Qwen2-MoE style routers) and have no transformers equivalent.
    """

    num_local_experts: int = doc("Routed experts per layer.", default=8)
    num_experts_per_tok: int = doc("Experts each token is routed to (top-k).", default=2)
    router_aux_loss_coef: float = doc(
        "Weight of the load-balancing loss (transformers' definition, see nanocore.model_parts.moe); 0 turns it off.",
        default=0.001,
    )
    router_jitter_noise: float = doc("transformers compatibility; only 0 (no jitter) is supported.", default=0.0)
    output_router_logits: bool = doc(
        "transformers compatibility; accepted and ignored (the auxiliary loss is on when its coefficient is).",
        default=False,
    )
    sliding_window: int | None = doc(
        "transformers compatibility; sliding-window attention is not supported: null, or at least "
        "max_position_embeddings (then it never applies).",
        default=None,
    )
    num_shared_experts: int = doc(
        "Dense SwiGLU experts every token goes through, added to the routed output (DeepSeek / Qwen2-MoE); "
        "not in transformers' Mixtral.",
        default=0,
    )
    shared_expert_intermediate_size: int | None = doc(
        "Width of the shared experts' MLP; null means intermediate_size x num_shared_experts.", default=None
    )
    scoring_func: str = doc(
        "Router scores: softmax (Mixtral) or sigmoid (DeepSeek-V3: top-k on score + a per-expert bias balanced "
        "after each step, weights = the chosen scores renormalised).",
        default="softmax",
    )
    router_bias_update_rate: float = doc(
        "sigmoid routing: after each optimizer step, bias_e += rate * sign(mean load - load_e).", default=0.001
    )
    router_z_loss_coef: float = doc(
        "Weight of the router z-loss (mean over tokens of logsumexp(router logits)^2, ST-MoE); 0 turns it off.",
        default=0.0,
    )

    @property
    def shared_intermediate_size(self) -> int:
        """shared_expert_intermediate_size, with null meaning intermediate_size x num_shared_experts."""
        if self.shared_expert_intermediate_size is not None:
            return self.shared_expert_intermediate_size
        return self.intermediate_size * self.num_shared_experts

    def moe_spec(self) -> MoESpec:
        """The sparse block every layer has (`nanocore.model_parts.moe`; the model counts the layers)."""
        return MoESpec(
            hidden_size=self.hidden_size,
            num_experts=self.num_local_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act,
            scoring_func=self.scoring_func,
            norm_topk_prob=True,
            aux_loss_coef=self.router_aux_loss_coef,
            z_loss_coef=self.router_z_loss_coef,
            bias_update_rate=self.router_bias_update_rate,
            shared_intermediate_size=self.shared_intermediate_size if self.num_shared_experts else 0,
        )

    def problems(self, tp: int = 1, ep: int = 1) -> list[str]:
        """Problems with this config (as 'field: message') for tensor- and expert-parallel sizes `tp`, `ep`."""
        p = super().problems(tp=tp)
        p += expert_problems(self.num_local_experts, self.num_experts_per_tok, ep, "num_local_experts")
        if self.router_jitter_noise != 0:
            p.append(f"router_jitter_noise: jitter is not supported; set it to 0 (got {self.router_jitter_noise})")
        if self.sliding_window is not None and self.sliding_window < self.max_position_embeddings:
            p.append(
                f"sliding_window: sliding-window attention is not supported; set it to null (or at least "
                f"max_position_embeddings = {self.max_position_embeddings}), got {self.sliding_window}"
            )
        if self.num_shared_experts < 0:
            p.append(f"num_shared_experts: must be 0 or more, got {self.num_shared_experts}")
        elif self.num_shared_experts and self.shared_intermediate_size < 1:
            p.append(f"shared_expert_intermediate_size: must be at least 1, got {self.shared_intermediate_size}")
        if self.scoring_func not in SCORING_FUNCS:
            p.append(f"scoring_func: unknown {self.scoring_func!r}; expected one of {', '.join(SCORING_FUNCS)}")
        for key in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
            if getattr(self, key) < 0:
                p.append(f"{key}: must be 0 or more, got {getattr(self, key)}")
        return p

    def check(self, config: Any) -> list[str]:
        """Cross-field checks against the whole run config (see nanocore.config.checks)."""
        par = config.parallelism
        return self.problems(tp=par.tp, ep=getattr(par, "expert_parallel_size", 1))
