"""The LLaMA model's config section (`model.model_config`), with nanotron's field names."""

from __future__ import annotations

from typing import Any

import attrs

from nanocore.config.schema import doc

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")
ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@attrs.define
class LlamaConfig:
    """A LLaMA decoder (LLaMA 1/2/3 family): RMSNorm, rotary positions, grouped-query attention, SwiGLU.

    Field names and meanings match nanotron's and Hugging Face transformers' `LlamaConfig`, so a
    checkpoint's `config.json` values can be copied over.
    """

    bos_token_id: int = doc("Beginning-of-sequence token id.", default=1)
    eos_token_id: int = doc("End-of-sequence token id (generation stops on it).", default=2)
    hidden_act: str = doc(f"MLP activation: one of {', '.join(ACTIVATIONS)}.", default="silu")
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
    pad_token_id: int | None = doc("Padding token id, if the tokenizer has one.", default=None)
    pretraining_tp: int = doc("transformers compatibility; accepted and ignored.", default=1)
    rms_norm_eps: float = doc("Epsilon inside RMSNorm.", default=1e-6)
    rope_scaling: dict[str, Any] | None = doc(
        "RoPE frequency scaling, as in transformers: null, {rope_type: linear, factor} or LLaMA-3's "
        "{rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}.",
        default=None,
    )
    rope_theta: float = doc("RoPE base period (10000 for LLaMA 2, 500000 for LLaMA 3).", default=10000.0)
    rope_interleaved: bool = doc(
        "nanotron compatibility; only false (transformers' rotate-half convention) is supported.", default=False
    )
    tie_word_embeddings: bool = doc("Share the input embedding matrix with the output head.", default=False)
    use_cache: bool = doc("transformers compatibility; generation always uses a key/value cache.", default=True)
    vocab_size: int = doc("Tokenizer vocabulary size (padded by model.make_vocab_size_divisible_by).", default=256)

    @property
    def kv_heads(self) -> int:
        """num_key_value_heads, with null meaning one per query head."""
        return self.num_key_value_heads if self.num_key_value_heads is not None else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rope_type(self) -> str:
        """The rope_scaling kind; transformers' older configs spell the key `type`."""
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    def problems(self, tp: int = 1) -> list[str]:
        """Problems with this config (as 'field: message') for a tensor-parallel size of `tp`."""
        p: list[str] = []
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
            if getattr(self, key) < 1:
                p.append(f"{key}: must be at least 1, got {getattr(self, key)}")
        if self.num_key_value_heads is not None and self.num_key_value_heads < 1:
            p.append(f"num_key_value_heads: must be at least 1 or null, got {self.num_key_value_heads}")
        if p:
            return p
        heads, kv = self.num_attention_heads, self.kv_heads
        if self.hidden_size % heads:
            p.append(f"hidden_size: {self.hidden_size} is not divisible by num_attention_heads = {heads}")
        elif self.head_dim % 2:
            p.append(
                f"hidden_size: head size hidden_size / num_attention_heads = {self.head_dim} must be even for RoPE"
            )
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
        if self.hidden_act not in ACTIVATIONS:
            p.append(
                f"hidden_act: unsupported activation {self.hidden_act!r}; expected one of {', '.join(ACTIVATIONS)}"
            )
        if self.rope_type not in ROPE_TYPES:
            p.append(f"rope_scaling: unknown rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        elif self.rope_type in ("linear", "llama3"):
            needed = ("factor",) if self.rope_type == "linear" else LLAMA3_ROPE_KEYS
            missing = [k for k in needed if k not in self.rope_scaling]  # type: ignore[operator]
            if missing:
                p.append(f"rope_scaling: rope_type {self.rope_type} needs {', '.join(missing)}")
        if self.rope_interleaved:
            p.append(
                "rope_interleaved: interleaved RoPE is not supported; set it to false (the transformers/LLaMA-3 "
                "convention; permute q_proj/k_proj rows when converting an interleaved checkpoint)"
            )
        return p

    def check(self, config: Any) -> list[str]:
        """Cross-field checks against the whole run config (see nanocore.config.checks)."""
        return self.problems(tp=config.parallelism.tp)


SCORING_FUNCS = ("softmax", "sigmoid")


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
        "Weight of the load-balancing loss (transformers' definition, see nanocore_plugins.llama.mixtral); "
        "0 turns it off.",
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

    def problems(self, tp: int = 1, ep: int = 1) -> list[str]:
        """Problems with this config (as 'field: message') for tensor- and expert-parallel sizes `tp`, `ep`."""
        p = super().problems(tp=tp)
        experts, k = self.num_local_experts, self.num_experts_per_tok
        if experts < 1:
            p.append(f"num_local_experts: must be at least 1, got {experts}")
        if k < 1:
            p.append(f"num_experts_per_tok: must be at least 1, got {k}")
        elif experts >= 1 and k > experts:
            p.append(f"num_experts_per_tok: {k} is above num_local_experts={experts}")
        if experts >= 1 and ep > 1 and experts % ep:
            p.append(
                f"num_local_experts: {experts} experts cannot be split over parallelism.expert_parallel_size = {ep} "
                "ranks; choose an expert_parallel_size that divides the number of experts"
            )
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
