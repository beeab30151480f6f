"""DeepSeek-V3 as a composition of the shared parts: multi-head latent attention
(`nanocore.model_parts.mla`) in every layer, a dense MLP in the first `first_k_dense_replace`
layers and the sparse block (sigmoid scores, group-limited top-k, shared experts) in the rest.

Module and parameter names equal transformers' `DeepseekV3ForCausalLM` (fused experts), so its
state dict loads without renaming.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanocore.model_api import PredictionRuntime, TPStyle, count_matmul_parameters
from nanocore.model_parts.attention import SequenceSlot
from nanocore.model_parts.layers import mlp_tp_plan
from nanocore.model_parts.mla import MultiHeadLatentAttention, mla_tp_plan
from nanocore.model_parts.moe import MoEDecoderLM, MoESpec
from nanocore.model_parts.mtp import MTPLayer, MultiTokenPrediction
from nanocore.model_parts.rotary import Rotary
from nanocore_plugins.deepseek_v3.config import DeepseekV3Config


class DeepseekV3ForCausalLM(MoEDecoderLM):
    """DeepSeek-V3 causal LM: `forward(input_ids, kv_cache=None) -> logits[b, s, vocab_size]`; with
    `num_nextn_predict_layers`, multi-token prediction modules `model.mtp.{k}` (nanocore.model_parts.mtp)
    in the last pipeline block, trained through the engine's prediction runtime."""

    config: DeepseekV3Config

    def __init__(self, config: DeepseekV3Config, **kwargs: Any):
        super().__init__(config, **kwargs)
        depth = self.mtp_depth = config.num_nextn_predict_layers
        self.prediction_metrics: list[str] = []
        if not depth:
            return
        layers, sequence = [], self.model.sequence
        rotary = self.model.layers[0].self_attn.rotary
        for k in range(depth):
            index = config.num_hidden_layers + k
            attn, mlp = self.make_attention(index, rotary, sequence), self.make_mlp(index)
            layers.append(MTPLayer(config.hidden_size, self.vocab_size, config.rms_norm_eps, attn, mlp))
        self.model.mtp = MultiTokenPrediction(layers, config.mtp_loss_coef)
        self.prediction_metrics = [MultiTokenPrediction.metric]
        for k in range(depth):
            prefix = f"model.mtp.{k}"
            self.tied_parameters += [
                ("model.embed_tokens.weight", f"{prefix}.embed_tokens.weight"),
                ("lm_head.weight", f"{prefix}.shared_head.head.weight"),
            ]
            self.tp_plan.update(
                {
                    f"{prefix}.embed_tokens": "vocab_embedding",
                    f"{prefix}.shared_head.head": "lm_head",
                    **self.attention_tp_plan(f"{prefix}.self_attn"),
                }
            )
            if self.is_sparse_layer(config.num_hidden_layers + k):
                self.moe_layers.append(f"{prefix}.mlp")
                if config.n_shared_experts:
                    self.tp_plan.update(mlp_tp_plan(f"{prefix}.mlp.shared_experts"))
            else:
                self.tp_plan.update(mlp_tp_plan(f"{prefix}.mlp"))
        self.tie_weights()
        self._matmul_params = count_matmul_parameters(self, ["model.embed_tokens.weight"], self.active_fraction)

    def set_prediction_runtime(self, runtime: PredictionRuntime | None) -> None:
        """Multi-token prediction reads its tokens and losses from `runtime` (see nanocore.model_parts.mtp)."""
        for module in self.model.modules():  # none on a pipeline stage without the last block
            if isinstance(module, MultiTokenPrediction):
                module.runtime = runtime

    def pipeline_blocks(self) -> list[list[str]]:
        blocks = super().pipeline_blocks()
        if self.mtp_depth:
            blocks[-1] = ["model.mtp", *blocks[-1]]
        return blocks

    def before_final_norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.mtp_depth:
            x = self.model.mtp(x)
        return x

    def sparse_block(self) -> MoESpec:
        return self.config.moe_spec()

    def is_sparse_layer(self, layer_idx: int) -> bool:
        return self.config.is_sparse_layer(layer_idx)

    def make_attention(self, layer_idx: int, rotary: Rotary, sequence: SequenceSlot) -> nn.Module:
        c = self.config
        return MultiHeadLatentAttention(
            c.hidden_size,
            c.num_attention_heads,
            q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            bias=c.attention_bias,
            eps=c.rms_norm_eps,
            softmax_scale=c.softmax_scale,
            rope_interleave=c.rope_interleave,
            layer_idx=layer_idx,
            rotary=rotary,
            sequence=sequence,
        )

    def attention_tp_plan(self, prefix: str) -> dict[str, TPStyle]:
        c = self.config
        return mla_tp_plan(prefix, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim)

    def attention_activation_elements(self) -> dict[str, float]:
        """What MLA keeps per token: split over TP, the query projection's output, its rotated part, the
        concatenated (and, under YaRN's mscale, scaled) queries, kv_b's output, the concatenated keys,
        the attention output and o_proj's input; whole on every TP rank, the query and key/value
        latents with their norms' input and output and the rotated shared key."""
        c = self.config
        heads, qk = c.num_attention_heads, c.qk_head_dim
        scaled = heads * qk if abs(c.softmax_scale * qk**0.5 - 1.0) > 1e-12 else 0
        sharded = (
            3 * heads * qk + heads * c.qk_rope_head_dim + scaled
            + heads * (c.qk_nope_head_dim + c.v_head_dim) + 2 * heads * c.v_head_dim
        )  # fmt: skip
        replicated = 3 * (c.q_lora_rank or 0) + 3 * c.kv_lora_rank + 2 * c.qk_rope_head_dim
        return {"sharded": sharded, "replicated": replicated, "core_outputs": heads * c.v_head_dim}

    def flops_per_token(self, sequence_length: int) -> float:
        """6N + attention: per layer, per token, 2 x seq x heads x (qk_head_dim + v_head_dim) x 3 (forward
        and backward), the same estimate as LLaMA's 12 x layers x width x seq with MLA's head sizes."""
        c = self.config
        attention = 6 * c.num_hidden_layers * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * sequence_length
        return 6 * self._matmul_params + attention
