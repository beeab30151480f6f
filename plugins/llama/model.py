"""LLaMA as a single-device causal LM that follows `nanocore.model_api`.

Module and parameter names equal Hugging Face transformers' `LlamaForCausalLM`, so its state dict
loads without renaming. There are no buffers: the engine materialises models from the meta device
and only knows parameters, so rotary tables are computed from the config on first use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion

from nanocore.model_api import KVCache, TiedWeightsMixin, count_matmul_parameters, init_normal
from nanocore.sequence_api import SequenceRuntime
from nanocore_plugins.llama.config import LlamaConfig

try:  # optional fast path on GPUs
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = None

ACT_FNS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """Per-pair inverse frequencies (float32, CPU), with transformers' rope_scaling rules."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind, scaling = config.rope_type, config.rope_scaling or {}
    if kind == "linear":
        return inv_freq / scaling["factor"]
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

    def __init__(self, config: LlamaConfig):
        with torch.device("cpu"):  # the model may be built under torch.device("meta")
            self.inv_freq = rope_inverse_frequencies(config)
        self.min_length = config.max_position_embeddings
        self._last: tuple | None = None  # (positions, (device, dtype), cos, sin) of the last `at`
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _direct(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at `positions` computed without the tables (the same values): inside a compiled
        graph (`model.compile`), which must not depend on what an earlier call stored, or a block
        recomputed in backward would run another graph than its forward did."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin(self, seq_len: int, offset: int, device: torch.device, dtype: torch.dtype):
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
                self._tables[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
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
    """x: [b, heads, s, head_dim]; cos, sin: [s, head_dim]."""
    return x * cos + rotate_half(x) * sin


# `scaled_dot_product_attention(..., enable_gqa=True)` arrived in torch 2.5
SDPA_HAS_GQA = TorchVersion(torch.__version__) >= "2.5"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last q_len positions over all kv_len keys. Inputs [b, heads, len, d]."""
    q_len, kv_len = q.shape[2], k.shape[2]
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        # flash-attn aligns the causal mask to the bottom-right corner, which is what a cache needs.
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)
    extra = {}
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group of q heads
        if SDPA_HAS_GQA:  # no repeated key/value copies (on CPU it also keeps the flash kernel)
            extra["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
    if q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
    if q_len == 1:  # one new token sees everything cached
        return F.scaled_dot_product_attention(q, k, v, **extra)
    # q_len new tokens after kv_len - q_len cached ones: query i sees keys up to kv_len - q_len + i.
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(diagonal=kv_len - q_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)


class LlamaRMSNorm(nn.Module):
    """RMSNorm computed in float32, as transformers does."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SequenceSlot:
    """The engine's `SequenceRuntime` (context parallelism, document masking), shared by every layer;
    None: positions from shapes and plain causal attention."""

    runtime: SequenceRuntime | None = None


class AttentionCore(nn.Module):
    """softmax(q k^T) v: parameter-free, so an engine can recompute it in backward instead of keeping
    what it saves (selective recompute, `selective_recompute_modules`). Positions are already applied."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runtime: SequenceRuntime | None = None):
        return runtime.attend(q, k, v) if runtime is not None else attention(q, k, v)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary positions. Head counts come from tensor shapes."""

    def __init__(self, config: LlamaConfig, layer_idx: int, rotary: Rotary, sequence: SequenceSlot | None = None):
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.layer_idx, self.head_dim, self.rotary = layer_idx, d, rotary
        self.sequence = sequence if sequence is not None else SequenceSlot()
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, config.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, config.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=bias)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        # Shapes come from the projections, not from x: under sequence parallelism x holds a
        # sequence shard and the column-parallel projections return the gathered sequence.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        runtime = self.sequence.runtime if kv_cache is None else None
        if runtime is not None:  # this rank's tokens of a longer sequence, or packed documents
            cos, sin = self.rotary.at(runtime.positions(), q.dtype)
            out = self.core(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, runtime)
            return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        offset = kv_cache.length if kv_cache is not None else 0
        cos, sin = self.rotary.cos_sin(s, offset, x.device, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = self.core(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)) (SwiGLU with silu)."""

    def __init__(self, config: LlamaConfig, intermediate_size: int | None = None):
        super().__init__()
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act = ACT_FNS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). One pipeline block; one tensor in, one out.

    `mlp` replaces the dense `LlamaMLP` (Mixtral's sparse mixture-of-experts block)."""

    def __init__(
        self,
        config: LlamaConfig,
        layer_idx: int,
        rotary: Rotary,
        mlp: nn.Module | None = None,
        sequence: SequenceSlot | None = None,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary, sequence)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (transformers' `model.` prefix). `make_mlp(layer_idx)`,
    if given, builds each layer's MLP."""

    def __init__(self, config: LlamaConfig, vocab_size: int, make_mlp: Callable[[int], nn.Module] | None = None):
        super().__init__()
        rotary = Rotary(config)
        self.sequence = SequenceSlot()
        self.embed_tokens = nn.Embedding(vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, make_mlp(i) if make_mlp is not None else None, self.sequence)
            for i in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(TiedWeightsMixin, nn.Module):
    """LLaMA causal LM: `forward(input_ids, kv_cache=None) -> logits[b, s, vocab_size]`.

    Subclasses change the MLP through `make_mlp` (called once per layer while building)."""

    def __init__(
        self, config: LlamaConfig, *, init_std: float = 0.02, scale_output_init: bool = True, vocab_multiple: int = 1
    ):
        super().__init__()
        self.config = config
        self.true_vocab_size = config.vocab_size
        self.vocab_size = -(-config.vocab_size // vocab_multiple) * vocab_multiple
        self.init_std = init_std
        self.scale_output_init = scale_output_init
        self.model = LlamaModel(config, self.vocab_size, self.make_mlp)
        self.lm_head = nn.Linear(config.hidden_size, self.vocab_size, bias=False)
        # Rows of these past true_vocab_size are padding (vocab_multiple): never saved in checkpoints.
        self.vocab_parameters = ["model.embed_tokens.weight", "lm_head.weight"]
        self.tied_parameters: list[tuple[str, str]] = []
        if config.tie_word_embeddings:
            self.tied_parameters = [("model.embed_tokens.weight", "lm_head.weight")]
            self.tie_weights()
        layers = "model.layers.*"
        # What engines may do to the sequence (nanocore.sequence_api): split it over context-parallel
        # ranks, mask attention between packed documents.
        self.sequence_features = {"context_parallel", "document_masking"}
        self.init_by_row_blocks = True  # init_parameter fills any block of rows alike (by name only)
        self.selective_recompute_modules = [f"{layers}.self_attn.core"]
        self.tp_plan: dict[str, Any] = {
            "model.embed_tokens": "vocab_embedding",
            f"{layers}.self_attn.q_proj": "colwise",
            f"{layers}.self_attn.k_proj": {"style": "colwise_kv", "head_dim": config.head_dim},
            f"{layers}.self_attn.v_proj": {"style": "colwise_kv", "head_dim": config.head_dim},
            f"{layers}.self_attn.o_proj": "rowwise",
            f"{layers}.mlp.gate_proj": "colwise",
            f"{layers}.mlp.up_proj": "colwise",
            f"{layers}.mlp.down_proj": "rowwise",
            "lm_head": "lm_head",
        }
        # Counted now, before an engine shards anything: every parameter but the input embedding
        # (the output head counts even when tied, since it is a real matmul).
        self._matmul_params = count_matmul_parameters(self, ["model.embed_tokens.weight"], self.active_fraction)

    def set_sequence_runtime(self, runtime: SequenceRuntime | None) -> None:
        """Attention asks `runtime` for positions and attends through it (see nanocore.sequence_api)."""
        self.model.sequence.runtime = runtime

    def make_mlp(self, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s MLP (called while `__init__` builds the layers; `self.config` is set)."""
        return LlamaMLP(self.config)

    def active_fraction(self, name: str) -> float:
        """The share of parameter `name` a token computes with, for the FLOPs estimate (all of it here)."""
        return 1

    def pipeline_blocks(self) -> list[list[str]]:
        layers = [[f"model.layers.{i}"] for i in range(len(self.model.layers))]
        return [["model.embed_tokens"], *layers, ["model.norm", "lm_head"]]

    def forward(self, input_ids: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1])
        return self.lm_head(self.model.norm(x))

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full tensor for `name`: normal(0, std) weights, output projections scaled, norms 1, biases 0."""
        if name.endswith("norm.weight"):
            tensor.data.fill_(1.0)
            return
        if name.endswith(".bias"):
            tensor.data.zero_()
            return
        if not name.endswith(".weight"):
            raise KeyError(f"llama: no initialisation rule for parameter {name!r}")
        std = self.init_std
        if self.scale_output_init and name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= math.sqrt(2 * self.config.num_hidden_layers)
        init_normal(tensor, std, generator)

    def activation_elements_per_token(self) -> dict[str, float] | None:
        """What autograd keeps for backward per token (elements), for the memory planner
        (`nanocore.model_api`): per decoder layer and for the head block."""
        c = self.config
        h, kv, i = c.hidden_size, c.kv_heads * c.head_dim, c.intermediate_size
        return {
            "layer_norms": 4 * h,  # both norms' input and output
            "layer_column_inputs": 2 * h,  # the normed inputs of q/k/v and gate/up (the norms' outputs)
            # rotated q, k, v, attention output, o_proj's input; gate, silu(gate), up, their product
            "layer_sharded": 3 * h + 2 * kv + 4 * i,
            "layer_attention_core_outputs": h,  # what selective recompute does not keep
            "head_norm": 2 * h,
            "head_logits": self.vocab_size,
        }

    def flops_per_token(self, sequence_length: int) -> float:
        """Training FLOPs per token (nanoGPT / PaLM estimate): 6N + 12 * layers * hidden * seq."""
        c = self.config
        return 6 * self._matmul_params + 12 * c.num_hidden_layers * c.hidden_size * sequence_length
