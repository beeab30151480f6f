"""Tiny random Hugging Face transformers LLaMA folders (float32, safetensors), written into a test's tmp dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.deepseek_v3 import BASE as DEEPSEEK_BASE

TINY_HF_LLAMA: dict[str, Any] = {
    "vocab_size": 67,  # odd: tensor parallelism pads it, and the padding must disappear on export
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "initializer_range": 0.2,  # large enough for varied greedy continuations
}


def save_hf_llama(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any) -> Path:
    """A random `LlamaForCausalLM` saved with `save_pretrained`; norm weights are random too, so that a
    mapping mistake anywhere changes the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_HF_LLAMA, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.2, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()  # float32 files load as float32


TINY_HF_QWEN3 = {
    "vocab_size": 67,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "rope_theta": 1e6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,  # large enough for varied routing and greedy continuations
}
TINY_HF_QWEN3_MOE = {**TINY_HF_QWEN3, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
               "norm_topk_prob": True, "mlp_only_layers": [0]}  # fmt: skip


def save_hf_qwen3(folder: Path, moe: bool, **overrides: Any) -> Path:
    """A random Qwen3 (or Qwen3-MoE) saved by transformers; norm weights random too."""
    import transformers

    torch.manual_seed(0)
    if moe:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**TINY_HF_QWEN3_MOE, **overrides}))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**TINY_HF_QWEN3, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


TINY_HF_DEEPSEEK_V3 = {
    **{k: v for k, v in DEEPSEEK_BASE.items() if k != "vocab_size"},
    "vocab_size": 67,
    "num_key_value_heads": 4,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "initializer_range": 0.2,  # large enough for varied routing and greedy continuations
    "num_nextn_predict_layers": 0,
}


def save_hf_deepseek_v3(folder: Path, **overrides: Any) -> Path:
    """A random DeepSeek-V3 saved by transformers; norms and the balancing bias random too."""
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**TINY_HF_DEEPSEEK_V3, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.1, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def assert_same_logits(ours: torch.nn.Module, theirs: torch.nn.Module, ids: torch.Tensor, tol: float = 1e-5) -> None:
    """Our logits within `tol` (relative to their largest magnitude) of a transformers model's on `ids`.
    The same float32 math in other kernels (reductions of <= 96 terms) measures ~3e-7 on the tiny models."""
    from tests.helpers.compare import rel_diff

    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids)
    assert got.shape == expected.shape
    assert rel_diff(got, expected) <= tol, rel_diff(got, expected)


def assert_logits_and_greedy_generation_equal(ours: torch.nn.Module, theirs: Any, eos: int, vocab: int = 67) -> None:
    """Equal logits on a random batch, and the same 16-token greedy continuation as transformers'
    `generate` (one that is not constant, which would hide differences)."""
    from nanocore.generation import generate

    assert_same_logits(ours, theirs, torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1)))
    prompt = [5, 17, 42, 3]
    new = generate(ours, prompt, 16, temperature=0, eos_token_id=eos)
    hf_out = theirs.generate(
        torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )
    assert new == hf_out[0, len(prompt) :].tolist()
    assert len(set(new)) >= 2, "a constant continuation would hide differences"


def assert_hf_round_trip_exact(folder: Path, model: torch.nn.Module, config: Any, state: dict, to_hf, from_hf) -> None:
    """`state` (a checkpoint of `model`, built from `config`) converted by `to_hf` and written as
    transformers' files loads in transformers with equal logits, and `from_hf` reads it back to the
    same config and the same tensors, bit for bit."""
    import json

    from safetensors.torch import load_file

    from nanocore.hf_interop import write_hf

    hf_config, hf_state = to_hf(config, state)
    write_hf(folder, hf_config, hf_state)
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    assert_same_logits(model, hf_model(folder), ids)
    back_config, back_state = from_hf(
        json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")
    )
    assert back_config == config
    assert back_state.keys() == state.keys()
    assert all(torch.equal(back_state[k], state[k]) for k in state)
