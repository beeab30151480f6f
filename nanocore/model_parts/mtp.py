"""Multi-token prediction (DeepSeek-V3's MTP): D sequential modules after the decoder, module k
predicting the token k + 1 positions ahead of each position, trained with the main loss.

Module k at position i: x = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]) (the embedding first,
as DeepSeek's released weights and Megatron-core concatenate), then one decoder layer, then the
shared output head: logits for t_{i+k+1}; h^0 is the decoder's last hidden state (before the final
norm), h^k this module's output. Loss: coef / D x sum_k of module k's mean cross-entropy over the
positions whose t_{i+k+1} the sample holds. The embedding and the head are the model's own (tied
parameters `embed_tokens`, `shared_head.head`); the tokens ahead, the vocabulary-parallel loss and its
normalisation come from the engine's `nanocore.model_api.PredictionRuntime`.

`MultiTokenPrediction` is the first module of the model's last pipeline block: it maps the hidden
state to itself and attaches the MTP loss's gradient to it (`moe_api.attach_aux_loss`), so it needs
no second backward and runs wherever the last block runs. It does nothing outside training.
"""

from __future__ import annotations

import torch
from torch import nn

from nanocore.model_api import PredictionRuntime
from nanocore.model_parts.layers import RMSNorm
from nanocore.moe_api import attach_aux_loss


class SharedHead(nn.Module):
    """The output head as DeepSeek's MTP names it: `shared_head.norm`, `shared_head.head` (tied)."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)


class MTPLayer(nn.Module):
    """One MTP module: a decoder layer's parts (transformers' names) plus `embed_tokens`, `enorm`,
    `hnorm`, `eh_proj` and `shared_head`, as DeepSeek-V3's checkpoints hold them."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.shared_head = SharedHead(hidden_size, vocab_size, eps)

    def forward(self, ids: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this module's hidden state, its logits)."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(ids)), self.hnorm(previous)], dim=-1))
        x = x + self.self_attn(self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        logits: torch.Tensor = self.shared_head.head(self.shared_head.norm(x))
        return x, logits


class MultiTokenPrediction(nn.ModuleList):
    """`model.mtp`: the D modules; `forward(h) -> h` with the MTP loss attached (see the module docstring)."""

    metric = "mtp_loss"

    def __init__(self, layers: list[MTPLayer], loss_coef: float):
        super().__init__(layers)
        self.loss_coef = loss_coef
        self.runtime: PredictionRuntime | None = None

    @torch.compiler.disable
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Eager inside a compiled block (`model.compile`): it reads the engine's per-micro-batch state."""
        runtime = self.runtime
        if runtime is None or not self.training or not torch.is_grad_enabled():
            return hidden
        previous, losses = hidden, []
        for depth, layer in enumerate(self, start=1):
            ids, _ = runtime.future_tokens(depth)
            previous, logits = layer(ids, previous)
            targets, valid = runtime.future_tokens(depth + 1)
            losses.append(runtime.token_loss(logits, targets, valid))
        loss = torch.stack(losses).mean()
        runtime.record(self.metric, loss)
        return attach_aux_loss(hidden, self.loss_coef * loss, runtime.grad_scale)
