"""Text generation for any model that follows `nanocore.model_api` (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

import torch
from torch import nn

from nanocore.model_api import KVCache


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float | None = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of `logits` [b, vocab]; returns LongTensor[b].

    temperature 0 or None is greedy (argmax). Otherwise logits are divided by the temperature, cut
    to the `top_k` most likely tokens and to the smallest set whose probability reaches `top_p`
    (nucleus), then sampled with `generator`.
    """
    if not temperature:
        return logits.argmax(dim=-1)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0 and top_k < logits.shape[-1]:
        values, indices = logits.topk(top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, indices, values)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens more likely than it already reach top_p; the first always stays.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float | None = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    seed: int = 0,
    true_vocab_size: int | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Continue `prompt_ids` by up to `max_new_tokens` tokens; returns only the new tokens.

    Stops after `eos_token_id` (which is included). Logits at indices >= `true_vocab_size` (padding
    of the embedding; default: the model's `true_vocab_size`) are never picked. With `use_cache` the
    prompt is run once and each new token reuses a `KVCache`; without it every step reruns the whole
    sequence (slow; for models without cache support and for testing). Sampling draws from a CPU
    generator seeded with `seed`, so a seed gives the same text on any device.
    """
    if not prompt_ids:
        raise ValueError("generate needs a non-empty prompt (start with the tokenizer's BOS token)")
    device = next(model.parameters()).device
    if true_vocab_size is None:
        true_vocab_size = getattr(model, "true_vocab_size", None)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    cache = KVCache() if use_cache else None
    tokens = list(prompt_ids)
    new: list[int] = []
    step_input = torch.tensor([tokens], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(step_input, kv_cache=cache) if use_cache else model(step_input)
        last = logits[:, -1, :].float().cpu()
        if true_vocab_size is not None and true_vocab_size < last.shape[-1]:
            last[:, true_vocab_size:] = float("-inf")
        token = int(sample_next_token(last, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator))
        new.append(token)
        tokens.append(token)
        if token == eos_token_id:
            break
        if use_cache:
            step_input = torch.tensor([[token]], dtype=torch.long, device=device)
        else:
            step_input = torch.tensor([tokens], dtype=torch.long, device=device)
    return new
