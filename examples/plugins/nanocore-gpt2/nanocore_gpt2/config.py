"""The GPT-2 model's config section (`model.model_config` with `model_type: gpt2`).

Field names follow Hugging Face transformers' `GPT2Config`, so the architecture part of a GPT-2
`config.json` can be copied over.
"""

from __future__ import annotations

from typing import Any

import attrs

from nanocore.config.schema import doc

ACTIVATIONS = ("gelu_new", "gelu", "gelu_pytorch_tanh", "relu", "silu")


@attrs.define
class GPT2Config:
    """A GPT-2 decoder: LayerNorm with bias, learned position embeddings, GELU MLP, biases on every
    linear layer, optionally tied input and output embeddings. No dropout (nanocore pretrains
    without it, and dropout would make runs depend on the parallel layout's RNG streams)."""

    vocab_size: int = doc("Tokenizer vocabulary size (padded by model.make_vocab_size_divisible_by).", default=256)
    n_positions: int = doc(
        "Rows of the learned position table: the longest sequence the model can read. Must be at least "
        "tokens.sequence_length and divisible by parallelism.tp (the table is split over TP ranks).",
        default=1024,
    )
    n_embd: int = doc("Width of the residual stream.", default=64)
    n_layer: int = doc("Transformer blocks.", default=2)
    n_head: int = doc("Attention heads per block (must divide n_embd and be divisible by parallelism.tp).", default=4)
    n_inner: int | None = doc("Width of the MLP's hidden layer; null means 4 * n_embd.", default=None)
    activation_function: str = doc(
        f"MLP activation: one of {', '.join(ACTIVATIONS)} (gelu_new is GPT-2's tanh approximation).",
        default="gelu_new",
    )
    layer_norm_epsilon: float = doc("Epsilon inside LayerNorm.", default=1e-5)
    tie_word_embeddings: bool = doc("Share the token embedding matrix with the output head (GPT-2 does).", default=True)
    initializer_range: float = doc(
        "transformers compatibility; nanocore initialises with model.init_method.std.", default=0.02
    )
    bos_token_id: int | None = doc("transformers compatibility; generation takes it from the tokenizer.", default=None)
    eos_token_id: int | None = doc("transformers compatibility; generation takes it from the tokenizer.", default=None)

    @property
    def inner_size(self) -> int:
        """n_inner, with null meaning 4 * n_embd."""
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def problems(self, tp: int = 1, sequence_length: int | None = None) -> list[str]:
        """Problems with this config (as 'field: message') for tensor-parallel size `tp`."""
        p: list[str] = []
        for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, key) < 1:
                p.append(f"{key}: must be at least 1, got {getattr(self, key)}")
        if self.n_inner is not None and self.n_inner < 1:
            p.append(f"n_inner: must be at least 1 or null, got {self.n_inner}")
        if p:
            return p
        if self.n_embd % self.n_head:
            p.append(f"n_embd: {self.n_embd} is not divisible by n_head = {self.n_head}")
        if self.n_head % tp:
            p.append(
                f"n_head: {self.n_head} heads cannot be split over parallelism.tp = {tp} ranks; "
                "choose a tp that divides the number of heads"
            )
        if self.inner_size % tp:
            p.append(f"n_inner: the MLP width {self.inner_size} cannot be split over parallelism.tp = {tp} ranks")
        if self.n_positions % tp:
            p.append(
                f"n_positions: the position table ({self.n_positions} rows) is split over parallelism.tp = {tp} "
                f"ranks, so n_positions must be divisible by {tp}"
            )
        if sequence_length is not None and sequence_length > self.n_positions:
            p.append(
                f"n_positions: tokens.sequence_length = {sequence_length} is longer than the {self.n_positions} "
                "learned positions; raise n_positions or shorten the sequence"
            )
        if self.activation_function not in ACTIVATIONS:
            p.append(
                f"activation_function: unsupported activation {self.activation_function!r}; "
                f"expected one of {', '.join(ACTIVATIONS)}"
            )
        return p

    def check(self, config: Any) -> list[str]:
        """Cross-field checks against the whole run config (see nanocore.config.checks)."""
        return self.problems(tp=config.parallelism.tp, sequence_length=config.tokens.sequence_length)
