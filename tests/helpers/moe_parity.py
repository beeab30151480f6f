"""What the mixture-of-experts parity tests share: a tiny Mixtral, its config at any layout, the
one-process reference, and the comparison (the dense parity tolerances plus the logged MoE metrics)."""

from __future__ import annotations

from tests.helpers.compare import rel_diff
from tests.helpers.parity import GLOBAL_MICROBATCHES, RTOL, STEP1_RTOL, layout, weight_diffs
from tests.helpers.training import run_training, tiny_config

TINY_MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.05,
}

# DeepSeek-style options: a shared expert, sigmoid scores balanced by a per-expert bias, z-loss
DEEPSEEK_STYLE = {
    "num_shared_experts": 1,
    "shared_expert_intermediate_size": 16,
    "scoring_func": "sigmoid",
    "router_bias_update_rate": 0.01,
    "router_aux_loss_coef": 0.0,
    "router_z_loss_coef": 0.01,
}


def moe_config(tmp, par=None, deepseek=False, **sections):
    model = dict(TINY_MIXTRAL, **(DEEPSEEK_STYLE if deepseek else {}))
    par = par or layout()
    tokens = {"batch_accumulation_per_replica": GLOBAL_MICROBATCHES // par["dp"], **sections.pop("tokens", {})}
    return tiny_config(tmp, model={"model_config": model}, parallelism=par, tokens=tokens, **sections)


_reference: dict[bool, dict] = {}


def reference(tmp_path_factory, deepseek=False) -> dict:
    if deepseek not in _reference:
        _reference[deepseek] = run_training(moe_config(tmp_path_factory.mktemp("moe_reference"), deepseek=deepseek))
    return _reference[deepseek]


def assert_matches(run: dict, ref: dict, metrics=("moe_aux_loss", "moe_max_load")) -> None:
    losses, ref_losses = run["losses"], ref["losses"]
    assert len(losses) == len(ref_losses) == 10
    assert rel_diff(losses[0], ref_losses[0]) <= STEP1_RTOL, (losses[0], ref_losses[0])
    diffs = [rel_diff(a, b) for a, b in zip(losses, ref_losses, strict=True)]
    assert max(diffs) <= RTOL, f"per-step relative loss differences: {diffs}"
    assert max(ref_losses) - min(ref_losses) > 0.01, "the reference must actually train"
    for name in metrics:
        ours = [row[name] for row in run["metrics"]]
        theirs = [row[name] for row in ref["metrics"]]
        worst = max(rel_diff(a, b) for a, b in zip(ours, theirs, strict=True))
        assert worst <= RTOL, f"{name}: {ours} vs {theirs}"
    bad = {name: diff for name, diff in weight_diffs(run["weights"], ref["weights"]).items() if not diff <= RTOL}
    assert not bad, f"weights differ by more than {RTOL} of their norm: {bad}"
