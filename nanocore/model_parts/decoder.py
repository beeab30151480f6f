"""A pre-norm decoder LM assembled from the shared parts: what LLaMA, Mixtral, Qwen3 and Qwen3-MoE
have in common, with transformers' module names (`model.embed_tokens`, `model.layers.N.self_attn`,
`.mlp`, `.input_layernorm`, `.post_attention_layernorm`, `model.norm`, `lm_head`).

A model type subclasses `DecoderLM` and changes what differs: `make_attention` / `make_mlp` (called
once per layer while building), `qk_norm`, and the TP plan, initialisation and planner figures that
follow. It satisfies `nanocore.model_api.CausalLM` as it stands.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from nanocore.config.schema import ModelArgs
from nanocore.errors import ConfigError
from nanocore.model_api import (
    KVCache,
    TiedWeightsMixin,
    TPStyle,
    count_matmul_parameters,
    init_normal,
    vocab_parameters,
)
from nanocore.model_parts.attention import GroupedQueryAttention, SequenceSlot
from nanocore.model_parts.config import DecoderConfig
from nanocore.model_parts.layers import GatedMLP, RMSNorm, mlp_tp_plan
from nanocore.model_parts.rotary import Rotary
from nanocore.sequence_api import SequenceRuntime

D = TypeVar("D", bound="DecoderLM")


def build_decoder(cls: type[D], model_args: ModelArgs, vocab_multiple: int = 1) -> D:
    """A model plugin's `build` for a `DecoderLM` subclass: checks the config (one error naming every
    problem by its YAML path), then builds on the current default device (meta when an engine calls)."""
    config = model_args.model_config
    problems = config.problems()
    if problems:
        raise ConfigError([f"model.model_config.{p}" for p in problems])
    init = model_args.init_method
    return cls(
        config, init_std=init.std, scale_output_init=init.scaling_method == "NUM_LAYERS", vocab_multiple=vocab_multiple
    )


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). One pipeline block; one tensor in, one out."""

    def __init__(
        self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, norm_class: type[nn.Module] = RMSNorm
    ):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm_class(hidden_size, eps)
        self.post_attention_layernorm = norm_class(hidden_size, eps)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_cache)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class PostNormDecoderLayer(nn.Module):
    """OLMo 2 and 3's block: each sub-block's output is normed before it joins the residual stream,
    x + norm(attn(x)), then + norm(mlp(.)) (`post_attention_layernorm`, `post_feedforward_layernorm`;
    no input norm)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.post_attention_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, kv_cache))
        out: torch.Tensor = x + self.post_feedforward_layernorm(self.mlp(x))
        return out


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (transformers' `model.` prefix)."""

    def __init__(
        self, embed_tokens: nn.Embedding, layers: Sequence[nn.Module], norm: nn.Module, sequence: SequenceSlot
    ):
        super().__init__()
        self.sequence = sequence
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class DecoderLM(TiedWeightsMixin, nn.Module):
    """Causal LM: `forward(input_ids, kv_cache=None) -> logits[b, s, vocab_size]`."""

    qk_norm = False  # RMSNorm each query and key head before rotary (Qwen3)

    def __init__(
        self, config: DecoderConfig, *, init_std: float = 0.02, scale_output_init: bool = True, vocab_multiple: int = 1
    ):
        super().__init__()
        self.config = config
        self.true_vocab_size = config.vocab_size
        self.vocab_size = -(-config.vocab_size // vocab_multiple) * vocab_multiple
        self.init_std = init_std
        self.scale_output_init = scale_output_init
        rotary = Rotary(config.head_size, config.rope_theta, config.rope_scaling, config.max_position_embeddings)
        sequence = SequenceSlot()
        layers = [
            self.make_layer(i, self.make_attention(i, rotary, sequence), self.make_mlp(i))
            for i in range(config.num_hidden_layers)
        ]
        self.model = DecoderModel(
            nn.Embedding(self.vocab_size, config.hidden_size),
            layers,
            RMSNorm(config.hidden_size, config.rms_norm_eps),
            sequence,
        )
        self.lm_head = nn.Linear(config.hidden_size, self.vocab_size, bias=False)
        # Rows of these past true_vocab_size are padding (vocab_multiple): never saved in checkpoints.
        self.vocab_parameters = ["model.embed_tokens.weight", "lm_head.weight"]
        self.tied_parameters: list[tuple[str, str]] = []
        if config.tie_word_embeddings:
            self.tied_parameters = [("model.embed_tokens.weight", "lm_head.weight")]
            self.tie_weights()
        layers_pattern = "model.layers.*"
        # What engines may do to the sequence (nanocore.sequence_api): split it over context-parallel
        # ranks, mask attention between packed documents.
        self.sequence_features = {"context_parallel", "document_masking"}
        self.attention_heads = config.num_attention_heads  # all_to_all context parallelism splits these
        self.init_by_row_blocks = True  # init_parameter fills any block of rows alike (by name only)
        self.selective_recompute_modules = [f"{layers_pattern}.self_attn.core"]
        self.tp_plan: dict[str, TPStyle] = {
            "model.embed_tokens": "vocab_embedding",
            **self.attention_tp_plan(f"{layers_pattern}.self_attn"),
            **mlp_tp_plan(f"{layers_pattern}.mlp"),
            "lm_head": "lm_head",
        }
        # Counted now, before an engine shards anything: every parameter but the input embedding
        # (the output head counts even when tied, since it is a real matmul).
        self._matmul_params = count_matmul_parameters(self, ["model.embed_tokens.weight"], self.active_fraction)

    # -- what a model type changes -------------------------------------------------------------
    def make_layer(self, layer_idx: int, self_attn: nn.Module, mlp: nn.Module) -> nn.Module:
        """Layer `layer_idx` around its attention and MLP: the pre-norm `DecoderLayer` here; OLMo 2 and 3
        put their norms after each block instead (`PostNormDecoderLayer`)."""
        return DecoderLayer(self_attn, mlp, self.config.hidden_size, self.config.rms_norm_eps)

    def make_attention(self, layer_idx: int, rotary: Rotary, sequence: SequenceSlot) -> nn.Module:
        """Layer `layer_idx`'s attention (called while `__init__` builds the layers; `self.config` is set),
        with the sliding window the config gives the layer (`DecoderConfig.attention_window`)."""
        c = self.config
        return GroupedQueryAttention(
            c.hidden_size,
            c.num_attention_heads,
            c.kv_heads,
            c.head_size,
            bias=c.attention_bias,
            layer_idx=layer_idx,
            rotary=rotary,
            sequence=sequence,
            qk_norm_eps=c.rms_norm_eps if self.qk_norm else None,
            window=c.attention_window(layer_idx),
        )

    def attention_tp_plan(self, prefix: str) -> dict[str, TPStyle]:
        """The TP plan of `make_attention`'s module under `prefix`: heads split over TP ranks."""
        d = self.config.head_size
        plan: dict[str, TPStyle] = {
            f"{prefix}.q_proj": "colwise",
            f"{prefix}.k_proj": {"style": "colwise_kv", "head_dim": d},
            f"{prefix}.v_proj": {"style": "colwise_kv", "head_dim": d},
            f"{prefix}.o_proj": "rowwise",
        }
        if self.qk_norm:  # one weight for every head; each rank sees its heads' share of the gradient
            plan[f"{prefix}.q_norm"] = "head_norm"
            plan[f"{prefix}.k_norm"] = "head_norm"
        return plan

    def make_mlp(self, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s MLP (called while `__init__` builds the layers; `self.config` is set)."""
        return GatedMLP(self.config.hidden_size, self.config.intermediate_size, self.config.hidden_act)

    def active_fraction(self, name: str) -> float:
        """The share of parameter `name` a token computes with, for the FLOPs estimate (all of it here)."""
        return 1

    def hidden_matrix(self, name: str) -> bool:
        """Every matrix but the vocabulary tables (and their tied copies) and the routers (`mlp.gate`)."""
        return name not in vocab_parameters(self) and not name.endswith(".mlp.gate.weight")

    # -- the CausalLM contract -----------------------------------------------------------------
    def set_sequence_runtime(self, runtime: SequenceRuntime | None) -> None:
        """Attention asks `runtime` for positions and attends through it (see nanocore.sequence_api)."""
        self.model.sequence.runtime = runtime

    def pipeline_blocks(self) -> list[list[str]]:
        layers = [[f"model.layers.{i}"] for i in range(len(self.model.layers))]
        return [["model.embed_tokens"], *layers, ["model.norm", "lm_head"]]

    def forward(self, input_ids: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1])
        else:
            x = self.before_final_norm(x)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits

    def before_final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """What the final norm reads when training (not when generating with a KV cache): the last
        layer's output here; a model type may run more on it (DeepSeek-V3's multi-token prediction)."""
        return x

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full tensor for `name`: normal(0, std) weights, output projections scaled, norms 1, biases 0."""
        if name.endswith("norm.weight"):
            tensor.data.fill_(1.0)
            return
        if name.endswith(".bias"):
            tensor.data.zero_()
            return
        if not name.endswith(".weight"):
            raise KeyError(f"{type(self).__name__}: no initialisation rule for parameter {name!r}")
        std = self.init_std
        if self.scale_output_init and name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= math.sqrt(2 * self.config.num_hidden_layers)
        init_normal(tensor, std, generator)

    def attention_activation_elements(self) -> dict[str, float]:
        """Per token, what `make_attention`'s module keeps for backward: `sharded` (split over TP),
        `replicated` (whole on every TP rank) and `core_outputs` (selective recompute's saving)."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_size, c.kv_heads * c.head_size
        qk_norm = 2 * (q + kv) if self.qk_norm else 0  # each head norm's float32 input and output
        # rotated q, k, v, attention output, o_proj's input
        return {"sharded": 3 * q + 2 * kv + qk_norm, "replicated": 0.0, "core_outputs": q}

    def activation_elements_per_token(self) -> dict[str, float] | None:
        """What autograd keeps for backward per token (elements), for the memory planner
        (`nanocore.model_api`): per decoder layer and for the head block."""
        c = self.config
        h, i = c.hidden_size, c.intermediate_size
        attention = self.attention_activation_elements()
        mlp = 4 * i  # gate, silu(gate), up, their product
        return {
            "layer_norms": 4 * h,  # both norms' input and output
            "layer_column_inputs": 2 * h,  # the normed inputs of q/k/v and gate/up (the norms' outputs)
            "layer_sharded": attention["sharded"] + mlp,
            "layer_replicated": attention["replicated"],
            "layer_attention_core_outputs": attention["core_outputs"],
            "dense_mlp_sharded": mlp,
            "head_norm": 2 * h,
            "head_logits": self.vocab_size,
            "attention_query": c.num_attention_heads * c.head_size,
            "attention_key_value": 2 * c.kv_heads * c.head_size,
            "attention_kv_heads": c.kv_heads,
        }

    def flops_per_token(self, sequence_length: int) -> float:
        """Training FLOPs per token (nanoGPT / PaLM estimate): 6N + 12 * attention width * the keys each
        layer reads, seq for a full layer and min(seq, window) for a sliding-window one."""
        c = self.config
        spans = sum(self.attention_span(i, sequence_length) for i in range(c.num_hidden_layers))
        return 6 * self._matmul_params + 12 * c.num_attention_heads * c.head_size * spans

    def attention_span(self, layer_idx: int, sequence_length: int) -> int:
        """The keys layer `layer_idx`'s attention term counts per query: the sequence, or its window."""
        window = self.config.attention_window(layer_idx)
        return sequence_length if window is None else min(sequence_length, window)
