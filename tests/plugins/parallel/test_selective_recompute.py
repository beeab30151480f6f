"""Selective recompute: only the attention core runs again in backward, and it keeps less for backward."""

from __future__ import annotations

import torch

from nanocore.config.schema import ModelArgs
from nanocore.model_parts import attention as llama_model
from nanocore_plugins.llama.config import LlamaConfig
from nanocore_plugins.llama.plugin import build
from nanocore_plugins.parallel.recompute import recompute_selected
from tests.helpers.training import TINY_MODEL


def _step(selective: bool, monkeypatch) -> tuple[int, int, torch.Tensor]:
    """(attention-core calls, bytes autograd saved for backward, the embedding's gradient) of one step."""
    torch.manual_seed(0)
    fields = {k: v for k, v in TINY_MODEL.items() if k != "model_type"}
    model = build(ModelArgs(model_config=LlamaConfig(**fields)))
    for name, p in model.named_parameters():
        model.init_parameter(name, p.data, torch.Generator().manual_seed(len(name)))
    if selective:
        recompute_selected(model)
    calls = [0]
    plain = llama_model.attention

    def counting(q, k, v):
        calls[0] += 1
        return plain(q, k, v)

    monkeypatch.setattr(llama_model, "attention", counting)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).float().logsumexp(-1).mean()
    loss.backward()
    backward_calls = calls[0]
    with torch.no_grad():  # evaluation: nothing to recompute, the core runs once per layer
        model(ids)
    assert calls[0] - backward_calls == TINY_MODEL["num_hidden_layers"]
    return backward_calls, saved[0], model.model.embed_tokens.weight.grad


def test_selective_recompute_runs_the_attention_core_again_and_saves_less(monkeypatch):
    layers = TINY_MODEL["num_hidden_layers"]
    calls, saved, grad = _step(False, monkeypatch)
    calls_selective, saved_selective, grad_selective = _step(True, monkeypatch)
    assert calls == layers
    assert calls_selective == 2 * layers  # forward, and again in backward
    assert saved_selective < saved, (saved_selective, saved)
    torch.testing.assert_close(grad_selective, grad, rtol=0, atol=0)  # the same arithmetic, run twice
