"""GPU path check: one prepared script for a machine with NVIDIA GPUs (NCCL, bfloat16, SDPA).

    python benchmarks/gpu_check.py                 # 1-GPU runs: eager, model.compile, FP8 (tensorwise,
                                                   # rowwise), compile + FP8: throughput, MFU, peak memory
    python benchmarks/gpu_check.py --multi-rank    # also a torchrun dp/tp/pp run when >= 2 GPUs

Prints one JSON line per run, to paste into benchmarks/RESULTS.md. On a CPU-only machine it says
so and exits 0 (nothing to check).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def config(tmp: Path, args, par: dict | None = None, model_extra: dict | None = None) -> dict:
    from tests.helpers.training import tiny_config

    model = {
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 8 // 3 // 64 * 64,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 256),
        "num_hidden_layers": args.layers,
        "vocab_size": 32768,
        "max_position_embeddings": args.seq,
    }
    return tiny_config(
        tmp,
        model={"model_config": model, "dtype": "bfloat16", **(model_extra or {})},
        tokens={
            "sequence_length": args.seq,
            "train_steps": args.steps,
            "micro_batch_size": args.micro_batch_size,
            "batch_accumulation_per_replica": args.accumulation,
        },
        optimizer={"optimizer_factory": {"name": "adam_w", "torch_adam_is_fused": True}},
        parallelism=par or {},
        logging={"log_dir": str(tmp / "logs"), "loggers": ["jsonl"]},
    )


# the 1-GPU variants: label -> model settings (`model.compile`, `model.float8_recipe`)
VARIANTS = {
    "eager": {},
    "compile": {"compile": True},
    "fp8 tensorwise": {"float8_recipe": "tensorwise"},
    "fp8 rowwise": {"float8_recipe": "rowwise"},
    "compile + fp8 tensorwise": {"compile": True, "float8_recipe": "tensorwise"},
}


def single_gpu(args, label: str = "eager") -> dict:
    from nanocore.config.checks import check_config
    from nanocore.config.converter import structure_config
    from nanocore.config.load import LoadedConfig
    from nanocore.plugins import load_plugins
    from nanocore.trainer import Trainer

    tmp = Path(tempfile.mkdtemp())
    plugins = load_plugins()
    cfg = structure_config(config(tmp, args, model_extra=VARIANTS[label]), plugins.registries)
    check_config(cfg, plugins.registries, 1)
    trainer = Trainer(LoadedConfig(cfg, plugins, None))
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    losses = trainer.train()
    elapsed = time.perf_counter() - start
    rows = [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]
    steady = rows[len(rows) // 2 :]
    trainer.close()
    return {
        "run": f"1 GPU, {label}",
        "device": torch.cuda.get_device_name(),
        "dtype": "bfloat16",
        "params_M": round(sum(p.numel() for p in trainer.engine.model.parameters()) / 1e6, 1),
        "tokens_per_sec": round(sum(r["tokens_per_sec"] for r in steady) / len(steady)),
        "first_step_s": round(args.micro_batch_size * args.accumulation * args.seq / rows[0]["tokens_per_sec"], 1),
        "mfu": round(sum(r.get("mfu", 0) for r in steady) / len(steady), 3),
        "peak_memory_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "first_loss": round(losses[0], 4),
        "last_loss": round(losses[-1], 4),
        "wall_s": round(elapsed, 1),
    }


def multi_rank(args) -> dict:
    import yaml

    n = torch.cuda.device_count()
    tmp = Path(tempfile.mkdtemp())
    par = {"dp": n // 4 or 1, "tp": 2 if n >= 2 else 1, "pp": 2 if n >= 4 else 1}
    par["dp"] = n // (par["tp"] * par["pp"])
    (tmp / "c.yaml").write_text(yaml.safe_dump(config(tmp, args, par)))
    cmd = ["torchrun", f"--nproc_per_node={n}", str(ROOT / "run_train.py"), "--config-file", str(tmp / "c.yaml")]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = (
        [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]
        if done.returncode == 0
        else []
    )
    return {
        "run": f"{n} GPUs {par}",
        "returncode": done.returncode,
        "tokens_per_sec": round(rows[-1]["tokens_per_sec"]) if rows else None,
        "wall_s": round(time.perf_counter() - start, 1),
        "stderr_tail": done.stderr[-2000:] if done.returncode else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--multi-rank", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"run": "skipped", "reason": "no CUDA device on this machine"}))
        return
    for label in VARIANTS:
        print(json.dumps(single_gpu(args, label)), flush=True)
    if args.multi_rank:
        if torch.cuda.device_count() < 2:
            print(json.dumps({"run": "multi-rank skipped", "reason": "NCCL needs one GPU per rank; 1 GPU here"}))
        else:
            print(json.dumps(multi_rank(args)), flush=True)


if __name__ == "__main__":
    main()
