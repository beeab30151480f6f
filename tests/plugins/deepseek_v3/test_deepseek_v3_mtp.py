"""DeepSeek-V3's multi-token prediction as its paper defines it: module k takes the embedding of
the token k ahead and the previous module's hidden state, runs one decoder layer and predicts the
token k + 1 ahead with the shared head; the loss, coef x the mean over modules of their mean
cross-entropies, reaches the gradient through the main loss's backward. Checked by hand on one
process with the engine's prediction runtime (the layouts: tests/parallel/test_deepseek_v3_parity.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanocore_plugins.parallel.prediction import TokenPrediction
from tests.helpers.compare import rel_diff
from tests.helpers.deepseek_v3 import make, tiny

V, S, COEF = 101, 16, 0.3


def by_hand(model, sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the main loss, the MTP loss) computed from the definition, module by module."""
    inputs = sample[:, :S]
    h = model.model.embed_tokens(inputs)
    for layer in model.model.layers:
        h = layer(h)
    main = F.cross_entropy(model.lm_head(model.model.norm(h)).reshape(-1, V), sample[:, 1:].reshape(-1))
    previous, losses = h, []
    for k, m in enumerate(model.model.mtp, start=1):
        ahead = F.pad(sample[:, k : k + S], (0, S - sample[:, k : k + S].shape[1]))  # t_{i+k}, 0 past the end
        x = m.eh_proj(torch.cat([m.enorm(m.embed_tokens(ahead)), m.hnorm(previous)], dim=-1))
        x = x + m.self_attn(m.input_layernorm(x))
        x = x + m.mlp(m.post_attention_layernorm(x))
        logits = m.shared_head.head(m.shared_head.norm(x))
        n = S - k  # positions whose token k + 1 ahead the sample holds
        losses.append(F.cross_entropy(logits[:, :n].reshape(-1, V), sample[:, k + 1 : k + 1 + n].reshape(-1)))
        previous = x
    return main, torch.stack(losses).mean()


def test_mtp_loss_and_gradient_follow_the_definition():
    config = tiny(num_nextn_predict_layers=2, mtp_loss_coef=COEF, router_bias_update_rate=0.0)
    model = make(config).train()
    assert model.pipeline_blocks()[-1] == ["model.mtp", "model.norm", "lm_head"]
    assert model.model.mtp[0].embed_tokens.weight is model.model.embed_tokens.weight  # tied, as is the head
    assert model.model.mtp[1].shared_head.head.weight is model.lm_head.weight
    sample = torch.randint(0, V, (2, S + 1), generator=torch.Generator().manual_seed(0))
    runtime = TokenPrediction(None, 0, None, 1, V, None, ["mtp_loss"])
    model.set_prediction_runtime(runtime)
    runtime.start_step(1)
    runtime.labels = sample[:, 1:]
    logits = model(sample[:, :S])
    F.cross_entropy(logits.reshape(-1, V), sample[:, 1:].reshape(-1)).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    recorded = runtime.step_sums()["mtp_loss"]

    model.set_prediction_runtime(None)
    model.zero_grad()
    main, mtp = by_hand(model, sample)
    (main + COEF * mtp).backward()
    assert rel_diff(recorded, mtp.detach()) <= 1e-6, (float(recorded), float(mtp))
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert ours.keys() == expected.keys()
    assert "model.mtp.1.eh_proj.weight" in ours
    bad = {n: rel_diff(ours[n], g) for n, g in expected.items() if rel_diff(ours[n], g) > 1e-5}
    assert not bad, bad


def test_mtp_does_not_run_outside_training():
    model = make(tiny(num_nextn_predict_layers=1))
    runtime = TokenPrediction(None, 0, None, 1, V, None, ["mtp_loss"])
    model.set_prediction_runtime(runtime)
    runtime.start_step(1)
    with torch.no_grad():
        model(torch.randint(0, V, (1, S)))  # no labels set: MTP would fail if it ran
    assert float(runtime.step_sums()["mtp_loss"]) == 0.0
