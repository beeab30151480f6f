"""nanocore.generation with the LLaMA model: cache vs no cache, sampling restrictions, EOS, padding."""

from __future__ import annotations

import torch

from nanocore.config.schema import ModelArgs
from nanocore.generation import generate, sample_next_token
from nanocore_plugins.llama.config import LlamaConfig
from nanocore_plugins.llama.plugin import build


def model(vocab_multiple: int = 1):
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=50
    )
    m = build(ModelArgs(model_config=config), vocab_multiple=vocab_multiple).eval()
    with torch.no_grad():  # larger weights than the default init, so greedy picks vary from step to step
        for p in m.parameters():
            p.mul_(3.0)
    return m


def test_greedy_generation_with_cache_equals_recomputing_everything():
    m = model()
    prompt = [1, 7, 9, 23]
    cached = generate(m, prompt, 20, temperature=0)
    recomputed = generate(m, prompt, 20, temperature=0, use_cache=False)
    assert cached == recomputed
    assert len(cached) == 20
    assert len(set(cached)) > 1

    # and it is the argmax of a plain forward pass at every step
    ids = prompt + cached
    with torch.no_grad():
        logits = m(torch.tensor([ids]))[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == cached


def test_sampling_is_seeded_and_stops_at_eos():
    m = model()
    a = generate(m, [1, 2], 15, temperature=1.0, seed=5)
    assert a == generate(m, [1, 2], 15, temperature=1.0, seed=5)
    assert a == generate(m, [1, 2], 15, temperature=1.0, seed=5, use_cache=False)
    eos = a[3]
    stopped = generate(m, [1, 2], 15, temperature=1.0, seed=5, eos_token_id=eos)
    assert stopped == a[: a.index(eos) + 1]


def test_padding_tokens_are_never_generated():
    m = model(vocab_multiple=64)
    assert m.vocab_size == 64 and m.true_vocab_size == 50
    with torch.no_grad():  # padding row 50 + j scores ten times token j: padding would usually win
        m.lm_head.weight[50:] = 10 * m.lm_head.weight[:14]
    unmasked = generate(m, [1, 2, 3], 10, temperature=0, true_vocab_size=64)
    assert any(t >= 50 for t in unmasked)
    assert all(t < 50 for t in generate(m, [1, 2, 3], 10, temperature=0))
    assert all(t < 50 for t in generate(m, [1, 2, 3], 10, temperature=1.0, seed=1))


def test_top_k_and_top_p_only_pick_allowed_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 30, generator=g)
    top5 = logits.topk(5, dim=-1).indices
    picks = torch.stack([sample_next_token(logits, temperature=2.0, top_k=5, generator=g) for _ in range(20)])
    for i in range(64):
        assert set(picks[:, i].tolist()) <= set(top5[i].tolist())

    # top_p: a distribution with mass 0.5, 0.3, 0.1, 0.1: p = 0.75 allows exactly the first two
    probs = torch.tensor([[0.1, 0.5, 0.1, 0.3]]).repeat(500, 1)
    picks = sample_next_token(probs.log(), temperature=1.0, top_p=0.75, generator=g)
    assert set(picks.tolist()) == {1, 3}
    picks = sample_next_token(probs.log(), temperature=1.0, top_p=0.75, top_k=1, generator=g)
    assert set(picks.tolist()) == {1}


def test_greedy_is_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    assert sample_next_token(logits, temperature=0).tolist() == [1, 0]
    assert sample_next_token(logits, temperature=None).tolist() == [1, 0]
