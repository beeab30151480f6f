"""The time model against published runs: Megatron-LM's weak-scaling table.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC '21 (arXiv 2104.04473), Table 1: GPT models from 1.7B to 1T parameters trained on
up to 3072 A100 80 GB GPUs (Selene: DGX A100 nodes of 8 GPUs, NVLink within a node, 8 x 200 Gb/s
HDR InfiniBand per node), vocabulary 51,200, sequence 2048, mixed precision, full activation
recompute. Each row gives the attention heads, hidden size, layers, tensor- and pipeline-parallel
sizes, GPUs, global batch (sequences) and the teraFLOP/s per GPU achieved. The paper counts FLOPs
per iteration as 96 B s l h^2 (1 + s / 6h + V / 16 l h) (its equation 3: forward, backward and the
recompute forward), so a row's step time is that over (teraFLOP/s x GPUs). The table's last row,
502 petaFLOP/s on 3072 GPUs, is the figure the paper's abstract quotes.

Each row becomes a nanocore config on the shipped `a100-80gb` description and is predicted with
`nanocore plan --hardware` (the same function). What nanocore's config cannot say exactly, and is
assumed here (the table does not give it either):

- the model: nanocore's LLaMA with GPT's widths. Its gated MLP's intermediate size is 8h/3 (three
  h x 8h/3 matrices have GPT's two h x 4h matrices' FLOPs and parameters), every head its own
  key/value head, tied embeddings as in Megatron's GPT; rotary instead of learned positions, RMSNorm
  instead of LayerNorm (memory-bound work of the same count);
- the schedule: 1F1B (non-interleaved), micro-batch size 1, full recompute, no ZeRO, tensor
  parallelism without sequence parallelism (ALL_REDUCE: 2021's Megatron), bfloat16 (the paper ran
  fp16 at the same peak).

The same for published H100 runs, in two groups:

- torchtitan's (pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md tables 1 and 3, and
  benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md): Llama 3.1 8B and 70B in bfloat16 with FSDP
  (as ZeRO-3), and with TP 8 (sequence parallel, plain and async); the Float8 rows are left out (the
  time model has no FP8 term). Both files ran on Meta's Grand Teton H100s: 96 GB HBM2e at 2.4 TB/s,
  a 500 W power limit, 400 Gb/s per GPU between hosts; the first file says their peak lies between
  the SXM and NVL parts and is not known. Assumed: sequence 8192 (torchtitan's Llama 3 training
  configs; 5,762 tokens/s at 8192 is the 33 % MFU the file quotes), nanocore's selective recompute
  (the attention core) for torchtitan's per-op SAC, and its attention core at the shipped `h100-sxm`'s
  attention efficiency (FlashAttention-2's 35 % on an H100, the kernel behind PyTorch's SDPA then).
  torch.compile is not modelled: the compiled rows are predicted as eager ones. Each row is
  predicted on the shipped `h100-sxm`; then on that description with the files' memory (96 GB,
  2.4 TB/s) and its bfloat16 peak set so that the first row is predicted exactly (the one figure
  taken from these runs: the rate these GPUs sustain); the other rows are then predicted with
  nothing more taken from them.
- Meta's Llama 3 405B pre-training (Grattafiori et al., "The Llama 3 Herd of Models", arXiv
  2407.21783, section 3.3 and Table 4): 700 W H100 SXM, 80 GB HBM3, 8 per Grand Teton host, 400 Gb/s
  per GPU; TP 8, PP 16, DP 64 or 128, 16M tokens per batch at sequence 8192; 430 and 400 teraFLOP/s
  per GPU (43 % and 41 % BF16 MFU). Predicted on the shipped `h100-sxm`, nothing fitted. Assumed:
  micro-batch 1, nanocore's interleaved schedule with 2 chunks per stage, ZeRO-1 (the paper's FSDP
  keeps the parameters gathered after the forward), sequence-parallel TP, no recompute. Compared as
  MFU (the paper's teraFLOP/s over 989.4), since the paper does not give its FLOP count.

    python benchmarks/published_layouts.py                   # every row, predicted (about a minute)
    python benchmarks/published_layouts.py --search 1.7,18.4  # also rank each named row's layout in plan --search
                                                              # (and among what 2021's Megatron offered)
    python benchmarks/published_layouts.py --json out.json
    python benchmarks/published_layouts.py --rows none --search-titan  # the H100 runs only; rank torchtitan's first

Printed per row: the published and predicted teraFLOP/s per GPU (the paper's FLOP count over the
step), the ratio, the predicted MFU and the dominant term. Issue 24's goal: each within 20 %.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

# Table 1 of arXiv 2104.04473: (parameters in billions, attention heads, hidden size, layers,
# tensor-parallel size, pipeline-parallel size, GPUs, global batch size, achieved teraFLOP/s per GPU)
TABLE_1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
# Llama 3.1 widths: (hidden, intermediate, heads, key/value heads, layers)
LLAMA3 = {"8b": (4096, 14336, 32, 8, 32), "70b": (8192, 28672, 64, 8, 80), "405b": (16384, 53248, 128, 8, 126)}
# torchtitan's bfloat16 H100 runs: (run, model, GPUs, tp, local batch, recompute, async TP, torch.compile,
# tokens/s per GPU, where). H: benchmarks/llama3_h100_202412_torchtitan.md; A: asyncTP_llama3_h100_2025-06
TORCHTITAN = (
    ("8B FSDP 8", "8b", 8, 1, 2, "selective", False, False, 5762, "H table 1"),
    ("8B FSDP 128", "8b", 128, 1, 2, "selective", False, False, 5605, "H table 3"),
    ("8B FSDP 8 x TP 8, compiled", "8b", 64, 8, 12, "selective", False, True, 4378, "A, 8B"),
    ("8B FSDP 8 x async TP 8, compiled", "8b", 64, 8, 12, "selective", True, True, 4809.4, "A, 8B"),
    ("70B FSDP 32 x TP 8, compiled", "70b", 256, 8, 16, "full", False, True, 597.3, "A, 70B"),
    ("70B FSDP 32 x async TP 8, compiled", "70b", 256, 8, 16, "full", True, True, 652.4, "A, 70B"),
)
GRAND_TETON_MEMORY = (96e9, 2.4e12)  # torchtitan's files: 96 GB HBM2e at 2.4 TB/s per GPU
# Llama 3 405B, arXiv 2407.21783 Table 4: (GPUs, tp, pp, dp, sequences per batch, teraFLOP/s per GPU)
LLAMA3_405B = ((8192, 8, 16, 64, 2048, 430), (16384, 8, 16, 128, 2048, 400))
H100_BF16_PEAK = 989.4e12
VOCAB = 51200
SEQUENCE = 2048


def paper_flops(batch: int, hidden: int, layers: int) -> float:
    """FLOPs of one iteration as the paper counts them (its equation 3, with recompute)."""
    s, h, l, v = SEQUENCE, hidden, layers, VOCAB  # noqa: E741 (the paper's l)
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def intermediate(hidden: int, tp: int) -> int:
    """8h/3 rounded to a multiple of 64 x tp (tensor parallelism splits it evenly)."""
    unit = 64 * tp
    return max(unit, round(8 * hidden / 3 / unit) * unit)


def llama_config(run: str, model: dict, parallelism: dict, tokens: dict, zero_stage: int) -> dict:
    """A bfloat16 nanocore LLaMA config (random init, no data) for `plan`: the sections that differ given."""
    return {
        "general": {"project": "published", "run": run, "seed": 1},
        "model": {
            "dtype": "bfloat16",
            "make_vocab_size_divisible_by": 128,
            "init_method": {"std": 0.02},
            "model_config": {"model_type": "llama", **model},
        },
        "parallelism": parallelism,
        "tokenizer": {"tokenizer_name_or_path": None},
        "tokens": {**tokens, "train_steps": 10},
        "optimizer": {
            "zero_stage": zero_stage,
            "learning_rate_scheduler": {"learning_rate": 1.0e-4},
            "optimizer_factory": {"name": "adam_w"},
        },
        "data_stages": [{"name": "stable", "start_training_step": 1, "data": {"dataset": None}}],
    }


def config_for(row: tuple, micro_batch: int = 1) -> dict:
    _, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    dp = gpus // (tp * pp)
    model = {
        "hidden_size": hidden,
        "intermediate_size": intermediate(hidden, tp),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "max_position_embeddings": SEQUENCE,
        "tie_word_embeddings": True,
    }
    parallelism = {"dp": dp, "tp": tp, "pp": pp, "pp_engine": "1f1b", "tp_mode": "ALL_REDUCE"}
    parallelism["recompute_granularity"] = "full"
    tokens = {"sequence_length": SEQUENCE, "micro_batch_size": micro_batch}
    tokens["batch_accumulation_per_replica"] = batch // (dp * micro_batch)
    return llama_config(f"gpt_{hidden}x{layers}", model, parallelism, tokens, zero_stage=0)


def predict(data: dict, path: Path, gpus: int, hardware):  # hardware: a name or a Hardware -> TimePrediction
    """`nanocore plan --hardware`'s prediction of the config `data`, written to `path` first (so that a
    search can read it again)."""
    from nanocore.config.load import load_config
    from nanocore.hardware import load_hardware
    from nanocore.plan import predict_for

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    loaded = load_config(path, world_size=gpus)
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    prediction = predict_for(loaded.config, loaded.plugins.registries, hw, "cuda", 1.0)
    assert prediction is not None
    return prediction


def predict_row(row: tuple, hardware: str, folder: Path) -> dict:
    params, heads, hidden, layers, tp, pp, gpus, batch, published = row
    path = folder / f"gpt_{params:g}b.yaml"
    start = time.perf_counter()
    prediction = predict(config_for(row), path, gpus, hardware)
    flops = paper_flops(batch, hidden, layers)
    predicted = flops / prediction.step_seconds / gpus / 1e12
    return {
        "params_b": params,
        "layout": f"tp{tp} pp{pp} dp{gpus // (tp * pp)}",
        "gpus": gpus,
        "batch": batch,
        "published_tflops_per_gpu": published,
        "published_step_seconds": flops / (published * 1e12 * gpus),
        "predicted_tflops_per_gpu": predicted,
        "predicted_step_seconds": prediction.step_seconds,
        "ratio": predicted / published,
        "predicted_mfu": prediction.mfu,
        "dominant": prediction.dominant,
        "terms": {t.name: t.seconds for t in prediction.terms},
        "config": str(path),
        "seconds_to_predict": time.perf_counter() - start,
    }


def llama3_config(model: str, gpus: int, tp: int, pp: int, local_batch: int, accumulation: int) -> dict:
    """A nanocore config of a Llama 3.1 model at sequence 8192 (dp = GPUs / tp / pp), ZeRO-3."""
    hidden, inter, heads, kv, layers = LLAMA3[model]
    widths = {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": layers,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    }
    parallelism = {"dp": gpus // (tp * pp), "tp": tp, "pp": pp, "tp_mode": "REDUCE_SCATTER"}
    tokens = {"sequence_length": 8192, "micro_batch_size": local_batch, "batch_accumulation_per_replica": accumulation}
    return llama_config(f"llama3_{model}", widths, parallelism, tokens, zero_stage=3)


def torchtitan_config(row: tuple) -> dict:
    _, model, gpus, tp, local, recompute, async_tp, compiled, _, _ = row
    data = llama3_config(model, gpus, tp, 1, local, 1)
    data["parallelism"].update(recompute_granularity=recompute, tp_linear_async_communication=async_tp)
    data["model"]["compile"] = compiled
    return data


def predict_torchtitan(row: tuple, hardware, folder: Path) -> dict:  # hardware: a nanocore Hardware
    run, model, gpus, tp, local, recompute, async_tp, compiled, published, where = row
    path = folder / f"titan_{model}_{gpus}_tp{tp}{'_async' if async_tp else ''}.yaml"
    prediction = predict(torchtitan_config(row), path, gpus, hardware)
    return {
        "run": run,
        "source": where,
        "gpus": gpus,
        "published_tokens_per_sec_per_gpu": published,
        "predicted_tokens_per_sec_per_gpu": prediction.tokens_per_sec_per_device,
        "ratio": prediction.tokens_per_sec_per_device / published,
        "predicted_step_seconds": prediction.step_seconds,
        "predicted_mfu": prediction.mfu,
        "dominant": prediction.dominant,
        "terms": {t.name: t.seconds for t in prediction.terms},
        "config": str(path),
    }


def grand_teton(first: tuple, folder: Path):  # -> (nanocore Hardware, its bfloat16 peak)
    """`h100-sxm` with torchtitan's GPUs' memory (96 GB HBM2e, 2.4 TB/s) and the bfloat16 peak at
    which `first` (a TORCHTITAN row) is predicted at its published speed: the one figure taken from
    these runs (a few fixed-point rounds; communication does not scale with the peak)."""
    import attrs

    from nanocore.hardware import load_hardware

    base = load_hardware("h100-sxm")
    memory, bandwidth = GRAND_TETON_MEMORY
    peak = base.peak_flops["bfloat16"]
    for _ in range(6):
        hw = attrs.evolve(
            base,
            name="h100-grand-teton-500w",
            source="h100-sxm; memory from torchtitan's benchmark files; bfloat16 peak from its first row",
            memory_bytes=int(memory),
            memory_bandwidth=bandwidth,
            peak_flops={**base.peak_flops, "bfloat16": peak, "float16": peak},
        )
        ratio = predict_torchtitan(first, hw, folder)["ratio"]
        if abs(ratio - 1) < 1e-4:
            break
        peak /= ratio
    return hw, peak


def predict_llama3_405b(row: tuple, folder: Path) -> dict:
    from nanocore.hardware import load_hardware

    gpus, tp, pp, dp, sequences, published = row
    data = llama3_config("405b", gpus, tp, pp, 1, sequences // dp)
    data["parallelism"].update(pp_engine="interleaved", pp_virtual_stages=2)
    data["optimizer"]["zero_stage"] = 1
    prediction = predict(data, folder / f"llama3_405b_{gpus}.yaml", gpus, load_hardware("h100-sxm"))
    published_mfu = published * 1e12 / H100_BF16_PEAK
    return {
        "run": f"Llama 3 405B, TP {tp} x PP {pp} x DP {dp}, {gpus:,} GPUs",
        "gpus": gpus,
        "published_tflops_per_gpu": published,
        "published_mfu": published_mfu,
        "predicted_mfu": prediction.mfu,
        "ratio": prediction.mfu / published_mfu,
        "predicted_tokens_per_sec_per_gpu": prediction.tokens_per_sec_per_device,
        "dominant": prediction.dominant,
        "terms": {t.name: t.seconds for t in prediction.terms},
    }


def search_torchtitan(row: tuple, hardware, path: str, top: int, own_step: float) -> dict:
    """Where `plan --search` ranks torchtitan's layout among every layout of the same GPUs."""
    from nanocore.config.load import load_config
    from nanocore.plan_search import search

    loaded = load_config(path, world_size=None)
    start = time.perf_counter()
    result = search(loaded.config, loaded.plugins.registries, row[2], hardware, hardware.memory_bytes, top=top)
    faster = [r for r in result.best if r.prediction.step_seconds < own_step * (1 - 1e-9)]
    first = result.best[0]
    return {
        "layouts": result.enumerated,
        "seconds": time.perf_counter() - start,
        "published_rank": len(faster) + 1 if len(faster) < len(result.best) else None,
        "first_choice": first.layout.label(),
        "first_choice_speedup": own_step / first.prediction.step_seconds,
        "top": [(r.layout.label(), r.prediction.step_seconds) for r in result.best],
    }


# what 2021's Megatron-LM offered (`plan --search --only`): no ZeRO, full recompute, tensor parallelism
# without sequence parallelism, no context parallelism, its two schedules
MEGATRON_2021 = "zero=0,recompute=full,tp_mode=ALL_REDUCE,cp=1,schedule=1f1b|interleaved"
# --searches: name -> (--only, what it is called)
SEARCHES = {
    "every": (None, "plan --search"),
    "2021": (MEGATRON_2021, "with 2021's options"),
    "2021-mbs1": (MEGATRON_2021 + ",micro_batch_size=1", "and micro-batch 1"),
}


def search_row(row: tuple, hardware: str, path: str, top: int, own_step: float, only: str | None = None) -> dict:
    """Where `plan --search` ranks the published layout among every layout of the same GPUs (or, with
    `only`, among those `--only only` allows), and the first one it prefers (any dp x tp x pp,
    schedule, micro-batch, recompute and ZeRO stage)."""
    from nanocore.config.load import load_config
    from nanocore.hardware import load_hardware
    from nanocore.plan_search import parse_only, search

    _, _, _, _, tp, pp, gpus, _, _ = row
    loaded = load_config(path, world_size=None)
    hw = load_hardware(hardware)
    start = time.perf_counter()
    result = search(
        loaded.config,
        loaded.plugins.registries,
        gpus,
        hw,
        hw.memory_bytes,
        device="cuda",
        top=top,
        progress=lambda line: print(f"         {line}", file=sys.stderr, flush=True),
        only=parse_only(only) if only else None,
    )
    faster = [r for r in result.best if r.prediction.step_seconds < own_step * (1 - 1e-9)]
    rank = len(faster) + 1 if len(faster) < len(result.best) or len(result.best) < top else None
    same_mesh = next(
        (i + 1 for i, r in enumerate(result.best) if (r.layout.tp, r.layout.pp, r.layout.cp) == (tp, pp, 1)), None
    )
    first = result.best[0] if result.best else None
    return {
        "layouts": result.enumerated,
        "seconds": time.perf_counter() - start,
        "published_rank": rank,  # None: below the top K
        "published_tp_pp_first_rank": same_mesh,
        "first_choice": first.layout.label() if first else None,
        "first_choice_speedup": own_step / first.prediction.step_seconds if first else None,
        "top": [(r.layout.label(), r.prediction.step_seconds) for r in result.best],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", default="a100-80gb")
    p.add_argument("--rows", default=None, help="comma-separated parameter counts (billions) of the rows to run")
    p.add_argument("--search", default="", help="comma-separated rows whose layout is also ranked by plan --search")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--search-titan", action="store_true", help="also rank torchtitan's 8-GPU layout in plan --search")
    p.add_argument(
        "--searches",
        default=",".join(SEARCHES),
        help="the searches of each --search row: every (layout), 2021 (2021's options), 2021-mbs1 (and micro-batch 1)",
    )
    p.add_argument("--no-h100", action="store_true", help="Megatron's table only (not the H100 runs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = TABLE_1
    if args.rows:
        wanted = {float(x) for x in args.rows.split(",") if x != "none"}
        rows = tuple(r for r in TABLE_1 if r[0] in wanted)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        print(
            f"{'params':>8} {'layout':>16} {'GPUs':>5} {'pub TF':>7} {'pred TF':>8} {'ratio':>6} {'MFU':>6}  dominant"
        )
        for row in rows:
            r = predict_row(row, args.hardware, Path(tmp))
            print(
                f"{r['params_b']:>7g}B {r['layout']:>16} {r['gpus']:>5} {r['published_tflops_per_gpu']:>7.0f} "
                f"{r['predicted_tflops_per_gpu']:>8.1f} {r['ratio']:>6.2f} {r['predicted_mfu']:>6.1%}  {r['dominant']}",
                flush=True,
            )
            if str(row[0]) in args.search.split(",") or f"{row[0]:g}" in args.search.split(","):
                step = r["predicted_step_seconds"]
                searched = []
                for kind in args.searches.split(","):
                    only, what = SEARCHES[kind]
                    r[f"search_{kind}"] = search_row(row, args.hardware, r["config"], args.top, step, only)
                    searched.append((r[f"search_{kind}"], what))
                for found, what in searched:
                    where = found["published_rank"] or f"below the top {args.top}"
                    print(
                        f"         {what} ({found['layouts']:,} layouts, {found['seconds']:.0f} s): the published "
                        f"layout ranks {where}; first choice {found['first_choice']}, predicted "
                        f"{found['first_choice_speedup']:.2f}x the published layout's speed",
                        flush=True,
                    )
            out.append(r)
        within = sum(abs(r["ratio"] - 1) <= 0.2 for r in out)
        print(f"{within} of {len(out)} rows predicted within 20 % of the published teraFLOP/s per GPU")
        h100 = published_h100(Path(tmp), args.top if args.search_titan else 0) if not args.no_h100 else {}
    if args.json:
        Path(args.json).write_text(json.dumps({"hardware": args.hardware, "rows": out, **h100}, indent=2))
    return 0


def published_h100(folder: Path, search_top: int) -> dict:
    """The H100 groups (the module docstring): each row predicted and printed; with `search_top`,
    torchtitan's first row is also ranked by `plan --search` on the fitted description."""
    from nanocore.hardware import load_hardware

    def show(label: str, r: dict) -> None:
        print(
            f"  {label:<36} published {r['published_tokens_per_sec_per_gpu']:>7,.0f}  predicted "
            f"{r['predicted_tokens_per_sec_per_gpu']:>7,.0f}  {r['ratio']:.2f}x  MFU {r['predicted_mfu']:.1%}  "
            f"{r['dominant']}",
            flush=True,
        )

    print("torchtitan on its 500 W HBM2e H100s (tokens/s per GPU), on the shipped h100-sxm:")
    sxm = load_hardware("h100-sxm")
    titan = []
    for row in TORCHTITAN:
        titan.append(predict_torchtitan(row, sxm, folder))
        show(row[0], titan[-1])
    fitted, peak = grand_teton(TORCHTITAN[0], folder)
    print(
        f"on h100-sxm with 96 GB at 2.4 TB/s and a bfloat16 peak of {peak / 1e12:.0f} teraFLOP/s "
        f"({peak / H100_BF16_PEAK:.0%} of the datasheet's; set by the first row, the others held out):"
    )
    held = []
    for row in TORCHTITAN:
        held.append(predict_torchtitan(row, fitted, folder))
        show(row[0], held[-1])
    within = sum(abs(r["ratio"] - 1) <= 0.2 for r in held[1:])
    print(f"{within} of {len(held) - 1} held-out torchtitan rows within 20 %")
    search = None
    if search_top:
        own = held[0]
        search = search_torchtitan(TORCHTITAN[0], fitted, own["config"], search_top, own["predicted_step_seconds"])
        where = search["published_rank"] or f"below the top {search_top}"
        print(
            f"  plan --search on 8 of these GPUs ({search['layouts']:,} layouts, {search['seconds']:.0f} s): "
            f"torchtitan's layout ranks {where}; first choice {search['first_choice']}, predicted "
            f"{search['first_choice_speedup']:.2f}x its speed",
            flush=True,
        )
    print("Llama 3 405B pre-training on 700 W H100 SXM (arXiv 2407.21783 Table 4), on the shipped h100-sxm:")
    meta = []
    for row in LLAMA3_405B:
        r = predict_llama3_405b(row, folder)
        meta.append(r)
        print(
            f"  {r['run']:<44} published MFU {r['published_mfu']:.1%}  predicted {r['predicted_mfu']:.1%}  "
            f"{r['ratio']:.2f}x  {r['dominant']}",
            flush=True,
        )
    return {
        "torchtitan_h100_sxm": titan,
        "torchtitan_fitted": {"bfloat16_peak": peak, "rows": held, "search": search},
        "llama3_405b": meta,
    }


if __name__ == "__main__":
    sys.exit(main())
