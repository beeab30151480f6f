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

The same for torchtitan's published H100 runs (pytorch/torchtitan,
benchmarks/llama3_h100_202412_torchtitan.md, tables 1 and 3: Llama 3.1 8B with FSDP, local batch
2, selective activation checkpointing, no torch.compile, no Float8; 5,762 tokens/s per GPU on 8 GPUs
and 5,605 on 128). Assumed: sequence 8192 (torchtitan's Llama 3 8B training config; the table does
not say), FSDP as ZeRO-3, nanocore's selective recompute (the attention core) for torchtitan's. The
file notes its H100s were 96 GB HBM2e parts at a 500 W limit, slower than the SXM datasheet figures
of the shipped `h100-sxm` description.

    python benchmarks/published_layouts.py                   # every row, predicted (about a minute)
    python benchmarks/published_layouts.py --search 1.7,18.4  # also rank each named row's layout in plan --search
    python benchmarks/published_layouts.py --json out.json

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
# torchtitan's Llama 3.1 8B FSDP runs on H100: (GPUs, local batch size, tokens/s per GPU)
TORCHTITAN_8B = ((8, 2, 5762), (128, 2, 5605))
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


def config_for(row: tuple, micro_batch: int = 1) -> dict:
    _, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    dp = gpus // (tp * pp)
    return {
        "general": {"project": "megatron_table1", "run": f"gpt_{hidden}x{layers}", "seed": 1},
        "model": {
            "dtype": "bfloat16",
            "make_vocab_size_divisible_by": 128,
            "init_method": {"std": 0.02},
            "model_config": {
                "model_type": "llama",
                "hidden_size": hidden,
                "intermediate_size": intermediate(hidden, tp),
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                "num_hidden_layers": layers,
                "vocab_size": VOCAB,
                "max_position_embeddings": SEQUENCE,
                "tie_word_embeddings": True,
            },
        },
        "parallelism": {
            "dp": dp,
            "tp": tp,
            "pp": pp,
            "pp_engine": "1f1b",
            "tp_mode": "ALL_REDUCE",
            "recompute_granularity": "full",
        },
        "tokenizer": {"tokenizer_name_or_path": None},
        "tokens": {
            "sequence_length": SEQUENCE,
            "micro_batch_size": micro_batch,
            "batch_accumulation_per_replica": batch // (dp * micro_batch),
            "train_steps": 10,
        },
        "optimizer": {
            "zero_stage": 0,
            "learning_rate_scheduler": {"learning_rate": 1.0e-4},
            "optimizer_factory": {"name": "adam_w"},
        },
        "data_stages": [{"name": "stable", "start_training_step": 1, "data": {"dataset": None}}],
    }


def predict(data: dict, path: Path, gpus: int, hardware: str):  # -> nanocore TimePrediction
    """`nanocore plan --hardware`'s prediction of the config `data`, written to `path` first (so that a
    search can read it again)."""
    from nanocore.config.load import load_config
    from nanocore.hardware import load_hardware
    from nanocore.plan import predict_for

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    loaded = load_config(path, world_size=gpus)
    prediction = predict_for(loaded.config, loaded.plugins.registries, load_hardware(hardware), "cuda", 1.0)
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


def predict_torchtitan(gpus: int, local_batch: int, published: float, folder: Path) -> dict:
    root = Path(__file__).resolve().parents[1]
    data = yaml.safe_load((root / "examples" / "config_llama3_8b.yaml").read_text())
    data["parallelism"] = {"dp": gpus, "tp": 1, "pp": 1, "recompute_granularity": "selective"}
    data["tokens"].update(sequence_length=8192, micro_batch_size=local_batch, batch_accumulation_per_replica=1)
    data["optimizer"]["zero_stage"] = 3
    data.pop("checkpoints", None)
    data.pop("logging", None)
    prediction = predict(data, folder / f"llama3_8b_fsdp{gpus}.yaml", gpus, "h100-sxm")
    return {
        "run": f"Llama 3.1 8B, FSDP {gpus}, local batch {local_batch}",
        "published_tokens_per_sec_per_gpu": published,
        "predicted_tokens_per_sec_per_gpu": prediction.tokens_per_sec_per_device,
        "ratio": prediction.tokens_per_sec_per_device / published,
        "predicted_mfu": prediction.mfu,
        "dominant": prediction.dominant,
        "terms": {t.name: t.seconds for t in prediction.terms},
    }


def search_row(row: tuple, hardware: str, path: str, top: int, own_step: float) -> dict:
    """Where `plan --search` ranks the published layout among every layout of the same GPUs, and the
    first one it prefers (any dp x tp x pp, schedule, micro-batch, recompute and ZeRO stage)."""
    from nanocore.config.load import load_config
    from nanocore.hardware import load_hardware
    from nanocore.plan_search import search

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
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = TABLE_1
    if args.rows:
        wanted = {float(x) for x in args.rows.split(",")}
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
                r["search"] = search_row(row, args.hardware, r["config"], args.top, r["predicted_step_seconds"])
                found = r["search"]
                where = found["published_rank"] or f"below the top {args.top}"
                print(
                    f"         plan --search ({found['layouts']:,} layouts, {found['seconds']:.0f} s): the published "
                    f"layout ranks {where}; first choice {found['first_choice']}, predicted "
                    f"{found['first_choice_speedup']:.2f}x the published layout's speed",
                    flush=True,
                )
            out.append(r)
        within = sum(abs(r["ratio"] - 1) <= 0.2 for r in out)
        print(f"{within} of {len(out)} rows predicted within 20 % of the published teraFLOP/s per GPU")
        titan = []
        print("torchtitan on H100 (h100-sxm):")
        for gpus, local, published in TORCHTITAN_8B:
            t = predict_torchtitan(gpus, local, published, Path(tmp))
            print(
                f"  {t['run']}: published {published:,} tokens/s per GPU, predicted "
                f"{t['predicted_tokens_per_sec_per_gpu']:,.0f} ({t['ratio']:.2f}x), MFU {t['predicted_mfu']:.1%}, "
                f"dominant {t['dominant']}"
            )
            titan.append(t)
    if args.json:
        Path(args.json).write_text(json.dumps({"hardware": args.hardware, "rows": out, "torchtitan": titan}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
