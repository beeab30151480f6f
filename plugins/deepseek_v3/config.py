"""The `deepseek_v3` config section (`model.model_config`), with transformers' `DeepseekV3Config`
names; the options beyond it (router balancing rate, auxiliary losses) are nanocore's."""

from __future__ import annotations

from typing import Any

import attrs

from nanocore.config.schema import doc
from nanocore.model_parts.config import DecoderConfig
from nanocore.model_parts.layers import ACT_FNS
from nanocore.model_parts.moe import MoESpec, expert_problems
from nanocore.model_parts.rotary import rope_problems, rope_type, yarn_mscale


@attrs.define
class DeepseekV3Config(DecoderConfig):
    """A DeepSeek-V3 decoder: multi-head latent attention, the first `first_k_dense_replace` layers
    dense, the rest fine-grained experts with sigmoid scores, group-limited top-k and shared experts.
    `num_key_value_heads` and `head_dim` are transformers' bookkeeping: MLA has one latent, and each
    head's sizes are the qk_*/v_head_dim fields."""

    intermediate_size: int = doc("Width of the dense layers' MLP.", default=128)
    moe_intermediate_size: int = doc("Width of each routed (and shared) expert's MLP.", default=32)
    n_routed_experts: int = doc("Routed experts per sparse layer.", default=8)
    n_shared_experts: int = doc(
        "Shared experts every token goes through (their MLP is n x the expert width).", default=1
    )
    num_experts_per_tok: int = doc("Routed experts each token is sent to (top-k).", default=2)
    n_group: int = doc("Expert groups for group-limited routing (1: no groups).", default=1)
    topk_group: int = doc("Groups a token may route to: the best topk_group by their two best scores.", default=1)
    routed_scaling_factor: float = doc("The routed experts' weights are multiplied by it.", default=1.0)
    norm_topk_prob: bool = doc("Renormalise the chosen experts' scores to sum to 1 (before the scaling).", default=True)
    first_k_dense_replace: int = doc("The first k layers keep a dense MLP.", default=1)
    q_lora_rank: int | None = doc("Rank of the query bottleneck; null: one full query projection.", default=32)
    kv_lora_rank: int = doc("Width of the compressed key/value latent.", default=32)
    qk_nope_head_dim: int = doc("Per-head query/key dimensions without rotary positions.", default=16)
    qk_rope_head_dim: int = doc(
        "Per-head query/key dimensions with rotary positions (one key for all heads).", default=8
    )
    v_head_dim: int = doc("Per-head value dimensions.", default=16)
    rope_interleave: bool = doc(
        "Rotary on interleaved pairs (DeepSeek's released weights); false: transformers' rotate-half.", default=True
    )
    attention_dropout: float = doc("transformers compatibility; only 0 (nanocore has no dropout).", default=0.0)
    pretraining_tp: int = doc("transformers compatibility; accepted and ignored.", default=1)
    num_nextn_predict_layers: int = doc(
        "Multi-token prediction modules (DeepSeek-V3's MTP): module k predicts the token k + 1 positions ahead; "
        "0 turns MTP off.",
        default=0,
    )
    mtp_loss_coef: float = doc(
        "Weight of the MTP loss (the mean over modules of their cross-entropies) added to the main loss; "
        "DeepSeek-V3 used 0.3, then 0.1.",
        default=0.1,
    )
    router_bias_update_rate: float = doc(
        "After each optimizer step, e_score_correction_bias_e += rate * sign(mean load - load_e) (DeepSeek-V3's "
        "auxiliary-loss-free balancing); 0 keeps the bias as loaded.",
        default=0.001,
    )
    router_aux_loss_coef: float = doc(
        "Weight of a load-balancing loss on the normalised sigmoid scores (nanocore.model_parts.moe); 0: off.",
        default=0.0,
    )
    router_z_loss_coef: float = doc("Weight of the router z-loss (ST-MoE); 0 turns it off.", default=0.0)

    @property
    def head_size(self) -> int:
        """The rotary width: the shared rotary key's, as transformers sets head_dim for DeepSeek-V3."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 where the scaling sets it."""
        scale = self.qk_head_dim**-0.5
        scaling = self.rope_scaling or {}
        if rope_type(scaling) != "default" and scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        return scale

    def is_sparse_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def moe_spec(self) -> MoESpec:
        """The sparse block of the sparse layers (`nanocore.model_parts.moe`; the model counts them)."""
        return MoESpec(
            hidden_size=self.hidden_size,
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            hidden_act=self.hidden_act,
            scoring_func="sigmoid",
            norm_topk_prob=self.norm_topk_prob,
            aux_loss_coef=self.router_aux_loss_coef,
            z_loss_coef=self.router_z_loss_coef,
            bias_update_rate=self.router_bias_update_rate,
            shared_intermediate_size=self.moe_intermediate_size * self.n_shared_experts,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def problems(self, tp: int = 1, ep: int = 1) -> list[str]:
        """Problems with this config (as 'field: message') for tensor- and expert-parallel sizes `tp`, `ep`."""
        p: list[str] = []
        positive = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
                    "num_hidden_layers", "vocab_size", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")  # fmt: skip
        for key in positive:
            if getattr(self, key) < 1:
                p.append(f"{key}: must be at least 1, got {getattr(self, key)}")
        for key in ("qk_nope_head_dim", "n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            if getattr(self, key) < 0:
                p.append(f"{key}: must be 0 or more, got {getattr(self, key)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            p.append(f"q_lora_rank: must be at least 1 or null, got {self.q_lora_rank}")
        if p:
            return p
        heads = self.num_attention_heads
        if heads % tp:
            p.append(
                f"num_attention_heads: {heads} heads cannot be split over parallelism.tp = {tp} ranks; "
                "choose a tp that divides the number of heads"
            )
        if self.qk_rope_head_dim % 2:
            p.append(f"qk_rope_head_dim: {self.qk_rope_head_dim} must be even for RoPE")
        p += expert_problems(self.n_routed_experts, self.num_experts_per_tok, ep, "n_routed_experts")
        experts, groups = self.n_routed_experts, self.n_group
        if groups < 1:
            p.append(f"n_group: must be at least 1, got {groups}")
        elif experts % groups:
            p.append(f"n_group: {groups} groups do not divide n_routed_experts = {experts} into equal groups")
        elif not 1 <= self.topk_group <= groups:
            p.append(f"topk_group: {self.topk_group} must be between 1 and n_group = {groups}")
        elif self.topk_group * (experts // groups) < self.num_experts_per_tok:
            p.append(
                f"topk_group: {self.topk_group} groups of {experts // groups} experts hold fewer than "
                f"num_experts_per_tok = {self.num_experts_per_tok}"
            )
        if self.hidden_act not in ACT_FNS:
            p.append(f"hidden_act: unsupported activation {self.hidden_act!r}; expected one of {', '.join(ACT_FNS)}")
        p += rope_problems(self.rope_scaling)
        if self.attention_dropout:
            p.append(f"attention_dropout: must be 0 (nanocore has no dropout), got {self.attention_dropout}")
        for key in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate", "mtp_loss_coef"):
            if getattr(self, key) < 0:
                p.append(f"{key}: must be 0 or more, got {getattr(self, key)}")
        return p

    def check(self, config: Any) -> list[str]:
        """Cross-field checks against the whole run config (see nanocore.config.checks)."""
        par = config.parallelism
        return self.problems(tp=par.tp, ep=getattr(par, "expert_parallel_size", 1))
