"""GPT-2 as a single-device causal LM that follows `nanocore.model_api`.

Written like any single-device model; the engine parallelises it from the TP plan and the pipeline
blocks. Two choices make that work:

- q, k and v are separate linears (GPT-2's fused `c_attn` would put all three in one column range,
  which the built-in `colwise` split would cut across q/k/v instead of across heads).
- The learned position table `wpe` is an `nn.Embedding` looked up in the *same* module as the token
  table `wte`, and the TP plan shards both with the `vocab_embedding` style. Under sequence
  parallelism (`tp_mode: REDUCE_SCATTER`) a vocab-parallel embedding returns this rank's slice of
  the sequence; because both lookups see the full `[.., s]` ids and both outputs are cut the same
  way, each rank adds exactly the positions of its own tokens without knowing its rank. A module
  that added positions after the token embedding would see only a shard and not know its offset.

There are no buffers (the engine materialises parameters only) and head counts come from tensor
shapes, so a TP rank's narrower projections just hold fewer heads.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanocore.model_api import KVCache, TiedWeightsMixin, count_matmul_parameters, init_normal
from nanocore_gpt2.config import GPT2Config

ACT_FNS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The last q_len positions attend to all kv_len keys causally. Inputs [b, heads, len, d]."""
    q_len, kv_len = q.shape[2], k.shape[2]
    if q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # q_len new tokens after kv_len - q_len cached ones: query i sees keys up to kv_len - q_len + i.
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(diagonal=kv_len - q_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class GPT2Embeddings(nn.Module):
    """Token plus learned position embedding: `input_ids [b, s] -> [b, s, n_embd]` (one pipeline block)."""

    def __init__(self, config: GPT2Config, vocab_size: int):
        super().__init__()
        self.n_positions = config.n_positions
        self.wte = nn.Embedding(vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)

    def forward(self, input_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """`offset` is the position of the first token (the number of cached tokens when generating)."""
        end = offset + input_ids.shape[1]
        if end > self.n_positions:
            raise ValueError(f"gpt2: position {end - 1} is beyond the model's n_positions = {self.n_positions}")
        positions = torch.arange(offset, end, device=input_ids.device).unsqueeze(0)
        # [1, s, h] broadcasts over the batch; under sequence parallelism both are the same shard.
        return self.wte(input_ids) + self.wpe(positions)


class GPT2Attention(nn.Module):
    """Causal multi-head self-attention with biases. Head counts come from tensor shapes."""

    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        h = config.n_embd
        self.layer_idx, self.head_dim = layer_idx, config.head_dim
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.c_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        # Shapes come from the projections, not from x: under sequence parallelism x holds a
        # sequence shard and the column-parallel projections return the gathered sequence.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s = q.shape[0], q.shape[1]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = causal_attention(q, k, v)
        return self.c_proj(out.transpose(1, 2).reshape(b, s, -1))


class GPT2MLP(nn.Module):
    """c_proj(act(c_fc(x))), both linears with bias."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.inner_size)
        self.c_proj = nn.Linear(config.inner_size, config.n_embd)
        self.act = ACT_FNS[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-LayerNorm block: x + attn(ln_1(x)), then + mlp(ln_2(.)). One pipeline block."""

    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache)
        return x + self.mlp(self.ln_2(x))


class GPT2Transformer(nn.Module):
    """Embeddings, blocks and final LayerNorm (the `transformer.` prefix, as in transformers)."""

    def __init__(self, config: GPT2Config, vocab_size: int):
        super().__init__()
        self.embeddings = GPT2Embeddings(config, vocab_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)


class GPT2LMHeadModel(TiedWeightsMixin, nn.Module):
    """GPT-2 causal LM: `forward(input_ids, kv_cache=None) -> logits[b, s, vocab_size]`."""

    def __init__(
        self, config: GPT2Config, *, init_std: float = 0.02, scale_output_init: bool = True, vocab_multiple: int = 1
    ):
        super().__init__()
        self.config = config
        self.true_vocab_size = config.vocab_size
        self.vocab_size = -(-config.vocab_size // vocab_multiple) * vocab_multiple
        self.init_std, self.scale_output_init = init_std, scale_output_init
        self.transformer = GPT2Transformer(config, self.vocab_size)
        self.lm_head = nn.Linear(config.n_embd, self.vocab_size, bias=False)
        # Rows of these past true_vocab_size are padding (vocab_multiple), never saved in checkpoints.
        # Not wpe: it is sharded like a vocabulary, but its rows are positions, all of them real.
        self.vocab_parameters = ["transformer.embeddings.wte.weight", "lm_head.weight"]
        self.tied_parameters: list[tuple[str, str]] = []
        if config.tie_word_embeddings:
            self.tied_parameters = [("transformer.embeddings.wte.weight", "lm_head.weight")]
            self.tie_weights()
        blocks = "transformer.h.*"
        self.tp_plan: dict[str, Any] = {
            "transformer.embeddings.wte": "vocab_embedding",
            "transformer.embeddings.wpe": "vocab_embedding",  # rows = positions; see the module docstring
            f"{blocks}.attn.q_proj": "colwise",
            f"{blocks}.attn.k_proj": "colwise",
            f"{blocks}.attn.v_proj": "colwise",
            f"{blocks}.attn.c_proj": "rowwise",
            f"{blocks}.mlp.c_fc": "colwise",
            f"{blocks}.mlp.c_proj": "rowwise",
            "lm_head": "lm_head",
        }
        # Counted now, before an engine shards anything: every parameter but the two lookup tables
        # (the output head counts even when tied, since it is a real matmul).
        lookup_tables = ["transformer.embeddings.wte.weight", "transformer.embeddings.wpe.weight"]
        self._matmul_params = count_matmul_parameters(self, lookup_tables)

    def pipeline_blocks(self) -> list[list[str]]:
        blocks = [[f"transformer.h.{i}"] for i in range(len(self.transformer.h))]
        return [["transformer.embeddings"], *blocks, ["transformer.ln_f", "lm_head"]]

    def forward(self, input_ids: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        # The pipeline calls each block with one tensor; the cache arguments are optional extras.
        x = self.transformer.embeddings(input_ids, kv_cache.length if kv_cache is not None else 0)
        for block in self.transformer.h:
            x = block(x, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1])
        return self.lm_head(self.transformer.ln_f(x))

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full tensor for `name`: normal(0, std) weights (output projections scaled by
        1/sqrt(2 * n_layer), as GPT-2 does), LayerNorm weights 1, biases 0."""
        if name.endswith(".bias"):
            tensor.data.zero_()
            return
        if ".ln_" in name:  # transformer.h.N.ln_1, ln_2 and transformer.ln_f
            tensor.data.fill_(1.0)
            return
        if not name.endswith(".weight"):
            raise KeyError(f"gpt2: no initialisation rule for parameter {name!r}")
        std = self.init_std
        if self.scale_output_init and name.endswith("c_proj.weight"):
            std /= math.sqrt(2 * self.config.n_layer)
        init_normal(tensor, std, generator)

    def flops_per_token(self, sequence_length: int) -> float:
        """Training FLOPs per token (nanoGPT's estimate): 6N + 12 * layers * n_embd * seq."""
        c = self.config
        return 6 * self._matmul_params + 12 * c.n_layer * c.n_embd * sequence_length
