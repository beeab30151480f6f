"""The `nd` engine's time model (plugins/parallel/time_model.py): each term against its formula
worked by hand on a tiny model and a made-up machine, the terms adding up to the step, and
`nanocore plan --hardware` printing the prediction."""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest
import torch
import yaml

from nanocore.config.converter import structure_config
from nanocore.hardware import AttentionEfficiency, Hardware, Link, hardware_to_yaml
from nanocore.plan import predict_for
from nanocore.plugins import load_plugins
from nanocore_plugins.parallel.time_model import trace_memory_bound
from tests.helpers.launch import REPO
from tests.helpers.training import TINY_MODEL, tiny_config

# a machine with no matmul curve (every matmul at the peak) and no latency: the formulas come out exact
PEAK = 1e12
HW = Hardware("flat", "test", {"float32": PEAK}, 2**34, 8, Link(1e10, 0.0), Link(1e9, 0.0), memory_bandwidth=1e11)


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def predict(registries, tmp_path, parallelism=None, hw=HW, **sections):
    raw = tiny_config(tmp_path, parallelism=parallelism or {}, **sections)
    return predict_for(structure_config(raw, registries), registries, hw, "cpu")


# the same machine with no memory-bound cost: the matmuls alone, as the terms stood before it
MATMUL_ONLY = attrs.evolve(HW, memory_bandwidth=None)


# tiny LLaMA: hidden 32, intermediate 64, 4 heads of 8, 2 kv heads, 4 layers, vocab 64 (untied)
H, FF, L, V = 32, 64, 4, 64
LAYER_MATMUL = H * H + 2 * H * 16 + H * H + 3 * H * FF  # q, k and v (2 kv heads of 8), o, gate/up/down
TOKENS, SEQ, M = 16, 16, 4  # micro-batch 1 x sequence 16, 4 micro-batches


def test_one_process_is_three_passes_of_matmuls_and_attention_at_the_peak(registries, tmp_path):
    p = predict(registries, tmp_path)
    matmul = 2 * TOKENS * (L * LAYER_MATMUL + V * H)  # the head is a matmul, the embedding a lookup
    attention = L * 4 * H * SEQ * TOKENS * 0.5
    assert p.term("compute") == pytest.approx(M * 3 * (matmul + attention) / PEAK)
    for name in ("tensor_parallel", "context_parallel", "expert_parallel", "pipeline_p2p", "data_parallel"):
        assert p.term(name) == 0.0, name
    assert p.term("pipeline_bubble") == pytest.approx(0.0, abs=1e-15)
    # AdamW: parameter and gradient in float32, two states, each read and written once
    params = 2 * V * H + L * (LAYER_MATMUL + 2 * H) + H
    assert p.term("optimizer") == pytest.approx(params * (2 * 4 + 4 + 2 * 4 * 2) / 1e11)
    assert p.step_seconds == pytest.approx(sum(t.seconds for t in p.terms))
    assert p.dominant == max(p.terms, key=lambda t: t.seconds).name
    assert p.tokens_per_sec_per_device == pytest.approx(M * TOKENS / p.step_seconds)
    # MFU counts the model's own FLOPs per token (6 N + 12 layers x width x sequence), not the work above
    with torch.device("meta"):
        model = registries.model.get("llama").factory(structure_config(tiny_config(tmp_path), registries).model,
                                                      vocab_multiple=1)  # fmt: skip
    assert p.mfu == pytest.approx(model.flops_per_token(SEQ) * M * TOKENS / (p.step_seconds * PEAK))


def test_the_attention_core_is_costed_at_the_descriptions_attention_efficiency(registries, tmp_path):
    """A fused attention kernel is not a matmul: with `attention_efficiency` its forward runs at the
    forward curve and its backward (twice the FLOPs) at the backward one; matmuls stay at the peak."""
    fused = attrs.evolve(HW, attention_efficiency=AttentionEfficiency(((1.0, 0.5),), ((1.0, 0.25),)))
    p = predict(registries, tmp_path, hw=fused)
    matmul = 2 * TOKENS * (L * LAYER_MATMUL + V * H)
    attention = L * 4 * H * SEQ * TOKENS * 0.5
    assert p.term("compute") == pytest.approx(M * (3 * matmul + attention / 0.5 + 2 * attention / 0.25) / PEAK)
    # selective recompute repeats the forward only, at the forward curve
    again = predict(registries, tmp_path, {"recompute_granularity": "selective"}, hw=fused)
    assert again.term("recompute") == pytest.approx(M * attention / 0.5 / PEAK)
    plain = predict(registries, tmp_path)
    assert p.step_seconds > plain.step_seconds and p.term("optimizer") == plain.term("optimizer")


def test_tensor_parallel_adds_its_all_reduces_and_halves_the_matmuls(registries, tmp_path):
    one = predict(registries, tmp_path)
    tp2 = predict(registries, tmp_path, {"tp": 2, "tp_mode": "ALL_REDUCE"})
    assert tp2.term("compute") == pytest.approx(one.term("compute") / 2)
    size = TOKENS * H * 4
    all_reduce = 2 * (size / 2 / 1e10)  # 2 (n-1) steps of size / n at 10 GB/s, n = 2
    # per layer two forward and two backward; the embedding's output forward, the head's input
    # backward, and the vocabulary-parallel loss's two (each token's largest logit, then its sum of
    # exponentials and target logit, in float32)
    loss = (TOKENS * 4 + 2 * TOKENS * 4) / 1e10
    assert tp2.term("tensor_parallel") == pytest.approx(M * ((L * 4 + 2) * all_reduce + loss))
    rs = predict(registries, tmp_path, {"tp": 2, "tp_mode": "REDUCE_SCATTER"})
    assert rs.term("tensor_parallel") == pytest.approx(tp2.term("tensor_parallel"))  # same bytes, other collectives
    overlapped = predict(
        registries, tmp_path, {"tp": 2, "tp_mode": "REDUCE_SCATTER", "tp_linear_async_communication": True}
    )
    assert overlapped.term("tensor_parallel") < rs.term("tensor_parallel")


def test_a_pipeline_pays_its_bubble_as_the_simulator_counts_it(registries, tmp_path):
    p = predict(registries, tmp_path, {"pp": 2, "pp_engine": "1f1b"})
    message = TOKENS * H * 4 / 1e10
    assert p.term("pipeline_p2p") == pytest.approx(M * 2 * message)
    # 1F1B at pp2 with the heavier last stage (it holds the head): it works without a pause once its
    # first forward arrives, so the step is F0 + m (F1 + B1) + B0 and the bubble F0 + B0 = 3 F0 (no
    # recompute), where stage 0 runs the embedding (a lookup) and two layers, plus a message each way
    layer = (2 * TOKENS * LAYER_MATMUL + 4 * H * SEQ * TOKENS * 0.5) / PEAK
    # and each of stage 0's blocks' non-matmul work (forward once, backward twice: 3 x, like the rest)
    traced = trace_memory_bound(structure_config(tiny_config(tmp_path), registries), registries)
    memory = sum(TOKENS * (b.stream + b.inner) * 4 / 1e11 for b in traced[:3])
    assert p.term("pipeline_bubble") == pytest.approx(3 * (2 * layer + memory) + 2 * message)
    assert p.step_seconds == pytest.approx(sum(t.seconds for t in p.terms))
    # where weight gradients are a real share of the backward (matmul-bound), ZB-H1 fills the bubble with them
    f1b = predict(registries, tmp_path, {"pp": 2, "pp_engine": "1f1b"}, hw=MATMUL_ONLY)
    zb = predict(registries, tmp_path, {"pp": 2, "pp_engine": "zb1p"}, hw=MATMUL_ONLY)
    assert zb.term("pipeline_bubble") < f1b.term("pipeline_bubble")


def test_recompute_data_parallel_and_zero3_cost_what_they_move(registries, tmp_path):
    one = predict(registries, tmp_path)
    full = predict(registries, tmp_path, {"recompute_granularity": "full"})
    layers = full.term("recompute") / ((one.term("compute") + one.term("memory_bound")) / 3)
    assert 0.8 < layers < 1.0  # the decoder layers' forward again: all of the forward but the head
    dp2 = predict(registries, tmp_path, {"dp": 2})
    assert dp2.term("data_parallel") > 0
    zero3 = predict(registries, tmp_path, {"dp": 2}, optimizer={"zero_stage": 3})
    zero1 = predict(registries, tmp_path, {"dp": 2}, optimizer={"zero_stage": 1})
    assert zero1.term("optimizer") == pytest.approx(dp2.term("optimizer") / 2, rel=0.02)  # half the rows each
    # ZeRO-3's gathers hide behind compute but for each pass's first block: with the matmuls alone to
    # hide behind, they cost more than ZeRO-1's one all-gather after the step
    zero3_bare = predict(registries, tmp_path, {"dp": 2}, hw=MATMUL_ONLY, optimizer={"zero_stage": 3})
    zero1_bare = predict(registries, tmp_path, {"dp": 2}, hw=MATMUL_ONLY, optimizer={"zero_stage": 1})
    assert zero3_bare.term("data_parallel") >= zero1_bare.term("data_parallel")
    assert zero3.term("data_parallel") > dp2.term("data_parallel")  # it moves the parameters besides


def test_context_parallel_modes_cost_their_own_exchanges(registries, tmp_path):
    ring = predict(registries, tmp_path, {"context_parallel_size": 2})
    a2a = predict(registries, tmp_path, {"context_parallel_size": 2, "context_parallel_mode": "all_to_all"})
    assert ring.term("compute") == pytest.approx(a2a.term("compute"))
    # all_to_all: queries, keys, values, output, forward and backward, per layer: (n-1) steps of size / n,
    # and three copies (a read and a write each) of every swapped tensor at the memory bandwidth
    q, kv = TOKENS / 2 * H * 4, TOKENS / 2 * 2 * 16 * 4
    swap = sum(x / 2 / 1e10 for x in (q, kv / 2, kv / 2, q))
    copies = 3 * 2 * (q + kv + q) / 1e11
    assert a2a.term("context_parallel") == pytest.approx(M * L * 2 * (swap + copies))
    # ring: one key/value block sent forward; backward it again and the two blocks' float32 gradients
    # (one hop each: the last reaches the owner), less the attention they hide behind
    attention = 4 * H * SEQ * (TOKENS / 2) * 0.5 / PEAK
    exposed = max(0.0, kv / 1e10 - attention) + max(0.0, 3 * kv / 1e10 - 2 * attention)
    # and each ring step's float32 scores written out: 4 heads x (T/2)^2 on the diagonal, half that off
    # it, read or written 10 times forward and 18 backward at the memory bandwidth
    scores = 4 * (TOKENS / 2) ** 2 * 1.5 * 4
    # and attention as matmuls per block: 2 forward, 5 backward, of the diagonal block (2 x 32 query
    # elements x T^2 FLOPs) and a half one, beyond the compute term's causal attention (once, twice)
    blocks = 2 * 32 * (TOKENS / 2) ** 2 * 1.5 / PEAK
    extra = (2 * blocks - attention) + (5 * blocks - 2 * attention)
    expected = M * L * (exposed + 28 * scores / 1e11 + extra)
    assert ring.term("context_parallel") == pytest.approx(expected) and exposed > 0
    # where compute does not hide a collective (calibrate's compute_overlap 0: gloo on a CPU's shared
    # cores), the whole exchange is exposed
    shared = attrs.evolve(HW, compute_overlap=0.0)
    ring0 = predict(registries, tmp_path, {"context_parallel_size": 2}, hw=shared)
    assert ring0.term("context_parallel") == pytest.approx(M * L * (4 * kv / 1e10 + 28 * scores / 1e11 + extra))


def test_zero3_pays_one_all_gather_per_parameter_tensor_in_every_pass(registries, tmp_path):
    """ZeRO-3 gathers each parameter by itself, before each block's forward and again before its
    backward: where each collective costs its latency (gloo on a CPU: about a millisecond after
    compute), the count is the cost, not the bytes."""
    latency = attrs.evolve(HW, intra_node=Link(1e30, 1e-3), compute_overlap=0.0)
    zero3 = predict(registries, tmp_path, {"dp": 2}, hw=latency, optimizer={"zero_stage": 3})
    tensors = 1 + L * 9 + 1 + 1  # embedding; q, k, v, o, gate, up, down and two norms per layer; norm; head
    reduce_scatter = 1e-3  # the gradients' one bucket: one step
    assert zero3.term("data_parallel") == pytest.approx(reduce_scatter + 2 * M * tensors * 1e-3)


def test_compute_overlap_decides_how_much_data_parallel_traffic_backward_hides(registries, tmp_path):
    slow_link = attrs.evolve(HW, intra_node=Link(1e8, 0.0))  # gradients take longer than a backward
    # the tiny model's gradients fit one 1 MiB bucket, the last one, which nothing hides: the whole
    # all-reduce of the float32 gradients, 2 (n-1) steps of size / n at n = 2
    params = 2 * V * H + L * (LAYER_MATMUL + 2 * H) + H  # embedding and head, layers and their norms, final norm
    tiny = predict(registries, tmp_path, {"dp": 2}, hw=slow_link, model={"ddp_bucket_cap_mb": 1})
    assert tiny.term("data_parallel") == pytest.approx(params * 4 / 1e8)
    wide = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8}

    def dp2(overlap, zero=0):  # a 3M-parameter model in 1 MiB buckets: all but the last can hide
        hw = attrs.evolve(slow_link, compute_overlap=overlap)
        model = {"ddp_bucket_cap_mb": 1, "model_config": wide}
        return predict(registries, tmp_path, {"dp": 2}, hw=hw, model=model, optimizer={"zero_stage": zero})

    hidden, half, exposed = dp2(1.0), dp2(0.5), dp2(0.0)
    assert hidden.term("data_parallel") < half.term("data_parallel") < exposed.term("data_parallel")
    assert dp2(0.0, zero=3).term("data_parallel") > dp2(1.0, zero=3).term("data_parallel")


def test_memory_bound_work_is_each_traced_op_and_its_bytes_at_the_memory_bandwidth(registries, tmp_path):
    config = structure_config(tiny_config(tmp_path), registries)
    traced = trace_memory_bound(config, registries)
    assert len(traced) == L + 2  # the embedding, the layers, the norm + head (+ the loss)
    # the embedding is one lookup: a token id read and a row of H written per token, nothing split by TP
    assert (traced[0].ops, traced[0].stream, traced[0].inner) == (1, H + 1, 0.0)
    assert traced[1].ops > 10 and traced[2] == traced[3] == traced[4]  # layer 0 also builds the rotary table
    # matmuls and the attention core are not counted here: a wider MLP adds only its activation's
    # elementwise work (inside the TP split), the residual stream's stays
    raw = tiny_config(tmp_path, model={"model_config": {"intermediate_size": 2 * FF}})
    wide = trace_memory_bound(structure_config(raw, registries), registries)
    assert wide[2].stream == traced[2].stream and wide[2].inner > traced[2].inner
    assert wide[2].ops == traced[2].ops

    # the term: m micro-batches x 3 passes x (ops x overhead + T x elements x 4 bytes / bandwidth)
    slow = attrs.evolve(HW, op_overhead=1e-6)
    one = predict_for(config, registries, slow, "cpu")
    work = sum(b.ops * 1e-6 + TOKENS * (b.stream + b.inner) * 4 / 1e11 for b in traced)
    assert one.term("memory_bound") == pytest.approx(M * 3 * work)
    assert predict_for(config, registries, HW, "cpu").term("memory_bound") == pytest.approx(
        M * 3 * sum(TOKENS * (b.stream + b.inner) * 4 / 1e11 for b in traced)
    )
    # tp 2: what lies inside the split halves; the residual stream's halves only with sequence parallelism
    for mode, stream_split in (("ALL_REDUCE", 1), ("REDUCE_SCATTER", 2)):
        raw = tiny_config(tmp_path, parallelism={"tp": 2, "tp_mode": mode})
        tp2 = predict_for(structure_config(raw, registries), registries, HW, "cpu")
        bytes_ = sum(TOKENS * (b.stream / stream_split + b.inner / 2) * 4 / 1e11 for b in traced)
        assert tp2.term("memory_bound") == pytest.approx(M * 3 * bytes_, rel=0.02), mode


def test_plan_prints_the_prediction_and_its_json_carries_the_three_figures(tmp_path):
    raw = tiny_config(tmp_path, parallelism={"dp": 2, "tp": 2})
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    hw = tmp_path / "hw.yaml"
    hw.write_text(hardware_to_yaml(HW))
    cmd = [sys.executable, "-m", "nanocore", "plan", str(config), "--world-size", "4", "--device", "cpu"]
    out = subprocess.run([*cmd, "--hardware", str(hw), "--json"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["predicted_step_seconds"] > 0
    assert data["predicted_tokens_per_sec_per_device"] == pytest.approx(
        2 * M * TOKENS / data["predicted_step_seconds"] / 4
    )
    assert 0 < data["predicted_mfu"] < 1
    assert {t["name"] for t in data["prediction"]["terms"]} >= {"compute", "tensor_parallel", "data_parallel"}
    assert data["fit"]["fits"]  # the description's memory is the device memory
    text = subprocess.run([*cmd, "--hardware", "h100-sxm"], capture_output=True, text=True, cwd=REPO)
    assert text.returncode == 0, text.stderr
    assert "predicted on h100-sxm" in text.stdout and "dominant cost:" in text.stdout
    bad = subprocess.run([*cmd, "--hardware", "h300"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "neither a shipped name" in bad.stderr
    assert TINY_MODEL["hidden_size"] == H
